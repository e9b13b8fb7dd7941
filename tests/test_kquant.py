"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) kept as stored: the dequantization matches
the gguf package's bit for bit (numpy here and the C kernels), the layer matches a
float32 matmul of those weights in every kernel build, and a tiny random GGUF written
with K-quant tensors gives the same greedy tokens under ``gguf`` as dequantized float32."""
from __future__ import annotations

import platform
import random

import numpy as np
import pytest
import torch

from conftest import TINY_VOCAB, tiny_config, tiny_tokenizer, tiny_weights
from gguf_files import random_kquant_blocks, write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.quant import kquant
from tokenmill.model.quant.kquant import KQuantLinear
from tokenmill.model.loader import load_model

TYPES = ("Q4_K", "Q5_K", "Q6_K")
X86 = platform.machine().lower() in ("x86_64", "amd64")
BUILDS = ["native"] + (["avx2", "portable"] if X86 else [])


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_bit_exact_with_gguf(type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rng = np.random.default_rng(1)
    blocks = random_kquant_blocks(type_name, 24, 512, rng)
    want = gguf_dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float32)
    got = kquant.dequantize(type_name, blocks, (24, 512))
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_kquant_as_int4_groups_gives_the_blocks_weights(type_name):
    """Q4_K and Q5_K as the int4 kernels' groups (``int4_from_gguf``: codes with a scale and an
    offset per 32 weights, and the blocks' own factors; Q5_K's codes five-bit) give the blocks'
    weights: the scale d sc and offset -dmin m are exact in float32, and the int4 form's zero
    (8 s + o) rounds at most once, in float32."""
    from tokenmill.model.quant.quant import int4_from_gguf

    rng = np.random.default_rng(3)
    blocks = random_kquant_blocks(type_name, 16, 512, rng)
    want = torch.from_numpy(kquant.dequantize(type_name, blocks, (16, 512)))
    codes = int4_from_gguf(type_name, blocks, (16, 512))
    assert codes.group_size == 32 and codes.repeat == 1 and codes.kscales is not None
    assert codes.bits == (5 if type_name == "Q5_K" else 4) and int(codes.codes.max()) == 2 ** codes.bits - 1
    d, dmin, sc, m = (t.float() for t in codes.kscales)
    assert torch.equal(codes.scales, (d.repeat_interleave(8, 1) * sc))
    offset = -(dmin.repeat_interleave(8, 1) * m)
    assert torch.allclose(codes.zeros - 8.0 * codes.scales, offset, rtol=0, atol=float(codes.scales.max()) * 2**-19)
    got = codes.dequantize()
    assert torch.allclose(got, want, rtol=0, atol=float(want.abs().max()) * 2**-21), (got - want).abs().max()


@pytest.fixture(scope="module", params=BUILDS)
def lib(request) -> cpu_kernels.KernelLibrary:
    if request.param == "avx2" and "avx2" not in cpu_kernels._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    return cpu_kernels.build(cpu_kernels.ISA_FLAGS[request.param])


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
@pytest.mark.parametrize("rows", [1, 5, 13, 40])
def test_kquant_factors_in_the_nibble_kernel_match_float32_scales(lib, rows, type_name):
    """A Q4_K (Q5_K) layer as int4 groups reads its own factors where the nibble kernel runs
    (``Q4_KSCALES``: fp16 d and dmin a super-block, 6-bit sc and m a group, 4.6 (5.6) bits a
    weight) and gives what the same codes with float32 scales and offsets give (6 (7) bits a
    weight), within float32 rounding, at every pass size of the kernel's row passes."""
    import dataclasses

    from tokenmill.model.ops import ModelOps
    from tokenmill.model.quant.quant import Int4Linear, int4_from_gguf

    if not lib.q4_int8_dot:
        pytest.skip("this build has no nibble kernel (the layer runs dequantized tiles)")
    rng = np.random.default_rng(7)
    n, k = 4 * lib.vector_width, 768
    codes = int4_from_gguf(type_name, random_kquant_blocks(type_name, n, k, rng), (n, k))
    factored, plain = Int4Linear(codes), Int4Linear(dataclasses.replace(codes, kscales=None))
    for layer in (factored, plain):
        layer.ops = ModelOps(library=lib)
    fifth = cpu_kernels.Q4_FIFTH if type_name == "Q5_K" else 0
    assert factored.kernel_description().q4_form == cpu_kernels.Q4_KSCALES | fifth
    assert plain.kernel_description().q4_form & (cpu_kernels.Q4_KSCALES | cpu_kernels.Q4_FIFTH) == fifth
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    with torch.inference_mode():
        got, want = factored(x), plain(x)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), (got - want).abs().max()


