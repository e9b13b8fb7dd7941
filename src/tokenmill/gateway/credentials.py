"""Reading the credential a client sends: shared by the server and the router.

Both check ``Authorization: Bearer TOKEN`` headers; the router proxies to the
servers and imports nothing of theirs, so the parsing lives here, below both.
"""
from __future__ import annotations


def bearer_token(header: bytes | str | None) -> bytes | None:
    """The credential of an ``Authorization: Bearer TOKEN`` header, the scheme in any case; else None."""
    if header is None:
        return None
    raw = header.encode("latin-1") if isinstance(header, str) else header
    scheme, _, token = raw.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip(b" \t")
