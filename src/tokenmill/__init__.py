"""tokenmill: serve open-weight language models privately.

The offline API mirrors vLLM's: ``from tokenmill import LLM, SamplingParams``.
Heavy modules load on first use so `tokenmill bench` stays light.
"""
from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from .entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutput", "CompletionOutput"):
        from .engine import request

        return getattr(request, name)
    raise AttributeError(name)
