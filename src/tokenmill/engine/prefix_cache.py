"""Prefix cache: a radix tree of token blocks pointing at KV blocks in the pool.

Each edge holds exactly one full block of token ids (block granularity, as in
SGLang's RadixAttention and vLLM's chained block hashes). Children are keyed by
the block's token-id tuple itself, so a hit compares token ids exactly; no hash
can ever serve another prompt's KV.

A node is *busy* while some request holds its block (ref count > 0) and *idle*
otherwise. Requests always hold whole root paths, so a busy node's ancestors
are busy and every idle subtree has an idle leaf: evicting idle leaves in LRU
order can always reclaim every idle block.

Each LoRA adapter has its own root (``namespace``: the adapter's id; 0 is the
base model): K/V computed under one adapter differ from the base's and from
another adapter's for the same tokens, so they are never shared. An adapter's
block names (KV events) are chained from a seed of its id, and its events carry
the id as ``lora_id``.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from ..kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, chain_hash


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    block: int
    parent: "_Node | None"
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    last_used: int = 0
    hash: int | None = None  # the block's name in KV events (kv_events.chain_hash of the path)


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of which served from cache
    evicted_blocks: int = 0  # idle blocks reclaimed for new allocations or a reset


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root = _Node(key=(), block=-1, parent=None)
        self._roots: dict[int, _Node] = {0: self.root}  # one per adapter namespace
        self._by_block: dict[int, _Node] = {}
        self._idle: set[int] = set()
        self._heap: list[tuple[int, int]] = []  # (last_used, block) of idle leaves; lazy
        self._clock = itertools.count(1)
        self.stats = PrefixCacheStats()
        # KV events since the last drain (kv_events.py); None: nobody subscribes, record nothing.
        self.events: list[KVEvent] | None = None

    def enable_events(self) -> None:
        """Record what is stored and removed from now on; ``drain_events`` hands it out."""
        if self.events is None:
            self.events = []

    def drain_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    # -- queries -------------------------------------------------------
    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._by_block)

    def contains_block(self, block: int) -> bool:
        return block in self._by_block

    def _block_key(self, token_ids: list[int], index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(token_ids[start : start + self.block_size])

    def _root(self, namespace: int) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node(key=(), block=-1, parent=None)
        return root

    @staticmethod
    def _seed(namespace: int) -> int | None:
        """What the first block of a namespace's paths chains from (None: the base model's)."""
        return chain_hash(None, (-1, namespace)) if namespace else None

    def match(self, token_ids: list[int], max_blocks: int, namespace: int = 0) -> list[int]:
        """Block ids of the longest cached prefix of ``token_ids`` (at most
        ``max_blocks`` full blocks) under ``namespace`` (an adapter id, 0: the base
        model). The caller must acquire them."""
        node = self._roots.get(namespace)
        if node is None:
            return []
        blocks: list[int] = []
        for i in range(max_blocks):
            child = node.children.get(self._block_key(token_ids, i))
            if child is None:
                break
            blocks.append(child.block)
            node = child
        return blocks

    # -- updates -------------------------------------------------------
    def insert(self, token_ids: list[int], block_table: list[int], start: int, end: int,
               namespace: int = 0) -> dict[int, int]:
        """Index the full, computed blocks ``start..end-1`` of a request (under
        ``namespace``: its adapter id, 0 for the base model).

        Blocks before ``start`` must already be indexed along this path.
        Returns ``{index: cached_block}`` for blocks whose content was already
        cached under another block id: the caller swaps its private copy for
        the cached one so that its path stays in the tree (deduplication).
        """
        node = self._root(namespace)
        for i in range(start):
            node = node.children[self._block_key(token_ids, i)]
        swaps: dict[int, int] = {}
        stored: list[_Node] = []
        for i in range(start, end):
            key = self._block_key(token_ids, i)
            child = node.children.get(key)
            if child is None:
                parent_hash = node.hash if node.parent is not None else self._seed(namespace)
                child = _Node(key=key, block=block_table[i], parent=node, hash=chain_hash(parent_hash, key))
                node.children[key] = child
                self._by_block[child.block] = child
                stored.append(child)
            elif child.block != block_table[i]:
                swaps[i] = child.block
            child.last_used = next(self._clock)
            node = child
        if stored and self.events is not None:
            # New nodes are a suffix of this path (a new node's children are new), so one event.
            self.events.append(BlockStored(block_hashes=[n.hash for n in stored],
                                           parent_block_hash=stored[0].parent.hash,
                                           token_ids=[t for n in stored for t in n.key],
                                           block_size=self.block_size, lora_id=namespace or None))
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
        if not node.children:
            heapq.heappush(self._heap, (node.last_used, block))

    def evict_one(self) -> int:
        """Remove the least recently used idle leaf; return its block id."""
        while self._heap:
            last_used, block = heapq.heappop(self._heap)
            node = self._by_block.get(block)
            if node is None or block not in self._idle or node.children or node.last_used != last_used:
                continue  # stale heap entry
            self._remove(node)
            self.stats.evicted_blocks += 1
            return block
        raise RuntimeError("no evictable cached block")

    def _remove(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        del self._by_block[node.block]
        self._idle.discard(node.block)
        if self.events is not None:
            last = self.events[-1] if self.events else None
            if isinstance(last, BlockRemoved):
                self.events[-1] = BlockRemoved([*last.block_hashes, node.hash], last.medium)
            else:
                self.events.append(BlockRemoved([node.hash]))
        if parent.parent is not None and not parent.children and parent.block in self._idle:
            heapq.heappush(self._heap, (parent.last_used, parent.block))

    def evict_all_idle(self) -> list[int]:
        """Drop every idle block (``/reset_prefix_cache``); return their ids."""
        freed: list[int] = []
        while self._idle:
            freed.append(self.evict_one())
        if self.events is not None and freed and not self._by_block:
            self.events.append(AllBlocksCleared())
        return freed

    def check_invariants(self, ref_counts: list[int]) -> None:
        """Tree and ref counts agree: idle iff unreferenced; busy nodes' parents busy."""
        for block, node in self._by_block.items():
            assert (ref_counts[block] == 0) == (block in self._idle), f"block {block} idle state wrong"
            if ref_counts[block] > 0 and node.parent is not None and node.parent.parent is not None:
                assert node.parent is not None and ref_counts[node.parent.block] > 0, (
                    f"busy block {block} has an idle parent"
                )
            assert node.parent is not None and node.parent.children.get(node.key) is node
