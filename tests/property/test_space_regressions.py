"""Plain reproductions of bugs that the space tests (test_space_stateful.py and the
kill -9 loop in tests/crash/test_kill9_gc.py) turned up in pins, GC and eviction.

A bug that is still open is marked ``xfail(strict=True)`` with its reason, so the
test starts failing (XPASS) the moment it is fixed: then drop the mark.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from kvstore import KVStore

SEGMENT_BYTES = 1 << 20
MAX_PAGE_BYTES = 256 << 10
# 62 blocks of payload: exactly four records fill a 1 MiB segment.
FOUR_PER_SEGMENT = 62 * 4096


def page(key: bytes, version: int, size: int = FOUR_PER_SEGMENT) -> bytes:
    return random.Random(f"{key!r}/{version}").randbytes(size)


def test_fifo_relocates_pages_of_pinned_keys(tmp_path: Path) -> None:
    """Found by CapacitySpaceMachine, fixed in 4169122. FIFO eviction used to neither
    evict nor relocate the current page of a pinned key living outside the pinned
    segment: it evicted the rest of each victim segment, freed none, and raised
    StoreFullError with most of the capacity reclaimable."""
    store = KVStore.open(
        tmp_path / "store",
        create=True,
        segment_bytes=SEGMENT_BYTES,
        max_page_bytes=MAX_PAGE_BYTES,
        capacity_bytes=6 * SEGMENT_BYTES,  # writers fill 5 segments, GC has 1 in reserve
        gc_interval_s=0,
        eviction_policy="fifo",
    )
    with store:
        pinned = [b"A", b"B", b"C", b"D"]
        for name in pinned:
            store.put(name, page(name, 1))  # segment 1: A B C D
            assert store.pin(name)  # segment 1 now holds pins: never freed
        fillers = 0
        for name in pinned:  # segments 2..5: a new version of a pinned key + 3 fillers
            store.put(name, page(name, 2))
            for _ in range(3):
                filler = f"f{fillers}".encode()
                store.put(filler, page(filler, 1))
                fillers += 1
        # Segments 2-4 are sealed and unpinned; their pinned-key pages can move
        # (LRU and cost always moved them); three of them fit in one segment.
        store.put(b"new", page(b"new", 1))
        assert store.get(b"new") == page(b"new", 1)
        for name in pinned:
            assert store.get(name) == page(name, 2)


def _open_fds_under(directory: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return found


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_close_during_background_gc_frees_cleanly(tmp_path: Path) -> None:
    options: dict[str, object] = {
        "create": True,
        "segment_bytes": 64 << 10,
        "max_page_bytes": 48 << 10,
    }
    problems: list[str] = []
    for attempt in range(15):
        path = tmp_path / f"store{attempt}"
        with KVStore.open(path, gc_interval_s=0, **options) as store:
            names = [f"k{i}".encode() for i in range(60)]
            store.put_many([(name, page(name, 1, 40_000)) for name in names])  # 1 per segment
            for name in names:
                store.delete(name)  # 60 empty sealed segments for GC to free, one flush each
        store = KVStore.open(path, gc_interval_s=0.001, **options)
        time.sleep(0.002 + 0.001 * (attempt % 10))  # close while the GC thread is freeing
        store.close()
        leaked = _open_fds_under(path)
        files = {p.name for p in (path / "segments").iterdir() if p.suffix == ".seg"}
        with KVStore.open(path, gc_interval_s=0, **options) as reopened:
            orphans = [note for note in reopened.recovery_notes if "orphan" in note]
            known = len(reopened.segment_states())
        if leaked or orphans:
            problems.append(
                f"attempt {attempt}: fds left open {leaked}; {len(files)} segment files "
                f"after close for {known} segments; {orphans}"
            )
            break
    assert not problems, problems