def _layer(types: tuple[str, ...], rows: int, k: int, seed: int = 0) -> KQuantLinear:
    rng = np.random.default_rng(seed)
    return KQuantLinear([(t, random_kquant_blocks(t, rows, k, rng), (rows, k)) for t in types])


def _float_tiles(lib, type_name: str) -> bool:
    """Whether many activation rows of ``type_name`` run on tiles widened to float32 (else
    on int8g tiles: Q4_K / Q5_K where the build has integer products)."""
    return type_name == "Q6_K" or not lib.kquant_int8_tiles


def test_kernel_dequantizes_exactly_and_matches_float32(lib):
    """Each type alone (the identity's product, 512 rows, reads the C kernel's weights out:
    exactly from float32 tiles; from int8g tiles within a rounding of the one-hot input's
    scale, 127 x (1 / 127)), then a fused Q4_K + Q6_K + Q5_K projection against the
    dequantized float32 matmul at row counts the widened tiles take (float32 activations:
    only the summation order differs)."""
    for t in TYPES:
        layer = _layer((t,), 32, 512, seed=2)
        (desc,) = layer.kernel_descriptions()
        eye = torch.eye(512)
        got = cpu_kernels.linear(desc, eye, lib)
        want = layer.dequantized_weight()
        assert got is not None, t
        if _float_tiles(lib, t):
            assert torch.equal(got.t(), want), t
        else:
            assert torch.allclose(got.t(), want, rtol=1e-6, atol=1e-7 * float(want.abs().max())), t
    layer = _layer(("Q4_K", "Q6_K", "Q5_K"), 48, 768, seed=3)
    w = layer.dequantized_weight()
    for rows in (1, 3, 7, 16, 33, 40):
        if rows < lib.kquant_int8_rows:
            continue  # int8 activations: test_int8_activation_products
        x = torch.randn(rows, 768)
        first = 0
        for part, d in zip(layer.parts, layer.kernel_descriptions()):
            first += part.rows
            if not _float_tiles(lib, part.type_name):
                continue  # int8g tiles: test_int8_activation_products
            got = cpu_kernels.linear(d, x, lib)
            want = x.double() @ w[first - part.rows : first].double().t()
            assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), rows


def test_q6_tiles_multiply_int8_activations_at_every_row_count(lib):
    """Q6_K in tiles (AVX2 and AVX-512 VNNI builds: cpu_kernels.pack_q6_tiles, q6k_rows)
    at every row count: against the float64 product of the dequantized weights and the
    activations quantized with a scale per 32 inputs, within float32 summation; each row's
    result the same bits alone as beside others, and with one thread as with two."""
    from tokenmill.model.ops import ModelOps

    if not lib.q6_tiles:
        pytest.skip("this build multiplies Q6_K as stored (float32 tiles)")
    k = 768
    layer = _layer(("Q6_K",), 4 * lib.vector_width, k, seed=9)
    layer.ops = ModelOps(library=lib)
    (desc,) = layer.kernel_descriptions()
    assert desc.packed is not None and desc.packed_scale is not None
    w = layer.dequantized_weight().double()
    gen = torch.Generator().manual_seed(10)
    for rows in (1, 2, 3, 4, 7, 40):
        x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
        x[0, :32] = 0.0  # an all-zero group
        got = cpu_kernels.linear(desc, x, lib).double()
        xq = _q8_activations(x)
        want = xq @ w.t()
        assert (got - want).abs().le(1e-5 * (xq.abs() @ w.abs().t()) + 1e-6).all(), rows
        alone = torch.cat([cpu_kernels.linear(desc, x[i : i + 1], lib) for i in range(rows)]).double()
        assert torch.equal(alone, got), rows
    _same_bits_with_one_thread_and_two(desc, x, lib)


@pytest.mark.parametrize("vector_width", [8, 16])
def test_q6_tiles_read_back_the_blocks_exactly(vector_width):
    """The tiles hold Q6_K's blocks without loss: unpacked (cpu_kernels.unpack_q6_tiles) and
    packed as the file has them (kquant.q6_blocks), they are the same bytes."""
    rng = np.random.default_rng(11)
    blocks = random_kquant_blocks("Q6_K", 2 * vector_width, 512, rng)
    q, sc, d = kquant.q6_parts(blocks, (2 * vector_width, 512))
    tiles = cpu_kernels.pack_q6_tiles(torch.from_numpy(q), torch.from_numpy(sc), torch.from_numpy(d), vector_width)
    q2, sc2, d2 = cpu_kernels.unpack_q6_tiles(*tiles, vector_width)
    back = kquant.q6_blocks(q2.numpy(), sc2.numpy(), d2.numpy())
    assert np.array_equal(back.reshape(-1), np.asarray(blocks).view(np.uint8).reshape(-1))


