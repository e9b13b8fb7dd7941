"""The KV cache's second tier: blocks evicted from the pool kept on local disk.

When the pool runs short, the prefix cache evicts its least recently used idle
blocks. With a tier (``--kv-offload-bytes``), an evicted block's K/V (every
layer, K and V, and a quantized pool's scales) is copied out before its pool
block is reused, and the radix tree keeps the node, now naming a *slot* of
this tier instead of a pool block. A later prompt that walks onto that node
gets a fresh pool block filled from the slot (``restore``) instead of
recomputing it. The tree still compares token ids exactly; the tier only
stores bytes.

Storage (engine/kv/tier_files.py keeps the folder): one preallocated file of
fixed-size slots (``kv_tier.bin``, read and written with pread/pwrite, so a
failing disk is an error, not a signal) and an append-only index
(``kv_tier.index``, one line per slot written or freed: the slot, its block's
token ids, its path's and its parent path's 128-bit chained digests, and a
CRC32 of the slot's bytes; each line has a checksum of its own, salted with the
tier's identity). The engine thread copies a block into a buffer and queues it;
a writer thread writes the slot, then the index line, so the index never names
bytes that were not written. A reader of a slot whose write is still queued
takes the buffer. The index is rewritten with just its live lines at start and
when appends have made it long.

One process per folder: the folder is locked for the tier's life, and a second
process is refused, naming the holder. Every restore checks the slot against
what this process stored there (the path's digest and the bytes' CRC32) and
drops what fails. The first I/O error (a full disk, EIO) turns the tier off,
with a log line and a metric; the server goes on without it.

Warm restarts: a process that opens the same folder with the same model
identity (``TierIdentity``: model digest, dtype, KV dtype, block size and the
pool's tensor shapes) reads the index, skips damaged lines, drops entries whose
bytes fail their CRC (torn by a crash) and entries whose parent path is
missing, and hands the rest to the prefix cache as disk nodes. A different
identity: the folder is ignored and rewritten, with one log line.
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

from .tier_files import (DATA_NAME, INDEX_NAME, MAX_LINE, META_NAME, TierFolder, TierRefused, decode_line,
                         encode_line, read_into, write_all)

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
        return self.read_many([block])[0]

    def write(self, block: int, data: np.ndarray) -> None:
        self.write_many([block], np.asarray(data).reshape(1, -1))

    def read_many(self, blocks: Sequence[int]) -> np.ndarray:
        """``[len(blocks), block_bytes]``: each block's bytes, one gather per pool tensor."""
        if not blocks:
            return np.empty((0, self.block_bytes), dtype=np.uint8)
        n = len(blocks)
        parts = []
        for t in self.tensors:
            idx = torch.tensor(blocks, device=t.device)
            rows = t.index_select(1, idx).transpose(0, 1).contiguous()  # [n, kv heads, ...]
            parts.append(rows.view(torch.uint8).reshape(n, -1))
        return torch.cat(parts, dim=1).cpu().numpy()

    def write_many(self, blocks: Sequence[int], data: np.ndarray) -> None:
        """Fill ``blocks`` from ``data`` (``read_many``'s layout), one scatter per pool tensor."""
        if not blocks:
            return
        n = len(blocks)
        flat = torch.from_numpy(np.ascontiguousarray(data).reshape(n, -1))
        offset = 0
        for t, size in zip(self.tensors, self.sizes):
            idx = torch.tensor(blocks, device=t.device)
            chunk = flat[:, offset:offset + size].contiguous().to(t.device).view(t.dtype)
            t.index_copy_(1, idx, chunk.reshape(n, t.shape[0], *t.shape[2:]).transpose(0, 1))
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


@dataclass(eq=False)
class _Record:
    """What a held slot must hold: the path digest it was stored under and, once written, the
    CRC32 of its bytes. A restore reads the slot and compares both before using it."""

    digest: bytes
    crc: int | None = None


@dataclass
class TierStats:
    stored_blocks: int = 0  # blocks written to the tier (pool evictions)
    restored_blocks: int = 0  # blocks read back into the pool on a prefix hit
    restore_seconds: float = 0.0
    dropped_blocks: int = 0  # tier evictions (the tier was full)
    torn_blocks: int = 0  # entries found torn at start (CRC mismatch) and dropped
    rejected_blocks: int = 0  # entries that failed their check on restore (dropped, recomputed)
    damaged_lines: int = 0  # index lines skipped at start (torn, damaged, another identity's)
    errors: int = 0  # I/O errors; the first one turns the tier off


