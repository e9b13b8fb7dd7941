"""The disk tier's folder kept as a database keeps its data: one process at a time (a second is
refused, the holder named), links and foreign files never followed, damaged index lines skipped
and the index rebuilt, every restored slot checked against its path and checksum, room reserved
up front or refused with the numbers, and an I/O error turning the tier off while the engine
goes on with the same greedy tokens."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

from conftest import make_tiny_llm
from tokenmill.engine.kv import kv_tier
from tokenmill.engine.kv.block_pool import BlockPool
from tokenmill.engine.kv.kv_tier import BlockIO, DiskTier, TierIdentity
from tokenmill.engine.kv.prefix_cache import PrefixCache
from tokenmill.engine.kv.tier_files import TierRefused, decode_line

BLOCK = 4


def _pool(num_blocks: int = 4) -> list[tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    shape = (2, num_blocks, BLOCK, 8)  # kv heads, blocks, block size, head dim
    return [(torch.randn(shape), torch.randn(shape)) for _ in range(2)]


def _identity(caches, model: str = "m") -> TierIdentity:
    return TierIdentity(model, "float32", "float32", BLOCK, BlockIO(caches).shapes())


def _tier(folder, caches, slots: int = 16, model: str = "m") -> DiskTier:
    return DiskTier(folder, slots * BlockIO(caches).block_bytes, BlockIO(caches), _identity(caches, model))


DOC = list(range(1, 1 + 4 * BLOCK))


def _offloaded(folder, caches) -> tuple[PrefixCache, BlockPool, DiskTier, list[np.ndarray]]:
    """A cache whose one 4-block document was moved to the tier (written); its blocks' bytes."""
    cache = PrefixCache(BLOCK)
    tier = _tier(folder, caches)
    cache.attach_tier(tier)
    pool = BlockPool(4, cache)
    table = pool.allocate(4)
    cache.insert(DOC, table, 0, 4)
    pool.release(table)
    expected = [BlockIO(caches).read(b) for b in table]
    assert cache.offload_all(pool) == 4
    tier.flush()
    return cache, pool, tier, expected


def _slot_of(folder, caches, tokens) -> int:
    salt = _identity(caches).key().encode()
    records = [decode_line(salt, line) for line in (folder / "kv_tier.index").read_bytes().splitlines(True)]
    return [r["slot"] for r in records if r and r.get("tokens") == list(tokens)][-1]


def test_a_second_tier_on_one_folder_is_refused_naming_the_holder(tmp_path):
    caches = _pool()
    first = _tier(tmp_path, caches)
    with pytest.raises(TierRefused, match=rf"in use by another tokenmill process \(pid {os.getpid()} on host "):
        _tier(tmp_path, caches)
    first.close()  # the lock goes with the tier
    _tier(tmp_path, caches).close()


def test_the_engine_refuses_a_held_folder_before_loading_the_model(tmp_path):
    caches = _pool()
    holder = _tier(tmp_path, caches)
    try:
        with pytest.raises(TierRefused, match="in use by another tokenmill process"):
            make_tiny_llm(num_blocks=16, kv_offload_bytes=1 << 20, kv_offload_dir=str(tmp_path))
    finally:
        holder.close()


def test_a_slot_changed_behind_the_tiers_back_is_never_restored(tmp_path):
    caches = _pool()
    cache, _, tier, expected = _offloaded(tmp_path, caches)
    pool = BlockPool(4, cache)  # a fresh pool: every block of the document is on disk only
    second = _slot_of(tmp_path, caches, DOC[BLOCK:2 * BLOCK])
    with open(tmp_path / "kv_tier.bin", "r+b") as fh:  # another writer's bytes in the slot
        fh.seek(second * BlockIO(caches).block_bytes)
        fh.write(b"\x7f" * 16)
    for layer in caches:
        for t in layer:
            t.zero_()
    got = cache.restore(DOC + [0], 0, 4, pool)
    assert len(got) == 1 and np.array_equal(BlockIO(caches).read(got[0]), expected[0])
    assert tier.stats.rejected_blocks == 1 and cache.num_on_disk == 0  # the bad block and below: dropped
    pool.check_invariants()
    cache.check_invariants(pool.ref_counts)
    tier.close()


def test_a_slot_holding_another_path_is_never_restored(tmp_path):
    caches = _pool()
    cache, _, tier, _ = _offloaded(tmp_path, caches)
    first = _slot_of(tmp_path, caches, DOC[:BLOCK])
    assert tier.fetch([(first, b"\x01" * 16)]) == [] and tier.stats.rejected_blocks == 1
    tier.close()


@pytest.mark.parametrize("name", ["kv_tier.bin", "kv_tier.index", "kv_tier.json", "kv_tier.lock"])
def test_a_link_in_the_folder_is_refused_never_followed(tmp_path, name):
    caches = _pool()
    folder, victim = tmp_path / "tier", tmp_path / "victim"
    folder.mkdir(mode=0o700)
    victim.write_bytes(b"precious")
    (folder / name).symlink_to(victim)
    with pytest.raises(TierRefused, match=f"{name} is a symbolic link"):
        _tier(folder, caches)
    os.unlink(folder / name)
    os.link(victim, folder / name)  # a hard link reaches the victim just the same
    with pytest.raises(TierRefused, match="one link"):
        _tier(folder, caches)
    assert victim.read_bytes() == b"precious"


