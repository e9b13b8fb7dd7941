"""The KV cache's second tier: blocks evicted from the pool kept on local disk.

When the pool runs short, the prefix cache evicts its least recently used idle
blocks. With a tier (``--kv-offload-bytes``), an evicted block's K/V (every
layer, K and V, and a quantized pool's scales) is copied out before its pool
block is reused, and the radix tree keeps the node, now naming a *slot* of
this tier instead of a pool block. A later prompt that walks onto that node
gets a fresh pool block filled from the slot (``restore``) instead of
recomputing it. The tree still compares token ids exactly; the tier only
stores bytes.

Storage: one memory-mapped file of fixed-size slots (``kv_tier.bin``) and an
append-only index (``kv_tier.index``, one JSON line per slot written or freed:
the slot, its block's token ids, its path's and its parent path's 128-bit
chained digests, and a CRC32 of the slot's bytes). The engine thread copies a
block into a buffer and queues it; a writer thread writes the slot, then the
index line, so the index never names bytes that were not written. A reader of
a slot whose write is still queued takes the buffer.

Warm restarts: a process that opens the same folder with the same model
identity (``TierIdentity``: model digest, dtype, KV dtype, block size and the
pool's tensor shapes) reads the index, drops entries whose bytes fail their
CRC (torn by a crash) and entries whose parent path is missing, and hands the
rest to the prefix cache as disk nodes. A different identity: the folder is
ignored and rewritten, with one log line.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

log = logging.getLogger("tokenmill.kv_tier")

ROOT_DIGEST = b"\0" * 16


def path_digest(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """A block's path identity: BLAKE2b-128 of its parent path's digest and its tokens."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class BlockIO:
    """Copies one pool block (all layers; K, V and any scales) to and from bytes. Every pool
    tensor has the block index on its dimension 1 (model/attention/layout.py, kv_quant.py)."""

    def __init__(self, kv_caches: Sequence[Sequence[torch.Tensor]]) -> None:
        self.tensors = [t for layer in kv_caches for t in layer]
        self.sizes = [t[:, 0].numel() * t.element_size() for t in self.tensors]
        self.block_bytes = sum(self.sizes)

    def shapes(self) -> list[list[int]]:
        return [[*t.shape[:1], *t.shape[2:], t.element_size()] for t in self.tensors]

    def read(self, block: int) -> np.ndarray:
        parts = [t[:, block].contiguous().view(torch.uint8).reshape(-1) for t in self.tensors]
        return torch.cat(parts).cpu().numpy()

    def write(self, block: int, data: np.ndarray) -> None:
        offset = 0
        flat = torch.from_numpy(np.ascontiguousarray(data))
        for t, size in zip(self.tensors, self.sizes):
            chunk = flat[offset:offset + size].to(t.device)
            t[:, block].copy_(chunk.view(t.dtype).reshape(t[:, block].shape))
            offset += size


@dataclass(frozen=True)
class TierIdentity:
    """What must match for a tier's bytes to be this process's K/V."""

    model: str
    dtype: str
    kv_dtype: str
    block_size: int
    shapes: list[list[int]]

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


def model_digest(path: str | None) -> str:
    """A cheap digest of a model's weight files: names, sizes and the first and last 4 MiB of
    each (hashing gigabytes at every start would cost more than the tier saves)."""
    if path is None:
        return "bundled"
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) + sorted(p.glob("*.gguf")) if p.is_dir() else [p]
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(4 << 20))
            if size > 8 << 20:
                fh.seek(size - (4 << 20))
                h.update(fh.read(4 << 20))
    return h.hexdigest()


@dataclass
class SlotEntry:
    """One stored block, as the index (and a warm restart) knows it."""

    slot: int
    digest: bytes  # this block's path digest
    parent: bytes  # its parent path's digest (ROOT_DIGEST at the root)
    token_ids: tuple[int, ...]


@dataclass
class TierStats:
    stored_blocks: int = 0  # blocks written to the tier (pool evictions)
    restored_blocks: int = 0  # blocks read back into the pool on a prefix hit
    restore_seconds: float = 0.0
    dropped_blocks: int = 0  # tier evictions (the tier was full)
    torn_blocks: int = 0  # entries found torn at start (CRC mismatch) and dropped