@pytest.mark.parametrize("types", [("Q6_K",), ("Q4_K", "Q6_K")])
def test_q6_parts_move_into_their_tiles(lib, types):
    """Where the kernels read Q6_K tiles, prepare_kernels moves each Q6_K part there and drops
    its blocks: the layer holds its weights once (6.6 bits a Q6_K weight), the products are
    the ones before the move bit for bit, and the weights read back the same. Elsewhere the
    blocks stay."""
    from tokenmill.model.ops import ModelOps

    rows, k = 2 * lib.vector_width, 512
    layer = _layer(types, rows, k, seed=12)
    layer.ops = ModelOps(library=lib)
    table = layer.dequantized_weight()
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(13))
    with torch.inference_mode():
        before = [layer(x[:r]) for r in (1, 5)]
    layer.prepare_kernels()
    q6 = next(p for p in layer.parts if p.type_name == "Q6_K")
    assert (layer.blocks_held(q6) is None) == bool(lib.q6_tiles)
    if lib.q6_tiles:
        assert 6.5 < kquant.weight_bits(layer) < 6.7 if types == ("Q6_K",) else kquant.weight_bits(layer) < 6.7
        assert all(layer.blocks_held(p) is not None for p in layer.parts if p.type_name != "Q6_K")
    with torch.inference_mode():
        after = [layer(x[:r]) for r in (1, 5)]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert torch.equal(layer.dequantized_weight(), table)


@pytest.mark.parametrize("type_name", TYPES)
def test_kquant_rows_read_the_dequantized_weights(lib, type_name):
    """A one-part K-quant layer looks rows up (a tied token table) as ``dequantize`` widens
    them, bit for bit: from its blocks, from the Q6_K tiles they moved into, or from the int4
    layer a Q4_K part becomes; a layer of several parts has no row lookup."""
    from tokenmill.model.ops import ModelOps

    rows, k = 3 * lib.vector_width, 512
    rng = np.random.default_rng(14)
    blocks = random_kquant_blocks(type_name, rows, k, rng)
    want = torch.from_numpy(kquant.dequantize(type_name, blocks, (rows, k)))
    ids = torch.tensor([0, rows - 1, 5, 5, lib.vector_width])
    from tokenmill.model.quant.quant import _kscales_int4_layer

    for int4_layer in (None, _kscales_int4_layer):
        layer = KQuantLinear([(type_name, blocks, (rows, k))], int4_layer=int4_layer)
        layer.ops = ModelOps(library=lib)
        layer.prepare_kernels()
        got = layer.rows(ids)
        if layer.parts[0].int4:  # the int4 form's zero rounds once in float32
            assert torch.allclose(got, want[ids], rtol=0, atol=float(want.abs().max()) * 2**-20)
        else:
            assert torch.equal(got, want[ids]), (type_name, int4_layer)
    assert _layer(("Q4_K", "Q6_K"), rows, k).rows(ids) is None


