"""Sample evaluation data shipped with tokenmill (read with importlib.resources)."""
