"""tokenmill: serve open-weight language models privately.

The offline API mirrors vLLM's: ``from tokenmill import LLM, SamplingParams``.
Heavy modules load on first use so `tokenmill bench` stays light.
"""
from __future__ import annotations

import os
from typing import Any

# OpenMP threads that spin while waiting steal the CPU from the other thread,
# the HTTP server and other processes on small machines; passive waiting was
# measured faster on a 2-core machine (single-stream decode) and far better
# under contention. Must be set before torch loads libgomp; the user's own
# setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "GrammarSpec"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from .entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutput", "CompletionOutput"):
        from .engine import request

        return getattr(request, name)
    if name == "GrammarSpec":
        from .engine.grammar.structured import GrammarSpec

        return GrammarSpec
    raise AttributeError(name)
