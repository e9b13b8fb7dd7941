"""The int8 matmuls on AMX tiles (``csrc/amx_int8.c``) against the VNNI path.

Both compute the same exact int32 sums and share one float epilogue, so every
result must be the same bit for bit: w8a8 rows are alone what they are batched,
whichever unit a batch size sends them to. The comparison runs in one library,
switching the tiles off and on (``tm_kernels_amx_init``), on a CPU with AMX-INT8
only; row counts straddle the 16-row tile edge and the 32-row pass, layer shapes
a single trailing weight tile and an input depth the int8 tiles do not take.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from tokenmill.model.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not on PATH: the kernel cannot be built")


@pytest.fixture(scope="module")
def lib() -> cpu_kernels.KernelLibrary:
    if "amx_int8" not in cpu_kernels._cpu_flags():
        pytest.skip("this CPU has no AMX-INT8")
    built = cpu_kernels.build(cpu_kernels.ISA_FLAGS["native"])
    if cpu_kernels.isa() != "native":
        pytest.skip("TOKENMILL_KERNEL_ISA narrows every build of this process")
    assert built.amx, "a native build on a CPU with AMX-INT8 uses the tiles"
    yield built
    built.cdll.tm_kernels_amx_init(1)


def _both(lib: cpu_kernels.KernelLibrary, desc: cpu_kernels.TmLinear, x: torch.Tensor):
    assert lib.cdll.tm_kernels_amx_init(0) == 0
    vnni = cpu_kernels.linear(desc, x, library=lib)
    assert lib.cdll.tm_kernels_amx_init(1) == 1
    tiles = cpu_kernels.linear(desc, x, library=lib)
    assert vnni is not None and tiles is not None
    return vnni, tiles


@pytest.mark.parametrize("rows", [16, 17, 33, 64, 100])
@pytest.mark.parametrize("n,k", [(48, 128), (80, 576), (32, 96)])
@pytest.mark.parametrize("bits", [8, 16])
def test_int8_layer_on_tiles_equals_vnni(lib, rows: int, n: int, k: int, bits: int) -> None:
    g = torch.Generator().manual_seed(rows * 7 + n + bits)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    bias = torch.randn(n, generator=g)
    packed = cpu_kernels.pack_vnni(q, lib.vector_width)
    sums = q.sum(dim=1, dtype=torch.int32)
    d = cpu_kernels.TmLinear()
    d.kind, d.n, d.k, d.repeat, d.group = cpu_kernels.W_INT8, n, k, 1, 32
    d.w, d.scale, d.bias, d.packed, d.row_sums = (q.data_ptr(), scale.data_ptr(), bias.data_ptr(),
                                                  packed.data_ptr(), sums.data_ptr())
    d.a8_rows, d.a16_rows = (1, 0) if bits == 8 else (0, 1)
    x = torch.randn(rows, k, generator=g) * 3
    vnni, tiles = _both(lib, d, x)
    assert torch.equal(vnni, tiles)
    want = x.double() @ (q.double() * scale.double()[:, None]).t() + bias.double()
    assert float((tiles.double() - want).norm() / want.norm()) < (2e-2 if bits == 8 else 1e-4)


@pytest.mark.parametrize("rows", [16, 31, 48, 70])
@pytest.mark.parametrize("n", [48, 80])
@pytest.mark.parametrize("dynamic", [False, True], ids=["a16", "a8g32"])
def test_grouped_int8_layer_on_tiles_equals_vnni(lib, rows: int, n: int, dynamic: bool) -> None:
    from tokenmill.model.ops import ModelOps
    from tokenmill.model.quant.quant import Int8GroupLinear

    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, 160, generator=g) * 0.05
    w[:, 5] *= 30
    layer = Int8GroupLinear.from_float(w, dynamic=dynamic)
    layer.ops = ModelOps(library=lib)
    layer.prepare_kernels()
    assert layer.qweight is None  # in the VNNI packing
    x = torch.randn(rows, 160, generator=g) * 3
    x[:, 7] *= 20
    vnni, tiles = _both(lib, layer.kernel_description(), x)
    assert torch.equal(vnni, tiles)