def test_a_folder_others_can_write_is_refused(tmp_path):
    folder = tmp_path / "tier"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(TierRefused, match="writable by nobody else"):
        _tier(folder, _pool())


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_of_another_user_is_refused(tmp_path):
    caches = _pool()
    _tier(tmp_path, caches).close()
    os.chown(tmp_path / "kv_tier.index", 12345, 12345)
    with pytest.raises(TierRefused, match="not a regular file of this user"):
        _tier(tmp_path, caches)


def test_garbage_appended_to_the_index_is_skipped_and_the_index_rebuilt(tmp_path):
    caches = _pool()
    cache, _, tier, _ = _offloaded(tmp_path, caches)
    tier.close()
    with open(tmp_path / "kv_tier.index", "ab") as fh:
        fh.write(b"\xff\xfe\x00\x9c garbage\n{\"slot\": 1}\n\x80\x81 no newline at the end")
    again = _tier(tmp_path, caches)
    assert again.stats.damaged_lines == 3 and len(again.recovered) == 4
    assert PrefixCache(BLOCK).attach_tier(again) == 4
    again.close()
    third = _tier(tmp_path, caches)  # rebuilt: nothing damaged is left
    assert third.stats.damaged_lines == 0 and len(third.recovered) == 4
    third.close()


def test_a_damaged_header_starts_the_tier_empty(tmp_path):
    caches = _pool()
    _, _, tier, _ = _offloaded(tmp_path, caches)
    tier.close()
    (tmp_path / "kv_tier.json").write_bytes(b"\x00\xff{")
    again = _tier(tmp_path, caches)
    assert again.recovered == [] and PrefixCache(BLOCK).attach_tier(again) == 0
    again.close()


def test_asking_for_more_than_the_filesystem_has_free_is_refused_with_the_numbers(tmp_path):
    caches = _pool()
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    asked = free + (1 << 30)
    with pytest.raises(TierRefused, match=r"asks for \d+ bytes .* has \d+ bytes \(.*\) free"):
        DiskTier(tmp_path, asked, BlockIO(caches), _identity(caches))
    assert not (tmp_path / "kv_tier.bin").exists() or (tmp_path / "kv_tier.bin").stat().st_size == 0


def test_the_data_file_is_reserved_not_sparse(tmp_path):
    caches = _pool()
    tier = _tier(tmp_path, caches, slots=64)
    st = (tmp_path / "kv_tier.bin").stat()
    assert st.st_size == 64 * BlockIO(caches).block_bytes and st.st_blocks * 512 >= st.st_size
    tier.close()


def _reference(prompts, params):
    llm = make_tiny_llm(num_blocks=256, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in (llm.generate([p], params)[0] for p in prompts)]


@pytest.mark.parametrize("failing", ["write_all", "read_into"])
def test_an_io_error_turns_the_tier_off_and_the_engine_goes_on(tmp_path, monkeypatch, failing):
    from prometheus_client import generate_latest

    from tokenmill import SamplingParams
    from tokenmill.entrypoints.server.metrics import ServerMetrics

    docs = [[(7 * d + i) % 200 + 3 for i in range(6 * 16)] for d in range(4)]
    prompts = [doc + [250 + q] for q in range(2) for doc in docs]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    reference = _reference(prompts, params)
    tiered = make_tiny_llm(num_blocks=16, kv_offload_bytes=64 << 20, kv_offload_dir=str(tmp_path))
    tier = tiered.engine.prefix_cache.tier
    calls = {"n": 0}
    real = getattr(kv_tier, failing)

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] > 3:  # a few blocks get through first
            raise OSError(errno.ENOSPC if failing == "write_all" else errno.EIO, "injected")
        return real(*args)

    monkeypatch.setattr(kv_tier, failing, flaky)
    got = [o.outputs[0].token_ids for o in (tiered.generate([p], params)[0] for p in prompts)]
    assert got == reference
    assert tier.disabled is not None and tier.stats.errors >= 1
    assert tiered.engine.prefix_cache.num_on_disk == 0
    tiered.engine.check_idle_invariants()
    text = generate_latest(ServerMetrics("tiny", tiered.engine).exposed).decode()
    assert 'tokenmill:kv_tier_disabled{model_name="tiny"} 1.0' in text
    assert 'tokenmill:kv_tier_errors_total{model_name="tiny"}' in text
    tiered.engine.close()


def test_several_models_cannot_share_one_tier_folder(tmp_path):
    from tokenmill.entrypoints.cli.main import build_parser
    from tokenmill.entrypoints.cli.serve_cli import finalize_serve_args

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    args = build_parser().parse_args(["serve", "--model", str(a), "--model", str(b), "--kv-offload-bytes", "1G",
                                      "--kv-offload-dir", str(tmp_path / "tier")])
    assert finalize_serve_args(args).startswith("--kv-offload-dir is for one model")
