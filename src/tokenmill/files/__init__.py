"""What the package reads from disk: GGUF containers, the bundled model's place, the text corpus, tokenizers, and the one-line refusal of what is unsupported."""