class DiskTier:
    """Fixed-size slots in one memory-mapped file; writes happen on a thread of their own."""

    def __init__(self, folder: str | os.PathLike[str], capacity_bytes: int, io: BlockIO,
                 identity: TierIdentity) -> None:
        self.io = io
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.num_slots = int(capacity_bytes // io.block_bytes)
        if self.num_slots < 1:
            raise ValueError(f"--kv-offload-bytes {capacity_bytes} holds no block ({io.block_bytes} bytes each)")
        self.identity = identity
        self.stats = TierStats()
        self.closed = False
        self.free_slots: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._pending: dict[int, np.ndarray] = {}  # slot -> bytes not yet written
        self._lock = threading.Lock()
        self._queue: "queue.Queue[tuple[str, int, object] | None]" = queue.Queue()
        self.recovered = self._open()
        self._thread = threading.Thread(target=self._writer, name="tokenmill-kv-tier", daemon=True)
        self._thread.start()

    # -- files --------------------------------------------------------------
    def _open(self) -> list[SlotEntry]:
        """Map the data file; return the entries a previous process left that are whole."""
        meta_path, data_path, index_path = (self.folder / n for n in ("kv_tier.json", "kv_tier.bin", "kv_tier.index"))
        key = self.identity.key()
        reuse = False
        if meta_path.exists():
            try:
                meta = json.loads(meta_path.read_text())
                reuse = meta.get("identity") == key and meta.get("slot_bytes") == self.io.block_bytes
                if not reuse:
                    log.info("KV tier in %s was written for another model or layout: ignoring it", self.folder)
            except (OSError, ValueError):
                log.info("KV tier in %s has an unreadable header: ignoring it", self.folder)
        size = self.num_slots * self.io.block_bytes
        if not reuse or not data_path.exists():
            for p in (data_path, index_path):
                p.unlink(missing_ok=True)
        with open(data_path, "ab") as fh:
            fh.truncate(size) if fh.tell() != size else None
        self.data = np.memmap(data_path, dtype=np.uint8, mode="r+", shape=(self.num_slots, self.io.block_bytes))
        entries = self._read_index(index_path) if reuse else {}
        meta_path.write_text(json.dumps({"identity": key, "slot_bytes": self.io.block_bytes,
                                         "identity_fields": asdict(self.identity)}))
        self._index = open(index_path, "a", encoding="utf-8")
        recovered: list[SlotEntry] = []
        for slot, (entry, crc) in sorted(entries.items()):
            if slot >= self.num_slots or zlib.crc32(self.data[slot]) != crc:
                self.stats.torn_blocks += 1
                continue
            recovered.append(entry)
        return recovered

    def _read_index(self, path: Path) -> dict[int, tuple[SlotEntry, int]]:
        """The last word on each slot: written (entry, crc) or freed; a torn last line is skipped."""
        entries: dict[int, tuple[SlotEntry, int]] = {}
        if not path.exists():
            return entries
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                    slot = int(rec["slot"])
                    if rec.get("free"):
                        entries.pop(slot, None)
                        continue
                    entries[slot] = (SlotEntry(slot, bytes.fromhex(rec["digest"]), bytes.fromhex(rec["parent"]),
                                               tuple(int(t) for t in rec["tokens"])), int(rec["crc"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by a crash
        return entries

    def claim(self, slots: Sequence[int]) -> None:
        """Mark recovered slots as used (the prefix cache took them)."""
        taken = set(slots)
        self.free_slots = [s for s in self.free_slots if s not in taken]

    # -- the engine thread's side -----------------------------------------------
    def store(self, block: int, entry: SlotEntry) -> None:
        """Copy pool block ``block`` out now (before it is reused) and queue its write."""
        data = self.io.read(block)
        with self._lock:
            self._pending[entry.slot] = data
        self.stats.stored_blocks += 1
        self._queue.put(("store", entry.slot, (data, entry)))

    def load(self, slot: int, block: int) -> None:
        """Fill pool block ``block`` from ``slot`` (its queued bytes if not written yet)."""
        t0 = time.perf_counter()
        with self._lock:
            data = self._pending.get(slot)
        self.io.write(block, data if data is not None else np.asarray(self.data[slot]))
        self.stats.restored_blocks += 1
        self.stats.restore_seconds += time.perf_counter() - t0

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)
        self._queue.put(("free", slot, None))

    @property
    def used_bytes(self) -> int:
        return (self.num_slots - len(self.free_slots)) * self.io.block_bytes

    # -- the writer thread -------------------------------------------------------
    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            kind, slot, payload = item
            try:
                if kind == "store":
                    data, entry = payload  # type: ignore[misc]
                    self.data[slot] = data
                    rec = {"slot": slot, "digest": entry.digest.hex(), "parent": entry.parent.hex(),
                           "tokens": list(entry.token_ids), "crc": zlib.crc32(data)}
                    with self._lock:
                        if self._pending.get(slot) is data:
                            del self._pending[slot]
                else:
                    rec = {"slot": slot, "free": True}
                self._index.write(json.dumps(rec, separators=(",", ":")) + "\n")
                self._index.flush()
            except Exception:  # noqa: BLE001 - a failed write loses one block, not the server
                log.exception("KV tier write failed")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        self._queue.join()
        self.data.flush()

    def close(self) -> None:
        """Finish the queued writes and close the files; idempotent."""
        if self.closed:
            return
        self.closed = True
        self._queue.put(None)
        self._thread.join(timeout=30)
        self.data.flush()
        self._index.close()
