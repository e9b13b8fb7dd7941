"""Prefix cache: a radix tree of token blocks pointing at KV blocks in the pool (or on disk).

Each edge holds exactly one full block of token ids (block granularity, as in
SGLang's RadixAttention and vLLM's chained block hashes). Children are keyed by
the block's token-id tuple itself, so a hit compares token ids exactly; no hash
can ever serve another prompt's KV.

A node is *busy* while some request holds its block (ref count > 0) and *idle*
otherwise. Requests always hold whole root paths, so a busy node's ancestors
are busy and every idle subtree has an idle leaf: evicting idle leaves in LRU
order can always reclaim every idle block.

With a second tier (``attach_tier``: engine/kv/kv_tier.py), an evicted block's K/V
goes to a disk slot and its node stays in the tree naming that slot; a node
lives in exactly one place (pool block or disk slot). Disk nodes only ever hang
below pool nodes or other disk nodes (a node is evicted only once none of its
children is in the pool, and a prompt restores a path from its top down), so
"leaf" for pool eviction means "no child in the pool". When the tier is full
its least recently used disk leaf is dropped to make room.

LoRA adapters (``namespace``: the adapter's id; 0 is the base model): K/V
computed under one adapter differ from the base's and from another adapter's
for the same tokens, so they are never shared. The first block of a path under
an adapter carries a marker before its tokens (``-namespace``; token ids are
never negative), so each adapter's paths are their own subtree and their block
names (KV events) differ; the events carry the id as ``lora_id`` and the
tokens without the marker.

The cache sits above the block pool (engine/kv/block_pool.py): it allocates and
releases pool blocks when it restores a path from disk, and it is the pool's
``CachedBlocks`` (the pool calls it back through that protocol, never by name),
so the two depend one way: this module on the pool.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...traffic.kv_events import MEDIUM_DISK, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, chain_hash
from .block_pool import BlockPool

if TYPE_CHECKING:  # typing only: the tier module imports torch, loaded once a tier is attached
    from .kv_tier import DiskTier


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    block: int  # pool block, or -1 while on disk
    parent: "_Node | None"
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    last_used: int = 0
    hash: int | None = None  # the block's name in KV events (kv_events.chain_hash of the path)
    slot: int = -1  # disk slot while on disk
    pool_children: int = 0  # children whose block is in the pool
    digest: bytes | None = None  # the path's identity on disk (kv_tier.path_digest), once needed

    @property
    def on_disk(self) -> bool:
        return self.slot >= 0


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of which served from cache
    evicted_blocks: int = 0  # idle blocks reclaimed for new allocations or a reset


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root = _Node(key=(), block=-1, parent=None)
        self._by_block: dict[int, _Node] = {}
        self._by_slot: dict[int, _Node] = {}
        self._idle: set[int] = set()
        self._heap: list[tuple[int, int]] = []  # (last_used, block) of idle pool leaves; lazy
        self._disk_heap: list[tuple[int, int]] = []  # (last_used, slot) of disk leaves; lazy
        self._clock = itertools.count(1)
        self.stats = PrefixCacheStats()
        self.tier: DiskTier | None = None
        self._offload = True  # False while a reset drops everything
        # KV events since the last drain (traffic/kv_events.py); None: nobody subscribes, record nothing.
        self.events: list[KVEvent] | None = None

    # -- events --------------------------------------------------------
    def enable_events(self) -> None:
        """Record what is stored and removed from now on (``drain_events`` hands it out),
        starting with what is held already (a tier recovered at start), so a subscriber
        knows everything."""
        if self.events is not None:
            return
        self.events = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                self._stored([child])
                stack.append(child)

    def drain_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def _stored(self, nodes: list[_Node]) -> None:
        """Nodes now held where they are (consecutive along one path)."""
        if self.events is None or not nodes:
            return
        parent = nodes[0].parent
        self.events.append(BlockStored(block_hashes=[n.hash for n in nodes],
                                       parent_block_hash=parent.hash if parent is not None else None,
                                       token_ids=[t for n in nodes for t in n.key if t >= 0],
                                       block_size=self.block_size,
                                       medium=MEDIUM_DISK if nodes[0].on_disk else "GPU",
                                       lora_id=_namespace(nodes[0]) or None))

    def _removed(self, node: _Node, medium: str) -> None:
        if self.events is None:
            return
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            self.events[-1] = BlockRemoved([*last.block_hashes, node.hash], medium)
        else:
            self.events.append(BlockRemoved([node.hash], medium))

    # -- queries -------------------------------------------------------
    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._by_block)

    @property
    def num_on_disk(self) -> int:
        return len(self._by_slot)

    def contains_block(self, block: int) -> bool:
        return block in self._by_block

    def _block_key(self, token_ids: list[int], index: int, namespace: int = 0) -> tuple[int, ...]:
        start = index * self.block_size
        key = tuple(token_ids[start : start + self.block_size])
        return (-namespace, *key) if namespace and index == 0 else key

    def match(self, token_ids: list[int], max_blocks: int, namespace: int = 0) -> list[int]:
        """Block ids of the longest prefix of ``token_ids`` cached in the pool (at most
        ``max_blocks`` full blocks) under ``namespace`` (an adapter id; 0: the base model).
        The caller must acquire them."""
        node = self.root
        blocks: list[int] = []
        for i in range(max_blocks):
            child = node.children.get(self._block_key(token_ids, i, namespace))
            if child is None or child.on_disk:
                break
            blocks.append(child.block)
            node = child
        return blocks

    # -- updates -------------------------------------------------------
    def insert(self, token_ids: list[int], block_table: list[int], start: int, end: int,
               namespace: int = 0) -> dict[int, int]:
        """Index the full, computed blocks ``start..end-1`` of a request (run under
        ``namespace``: its adapter id; 0: the base model).

        Blocks before ``start`` must already be indexed along this path.
        Returns ``{index: cached_block}`` for blocks whose content was already
        cached under another block id: the caller swaps its private copy for
        the cached one so that its path stays in the tree (deduplication). A block
        the tree holds on disk takes the request's pool block instead (its slot is freed).
        """
        node = self.root
        for i in range(start):
            node = node.children[self._block_key(token_ids, i, namespace)]
        swaps: dict[int, int] = {}
        stored: list[_Node] = []
        for i in range(start, end):
            key = self._block_key(token_ids, i, namespace)
            child = node.children.get(key)
            if child is None:
                child = _Node(key=key, block=block_table[i], parent=node, hash=chain_hash(node.hash, key))
                node.children[key] = child
                self._by_block[child.block] = child
                node.pool_children += 1
                stored.append(child)
            elif child.on_disk:  # computed again while on disk: the pool copy wins
                self._leave_disk(child)
                self._removed(child, MEDIUM_DISK)
                child.block = block_table[i]
                self._by_block[child.block] = child
                node.pool_children += 1
                stored.append(child)
            elif child.block != block_table[i]:
                swaps[i] = child.block
            child.last_used = next(self._clock)
            node = child
        self._stored(stored)
        return swaps

    def mark_busy(self, block: int) -> None:
        """A request took a reference on an idle cached block."""
        self._idle.discard(block)
        self._by_block[block].last_used = next(self._clock)

    def mark_idle(self, block: int) -> None:
        """The last reference on a cached block was dropped."""
        node = self._by_block[block]
        node.last_used = next(self._clock)
        self._idle.add(block)
        if not node.pool_children:
            heapq.heappush(self._heap, (node.last_used, block))

    def evict_one(self) -> int:
        """Free the least recently used idle pool leaf's block and return it: its K/V moves to
        the disk tier when there is one (and room), else the node leaves the tree."""
        while self._heap:
            last_used, block = heapq.heappop(self._heap)
            node = self._by_block.get(block)
            if node is None or block not in self._idle or node.pool_children or node.last_used != last_used:
                continue  # stale heap entry
            self.stats.evicted_blocks += 1
            slot = self._take_slot() if self.tier is not None and self._offload else None
            if slot is None:
                self._remove(node)
            else:
                self._to_disk(node, slot)
            return block
        raise RuntimeError("no evictable cached block")

    def _to_disk(self, node: _Node, slot: int) -> None:
        from .kv_tier import SlotEntry

        assert self.tier is not None and node.parent is not None
        self.tier.store(node.block, SlotEntry(slot, self._digest(node), self._digest(node.parent), node.key))
        self._removed(node, "GPU")
        del self._by_block[node.block]
        self._idle.discard(node.block)
        node.block, node.slot = -1, slot
        self._by_slot[slot] = node
        self._stored([node])
        parent = node.parent
        parent.pool_children -= 1
        self._maybe_pool_leaf(parent)
        if not node.children:
            heapq.heappush(self._disk_heap, (node.last_used, slot))

    def _maybe_pool_leaf(self, node: _Node) -> None:
        if node is not self.root and not node.on_disk and not node.pool_children and node.block in self._idle:
            heapq.heappush(self._heap, (node.last_used, node.block))

    def _take_slot(self) -> int | None:
        """A free disk slot, dropping the least recently used disk leaf if none is free."""
        assert self.tier is not None
        if self.tier.disabled is not None:
            return None
        if self.tier.free_slots:
            return self.tier.free_slots.pop()
        while self._disk_heap:
            last_used, slot = heapq.heappop(self._disk_heap)
            node = self._by_slot.get(slot)
            if node is None or node.children or node.last_used != last_used:
                continue
            self.tier.stats.dropped_blocks += 1
            self._remove(node)
            return self.tier.free_slots.pop()
        return None

    def _leave_disk(self, node: _Node, free: bool = True) -> None:
        """The node no longer names its slot; the slot is free again unless the caller still
        has to read it (``restore`` frees its slots once they are loaded)."""
        assert self.tier is not None
        del self._by_slot[node.slot]
        if free:
            self.tier.free(node.slot)
        node.slot = -1

    def _remove(self, node: _Node) -> None:
        """Take ``node`` and everything below it (on disk only: pool nodes are evicted leaf
        first) out of the tree."""
        parent = node.parent
        assert parent is not None
        for child in list(node.children.values()):
            self._remove(child)
        del parent.children[node.key]
        if node.on_disk:
            self._removed(node, MEDIUM_DISK)
            self._leave_disk(node)
        else:
            self._removed(node, "GPU")
            del self._by_block[node.block]
            self._idle.discard(node.block)
            parent.pool_children -= 1
            self._maybe_pool_leaf(parent)
        if parent.on_disk and not parent.children:
            heapq.heappush(self._disk_heap, (parent.last_used, parent.slot))

    def restore(self, token_ids: list[int], have: int, max_blocks: int, pool: BlockPool,
                namespace: int = 0) -> list[int]:
        """Continue a prompt's pool match (``have`` blocks, acquired by the caller) through
        nodes on disk: each gets a fresh pool block (ref count 1, the caller's) filled from its
        slot. Returns those blocks, in order; stops where the pool has no room, and before a
        slot that fails the tier's check (that node and everything below it leave the tree)."""
        if self.tier is None or have >= max_blocks or self._tier_gone():
            return []
        node = self.root
        for i in range(have):
            node = node.children[self._block_key(token_ids, i, namespace)]
        path: list[_Node] = []
        for i in range(have, max_blocks):
            child = node.children.get(self._block_key(token_ids, i, namespace))
            if child is None or not child.on_disk:
                break
            path.append(child)
            node = child
        rows = self.tier.fetch([(n.slot, self._digest(n)) for n in path])
        if len(rows) < len(path):  # failed its check: never served
            self._remove(path[len(rows)])
            path = path[:len(rows)]
        for n in path:  # the most recent now: making room below must not drop them
            n.last_used = next(self._clock)
        blocks: list[int] = []
        loads: list[tuple[int, int]] = []
        for n in path:
            if pool.num_available < 1:
                break
            block = pool.allocate(1)[0]  # may move other idle blocks to disk
            if not n.on_disk or n.parent is None or n.parent.children.get(n.key) is not n:
                pool.release([block])  # dropped while making room: the rest is recomputed
                break
            loads.append((n.slot, block))
            self._removed(n, MEDIUM_DISK)
            self._leave_disk(n, free=False)
            n.block = block
            self._by_block[block] = n
            n.parent.pool_children += 1
            self._stored([n])
            blocks.append(block)
        self.tier.load(blocks, rows)  # one copy per pool tensor for the whole path
        for slot, _ in loads:
            self.tier.free(slot)
        return blocks

    def flush_tier(self) -> None:
        """Copy out the blocks moved to disk since the last call, before anything overwrites
        them (the scheduler calls this at the end of each step's scheduling)."""
        if self.tier is not None:
            self.tier.flush_reads()
            self._tier_gone()

    def _tier_gone(self) -> bool:
        """Whether the tier was turned off (an I/O error); the first call after that drops
        every node on disk, so the tree holds the pool's blocks alone."""
        assert self.tier is not None
        if self.tier.disabled is None:
            return False
        self._drop_disk_nodes()
        return True

    def _drop_disk_nodes(self) -> None:
        for node in [n for n in self._by_slot.values() if not n.parent.on_disk]:  # type: ignore[union-attr]
            self._remove(node)

    def evict_all_idle(self) -> list[int]:
        """Drop every idle block and everything on disk (``/reset_prefix_cache``); return
        the pool blocks freed."""
        freed: list[int] = []
        self._offload = False
        try:
            while self._idle:
                freed.append(self.evict_one())
            self._drop_disk_nodes()
        finally:
            self._offload = True
        if self.events is not None and freed and not self._by_block:
            self.events.append(AllBlocksCleared())
        return freed

    # -- the second tier -------------------------------------------------
    def attach_tier(self, tier: "DiskTier") -> int:
        """Use ``tier`` for evicted blocks, adopting the blocks a previous process left in it
        (whole paths only: an entry whose parent is missing is dropped). Returns how many."""
        from .kv_tier import ROOT_DIGEST, path_digest

        self.tier = tier
        by_parent: dict[bytes, list] = {}
        for entry in tier.recovered:
            if path_digest(entry.parent, entry.token_ids) == entry.digest and len(entry.token_ids) == self.block_size:
                by_parent.setdefault(entry.parent, []).append(entry)
        adopted: list[int] = []
        self.root.digest = ROOT_DIGEST
        stack = [self.root]
        while stack:
            parent = stack.pop()
            for entry in by_parent.pop(parent.digest or b"", []):
                if entry.token_ids in parent.children:
                    continue
                node = _Node(key=entry.token_ids, block=-1, parent=parent, hash=chain_hash(parent.hash, entry.token_ids),
                             slot=entry.slot, digest=entry.digest, last_used=next(self._clock))
                parent.children[node.key] = node
                self._by_slot[node.slot] = node
                adopted.append(node.slot)
                stack.append(node)
        tier.claim(adopted)
        for node in self._by_slot.values():
            if not node.children:
                heapq.heappush(self._disk_heap, (node.last_used, node.slot))
        return len(adopted)

    def _digest(self, node: _Node) -> bytes:
        """The node's path digest (kv_tier.path_digest), computed top-down where missing."""
        from .kv_tier import ROOT_DIGEST, path_digest

        if node is self.root:
            return ROOT_DIGEST
        missing: list[_Node] = []
        n: _Node | None = node
        while n is not None and n is not self.root and n.digest is None:
            missing.append(n)
            n = n.parent
        for m in reversed(missing):
            assert m.parent is not None
            m.digest = path_digest(m.parent.digest if m.parent is not self.root else ROOT_DIGEST, m.key)
        assert node.digest is not None
        return node.digest

    def offload_all(self, pool: BlockPool) -> int:
        """Copy every idle pool block to the tier (a clean shutdown: the next process finds
        them); returns how many. The pool blocks stay where they are."""
        if self.tier is None or self._tier_gone():
            return 0
        moved = 0
        while self._idle and self.tier.free_slots:
            block = self.evict_one()
            pool.return_evicted(block)
            moved += 1
        return moved

    def check_invariants(self, ref_counts: list[int]) -> None:
        """Tree and ref counts agree: idle iff unreferenced; busy nodes' parents busy; each node
        in exactly one place; disk nodes only below disk or pool nodes, never above a pool node."""
        for block, node in self._by_block.items():
            assert node.block == block and not node.on_disk, f"block {block} indexed as if on disk"
            assert (ref_counts[block] == 0) == (block in self._idle), f"block {block} idle state wrong"
            if ref_counts[block] > 0 and node.parent is not self.root:
                assert node.parent is not None and ref_counts[node.parent.block] > 0, (
                    f"busy block {block} has an idle parent"
                )
            assert node.parent is not None and node.parent.children.get(node.key) is node
            assert node.pool_children == sum(not c.on_disk for c in node.children.values()), "pool child count"
            assert node.parent is self.root or not node.parent.on_disk, f"pool block {block} below a disk node"
        for slot, node in self._by_slot.items():
            assert node.slot == slot and node.block == -1 and not node.pool_children, f"slot {slot} misindexed"
            assert node.parent is not None and node.parent.children.get(node.key) is node
        if self.tier is not None:
            free = set(self.tier.free_slots)
            assert len(free) == len(self.tier.free_slots), "a disk slot is free twice"
            assert not free & set(self._by_slot), "a disk slot is both free and held"
            assert len(free) + len(self._by_slot) == self.tier.num_slots, "a disk slot leaked"


def _namespace(node: _Node) -> int:
    """The adapter id a node's path runs under (the marker of its first block; 0: the base)."""
    while node.parent is not None and node.parent.parent is not None:
        node = node.parent
    return -node.key[0] if node.key and node.key[0] < 0 else 0
