"""What tokenmill can run, and the one error for a model it cannot (and one for a
resource the server was told to use but cannot, ``StartupRefused``).

Kept free of torch so the command line can catch both (one line, exit status 2)
without importing the model code.
"""
from __future__ import annotations


class UnsupportedModel(ValueError):
    """A model (architecture, tensor type, rope scaling, layer setting) tokenmill cannot
    run; the message names what is unsupported and what is."""


class StartupRefused(ValueError):
    """A resource named on the command line cannot be used as asked (a folder another process
    holds, too little disk, a file that is not ours); the message names it and why."""
