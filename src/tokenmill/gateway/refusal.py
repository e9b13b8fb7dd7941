"""Why a request is not admitted, as a value: what every admission check returns.

A check returns a ``Refusal`` (or None to admit) instead of raising, so the one
object that runs the checks (the server's admission) decides in one place how a
refusal is counted and answered: the HTTP status, the error code, the message,
the ``Retry-After`` a 429 carries, the request field a 400 names.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Refusal:
    """One refusal. ``retry_after_s``: seconds a client should wait (a 429's
    ``Retry-After``; None where the check cannot know it and the caller's default
    applies, or where retrying cannot help); ``param``: the request field at fault;
    ``against_tenant``: the tenant's own load refused it (its share, its limits, its
    class's backlog), so it counts in that tenant's usage, not only the server's;
    ``code``: the error code (None only for a malformed request's 400 that has none)."""

    status: int
    code: str | None
    message: str
    retry_after_s: int | None = None
    param: str | None = None
    against_tenant: bool = False
