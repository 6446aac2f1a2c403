"""The remote tier's read path, and the bookkeeping the whole tier shares.

``RemoteReads`` is the base class of ``RemoteTier`` (remote_tier.py, which builds
it, publishes, and runs the control cycle). docs/tiering.md, "The remote tier":
when a lookup's run of resident pages stops short of its keys, the pages that
follow are asked of the cluster: read straight into whole DRAM slots (no size
query: a page is at most ``page_bytes``; zero-copy where the backend allows: the
arena is registered), or, with no free slot to take and a cluster that lately
lacked most pages asked, after a size query into slots for the pages found;
verified in place on a worker against the wire header (docs/format.md, "Remote
tier value") and then admitted as DRAM pages, in key order, as an NVMe read would
be. Every read that is short, empty, late, of another key or namespace, or fails
its checksum is a miss counted by reason, never a page.

The bookkeeping here (counters, misses and hold-offs, degraded and back, kappa,
the header blocks) is what reads and publishing both use.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.format.remote import (
    REMOTE_HEADER_BYTES,
    RemotePage,
    remote_key,
    verify_remote_values,
)
from kvstore.tiering.arena import SlotPool
from kvstore.tiering.config import TierConfig
from kvstore.tiering.cost import Bandwidth, CostModel
from kvstore.tiering.pages import DRAM, PageRec, page_key
from kvstore.tiering.remote import RemoteBackend, RemoteError, RemoteJob, RemoteLink
from kvstore.tiering.state import TierState

__all__ = ["REMOTE_READ", "REMOTE_WRITE", "RemoteReads"]

log = logging.getLogger("kvstore.tiering")

REMOTE_READ, REMOTE_WRITE = "remote_read", "remote_write"  # the paths' names
_HDR = REMOTE_HEADER_BYTES
_PUBLISHED_KEYS = 1 << 20  # keys remembered as published (oldest forgotten first)
_EXPLORE_S = 5.0  # with kappa < 1, one read this often re-measures the network
_READ_CHUNK = 64  # pages per read call (Mooncake moves one large batch fastest)
_RETRY_S = 5.0  # a page whose read missed (bad, late, absent) is not asked again sooner
# A lookup reads straight into evicted-for slots while at least this share of the
# pages asked lately was in the cluster (else free slots only, or a size query first).
_SPECULATE_AT = 0.5
# Where the cluster's run ended, a lookup asks again no sooner (a peer may publish the
# page meanwhile; an engine that waits for remote pages gets its answer, a miss).
_ABSENT_RETRY_S = 1.0
_PRESENT_WEIGHT = 0.25  # one ask's weight in that share


@dataclass
class _Fetch:
    keys: list[bytes]
    parent: bytes | None  # the page before keys[0] in the lookup (None: a root)
    items: list[tuple[bytes, int, int, int]] | None = None  # key, slot, header, payload
    chunks: list[RemoteJob] = field(default_factory=list)  # the reads, in key order
    next: int = 0  # the first chunk not admitted yet
    expected: bytes | None = None  # the parent the next page must name
    chain: bool = True  # no page missed so far
    absent_at: int | None = None  # a direct read: the first page the cluster lacks

    def __post_init__(self) -> None:
        self.expected = self.parent


@dataclass
class _Chunk:
    fetch: _Fetch
    items: list[tuple[bytes, int, int, int]]
    direct: bool = False  # read without a size query: an absent page ends the run
    polled: bool = False
    read_s: float = 0.0  # the backend's call, on the worker
    verify_s: float = 0.0  # the checks of what it returned, on the worker


class RemoteReads:
    """The read path of ``RemoteTier`` (its base class) and the bookkeeping it shares.

    The attributes below are set by ``RemoteTier.__init__``.
    """

    config: TierConfig
    namespace: str
    bandwidth: dict[str, Bandwidth]
    counters: dict[str, int]
    degraded: str | None
    _state: TierState
    _pages: dict[bytes, PageRec]
    _backend: RemoteBackend
    _dram: SlotPool
    _alloc: Callable[[int], int | None]
    _alloc_many: Callable[[int, int], list[int] | None]
    _cost: CostModel
    _h2d: Bandwidth
    _deadline_s: float
    _max_pages: int
    _headers: Any
    _free_headers: list[int]
    _headers_at: int
    _fetching: set[bytes]
    _present: float
    _missed: dict[bytes, float]
    _from_remote: OrderedDict[bytes, None]
    _last_explore: float
    _data: RemoteLink
    # The latest reads that returned: (pages, seconds queued, seconds reading,
    # seconds verifying), for ``read_timings``.
    _timings: deque[tuple[int, float, float, float]]

    # -- bookkeeping ---------------------------------------------------------------

    def _bump(self, name: str, by: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + by

    def _miss(self, reason: str, pages: int = 1, key: bytes | None = None) -> None:
        if key is not None:
            self._hold_off(key, _RETRY_S)
        self._bump("misses", pages)
        self._bump("miss:" + reason, pages)

    def _hold_off(self, key: bytes, seconds: float) -> None:
        """A lookup whose first remote page is ``key`` asks nothing for ``seconds``."""
        if len(self._missed) > _PUBLISHED_KEYS:
            self._missed.clear()
        self._missed[key] = time.monotonic() + seconds

    def _degrade(self, reason: str) -> None:
        if self.degraded is None:
            log.warning("remote tier degraded: %s; local tiers keep serving", reason)
            self._bump("degraded_events")
        self.degraded = reason

    def _heal(self) -> None:
        if self.degraded is not None:
            log.info("remote tier back: %s", self._backend.describe())
        self.degraded = None

    @property
    def up(self) -> bool:
        return self.degraded is None

    def kappa(self) -> float:
        """Recompute time of one page over its load from the cluster (into DRAM, then
        to the engine): below 1, lookups recompute rather than read remotely."""
        page = self.config.page_bytes
        load = self.bandwidth[REMOTE_READ].seconds(page + _HDR) + self._h2d.seconds(page)
        return self._cost.recompute_s(self.config.tokens_per_page) / load if load > 0 else math.inf

    def _header(self, index: int) -> Any:
        return self._headers[index * _HDR : (index + 1) * _HDR]

    def _header_address(self, index: int) -> int:
        return self._headers_at + index * _HDR

    def _remember(self, table: OrderedDict[bytes, None], key: bytes) -> None:
        table[key] = None
        if len(table) > _PUBLISHED_KEYS:
            table.popitem(last=False)

    def _failed(self, error: str) -> None:
        self._bump("call_errors")
        if error.startswith(RemoteError.__name__):
            self._degrade(error.split(": ", 1)[-1])

    # -- lookups -------------------------------------------------------------------

    def lookup(self, keys: Sequence[object], hit: int, now: float) -> int:
        """After a local lookup whose run stopped at ``keys[hit]``: ask the cluster for
        the pages that follow. How many of them are on their way (0: none asked)."""
        if hit >= len(keys):
            return 0
        first = keys[hit]
        first_key = first if type(first) is bytes else page_key(first)
        if first_key in self._fetching:  # asked again before the pages landed
            pending = 0
            for raw in keys[hit : hit + self._max_pages]:
                if (raw if type(raw) is bytes else page_key(raw)) not in self._fetching:
                    break
                pending += 1
            return pending
        if not self.up:
            self._bump("lookups:degraded")
            return 0
        retry_at = self._missed.get(first_key)
        if retry_at is not None:
            if time.monotonic() < retry_at:
                self._bump("lookups:missed_recently")
                return 0
            del self._missed[first_key]
        if self.kappa() < 1.0:
            if now - self._last_explore < _EXPLORE_S:
                self._bump("lookups:recompute_faster")
                return 0
            self._last_explore = now
            self._bump("lookups:explore")
        cont: list[bytes] = []
        for raw in keys[hit : hit + self._max_pages]:
            key = raw if type(raw) is bytes else page_key(raw)
            rec = self._pages.get(key)
            if key in self._fetching or (rec is not None and rec.tiers):
                break
            cont.append(key)
        if not cont:
            return 0
        prev = keys[hit - 1] if hit > 0 else None
        parent = None if prev is None else prev if type(prev) is bytes else page_key(prev)
        fetch = _Fetch(cont, parent)
        self._fetching.update(cont)
        self._bump("lookups")
        if not self._read_direct(fetch):
            names = [remote_key(self.namespace, k) for k in cont]
            backend = self._backend
            self._data.submit("query", lambda: backend.sizes(names), self._deadline_s, fetch)
            self._bump("lookups:queried")
        return len(cont)

    def _read_direct(self, fetch: _Fetch) -> bool:
        """Read the pages straight into whole DRAM slots, no size query first (a
        manager's pages are at most ``page_bytes``): one round trip, started now.
        Slots come free ones only, unless most pages asked lately were there: then
        evicting for them is worth it; else (and with no header blocks) False, and
        the lookup asks the sizes first and takes slots for the pages found only."""
        n = len(fetch.keys)
        if len(self._free_headers) < n:
            return False
        if self._present >= _SPECULATE_AT:
            slots = self._alloc_many(DRAM, n)  # evicting for the whole shortfall at once
        else:
            slots = _free_only(self._dram, n)
        if slots is None:
            return False
        limit = self.config.page_bytes
        items = [
            (key, slot, self._free_headers.pop(), limit)
            for key, slot in zip(fetch.keys, slots, strict=True)
        ]
        self._bump("lookups:direct")
        self._submit_reads(fetch, items, direct=True)
        return True

    def _saw(self, asked: int, present: int) -> None:
        """The share of asked pages the cluster held, averaged over recent asks."""
        if asked:
            self._present += _PRESENT_WEIGHT * (present / asked - self._present)

    def _query_done(self, job: RemoteJob) -> None:
        fetch: _Fetch = job.context
        sizes: list[int | None] = job.result if job.error is None else []
        if job.error is not None:
            self._failed(job.error)
        items: list[tuple[bytes, int, int, int]] = []
        limit = self.config.page_bytes
        if job.error is None:
            found = next((i for i, size in enumerate(sizes) if size is None), len(sizes))
            self._saw(len(fetch.keys), found)
            if found < len(fetch.keys):
                self._hold_off(fetch.keys[found], _ABSENT_RETRY_S)
        for key, size in zip(fetch.keys, sizes, strict=False):
            if size is None:
                break
            if not _HDR < size <= _HDR + limit:
                self._miss("short" if size <= _HDR else "too_large")
                break
            slot = self._alloc(DRAM)
            if slot is None:
                self._miss("no_slot")
                break
            if not self._free_headers:
                self._dram.free(slot)
                self._miss("busy")
                break
            items.append((key, slot, self._free_headers.pop(), size - _HDR))
        for key in fetch.keys[len(items) :]:
            self._fetching.discard(key)
        if not items:
            self._bump("lookups:absent")
            return
        self._submit_reads(fetch, items, direct=False)

    def _submit_reads(
        self, fetch: _Fetch, items: list[tuple[bytes, int, int, int]], *, direct: bool
    ) -> None:
        fetch.items = items
        for at in range(0, len(items), _READ_CHUNK):
            chunk = _Chunk(fetch, items[at : at + _READ_CHUNK], direct=direct)
            job = self._data.submit("get", self._reader(chunk, direct), self._deadline_s, chunk)
            job.nbytes = sum(_HDR + n for _, _, _, n in chunk.items)
            fetch.chunks.append(job)

    def _reader(
        self, chunk: _Chunk, direct: bool
    ) -> Callable[[], list[tuple[RemotePage | None, str]]]:
        """The call that reads ``items`` into their slots and verifies each (a worker
        runs it: the checksums too stay off the manager's lock). ``direct``: each
        item's size is its slot's, the most the value may be (``read_into``); else
        the value's exact size, from a size query (``get_into``). Verified in place:
        the header block and the payload's bytes as they landed in the slot. The
        chunk keeps how long the call and the checks took."""
        items = chunk.items
        names = [remote_key(self.namespace, k) for k, _, _, _ in items]
        encoded = [name.encode() for name in names]
        views = [self._dram.view(slot, n) for _, slot, _, n in items]
        parts = [
            [(self._header_address(h), _HDR), (int(view.data_ptr()), n)]
            for (_, _, h, n), view in zip(items, views, strict=True)
        ]
        headers = [self._header(h) for _, _, h, _ in items]
        backend, namespace, limit = self._backend, self.namespace, self.config.page_bytes

        def fits(nbytes: int, n: int) -> bool:
            return _HDR < nbytes <= _HDR + n and (direct or nbytes == _HDR + n)

        def outcome(page: RemotePage | str) -> tuple[RemotePage | None, str]:
            return (None, page) if isinstance(page, str) else (page, "")

        def read() -> list[tuple[RemotePage | None, str]]:
            # A value the backend says has wholly landed is verified at once, while the
            # rest are on their way; the others are verified in one pass after.
            early: dict[int, tuple[int, RemotePage | str]] = {}
            early_s = 0.0

            def landed(at: int, nbytes: int) -> None:
                nonlocal early_s
                if not fits(nbytes, items[at][3]):
                    return  # counted by size below
                began = time.perf_counter()
                early[at] = (
                    nbytes,
                    verify_remote_values(
                        [headers[at]],
                        [views[at].numpy()[: nbytes - _HDR]],
                        namespace=namespace,
                        names=[encoded[at]],
                        max_payload_bytes=limit,
                    )[0],
                )
                early_s += time.perf_counter() - began

            started = time.perf_counter()
            got = (
                backend.read_into(names, parts, landed)
                if direct
                else backend.get_into(names, parts)
            )
            read_at = time.perf_counter()
            chunk.read_s = read_at - started - early_s
            out: list[tuple[RemotePage | None, str]] = []
            # The values whose size passes are verified in one pass, then slotted in.
            check: list[int] = []
            for at, ((_, _, _, n), (nbytes, reason)) in enumerate(zip(items, got, strict=True)):
                if reason:
                    out.append((None, reason))
                elif nbytes == 0:
                    out.append((None, "empty"))
                elif not fits(nbytes, n):
                    out.append((None, "short"))
                elif at in early and early[at][0] == nbytes:
                    out.append(outcome(early[at][1]))
                else:
                    out.append((None, "unverifiable"))  # until verified below
                    check.append(at)
            if check:
                verified = verify_remote_values(
                    [headers[at] for at in check],
                    [views[at].numpy()[: got[at][0] - _HDR] for at in check],
                    namespace=namespace,
                    names=[encoded[at] for at in check],
                    max_payload_bytes=limit,
                )
                for at, page in zip(check, verified, strict=True):
                    out[at] = outcome(page)
            chunk.verify_s = time.perf_counter() - read_at + early_s
            return out

        return read

    def _get_done(self, job: RemoteJob, now: float) -> None:
        chunk: _Chunk = job.context
        if job.expired:  # counted late when it was given up on: only give back
            for _, slot, header, _ in chunk.items:
                self._dram.free(slot)
                self._free_headers.append(header)
            return
        chunk.polled = True
        if job.started_s is not None:
            self._timings.append(
                (len(chunk.items), job.started_s - job.submitted_s, chunk.read_s, chunk.verify_s)
            )
        self._advance(chunk.fetch, now)

    def read_timings(self) -> list[tuple[int, float, float, float]]:
        """The latest reads that returned (at most 256), oldest first: pages, and the
        seconds each spent queued for a worker, in the backend's call, and verifying
        (``tools/bench_remote.py`` splits a round with them)."""
        return list(self._timings)

    def _advance(self, fetch: _Fetch, now: float) -> None:
        """Admit the chunks of a fetch in order (a page's parent is the page before it),
        as far as they have returned; a chunk given up on breaks the chain."""
        while fetch.next < len(fetch.chunks):
            job = fetch.chunks[fetch.next]
            chunk: _Chunk = job.context
            if job.expired:
                fetch.chain = False
                if fetch.chunks and chunk.items:
                    fetch.expected = chunk.items[-1][0]
            elif not chunk.polled:
                return
            else:
                self._admit_chunk(job, chunk, now)
            fetch.next += 1

    def _admit_chunk(self, job: RemoteJob, chunk: _Chunk, now: float) -> None:
        fetch, items = chunk.fetch, chunk.items
        if job.error is not None:
            self._failed(job.error)
        results: list[tuple[RemotePage | None, str]] = (
            job.result if job.error is None else [(None, "error")] * len(items)
        )
        expected, chain = fetch.expected, fetch.chain
        moved = 0
        state, pages = self._state, self._pages
        if chunk.direct and job.error is None:
            # Absent pages were asked without a size query: where the cluster's run
            # ends is no miss (a query would have stopped there); the pages after it
            # were not really asked either.
            end = next((i for i, (_, r) in enumerate(results) if r == "absent"), len(items))
            if fetch.absent_at is None and end < len(items):
                fetch.absent_at = fetch.next * _READ_CHUNK + end
                self._hold_off(items[end][0], _ABSENT_RETRY_S)
            self._saw(len(items), end)
            if fetch.absent_at == 0:
                self._bump("lookups:absent")
        for at, ((key, slot, header, _), (page, reason)) in enumerate(
            zip(items, results, strict=True)
        ):
            self._free_headers.append(header)
            self._fetching.discard(key)
            admitted = False
            if fetch.absent_at is not None and fetch.next * _READ_CHUNK + at >= fetch.absent_at:
                self._dram.free(slot)
                chain = False
                expected = key
                continue
            if page is None:
                self._miss(reason or "error", key=key)
                if reason == "master":
                    self._degrade("the master does not answer reads")
            elif not chain:
                self._miss("orphan")
            elif page.parent != expected and not (expected is None and page.parent is not None):
                self._miss("mismatched", key=key)
            else:
                parent_rec = pages.get(page.parent) if page.parent is not None else None
                old = pages.get(key)
                if page.parent is not None and (parent_rec is None or not parent_rec.tiers):
                    self._miss("orphan")
                elif old is not None:
                    self._bump("present")  # offered or read locally meanwhile
                    admitted = old.tiers != 0  # the chain goes on from the local copy
                    self._dram.free(slot)
                    slot = -1
                else:
                    depth = parent_rec.depth + 1 if parent_rec is not None else 0
                    rec = PageRec(key, page.parent, depth, page.tokens, page.payload_bytes, now)
                    pages[key] = rec
                    if parent_rec is not None:
                        if parent_rec.children == 1:
                            state.child_created(parent_rec)
                        else:
                            parent_rec.children += 1
                    rec.dram_slot = slot
                    state.set_tier(rec, DRAM)
                    self._remember(self._from_remote, key)
                    self._bump("hits")
                    self._bump("bytes_read", page.payload_bytes)
                    moved += _HDR + page.payload_bytes
                    admitted = True
            if not admitted:
                if slot >= 0:
                    self._dram.free(slot)
                chain = False
            expected = key
        fetch.expected, fetch.chain = expected, chain
        seconds = job.seconds()
        if moved and seconds:
            self.bandwidth[REMOTE_READ].observe(moved, seconds, now)


def _free_only(pool: SlotPool, n: int) -> list[int] | None:
    """``n`` free slots, evicting nothing (None, and nothing taken: fewer are free)."""
    if pool.free_slots() < n:
        return None
    slots: list[int] = []
    for _ in range(n):
        slot = pool.alloc()
        if slot is None:
            for taken in slots:
                pool.free(taken)
            return None
        slots.append(slot)
    return slots
