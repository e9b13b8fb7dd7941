"""Anthropic's Messages API over the same engine, and its encoder of output events."""
