"""Structured outputs: grammar specs, their crash-isolated compilation, and per-row token masks."""
