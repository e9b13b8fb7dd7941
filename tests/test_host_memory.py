"""The CPU KV pool: one zeroed allocation, per-layer views that do not overlap,
on transparent huge pages where the kernel offers them."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.engine.kv.host_memory import HUGE_PAGE, kv_pool_tensors, zeros_on_huge_pages

SHAPE = (3, 40, 16, 64)  # kv heads, blocks, block size, head dim: 480 KB a tensor


def test_pool_views_are_zeroed_contiguous_and_disjoint() -> None:
    pools = kv_pool_tensors(4, SHAPE, torch.float32, torch.device("cpu"))
    assert len(pools) == 4
    for k, v in pools:
        assert k.shape == v.shape == SHAPE
        assert k.is_contiguous() and v.is_contiguous()
        assert not k.any() and not v.any()
    for i, (k, v) in enumerate(pools):
        k.fill_(2 * i + 1)
        v.fill_(2 * i + 2)
    for i, (k, v) in enumerate(pools):  # every write landed in its own tensor only
        assert bool((k == 2 * i + 1).all()) and bool((v == 2 * i + 2).all())


def test_bfloat16_pool_and_switch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    pools = kv_pool_tensors(2, SHAPE, torch.bfloat16, torch.device("cpu"))
    assert pools[1][1].dtype == torch.bfloat16 and not pools[1][1].any()
    monkeypatch.setenv("TOKENMILL_HUGE_PAGES", "0")
    flat = zeros_on_huge_pages(3 * HUGE_PAGE // 4, torch.float32)
    assert flat.numel() == 3 * HUGE_PAGE // 4 and not flat.any()
    assert flat.untyped_storage().nbytes() == flat.numel() * 4  # a plain allocation, no slack


def _thp_mode() -> str | None:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not path.exists():
        return None
    found = re.search(r"\[(\w+)\]", path.read_text())
    return found.group(1) if found else None


def _huge_kb_in(start: int, end: int) -> int:
    """AnonHugePages of this process's mappings that overlap [start, end)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            lo, hi = int(head.group(1), 16), int(head.group(2), 16)
            inside = lo < end and hi > start
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")
def test_large_pool_gets_huge_pages() -> None:
    flat = zeros_on_huge_pages(16 * HUGE_PAGE // 4, torch.float32)  # 32 MB
    assert flat.data_ptr() % HUGE_PAGE == 0
    start = flat.data_ptr()
    assert _huge_kb_in(start, start + flat.numel() * 4) >= HUGE_PAGE // 1024
