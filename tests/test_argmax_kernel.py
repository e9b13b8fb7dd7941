"""Greedy sampling's C argmax (model/kernels/csrc/argmax.c) against torch.argmax.

The kernel must give exactly torch's indices, or greedy output would change:
first index among equal maxima, NaN larger than everything (first NaN wins),
a row of -inf gives 0, any row stride; and the sampler must use it on CPU and
fall back to torch where it cannot."""
from __future__ import annotations

import platform
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.model.kernels import cpu_kernels
from tokenmill.model import sampler

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not on PATH: the kernel cannot be built")


@pytest.fixture(scope="module")
def lib() -> cpu_kernels.KernelLibrary:
    return cpu_kernels.build()


SPECIALS = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0)


@st.composite
def logit_rows(draw) -> torch.Tensor:
    """Rows of random logits (often small integers, so ties are common) with a few
    specials planted, sometimes a strided view of a wider tensor."""
    rows = draw(st.integers(0, 9))
    cols = draw(st.integers(1, 1100))
    pad = draw(st.sampled_from([0, 0, 3, 256]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if draw(st.booleans()):
        x = torch.randint(-3, 4, (rows, cols + pad), generator=gen).float()
    else:
        x = torch.randn(rows, cols + pad, generator=gen)
    for _ in range(draw(st.integers(0, 4))):
        if rows:
            x[draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))] = draw(st.sampled_from(SPECIALS))
    if draw(st.booleans()) and rows:
        x[draw(st.integers(0, rows - 1)), :cols] = float("-inf")
    return x[:, :cols]


@settings(max_examples=300, deadline=None)
@given(x=logit_rows())
def test_same_indices_as_torch(lib, x) -> None:
    assert torch.equal(cpu_kernels.argmax_rows(x, library=lib), x.argmax(dim=-1))


def test_large_rows_split_over_threads_match(lib) -> None:
    x = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0))
    x[5, 40000] = x[5, 30000] = 50.0  # a tie across blocks: the first wins
    x[9, 12345] = float("nan")
    got = cpu_kernels.argmax_rows(x, library=lib)
    assert torch.equal(got, x.argmax(dim=-1)) and got[5] == 30000 and got[9] == 12345


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 flag")
def test_eight_lane_build_matches() -> None:
    narrow = cpu_kernels.build(cpu_kernels.ISA_FLAGS["avx2"])  # the AVX2 build the other kernel tests compile
    x = torch.randint(-2, 3, (7, 1000), generator=torch.Generator().manual_seed(1)).float()
    x[2, 999] = float("nan")
    assert torch.equal(cpu_kernels.argmax_rows(x, library=narrow), x.argmax(dim=-1))


def test_refuses_what_it_cannot_take(lib) -> None:
    """The caller falls back to torch for these (None, nothing computed)."""
    x = torch.randn(4, 10)
    assert cpu_kernels.argmax_rows(x.double(), library=lib) is None
    assert cpu_kernels.argmax_rows(x.t(), library=lib) is None  # inner stride 4
    assert cpu_kernels.argmax_rows(x[0], library=lib) is None  # 1-D
    assert cpu_kernels.argmax_rows(torch.empty(3, 0), library=lib) is None


def test_sampler_uses_the_kernel_on_cpu_and_torch_when_disabled(monkeypatch) -> None:
    calls = []
    real = cpu_kernels.argmax_rows

    def spy(logits, library=None):
        out = real(logits, library)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_kernels, "argmax_rows", spy)
    x = torch.randn(3, 500, generator=torch.Generator().manual_seed(2))
    assert torch.equal(sampler._argmax(x, cpu_kernels.load()), x.argmax(dim=-1)) and calls == [True]
    assert torch.equal(sampler._argmax(x, None), x.argmax(dim=-1)) and calls == [True]  # no library: torch
