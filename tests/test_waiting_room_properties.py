"""The waiting room's fairness (gateway/waiting_room.py), over any interleaving of tenants and classes
arriving and starting: the room never holds more than --max-waiting, a tenant within its share is
never refused, and a refusal is never caused by worse classes (the best class keeps a quarter of
the room from every other class)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from tokenmill.gateway.waiting_room import EPSILON, CompileRoom, RoomShares, WaitingRoom, compile_keep

tenants_st = st.lists(st.tuples(st.sampled_from([0.5, 1.0, 2.0, 4.0]), st.integers(0, 4)), min_size=1, max_size=5)
events_st = st.lists(st.tuples(st.sampled_from(["arrive", "arrive", "arrive", "start"]), st.integers(0, 4),
                               st.integers(1, 6)), max_size=120)


def excess(room: WaitingRoom, shares: RoomShares, names: list[str], tenant: str, new: int) -> float:
    """What ``names`` hold past their shares, with ``new`` more sequences for ``tenant``."""
    return sum(max(0.0, room.held.get(n, 0) + (new if n == tenant else 0) - shares.share(n)) for n in names)


@settings(max_examples=400, deadline=None)
@given(capacity=st.integers(1, 64), tenants=tenants_st, events=events_st)
def test_any_interleaving_keeps_the_bound_the_shares_and_the_classes(capacity, tenants, events):
    names = [f"t{i}" for i in range(len(tenants))]
    klass = {n: c for n, (_, c) in zip(names, tenants)}
    shares = RoomShares.of(capacity, ((n, w, c) for n, (w, c) in zip(names, tenants)))
    room = WaitingRoom()
    for kind, who, count in events:
        tenant = names[who % len(names)]
        if kind == "start":
            room.remove(tenant, count)
            continue
        within = room.held.get(tenant, 0) + count <= shares.share(tenant) + EPSILON
        refusal = room.decide(shares, tenant, klass[tenant], count)
        if within:  # a tenant within its share is never refused, whatever the others hold
            assert refusal is None, (refusal, room.held)
        if refusal is None:
            room.add(tenant, count)
            assert room.total <= capacity  # the global bound
            assert room.total == sum(room.held.values())
            continue
        # refused: the tenants of its class and better ones hold, past their shares, more than
        # the slice its class keeps from the worse ones; worse classes never caused it
        rank = shares.rank(klass[tenant])
        kept = shares.kept_for_better(klass[tenant])
        gap = shares.capacity * 0.5 * 0.5 ** (rank + 1)
        assert gap > 0 and kept + gap <= capacity
        better_or_same = [n for n in names if shares.rank(klass[n]) <= rank]
        assert excess(room, shares, better_or_same, tenant, count) > gap - EPSILON, (refusal, room.held)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(2, 64), flood=st.integers(1, 400), weights=st.tuples(st.sampled_from([1.0, 2.0]),
                                                                                 st.sampled_from([1.0, 2.0])))
def test_a_flood_is_refused_for_its_share_before_it_takes_a_quiet_tenants_place(capacity, flood, weights):
    shares = RoomShares.of(capacity, [("flood", weights[0], 2), ("quiet", weights[1], 2)])
    room = WaitingRoom()
    codes = set()
    for _ in range(flood):
        refusal = room.decide(shares, "flood", 2, 1)
        if refusal is None:
            room.add("flood", 1)
        else:
            codes.add(refusal.code)
    assert codes <= {"tenant_queue_share"}
    if shares.share("quiet") >= 1:
        assert room.decide(shares, "quiet", 2, 1) is None


def test_the_best_class_keeps_a_quarter_of_the_room_from_a_worse_class_flood():
    shares = RoomShares.of(16, [("batch", 8.0, 4), ("critical", 1.0, 0)])
    room = WaitingRoom()
    while room.decide(shares, "batch", 4, 1) is None:
        room.add("batch", 1)
    for _ in range(4):  # its share (about one) and the quarter kept for it
        assert room.decide(shares, "critical", 0, 1) is None
        room.add("critical", 1)


def test_a_lone_tenant_still_fills_the_whole_room():
    """Without a keys file everyone is the default tenant: --max-waiting means what it did."""
    shares = RoomShares.of(8, [("default", 1.0, 2)])
    room = WaitingRoom()
    for _ in range(8):
        assert room.decide(shares, "default", 2, 1) is None
        room.add("default", 1)
    refusal = room.decide(shares, "default", 2, 1)
    assert refusal is not None and refusal.code == "queue_full"
    assert room.decide(shares, "default", 2, 9).status == 400


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 32), events=st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=80))
def test_the_compile_queue_keeps_room_for_another_tenant_and_the_best_class(size, events):
    room = CompileRoom(size)
    best = {0: True, 1: False, 2: False, 3: False}
    keep = compile_keep(size)
    for arrive, who in events:
        name = f"t{who}"
        if not arrive:
            if room.held.get(name):
                room.remove(name, best[who])
            continue
        if room.decide(name, best[who], several=True) is None:
            room.add(name, best[who])
        assert room.worse <= size - keep  # the best class keeps its part from the worse ones
        assert all(held <= room.tenant_limit(True) for held in room.held.values())
        if size >= 2:
            assert room.decide("quiet-best", True, several=True) is None  # the best class always finds room
    assert room.decide("lone", False, several=False) is None or room.held.get("lone", 0) >= size or (
        room.worse >= size - keep)
