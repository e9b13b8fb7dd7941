"""The server's admission gates (entrypoints/server/admission.py), each on its own and
run together: every refusal is a typed value (status, code, message, Retry-After, the
field at fault, whether it is of the tenant's own load), the first gate in the fixed
order answers, and nothing is counted unless every gate admits. The HTTP-level wording
is pinned by test_server_limits.py, test_server_tenants.py and test_admission_fairness.py."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tokenmill.engine.request import Placement, SamplingParams
from tokenmill.engine.sched.fairness import QueueHead, make_queue_order
from tokenmill.engine.stats import EngineStats
from tokenmill.engine.limits import RequestLimits
from tokenmill.entrypoints.server.admission import (Admission, Ask, BacklogGate, RequestLimitsGate, RoomGate,
                                                     SequencesGate, TenantLimitsGate, refusal_error)
from tokenmill.entrypoints.server.errors import APIError
from tokenmill.entrypoints.server.serving import Job
from tokenmill.gateway.refusal import Refusal
from tokenmill.gateway.tenant_gate import TenantGate
from tokenmill.gateway.tenants import Tenant, TenantLimits
from tokenmill.gateway.waiting_room import CompileRoom, RoomShares, WaitingRoom

A = Tenant("a", limits=TenantLimits(max_inflight=1))
B = Tenant("b")


def _ask(tenant: Tenant = A, sequences: int = 1, requests: int = 1, tokens: int = 10) -> Ask:
    return Ask(tenant, Placement(tenant.name, tenant.priority_class, tenant.weight), requests, sequences, tokens)


def _shares(capacity: int = 8) -> RoomShares:
    return RoomShares.of(capacity, [("a", 1.0, 2), ("b", 1.0, 2)])


@dataclass
class _Published:
    """An engine as the backlog gate sees it: a published snapshot."""

    stats: EngineStats = field(default_factory=EngineStats)


def test_sequences_gate_refuses_what_could_never_queue_with_a_400_naming_n():
    gate = SequencesGate(max_waiting=4)
    assert gate.decide(_ask(sequences=4)) is None
    refusal = gate.decide(_ask(sequences=5))
    assert refusal == Refusal(400, "too_many_sequences", "this request asks for 5 sequences (prompts x n) but the "
                              "server queues at most 4 (--max-waiting); send fewer prompts or a smaller n", param="n")
    assert SequencesGate(max_waiting=None).decide(_ask(sequences=10 ** 6)) is None


def test_room_gate_refuses_a_full_room_for_everyone_and_a_share_for_its_tenant():
    room = WaitingRoom()
    gate = RoomGate(room, lambda: _shares(8), bounded=True)
    room.add("b", 8)
    full = gate.decide(_ask(B))
    assert (full.status, full.code, full.retry_after_s, full.against_tenant) == (429, "queue_full", None, False)
    room.remove("b", 8)
    room.add("a", 6)
    share = gate.decide(_ask(A))
    assert (share.status, share.code, share.against_tenant) == (429, "tenant_queue_share", True)
    assert gate.decide(_ask(B)) is None  # b is within its own share
    too_big = gate.decide(_ask(B, sequences=9))
    assert (too_big.status, too_big.code, too_big.param) == (400, "too_many_sequences", "n")
    assert RoomGate(room, lambda: _shares(8), bounded=False).decide(_ask(A, sequences=100)) is None


def test_backlog_gate_reads_the_published_queues_and_computes_its_retry_after():
    order = make_queue_order("priority", 10.0)
    key = order.queue_key(_ask().placement)
    published = _Published(EngineStats(queue_heads={key: QueueHead(oldest=0.0, waiting=20, started_since=1)}))
    gate = BacklogGate(order, published, clock=lambda: 1.0)
    refusal = gate.decide(_ask())
    # 21 requests at one a second: 21s expected, past 70% of the 10s bound by 14s
    assert (refusal.status, refusal.code, refusal.retry_after_s, refusal.against_tenant) == (
        429, "class_backlog", 14, True)
    assert "about 21.0s to start, past the 10s starvation bound" in refusal.message
    assert gate.decide(_ask(Tenant("c", priority_class=0))) is None  # another class's queue is empty
    assert BacklogGate(None, published).decide(_ask()) is None  # FCFS: never


def test_tenant_limits_gate_refuses_that_tenant_with_the_gates_retry_after():
    tenant_gate = TenantGate(retry_after_s=3)
    gate = TenantLimitsGate(tenant_gate)
    assert gate.decide(_ask(A)) is None
    gate.count(_ask(A))
    refusal = gate.decide(_ask(A))
    assert refusal == Refusal(429, "tenant_inflight_limit", "tenant 'a' has 1 requests in flight, this adds 1, "
                              "its limit is 1; retry later", retry_after_s=3, against_tenant=True)
    assert gate.decide(_ask(B)) is None


def test_refusal_error_carries_retry_after_on_429s_only():
    error = refusal_error(Refusal(429, "queue_full", "full"), retry_after_s=7)
    assert (error.status, error.code, error.headers) == (429, "queue_full", {"Retry-After": "7"})
    assert refusal_error(Refusal(429, "class_backlog", "x", retry_after_s=2), 7).headers == {"Retry-After": "2"}
    bad = refusal_error(Refusal(400, "too_many_sequences", "no", param="n"), 7)
    assert (bad.status, bad.param, bad.headers) == (400, "n", None)


def test_request_limits_gate_names_the_field_and_is_not_counted_as_a_refusal_of_load():
    gate = RequestLimitsGate(RequestLimits(max_model_len=64, vocab_size=100), 20, lambda: 4)
    assert gate.text_fits(64, "prompt") is None
    too_long = gate.text_fits(10_000, "messages")
    assert (too_long.status, too_long.param, too_long.against_tenant) == (400, "messages", False)
    empty = gate.prompt_ids([])
    assert (empty.status, empty.param, empty.message) == (400, "prompt", "prompt: the prompt is empty")
    assert gate.prompt_ids([1, 2]) is None
    assert gate.max_tokens(10, 5, 16) == 5 and gate.max_tokens(10, None, 16) == 20  # the flag is the default
    over = gate.max_tokens(60, 30, 16)
    assert isinstance(over, Refusal) and over.status == 400
    admission, refused = _admission()
    with pytest.raises(APIError) as exc:
        admission.check_prompt_ids([1, 100])  # past the vocabulary
    assert exc.value.status == 400 and exc.value.param == "prompt" and refused == []


def _admission(max_waiting: int = 8) -> tuple[Admission, list[tuple[str, str]]]:
    refused: list[tuple[str, str]] = []
    room, tenant_gate = WaitingRoom(), TenantGate(retry_after_s=1)

    def shares() -> RoomShares:
        return _shares(max_waiting)

    gates = (SequencesGate(max_waiting), RoomGate(room, shares, True), BacklogGate(None, _Published()),
             TenantLimitsGate(tenant_gate))
    limits = RequestLimitsGate(RequestLimits(max_model_len=64, vocab_size=100), None, lambda: 4)
    admission = Admission(limits, gates, room, CompileRoom(4), shares, tenant_gate, 5,
                          lambda refusal, tenant: refused.append((refusal.code, tenant)))
    return admission, refused


def _job(n: int = 1) -> Job:
    return Job("r", [1, 2, 3], SamplingParams(n=n, max_tokens=4), "completions")


def test_admission_asks_its_gates_in_order_and_counts_only_what_it_admits():
    admission, refused = _admission(max_waiting=8)
    with pytest.raises(APIError) as exc:  # the sequences bound answers before the room
        admission.reserve([_job(n=9)], A)
    assert exc.value.code == "too_many_sequences" and refused == [("too_many_sequences", "a")]
    assert admission.room.total == 0 and admission.pending == 0 and not admission.tenant_gate.load("a").inflight
    job = _job(n=2)
    admission.reserve([job], A)
    assert (admission.room.held, admission.pending, admission.tenant_gate.load("a").queued) == ({"a": 2}, 2, 2)
    with pytest.raises(APIError) as exc:  # past a's share and its in-flight limit: the room answers first
        admission.check(A, 7)
    assert exc.value.status == 400 and "tenant 'a' may queue at most 6" in exc.value.message
    with pytest.raises(APIError) as exc:  # a's one request in flight: its own limit
        admission.check(A, 1)
    assert exc.value.code == "tenant_inflight_limit" and exc.value.headers == {"Retry-After": "1"}
    admission.check(B, 1)  # b is not held to a's limit, and check counts nothing
    assert admission.room.held == {"a": 2} and "b" not in admission.room.held
    admission.release(job)  # never streamed: everything it held goes back
    assert (admission.room.total, admission.pending, admission.tenant_gate.load("a").inflight) == (0, 0, 0)


def test_admission_fills_in_its_own_retry_after_for_a_full_room():
    admission, refused = _admission(max_waiting=4)
    for tenant, n in ((A, 1), (B, 1), (B, 2)):  # each within its share, then b into the open half
        admission.reserve([_job(n=n)], tenant)
    with pytest.raises(APIError) as exc:
        admission.reserve([_job(n=1)], B)
    assert (exc.value.status, exc.value.code, exc.value.headers) == (429, "queue_full", {"Retry-After": "5"})
    assert refused == [("queue_full", "b")]
