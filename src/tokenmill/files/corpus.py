"""The bundled English text corpus, shared by the load tester and calibration.

The load tester cuts prompts of exact token counts out of it (``bench/tokens.py``);
w8a8's activation smoothing measures activations on it (``engine/loading.py``).
It lives at the package root, below both, so that neither reads the other's data.
"""
from __future__ import annotations

from importlib import resources


def corpus_text() -> str:
    return resources.files("tokenmill.files").joinpath("corpus.txt").read_text(encoding="utf-8")
