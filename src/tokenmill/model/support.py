"""What tokenmill can run, and the one error for a model it cannot.

Kept free of torch so the command line can catch ``UnsupportedModel`` (one
line, exit status 2) without importing the model code.
"""
from __future__ import annotations


class UnsupportedModel(ValueError):
    """A model (architecture, tensor type, rope scaling, layer setting) tokenmill cannot
    run; the message names what is unsupported and what is."""
