"""Per-tenant limits at admission: requests in flight, tokens per minute, queued
sequences (gateway/tenants.py says what each means). A tenant past one gets a 429 with
``Retry-After``; nobody else is affected, unlike the global ``--max-waiting``.

The gate lives on the event loop (admission and accounting happen in handlers,
with no await between check and count), so it needs no lock.

Tokens per minute is a bucket of ``tokens_per_minute`` tokens refilled at that
rate, continuously. Admission holds the request's prompt plus ``n x
max_tokens`` (what it may cost) and needs that much in the bucket (a request
bigger than the whole bucket needs a full one, and leaves it in debt); the end
of a request gives back the output it did not produce, so the limit is on
tokens used, and a client cannot slip past it by asking small.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from .refusal import Refusal
from .tenants import Tenant


@dataclass
class TenantLoad:
    """What one tenant holds now."""

    inflight: int = 0  # engine requests admitted and not finished
    queued: int = 0  # sequences admitted that have produced no token yet
    bucket: float | None = None  # tokens-per-minute bucket (None: full, not touched yet)
    stamp: float = 0.0  # when the bucket was last refilled


class TenantLimited(Exception):
    """A tenant limit refused a request (``TenantGate.admit``'s answer, for callers that
    take a refusal as an exception): which one, the message, seconds to wait."""

    def __init__(self, code: str, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


class TenantGate:
    def __init__(self, retry_after_s: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.loads: dict[str, TenantLoad] = {}

    def load(self, name: str) -> TenantLoad:
        return self.loads.setdefault(name, TenantLoad())

    def _bucket(self, tenant: Tenant, load: TenantLoad, now: float) -> float:
        tpm = tenant.limits.tokens_per_minute
        assert tpm is not None
        if load.bucket is None:
            load.bucket, load.stamp = float(tpm), now
        load.bucket = min(float(tpm), load.bucket + (now - load.stamp) * tpm / 60.0)
        load.stamp = now
        return load.bucket

    def admit(self, tenant: Tenant, requests: int, sequences: int, tokens: int) -> None:
        """Count ``requests`` engine requests of ``sequences`` sequences that may cost
        ``tokens`` against ``tenant``, or raise TenantLimited (and count nothing)."""
        refusal = self.decide(tenant, requests, sequences, tokens)
        if refusal is not None:
            assert refusal.retry_after_s is not None
            raise TenantLimited(refusal.code, refusal.message, refusal.retry_after_s)
        self.count(tenant, requests, sequences, tokens)

    def decide(self, tenant: Tenant, requests: int, sequences: int, tokens: int) -> Refusal | None:
        """None when ``tenant`` may have this much more, else the limit it would pass; counts
        nothing (``count`` does, right after, with no await between). Also asked before a
        request's costly preparation (compiling its grammar), with what is known of it
        then, so a tenant past a limit never takes a place in the shared compile queue.
        Refills the tokens-per-minute bucket to now."""
        limits, load, now = tenant.limits, self.load(tenant.name), self.clock()
        if limits.max_inflight is not None and load.inflight + requests > limits.max_inflight:
            return self._refusal("tenant_inflight_limit",
                                 f"tenant {tenant.name!r} has {load.inflight} requests in flight, this adds "
                                 f"{requests}, its limit is {limits.max_inflight}; retry later")
        if limits.max_queued is not None and load.queued + sequences > limits.max_queued:
            return self._refusal("tenant_queue_limit",
                                 f"tenant {tenant.name!r} has {load.queued} sequences queued, this adds "
                                 f"{sequences}, its limit is {limits.max_queued}; retry later")
        tpm = limits.tokens_per_minute
        if tpm is not None:
            bucket = self._bucket(tenant, load, now)
            need = min(tokens, tpm)
            if bucket < need:
                wait = math.ceil((need - bucket) * 60.0 / tpm)
                return self._refusal("tenant_token_rate_limit",
                                     f"tenant {tenant.name!r} is over its {tpm} tokens per minute (this request "
                                     f"may use {tokens}); retry in {wait}s", max(1, wait))
        return None

    def _refusal(self, code: str, message: str, retry_after_s: int | None = None) -> Refusal:
        return Refusal(429, code, message, self.retry_after_s if retry_after_s is None else retry_after_s,
                       against_tenant=True)

    def count(self, tenant: Tenant, requests: int, sequences: int, tokens: int) -> None:
        """Count what ``decide`` just admitted: the requests in flight, the sequences
        queued, ``tokens`` taken from the bucket ``decide`` refilled."""
        load = self.load(tenant.name)
        if tenant.limits.tokens_per_minute is not None and load.bucket is not None:
            load.bucket -= tokens
        load.inflight += requests
        load.queued += sequences

    def started(self, name: str, sequences: int) -> None:
        """``sequences`` of the tenant produced their first token (or ended before it)."""
        load = self.load(name)
        load.queued = max(0, load.queued - sequences)

    def finished(self, tenant: Tenant, requests: int, unused_tokens: int) -> None:
        """Requests ended; ``unused_tokens`` of what admission held go back to the bucket."""
        load = self.load(tenant.name)
        load.inflight = max(0, load.inflight - requests)
        tpm = tenant.limits.tokens_per_minute
        if tpm is not None and load.bucket is not None and unused_tokens > 0:
            load.bucket = min(float(tpm), load.bucket + unused_tokens)
