"""Traces and conversations for replay: capture analysis, Mooncake files, vLLM's dataset format, multi-turn sessions."""
