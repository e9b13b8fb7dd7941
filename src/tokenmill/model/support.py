"""The model code's name for ``tokenmill.files.unsupported`` (the error lives at the package root,
below the tokenizer, which raises it too, and the model)."""
from __future__ import annotations

from ..files.unsupported import UnsupportedModel

__all__ = ["UnsupportedModel"]
