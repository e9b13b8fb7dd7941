"""The model's Linear: float32 CPU matmuls through oneDNN, the same values as F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.models import llama
from tokenmill.model.models.llama import Linear
from tokenmill.model.ops import ModelOps, onednn_linear_available, select_ops
from tokenmill.settings.options import KernelOptions

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="torch here has no oneDNN linear")
ONEDNN = ModelOps(None, onednn_linear=True)


@pytest.mark.parametrize("rows", [1, 7, 16, 65, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_f_linear(rows: int, bias: bool, monkeypatch) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, 200, bias=bias)
    layer.ops = ONEDNN
    x = torch.randn(rows, 96)
    calls: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:  # counts calls into the oneDNN op, so the test knows which path ran
        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            if name == "_linear_pointwise":
                return lambda *a: calls.append(1) or real(*a)
            return getattr(torch.ops.mkldnn, name)

    monkeypatch.setattr(llama.torch.ops, "mkldnn", Spy(), raising=False)
    with torch.inference_mode():
        got = layer(x)
    assert calls, "the float32 CPU path did not take oneDNN"
    want = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    assert got.dtype == torch.float32 and got.shape == (rows, 200)
    assert (got.double() - want).abs().max().item() < 1e-4


def test_autograd_and_other_dtypes_keep_f_linear() -> None:
    layer = Linear(32, 16)
    layer.ops = ONEDNN
    x = torch.randn(4, 32, requires_grad=True)
    y = layer(x)  # grad enabled: the op has no backward, so F.linear runs
    y.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    with torch.inference_mode():
        bf = layer.to(torch.bfloat16)(torch.randn(4, 32, dtype=torch.bfloat16))
    assert bf.dtype == torch.bfloat16


def test_options_choose_onednn_once() -> None:
    """TOKENMILL_ONEDNN_LINEAR=0 turns it off in the options; the ops carry the choice."""
    assert not KernelOptions.from_env({"TOKENMILL_ONEDNN_LINEAR": "0"}).onednn_linear
    on = KernelOptions.from_env({})
    assert on.onednn_linear
    assert select_ops(torch.device("cpu"), None, on.onednn_linear).onednn_linear
    assert not select_ops(torch.device("cpu"), None, False).onednn_linear
    assert not Linear.ops.onednn_linear  # a model no engine bound runs F.linear
