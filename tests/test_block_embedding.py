"""A GGUF token table kept in its blocks (model/quant/block_embedding.py): each lookup widens
just its rows, to the same values the loader's dense table holds, bit for bit; a ``gguf``
engine on an untied file keeps its table and head as the file's blocks (no dense copy made)
and generates what it generates with the dense table; and one on a tied file keeps its one
table as the head's blocks, the lookups reading the head's rows."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conftest import TINY_VOCAB, tiny_config, tiny_tokenizer, tiny_weights
from gguf_files import random_kquant_blocks, write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.model.quant.block_embedding import BlockEmbedding
from tokenmill.model.loader import dequantize, load_model

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_rows_are_the_dense_tables_bit_for_bit(type_name: str) -> None:
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quantize as gguf_quantize

    rng = np.random.default_rng(1)
    rows, dim = 40, 512
    if type_name.endswith("_K"):
        blocks = random_kquant_blocks(type_name, rows, dim, rng)
    else:
        blocks = gguf_quantize((rng.standard_normal((rows, dim)) * 0.05).astype(np.float32), getattr(QT, type_name))
    dense = torch.from_numpy(dequantize(blocks, type_name, (rows, dim)))
    table = BlockEmbedding(type_name, blocks, (rows, dim), torch.float32)
    ids = torch.tensor([[0, 39, 7], [7, 1, 20]])
    got = table(ids)
    assert got.shape == (2, 3, dim) and got.dtype == torch.float32
    assert torch.equal(got, dense[ids])
    assert BlockEmbedding(type_name, blocks, (rows, dim), torch.bfloat16)(ids).dtype == torch.bfloat16
    assert table.blocks.numel() == np.asarray(blocks).nbytes  # the blocks, nothing widened


def test_gguf_engine_keeps_an_untied_table_and_head_in_blocks(tmp_path) -> None:
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    assert not cfg.tie_word_embeddings
    path = str(tmp_path / "untied.gguf")
    write_gguf(path, tiny_weights(cfg, seed=8), cfg, eos_token_id=None,
               qtypes={"embed_tokens": "Q4_K", "lm_head": "Q6_K", "v_proj": "Q6_K", "layers.": "Q4_K"})
    loaded = load_model(path)
    llm = LLM(loaded_model=loaded, tokenizer=tiny_tokenizer(), dtype="float32", quantization="gguf",
              kv_cache_dtype="float32", num_blocks=64)
    model = llm.engine.runner.model
    assert isinstance(model.embed_tokens, BlockEmbedding)
    assert model.quant_report.token_table == "Q4_K blocks" and "lm_head" in model.quant_report.quantized
    vocab_sized = [n for n, p in model.named_parameters() if p.shape[0] == cfg.vocab_size]
    assert not vocab_sized, vocab_sized  # neither the table nor the head widened
    dense_table = loaded.weights["model.embed_tokens.weight"].float()
    ids = torch.arange(cfg.vocab_size)
    assert torch.equal(model.embed_tokens(ids), dense_table)
    rng = random.Random(9)
    prompts = [[rng.randrange(TINY_VOCAB - 1) for _ in range(rng.randint(3, 30))] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    model.embed_tokens = torch.nn.Embedding.from_pretrained(dense_table)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want


@pytest.mark.parametrize("table_type", ["Q6_K", "Q8_0"])
def test_gguf_engine_keeps_a_tied_table_once(tmp_path, table_type: str) -> None:
    """A tied table in blocks (Llama 3.2's Q4_K_M files store it in Q6_K, with no output
    tensor): the head is built from the blocks and the lookups read the head's rows, so no
    vocab-sized dense weight is ever made."""
    from tokenmill.model.quant.quant import QuantizedEmbedding

    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True)
    weights = {k: v for k, v in tiny_weights(cfg, seed=10).items() if k != "lm_head.weight"}
    path = str(tmp_path / "tied.gguf")
    write_gguf(path, weights, cfg, eos_token_id=None,
               qtypes={"embed_tokens": table_type, "v_proj": "Q6_K", "layers.": "Q4_K"})
    loaded = load_model(path)
    llm = LLM(loaded_model=loaded, tokenizer=tiny_tokenizer(), dtype="float32", quantization="gguf",
              kv_cache_dtype="float32", num_blocks=64)
    model = llm.engine.runner.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.quant_report.shared_embedding
    vocab_sized = [n for n, p in model.named_parameters() if p.shape[0] == cfg.vocab_size]
    assert not vocab_sized, vocab_sized
    dense_table = loaded.weights["model.embed_tokens.weight"].float()
    got_rows = model.embed_tokens(torch.arange(cfg.vocab_size))
    assert torch.allclose(got_rows, dense_table, rtol=0, atol=float(dense_table.abs().max()) * 2**-20)
    rng = random.Random(11)
    prompts = [[rng.randrange(TINY_VOCAB - 1) for _ in range(rng.randint(3, 30))] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert all(len(o.outputs[0].token_ids) == 8 for o in llm.generate(prompts, params))
