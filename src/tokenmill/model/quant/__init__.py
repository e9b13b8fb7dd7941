"""Quantized layers: int8, int4 and GGUF-block linears, K-quants, activation smoothing, the quantized KV format, block-kept token tables."""
