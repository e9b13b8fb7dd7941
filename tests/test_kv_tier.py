"""The prefix cache's disk tier: invariants under random workloads (a shadow of every block's
contents proves a restored block holds exactly what was evicted), restores, warm restarts, torn
writes, and greedy tokens unchanged on the tiny model whether a prefix came from the pool, the
disk tier, or recompute."""
from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_cache_properties import BLOCK, Sim, _arrive, prefixes, request_st
from tokenmill.engine.kv.kv_tier import BlockIO, DiskTier, TierIdentity
from tokenmill.engine.kv.tier_files import decode_line


class ShadowIO:
    """BlockIO over the simulation's shadow contents: a block's bytes are its tokens (-1: empty)."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.block_bytes = BLOCK * 8

    def read_many(self, blocks) -> np.ndarray:
        rows = [[self.sim.shadow.get(b, {}).get(i, -1) for i in range(BLOCK)] for b in blocks]
        return np.array(rows, dtype=np.int64).reshape(len(blocks), BLOCK).view(np.uint8)

    def write_many(self, blocks, data: np.ndarray) -> None:
        for block, row in zip(blocks, np.asarray(data, dtype=np.uint8).reshape(len(blocks), -1)):
            values = np.ascontiguousarray(row).view(np.int64)
            self.sim.shadow[block] = {i: int(v) for i, v in enumerate(values) if v != -1}


IDENTITY = TierIdentity("test", "float32", "float32", BLOCK, [[BLOCK, 8]])


def _tiered_sim(folder: str, num_blocks: int, slots: int, budget: int, max_seqs: int) -> tuple[Sim, DiskTier]:
    sim = Sim(num_blocks, caching=True, budget=budget, max_seqs=max_seqs)
    tier = DiskTier(folder, slots * BLOCK * 8, ShadowIO(sim), IDENTITY)
    sim.cache.attach_tier(tier)
    return sim, tier


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared=st.lists(prefixes, min_size=4, max_size=4), requests=st.lists(request_st, min_size=1, max_size=12),
       num_blocks=st.integers(4, 24), slots=st.integers(1, 16), budget=st.integers(1, 24), max_seqs=st.integers(1, 6))
def test_random_workloads_with_a_disk_tier_keep_invariants_and_exact_contents(shared, requests, num_blocks, slots,
                                                                              budget, max_seqs):
    folder = tempfile.mkdtemp()
    try:
        sim, tier = _tiered_sim(folder, num_blocks, slots, budget, max_seqs)
        _arrive(sim, shared, sorted(enumerate(requests), key=lambda x: x[1][3]), steps=8)
        sim.drain(limit=2000)  # checks every hit's contents against the shadow, and the invariants
        assert tier.used_bytes <= tier.num_slots * tier.io.block_bytes
        for block in sim.cache.evict_all_idle():
            sim.pool.return_evicted(block)
        sim.cache.check_invariants(sim.pool.ref_counts)
        assert sim.cache.num_on_disk == 0 and len(tier.free_slots) == tier.num_slots
        tier.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_an_evicted_document_comes_back_from_disk(tmp_path):
    sim, tier = _tiered_sim(str(tmp_path), num_blocks=6, slots=8, budget=64, max_seqs=1)
    doc_a = list(range(100, 100 + 4 * BLOCK))
    doc_b = list(range(500, 500 + 5 * BLOCK))
    for rid, doc in (("a", doc_a), ("b", doc_b)):
        sim.add(rid, doc, 1)
        sim.drain(50)
    assert tier.stats.stored_blocks >= 3  # b pushed a's blocks out of the 6-block pool
    sim.add("a2", doc_a + [7], 1)
    req = sim.active[-1]
    sim.drain(50)
    assert tier.stats.restored_blocks >= 3 and req.num_cached_tokens >= 3 * BLOCK
    tier.close()


def _pool(num_blocks: int = 4) -> list[tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    shape = (2, num_blocks, BLOCK, 8)  # kv heads, blocks, block size, head dim
    return [(torch.randn(shape), torch.randn(shape), torch.rand(2, num_blocks)) for _ in range(3)]


def test_block_io_round_trips_every_layer_and_scale():
    caches = _pool()
    io = BlockIO(caches)
    data = io.read(1)
    assert data.nbytes == io.block_bytes == 3 * (2 * 2 * BLOCK * 8 * 4 + 2 * 4)
    before = [t[:, 1].clone() for layer in caches for t in layer]
    for layer in caches:
        for t in layer:
            t[:, 1].zero_()
    io.write(1, data)
    assert all(torch.equal(a, t[:, 1]) for a, t in zip(before, [t for layer in caches for t in layer]))
    rows = io.read_many([3, 1])  # a batch is the single reads stacked, and writes back the same
    assert np.array_equal(rows[0], io.read(3)) and np.array_equal(rows[1], data)
    io.write_many([2, 0], rows)
    assert np.array_equal(io.read(2), rows[0]) and np.array_equal(io.read(0), data)


def test_warm_restart_keeps_whole_paths_and_drops_torn_ones(tmp_path):
    from tokenmill.engine.kv.prefix_cache import PrefixCache

    caches = _pool(num_blocks=4)
    identity = TierIdentity("m", "float32", "float32", BLOCK, BlockIO(caches).shapes())
    cache = PrefixCache(BLOCK)
    tier = DiskTier(tmp_path, 16 * BlockIO(caches).block_bytes, BlockIO(caches), identity)
    cache.attach_tier(tier)
    from tokenmill.engine.kv.block_pool import BlockPool

    pool = BlockPool(4, cache)
    doc = list(range(1, 1 + 4 * BLOCK))
    table = pool.allocate(4)
    cache.insert(doc, table, 0, 4)
    pool.release(table)
    expected = [BlockIO(caches).read(b) for b in table]
    assert cache.offload_all(pool) == 4 and cache.num_on_disk == 4
    tier.close()

    # Same identity: the four blocks come back as one path, and restore fills pool blocks exactly.
    cache2, pool2 = PrefixCache(BLOCK), None
    tier2 = DiskTier(tmp_path, 16 * BlockIO(caches).block_bytes, BlockIO(caches), identity)
    assert cache2.attach_tier(tier2) == 4
    pool2 = BlockPool(4, cache2)
    for layer in caches:
        for t in layer:
            t.zero_()
    got = cache2.restore(doc + [0], 0, 4, pool2)
    assert len(got) == 4 and all(np.array_equal(BlockIO(caches).read(b), e) for b, e in zip(got, expected))
    pool2.check_invariants()
    cache2.check_invariants(pool2.ref_counts)
    pool2.release(got)
    assert cache2.offload_all(pool2) == 4
    tier2.close()

    # A torn slot (its bytes no longer match their checksum) is dropped with everything below it.
    data = np.memmap(tmp_path / "kv_tier.bin", dtype=np.uint8, mode="r+")
    second = _last_slot_of(tmp_path, identity, doc[BLOCK:2 * BLOCK])
    data[second * BlockIO(caches).block_bytes] ^= 0xFF
    data.flush()
    del data
    cache3 = PrefixCache(BLOCK)
    tier3 = DiskTier(tmp_path, 16 * BlockIO(caches).block_bytes, BlockIO(caches), identity)
    assert tier3.stats.torn_blocks == 1 and cache3.attach_tier(tier3) == 1  # only the first block is whole
    tier3.close()

    # Another model: the folder is ignored.
    other = TierIdentity("another", "float32", "float32", BLOCK, identity.shapes)
    tier4 = DiskTier(tmp_path, 16 * BlockIO(caches).block_bytes, BlockIO(caches), other)
    assert PrefixCache(BLOCK).attach_tier(tier4) == 0
    tier4.close()


def _last_slot_of(folder, identity: TierIdentity, tokens) -> int:
    """The slot the index last stored ``tokens`` in."""
    records = [decode_line(identity.key().encode(), line)
               for line in (folder / "kv_tier.index").read_bytes().splitlines(keepends=True)]
    return [r["slot"] for r in records if r and r.get("tokens") == list(tokens)][-1]


def test_greedy_tokens_are_the_same_from_pool_disk_or_recompute_and_after_a_restart(tmp_path):
    from conftest import make_tiny_llm
    from tokenmill import SamplingParams

    docs = [[(7 * d + i) % 200 + 3 for i in range(6 * 16)] for d in range(4)]
    prompts = [doc + [250 + q] for q in range(2) for doc in docs]  # each document twice, far apart
    params = SamplingParams(temperature=0.0, max_tokens=6)

    def run(llm):
        return [o.outputs[0].token_ids for o in (llm.generate([p], params)[0] for p in prompts)]

    reference = run(make_tiny_llm(num_blocks=256, enable_prefix_caching=False))
    tiered = make_tiny_llm(num_blocks=16, kv_offload_bytes=64 << 20, kv_offload_dir=str(tmp_path))
    assert run(tiered) == reference
    engine = tiered.engine
    tier = engine.prefix_cache.tier
    assert tier.stats.stored_blocks > 0 and tier.stats.restored_blocks > 0
    engine.check_idle_invariants()
    from tokenmill.entrypoints.server.metrics import ServerMetrics

    from prometheus_client import generate_latest

    text = generate_latest(ServerMetrics("tiny", engine).exposed).decode()
    assert f'tokenmill:kv_tier_restored_blocks_total{{model_name="tiny"}} {float(tier.stats.restored_blocks)}' in text
    engine.close()  # the pool's cached blocks go to disk too

    restarted = make_tiny_llm(num_blocks=16, kv_offload_bytes=64 << 20, kv_offload_dir=str(tmp_path))
    assert restarted.engine.prefix_cache.num_on_disk > 0
    out = restarted.generate([prompts[-1]], params)[0]
    assert out.outputs[0].token_ids == reference[-1] and out.num_cached_tokens >= 5 * 16
    restarted.engine.close()
