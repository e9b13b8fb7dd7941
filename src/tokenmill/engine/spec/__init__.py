"""Speculative decoding: n-gram and draft-model proposals and their exact verification."""
