"""The segment set's file side: new segment files, the spare made ahead, and rolling
the active segment (docs/design.md, "Segments").

The accounting (states, the active segment, the spare, capacity, readers and
writers per segment) is in ``runtime.state.StoreState``, under the state lock; this
component makes the files. A new segment is named in the WAL (SEGMENT_OPEN) when it
becomes active, and its directory entry is durable before that (``create_segment``).
The prepare thread keeps one spare ready so rolling never waits on fallocate.
"""

from __future__ import annotations

import threading
from pathlib import Path

from kvstore.errors import IOFailure, StoreFullError
from kvstore.format.constants import BLOCK_BYTES
from kvstore.format.entries import SEGMENT_ACTIVE, SEGMENT_SEALED
from kvstore.format.wal import encode_segment_open
from kvstore.index.table import SegmentState
from kvstore.log.segments import Segment, create_segment
from kvstore.runtime.state import StoreState
from kvstore.telemetry import counters as tc

__all__ = ["SegmentSet"]


class SegmentSet:
    def __init__(
        self, state: StoreState, root: Path, *, store_uuid: bytes, segment_bytes: int, direct: bool
    ) -> None:
        self._state = state
        self._root = root
        self._store_uuid = store_uuid
        self._segment_bytes = segment_bytes
        self._direct = direct

    def new_segment(self, segment_id: int, generation: int) -> Segment:
        try:
            return create_segment(
                self._root,
                segment_id,
                generation,
                size_bytes=self._segment_bytes,
                store_uuid=self._store_uuid,
                direct=self._direct,
            )
        except IOFailure as e:
            if e.errno == 28:  # ENOSPC: nothing was written, the writer stays healthy
                raise StoreFullError(
                    f"no space on the device for a new {self._segment_bytes}-byte segment"
                ) from e
            raise

    def claim_spare_locked(self) -> tuple[int, int] | None:
        """(id, generation) for a new spare, or None if one exists, is being made, or
        must not be made now (failed writer, lease exhausted, capacity). The caller
        holds the state lock and must end with ``state.preparing = False`` and notify."""
        st = self._state
        if (
            st.spare is not None
            or st.preparing
            or st.failed is not None
            or st.next_lsn + 2 >= st.lease_until
            or not st.spare_allowed_locked()
        ):
            return None
        st.preparing = True
        segment_id = st.next_segment_id
        st.next_segment_id += 1
        return segment_id, st.take_lsn_locked()

    def _take_spare_locked(self) -> Segment | None:
        """The prepared spare, if any. Caller holds the state lock and made sure no
        spare is being made (the store's reserve waits that out first, then re-checks)."""
        st = self._state
        assert not st.preparing, "a spare is being made; reserve must wait first"
        spare, st.spare = st.spare, None
        return spare

    def roll_locked(self) -> Segment:
        """Open a fresh active segment. Caller holds the state lock."""
        st = self._state
        segment = self._take_spare_locked()
        if segment is None:
            segment_id = st.next_segment_id
            generation = st.take_lsn_locked()
            segment = self.new_segment(segment_id, generation)
            st.next_segment_id += 1
            st.tv[tc.SEGMENT_HEADER] += BLOCK_BYTES
        segment_id, generation = segment.segment_id, segment.generation
        st.spare_wanted.set()
        if st.active is not None:
            st.segment_states[st.active.segment_id].state = SEGMENT_SEALED
        st.segments[segment_id] = segment
        st.segment_states[segment_id] = SegmentState(
            generation, BLOCK_BYTES, 0, 0, segment.created_unix_ns, SEGMENT_ACTIVE
        )
        st.pending.append(encode_segment_open(generation, segment_id, generation))
        st.active = segment
        return segment

    def prepare_loop(self, stop: threading.Event) -> None:
        """Keep one spare segment ready so rolling never waits on fallocate."""
        st = self._state
        while not stop.is_set():
            st.spare_wanted.wait(0.5)
            st.spare_wanted.clear()
            if not stop.is_set():
                self.prepare_once()

    def prepare_once(self) -> None:
        """Make the spare now if one may be made (see ``claim_spare_locked``). The
        prepare thread's step; a recorded power-loss run calls it between workload
        steps instead, so its recording is the same every time."""
        st = self._state
        with st.cond:
            claimed = self.claim_spare_locked()
        if claimed is None:
            return
        segment_id, generation = claimed
        spare: Segment | None = None
        try:
            spare = self.new_segment(segment_id, generation)
        except Exception:
            pass  # the writer creates its next segment itself, and reports the error
        finally:
            with st.cond:
                st.spare = spare
                st.preparing = False
                if spare is not None:
                    st.tv[tc.SEGMENT_HEADER] += BLOCK_BYTES
                st.cond.notify_all()
