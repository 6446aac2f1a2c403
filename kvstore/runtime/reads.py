"""The read path's bookkeeping around ``SegmentReader``: look a key up, hold the
segments read (``protection.hold``) so GC cannot free them meanwhile, read and
verify, then count hits, misses and bytes and tell the eviction policy, with the
state lock taken once before the reads and once after. ``read_one`` is the latency
path of ``get`` and ``get_into``: no batch bookkeeping at all."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from kvstore.format.constants import BLOCK_BYTES
from kvstore.format.entries import PageEntry
from kvstore.inputs import check_fits, decode_meta, key_bytes
from kvstore.log.segment_reader import SegmentReader, Wanted
from kvstore.runtime.protection import hold, unhold
from kvstore.runtime.state import StoreState
from kvstore.telemetry import counters as tc
from kvstore.types import HeldExtent, Key

__all__ = ["ReadPath"]

_T = TypeVar("_T")


class ReadPath:
    def __init__(self, state: StoreState, reader: SegmentReader) -> None:
        self._state = state
        self._reader = reader

    def entry(self, key: Key) -> tuple[bytes, PageEntry | None]:
        raw = key_bytes(key)
        entry = self._state.table.get(raw)
        if (
            entry is not None
            and self._state.gone_segments
            and entry.segment_id in self._state.gone_segments
        ):
            return raw, None  # read-only: freed by the live writer since this view
        return raw, entry

    def read_many(
        self,
        wanted: Wanted,
        sink: Callable[[int, memoryview], None],
        targets: list[memoryview] | None = None,
    ) -> list[int | None]:
        """Read and verify pages; ``sink(index, payload_view)`` consumes each one.

        With ``targets``, a page whose ``targets[index]`` can take it directly
        (``direct_target``) is read there and not passed to ``sink``.
        """
        hold(self._state, wanted)
        try:
            return self._read_held(wanted, sink, targets)
        finally:
            unhold(self._state, wanted)

    def _read_held(
        self,
        wanted: Wanted,
        sink: Callable[[int, memoryview], None],
        targets: list[memoryview] | None,
    ) -> list[int | None]:
        st = self._state
        started_ns = time.perf_counter_ns()
        results, error = self._reader.read_held(wanted, sink, targets)
        hits = sum(1 for r in results if r is not None)
        done_ns = time.perf_counter_ns()
        tv = st.tv
        with st.lock:
            for (read_key, _), outcome in zip(wanted, results, strict=True):
                if outcome is not None:
                    st.policy.on_read(read_key)
            tv[tc.GETS] += len(wanted)
            tv[tc.HITS] += hits
            tv[tc.MISSES] += len(wanted) - hits
            tv[tc.READ_BYTES] += sum(r for r in results if r is not None)
            tc.observe(tv, tc.OP_GET, done_ns - started_ns)
        if error is not None:
            raise error
        return results

    def read_one(
        self, key: Key, consume: Callable[[memoryview, bool], _T], target: memoryview | None
    ) -> _T | None:
        """One page, the latency path: ``consume(verified payload, in_place)``, or None.

        ``in_place``: the payload was read straight into ``target`` (zero-copy).

        No batch bookkeeping: hold the segment, one read (on io_uring, polled for
        up to ``read_poll_us``; else one ``preadv``), verify, consume, and count,
        with the store lock taken once before the read and once after.
        """
        st = self._state
        started_ns = time.perf_counter_ns()
        raw, entry = self.entry(key)
        if entry is not None:
            if target is not None:
                check_fits(target, raw, entry.payload_bytes)
            with st.lock:
                segment = st.segments.get(entry.segment_id)
                if segment is not None:
                    st.segment_readers[entry.segment_id] += 1
            if segment is None:  # raced a segment free, or a damaged index: look again
                wanted: Wanted = [(raw, entry)]
                hold(self._state, wanted)
                entry = wanted[0][1]
                if entry is not None:
                    segment = st.segments[entry.segment_id]
        result: _T | None = None
        try:
            if entry is not None:
                assert segment is not None
                if target is not None:  # the hold may have found a newer, larger page
                    check_fits(target, raw, entry.payload_bytes)
                result = self._reader.read_page(raw, entry, consume, target)
        finally:
            done_ns = time.perf_counter_ns()
            tv = st.tv
            with st.lock:
                if entry is not None:
                    st.release_reader_locked(entry.segment_id)
                tv[tc.GETS] += 1
                if result is None:
                    tv[tc.MISSES] += 1
                else:
                    assert entry is not None
                    tv[tc.HITS] += 1
                    tv[tc.READ_BYTES] += entry.payload_bytes
                    st.policy.on_read(raw)
                tc.observe(tv, tc.OP_GET, done_ns - started_ns)
        return result

    @contextmanager
    def held_extents(self, keys: list[Key]) -> Iterator[list[HeldExtent | None]]:
        """Hold the segments of ``keys``' current pages and verify each record's header;
        yield where each payload is (None: absent). The holds end with the block."""
        wanted = [self.entry(key) for key in keys]
        hold(self._state, wanted)
        try:
            extents: list[HeldExtent | None] = []
            for raw, entry in wanted:
                if entry is None:
                    extents.append(None)
                    continue
                segment = self._reader.verify_header(raw, entry)
                extents.append(
                    HeldExtent(
                        raw,
                        str(segment.path),
                        entry.offset + BLOCK_BYTES,
                        entry.payload_bytes,
                        entry.payload_checksum,
                        decode_meta(entry.meta),
                        entry.segment_id,
                    )
                )
            yield extents
        finally:
            unhold(self._state, wanted)
