"""Anthropic's Messages API over the same engine."""
