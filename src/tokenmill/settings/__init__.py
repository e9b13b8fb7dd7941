"""Settings every part reads: the engine's typed configuration, the kernel switches read once, the command line's argument habits, grammar limits."""