class DiskTier:
    """Fixed-size slots in one preallocated file; writes happen on a thread of their own.

    ``disabled`` (None while the tier works) is set, with the reason, by the first I/O error:
    from then on nothing is stored or restored (the prefix cache drops its disk nodes and goes
    on with the pool alone) and the folder stays locked until ``close``."""

    def __init__(self, folder: str | os.PathLike[str], capacity_bytes: int, io: BlockIO,
                 identity: TierIdentity) -> None:
        self.io = io
        self.num_slots = int(capacity_bytes // io.block_bytes)
        if self.num_slots < 1:
            raise ValueError(f"--kv-offload-bytes {capacity_bytes} holds no block ({io.block_bytes} bytes each)")
        self.identity = identity
        self.stats = TierStats()
        self.closed = False
        self.disabled: str | None = None
        self.free_slots: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._pending: dict[int, np.ndarray] = {}  # slot -> bytes not yet written
        self._records: dict[int, _Record] = {}  # held slot -> what it must hold
        self._reads: list[tuple[int, SlotEntry]] = []  # blocks moved to a slot, not copied out yet
        self._lock = threading.Lock()
        self._queue: "queue.Queue[tuple[str, int, object] | None]" = queue.Queue()
        self._salt = identity.key().encode()
        self._lines: dict[int, bytes] = {}  # the index's live lines (the writer thread's, once started)
        self._appended = 0  # index lines appended since it was last rewritten
        self._data_fd = self._index_fd = -1
        self.folder = TierFolder.open(folder)
        try:
            self.recovered = self._open()
        except BaseException:
            self._close_files()
            raise
        self._thread = threading.Thread(target=self._writer, name="tokenmill-kv-tier", daemon=True)
        self._thread.start()

    # -- files --------------------------------------------------------------
    def _open(self) -> list[SlotEntry]:
        """Reserve the data file; return the entries a previous process left that are whole, and
        rewrite the index with just those."""
        try:
            for name in (META_NAME, DATA_NAME, INDEX_NAME):  # links and foreign files refused before any use
                if self.folder.exists(name):
                    os.close(self.folder.open_file(name, os.O_RDONLY))
            reuse = self._header_matches()
            if not reuse:
                for name in (DATA_NAME, INDEX_NAME):
                    if self.folder.exists(name):
                        os.unlink(name, dir_fd=self.folder.dir_fd)
            self._data_fd = self.folder.open_file(DATA_NAME, os.O_RDWR | os.O_CREAT)
            self.folder.reserve(self._data_fd, self.num_slots * self.io.block_bytes)
            entries = self._read_index() if reuse else {}
            self.folder.replace(META_NAME, [json.dumps({"identity": self._salt.decode(),
                                                        "slot_bytes": self.io.block_bytes,
                                                        "identity_fields": asdict(self.identity)}).encode()])
            recovered = self._verify(entries)
            self._rewrite_index()
        except OSError as exc:
            raise TierRefused(f"--kv-offload-dir {self.folder.path}: {exc.strerror or exc}") from None
        return recovered

    def _header_matches(self) -> bool:
        raw = self.folder.read(META_NAME)
        if raw is None:
            return False
        try:
            meta = json.loads(raw)
            if meta.get("identity") == self._salt.decode() and meta.get("slot_bytes") == self.io.block_bytes:
                return True
            log.info("KV tier in %s was written for another model or layout: ignoring it", self.folder.path)
        except (ValueError, AttributeError):
            log.warning("KV tier in %s has an unreadable header: ignoring it", self.folder.path)
        return False

    def _read_index(self) -> dict[int, tuple[SlotEntry, int]]:
        """The last word on each slot: written (entry, crc) or freed. Lines that fail their
        checksum or do not parse are skipped and counted; never an exception."""
        entries: dict[int, tuple[SlotEntry, int]] = {}
        if not self.folder.exists(INDEX_NAME):
            return entries
        with os.fdopen(self.folder.open_file(INDEX_NAME, os.O_RDONLY), "rb") as fh:
            while line := fh.readline(MAX_LINE):
                whole = line.endswith(b"\n")
                while line and not line.endswith(b"\n"):  # torn or overlong: skip to the next line
                    line = fh.readline(MAX_LINE)
                parsed = _parse_record(decode_line(self._salt, line) if whole else None)
                if parsed is None:
                    self.stats.damaged_lines += 1
                elif parsed[0] is None:
                    entries.pop(parsed[1], None)
                else:
                    entries[parsed[1]] = (parsed[0], parsed[2])
        if self.stats.damaged_lines:
            log.warning("KV tier index in %s: %d damaged lines skipped; rebuilt from the %d whole entries",
                        self.folder.path, self.stats.damaged_lines, len(entries))
        return entries

    def _verify(self, entries: dict[int, tuple[SlotEntry, int]]) -> list[SlotEntry]:
        """The entries whose bytes match their CRC (others were torn by a crash or changed)."""
        recovered: list[SlotEntry] = []
        buf = np.empty(self.io.block_bytes, dtype=np.uint8)
        for slot, (entry, crc) in sorted(entries.items()):
            try:
                whole = slot < self.num_slots and self._read_slot(slot, buf) == crc
            except OSError:
                whole = False
            if not whole:
                self.stats.torn_blocks += 1
                continue
            recovered.append(entry)
            self._records[slot] = _Record(entry.digest, crc)
            self._lines[slot] = encode_line(self._salt, _entry_record(entry, crc))
        return recovered

    def _read_slot(self, slot: int, buf: np.ndarray) -> int:
        """Fill ``buf`` with the slot's bytes; their CRC32."""
        read_into(self._data_fd, memoryview(buf), slot * self.io.block_bytes)
        return zlib.crc32(buf)

    def _rewrite_index(self) -> None:
        """The index, just the live lines, replacing the old one whole (at start, and when
        appends have made it long)."""
        self.folder.replace(INDEX_NAME, list(self._lines.values()))
        if self._index_fd >= 0:
            os.close(self._index_fd)
            self._index_fd = -1
        self._index_fd = self.folder.open_file(INDEX_NAME, os.O_WRONLY | os.O_APPEND)
        self._appended = 0

    def claim(self, slots: Sequence[int]) -> None:
        """Mark recovered slots as used (the prefix cache took them); the others are free."""
        taken = set(slots)
        self.free_slots = [s for s in self.free_slots if s not in taken]
        with self._lock:
            self._records = {s: r for s, r in self._records.items() if s in taken}
        self._queue.put(("keep", 0, taken))

    # -- the engine thread's side -----------------------------------------------
    def store(self, block: int, entry: SlotEntry) -> None:
        """Move pool block ``block`` into ``entry.slot``. Its bytes are copied out at the next
        ``flush_reads`` (all of a step's evictions in one gather), which must come before
        anything writes into the block: ``fetch`` and ``load`` call it, and the scheduler at the
        end of each step's scheduling (a reused block is written only when the step runs)."""
        self._reads.append((block, entry))
        self.stats.stored_blocks += 1

    def flush_reads(self) -> None:
        if not self._reads:
            return
        reads, self._reads = self._reads, []
        if self.disabled is not None:
            return
        data = self.io.read_many([block for block, _ in reads])
        for row, (_, entry) in zip(data, reads):
            record = _Record(entry.digest)
            with self._lock:
                self._pending[entry.slot] = row
                self._records[entry.slot] = record
            self._queue.put(("store", entry.slot, (row, entry, record)))

    def fetch(self, wanted: Sequence[tuple[int, bytes]]) -> list[np.ndarray]:
        """The bytes of each ``(slot, path digest)`` in order, each checked: the slot must hold
        that path (the digest it was stored under) and its bytes their CRC. Stops before the
        first that fails (counted in ``stats.rejected_blocks``; the caller drops it)."""
        t0 = time.perf_counter()
        self.flush_reads()
        rows: list[np.ndarray] = []
        for slot, digest in wanted:
            row = self._checked(slot, digest)
            if row is None:
                break
            rows.append(row)
        self.stats.restore_seconds += time.perf_counter() - t0
        return rows

    def _checked(self, slot: int, digest: bytes) -> np.ndarray | None:
        if self.disabled is not None:
            return None
        with self._lock:
            pending, record = self._pending.get(slot), self._records.get(slot)
            crc = record.crc if record is not None else None
        if record is not None and record.digest == digest and pending is not None:
            return pending  # not written yet: this process's own bytes
        row = np.empty(self.io.block_bytes, dtype=np.uint8)
        try:
            ok = (record is not None and record.digest == digest and crc is not None
                  and self._read_slot(slot, row) == crc)
        except OSError as exc:
            self._fail(exc, "reading")
            return None
        if not ok:
            self.stats.rejected_blocks += 1
            log.warning("KV tier slot %d in %s failed its check (path or checksum): dropped, recomputed",
                        slot, self.folder.path)
            return None
        return row

    def load(self, blocks: Sequence[int], rows: Sequence[np.ndarray]) -> None:
        """Fill pool ``blocks`` from ``fetch``'s rows, one scatter per pool tensor."""
        if not blocks:
            return
        t0 = time.perf_counter()
        self.flush_reads()  # blocks evicted to make room leave the pool before they are overwritten
        self.io.write_many(blocks, np.stack(rows[:len(blocks)]))
        self.stats.restored_blocks += len(blocks)
        self.stats.restore_seconds += time.perf_counter() - t0

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)
        with self._lock:
            self._records.pop(slot, None)
        if self.disabled is None:
            self._queue.put(("free", slot, None))

    @property
    def used_bytes(self) -> int:
        return (self.num_slots - len(self.free_slots)) * self.io.block_bytes

    # -- the writer thread -------------------------------------------------------
    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                break
            try:
                if self.disabled is None:
                    self._apply(*item)
            except Exception as exc:  # noqa: BLE001 - the tier goes, not the server
                self._fail(exc, "writing")
            finally:
                self._queue.task_done()

    def _apply(self, kind: str, slot: int, payload: object) -> None:
        if kind == "keep":
            self._lines = {s: line for s, line in self._lines.items() if s in payload}  # type: ignore[operator]
            self._rewrite_index()
            return
        if kind == "free":
            self._lines.pop(slot, None)
            self._append(encode_line(self._salt, {"slot": slot, "free": True}))
            return
        row, entry, record = payload  # type: ignore[misc]
        write_all(self._data_fd, memoryview(row), slot * self.io.block_bytes)
        crc = zlib.crc32(row)
        line = encode_line(self._salt, _entry_record(entry, crc))
        self._append(line)  # after the bytes: the index never names bytes that were not written
        self._lines[slot] = line
        with self._lock:
            if self._pending.get(slot) is row:
                del self._pending[slot]
            if self._records.get(slot) is record:
                record.crc = crc

    def _append(self, line: bytes) -> None:
        view = memoryview(line)
        while view:
            view = view[os.write(self._index_fd, view):]
        self._appended += 1
        if self._appended > max(1024, 2 * len(self._lines)):
            self._rewrite_index()

    def _fail(self, exc: BaseException, doing: str) -> None:
        """The first I/O error turns the tier off (one log line); later ones are only counted."""
        with self._lock:
            self.stats.errors += 1
            if self.disabled is not None:
                return
            self.disabled = f"{doing}: {exc}"
            self._pending.clear()
            self._records.clear()
        log.error("KV disk tier in %s turned off after an error %s (%s); the server goes on without it: "
                  "evicted blocks are recomputed when needed", self.folder.path, doing, exc)

    def flush(self) -> None:
        """Wait until every queued write is done."""
        self.flush_reads()
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes, close the files and release the folder; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.flush_reads()
        self._queue.put(None)
        self._thread.join(timeout=30)
        self._close_files()

    def _close_files(self) -> None:
        for fd in (self._data_fd, self._index_fd):
            if fd >= 0:
                try:
                    os.fdatasync(fd)
                except OSError:
                    pass  # a full or failing disk: what was written stays checkable by its CRCs
                os.close(fd)
        self._data_fd = self._index_fd = -1
        self.folder.close()


def _entry_record(entry: SlotEntry, crc: int) -> dict:
    return {"slot": entry.slot, "digest": entry.digest.hex(), "parent": entry.parent.hex(),
            "tokens": list(entry.token_ids), "crc": crc}


def _parse_record(rec: dict | None) -> tuple[SlotEntry | None, int, int] | None:
    """(entry or None for a freed slot, slot, crc) of an index record, or None if malformed."""
    if rec is None:
        return None
    try:
        slot = int(rec["slot"])
        if slot < 0:
            return None
        if rec.get("free"):
            return None, slot, 0
        digest, parent = bytes.fromhex(rec["digest"]), bytes.fromhex(rec["parent"])
        tokens = tuple(int(t) for t in rec["tokens"])
        if len(digest) != 16 or len(parent) != 16:
            return None
        return SlotEntry(slot, digest, parent, tokens), slot, int(rec["crc"])
    except (ValueError, KeyError, TypeError):
        return None
