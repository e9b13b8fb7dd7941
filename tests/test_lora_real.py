"""One peft adapter on the bundled SmolLM2 (float32): greedy tokens equal transformers + peft,
alone and batched with the base model. Slow: it loads the model twice."""
from __future__ import annotations

import os

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")


@pytest.fixture()
def one_thread():
    """One thread: on a loaded machine two threads spend most of their time waiting for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_bundled_model_with_one_adapter(real_loaded, real_tokenizer, bundled_model_path, tmp_path, one_thread):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(bundled_model_path)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(gguf_file=name, dequantize=True)).eval()
    base.generation_config.eos_token_id = None
    base.generation_config.pad_token_id = 0
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False, lora_dropout=0.0)
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(str(tmp_path / "adapter"))
    prompt = real_tokenizer.encode("The capital of France is")
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                             do_sample=False)[0, len(prompt):].tolist()
        with model.disable_adapter():
            ref_base = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                      do_sample=False)[0, len(prompt):].tolist()
    assert ref != ref_base
    llm = LLM(loaded_model=real_loaded, tokenizer=real_tokenizer, dtype="float32", quantization="none",
              kv_cache_memory="128MiB", enable_lora=True, max_lora_rank=8, num_threads=1)
    llm.load_lora("fr", str(tmp_path / "adapter"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([prompt, prompt], params, lora=["fr", None])
    assert outs[0].outputs[0].token_ids == ref
    assert outs[1].outputs[0].token_ids == ref_base
    llm.close()