def _same_bits_with_one_thread_and_two(desc, x: torch.Tensor, lib) -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.linear(desc, x, lib)
        torch.set_num_threads(2)
        two = cpu_kernels.linear(desc, x, lib)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def _q8_activations(x: torch.Tensor, divide: bool = False) -> torch.Tensor:
    """x as the integer K-quant paths see it: per row and 32 inputs, d = amax / 127 and
    codes round(x * (127 / amax)) (few rows), or round(x / d) (``divide``: the int8g tiles'
    input, quantized as int8g layers' is), float32 arithmetic, ties to even, widened back."""
    a = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(a).max(axis=2, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        if divide:
            q = np.where(amax > 0, np.rint(a / np.where(amax > 0, d, np.float32(1))), 0)
        else:
            inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
            q = np.rint(a * inv)
    return torch.from_numpy((q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape))


@pytest.mark.parametrize("type_name", TYPES)
def test_int8_activation_products(lib, type_name):
    """Few activation rows: the blocks' codes times int8 activations (a scale per 32 inputs)
    in builds with integer dot products. Against the float64 product of the dequantized
    weights and the activations quantized the same way, within float32 summation; against
    the unquantized activations, within the rounding bound (half a step per input); and each
    row's result the same bits whatever rows share its call and however many threads run it."""
    k = 768
    layer = _layer((type_name,), 64, k, seed=7)
    (desc,) = layer.kernel_descriptions()
    w = layer.dequantized_weight().double()
    gen = torch.Generator().manual_seed(8)
    for rows in (1, 2, 3, 7, 16, 33, 70):
        x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
        x[0, :32] = 0.0  # an all-zero group
        got = cpu_kernels.linear(desc, x, lib)
        assert got is not None
        got = got.double()
        exact = x.double() @ w.t()
        many = rows >= lib.kquant_int8_rows
        if many and _float_tiles(lib, type_name):  # widened tiles, float32 activations
            assert torch.allclose(got, exact, rtol=1e-4, atol=1e-4 * float(exact.abs().max())), rows
            continue
        xq = _q8_activations(x, divide=many)
        want = xq @ w.t()
        assert (got - want).abs().le(1e-5 * (xq.abs() @ w.abs().t()) + 1e-6).all(), rows
        step = x.double().reshape(rows, -1, 32).abs().amax(2, keepdim=True).expand(rows, k // 32, 32) / 254
        assert (got - exact).abs().le(step.reshape(rows, k) @ w.abs().t() + 1e-6).all(), rows
        assert not torch.allclose(got, exact, rtol=1e-6, atol=0), "the int8 path was not taken"
        # a row's result does not depend on the rows beside it (with many rows: on the AMX
        # tiles or the vector units, whichever took it)
        split = (lib.kquant_int8_rows + 1) if many else 1
        parts = [cpu_kernels.linear(desc, x[i : i + split], lib) for i in range(0, rows, split)]
        if many and parts[-1].shape[0] < lib.kquant_int8_rows:
            parts[-1] = cpu_kernels.linear(desc, x[-lib.kquant_int8_rows - 1:], lib)[-parts[-1].shape[0]:]
        assert torch.equal(torch.cat(parts).double(), got), rows
    if lib.kquant_int8_rows:
        _same_bits_with_one_thread_and_two(desc, torch.randn(5, k, generator=gen), lib)


def test_int8_activation_path_in_avx_builds():
    """Builds with AVX2 (and AVX-512 with VNNI) have the integer path; the portable one keeps
    widening tiles to float32."""
    if not X86:
        pytest.skip("x86 builds only")
    assert cpu_kernels.build(cpu_kernels.ISA_FLAGS["portable"]).kquant_int8_rows == 0
    if "avx2" in cpu_kernels._cpu_flags():
        assert cpu_kernels.build(cpu_kernels.ISA_FLAGS["avx2"]).kquant_int8_rows > 1


def _kquant_file(tmp_path, qtypes: dict[str, str]) -> str:
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    path = str(tmp_path / "kq.gguf")
    write_gguf(path, tiny_weights(cfg, seed=4), cfg, qtypes=qtypes, eos_token_id=None)
    return path


def test_gguf_kquant_model_same_tokens_as_dequantized_float32(tmp_path):
    # Q4_K_M's mixture: q/k/gate/up Q4_K, v and down Q6_K, o Q5_K
    path = _kquant_file(tmp_path, {"v_proj": "Q6_K", "down_proj": "Q6_K", "o_proj": "Q5_K", "layers.": "Q4_K"})
    loaded = load_model(path)
    kinds = {entry[0] for entry in loaded.raw_quantized.values()}
    assert kinds == set(TYPES)
    rng = random.Random(5)
    prompts = [[rng.randrange(TINY_VOCAB - 1) for _ in range(rng.randint(3, 40))] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    dense = LLM(loaded_model=loaded, tokenizer=tiny_tokenizer(), dtype="float32", num_blocks=64)
    kept = LLM(loaded_model=loaded, tokenizer=tiny_tokenizer(), dtype="float32", quantization="gguf",
               kv_cache_dtype="float32", num_blocks=64)
    report = kept.engine.runner.model.quant_report
    assert report.quantized["layers.0.self_attn.qkv_proj"] == "Q4_K+Q6_K blocks"
    assert report.quantized["layers.1.mlp.down_proj"] == "Q6_K blocks" and not report.kept
    assert kept.engine.weight_bytes < dense.engine.weight_bytes
    want = [o.outputs[0].token_ids for o in dense.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in kept.generate(prompts, params)]
    lib = cpu_kernels.load()
    if lib is None or not lib.kquant_int8_rows:  # float32 activations throughout
        assert got == want
        return
    # Decode rows multiply int8 activations: each token kept is the dense model's choice or
    # within a near tie of it, scored by the dense model on the kept model's own text. Near:
    # the activations' rounding moved these random-code models' picks by up to 0.11 nats
    # over twelve block draws (a quarter of them had one such tie in 48 tokens).
    scored = dense.score([p + g for p, g in zip(prompts, got)], top=1)
    for prompt, tokens, entries in zip(prompts, got, scored):
        for j, token in enumerate(tokens):
            e = entries[len(prompt) + j]
            assert e.token_id == token and max(e.top.values()) - e.logprob < 0.2, (j, e)


def test_auto_keeps_kquant_blocks_and_other_types_say_dequantized(tmp_path):
    from tokenmill.engine.auto import resolve_quantization

    loaded = load_model(_kquant_file(tmp_path, {"layers.": "Q4_K"}))
    mode, why = resolve_quantization("auto", loaded, torch.device("cpu"))
    assert mode == "gguf" and "Q4_K" in why
    # a fused projection mixing a K-quant with another block type is dequantized, and says so
    loaded = load_model(_kquant_file(tmp_path, {"v_proj": "Q8_0", "layers.": "Q4_K"}))
    llm = LLM(loaded_model=loaded, tokenizer=tiny_tokenizer(), dtype="float32", quantization="gguf",
              num_blocks=16)
    report = llm.engine.runner.model.quant_report
    assert "dequantized" in report.kept["layers.0.self_attn.qkv_proj"]
    assert "kept dense" in report.summary()


@pytest.mark.parametrize("qtypes,parts", [
    ({"down_proj": "Q6_K", "o_proj": "Q5_K", "layers.": "Q6_K"}, 1),  # q/k/v stacked into one block matrix
    ({"v_proj": "Q6_K", "down_proj": "Q6_K", "layers.": "Q4_K"}, 2),  # Q4_K_M's q/k Q4_K beside v Q6_K
    ({"v_proj": "Q6_K", "down_proj": "Q6_K", "layers.": "Q5_K"}, 2),  # Q5_K_M's
])
def test_fused_step_takes_kquant_projections(tmp_path, qtypes, parts):
    """A K-quant model runs the fused step (decode rows and prefill chunks) with the eager
    forward's greedy tokens: a q/k/v projection of one block type as one part, one of two
    types (Q4_K_M's, Q5_K_M's) as two, the second's outputs after the first's (``qkv_tail``).
    Q4_K and Q5_K projections, and such a part of a two-type one, become int4 layers where the
    build has the nibble kernel (Q5_K's five-bit)."""
    from tokenmill.model.quant.quant import Int4Linear
    from tokenmill.settings.options import KernelOptions

    lib = cpu_kernels.load()
    if lib is None:
        pytest.skip("the C kernels are not built here")
    loaded = load_model(_kquant_file(tmp_path, qtypes))
    rng = random.Random(6)
    prompts = [[rng.randrange(TINY_VOCAB - 1) for _ in range(rng.randint(3, 40))] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    fused = LLM(loaded_model=loaded, tokenizer=tiny_tokenizer(), dtype="float32", quantization="gguf",
                kv_cache_dtype="float32", num_blocks=64, max_num_batched_tokens=16)
    layer = fused.engine.runner.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, KQuantLinear) and len(qkv.parts) == parts
    if parts == 2:  # the Q4_K / Q5_K part of q/k/v, and gate/up alone: int4 groups where the nibble kernel
        # runs them, on the blocks' own factors
        assert [p.int4 for p in qkv.parts] == [bool(lib.q4_int8_dot), False]
        gate_up = layer.mlp.gate_up_proj
        assert isinstance(gate_up, Int4Linear if lib.q4_int8_dot else KQuantLinear)
        if lib.q4_int8_dot:
            fifth = cpu_kernels.Q4_FIFTH if qtypes["layers."] == "Q5_K" else 0
            assert gate_up.tiles_vw == lib.vector_width and gate_up.q4_form == cpu_kernels.Q4_KSCALES | fifth
            assert qkv.int4_part(qkv.parts[0]).q4_form == cpu_kernels.Q4_KSCALES | fifth
    assert fused.engine.runner.fused is not None
    eager = LLM(loaded_model=loaded, tokenizer=tiny_tokenizer(), dtype="float32", quantization="gguf",
                kv_cache_dtype="float32", num_blocks=64, max_num_batched_tokens=16,
                kernel_options=KernelOptions.from_env().replace(fused_decode=False))
    assert eager.engine.runner.fused is None
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in fused.generate(prompts, params)] == want
