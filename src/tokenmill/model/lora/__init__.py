"""LoRA adapters: PEFT and GGUF adapter files and the low-rank update around a projection."""
