"""Protection: what keeps a page's bytes where a reader or a caller needs them.

- **Reads in progress** (``hold`` / ``unhold``): a read registers itself on the
  segment that holds its page (``StoreState.segment_readers``) before it reads, so GC
  neither frees nor reuses that file meanwhile.
- **Pins** (``KVStore.pin``): volatile, per process; a pinned page is never moved,
  evicted or freed (``StoreState.pins`` and ``segment_pins``; the pin and unpin
  paths are inlined in the facade for speed).
- **Retains** (``retain_step_locked``): durable (a RETAIN WAL record); a retained
  page is never evicted.

Every function here takes or needs the state lock, as it says.
"""

from __future__ import annotations

import time

from kvstore.errors import CorruptionError
from kvstore.format.wal import encode_retain
from kvstore.log.segment_reader import Wanted
from kvstore.runtime.state import StoreState

__all__ = ["hold", "retain_step_locked", "unhold"]


def hold(state: StoreState, wanted: Wanted) -> None:
    """Register reads on the segments holding ``wanted`` so GC cannot free them.
    Takes the state lock.

    A lookup that raced a segment free (its page moved or died) is redone, in place
    in ``wanted``. An entry that keeps naming a segment the store does not have is
    corruption (a damaged or hostile index), not a race: CorruptionError, nothing held.
    """
    held: list[int] = []
    todo = list(range(len(wanted)))
    stuck_rounds = 0
    while todo:
        retry = []
        with state.lock:
            for index in todo:
                entry = wanted[index][1]
                if entry is None:
                    continue
                if entry.segment_id in state.segments:
                    state.segment_readers[entry.segment_id] += 1
                    held.append(index)
                else:
                    retry.append(index)
        stuck = None
        for index in retry:
            key, old = wanted[index]
            new = state.table.get(key)
            if new is not None and new == old:
                stuck = (key, new)
            wanted[index] = (key, new)
        stuck_rounds = stuck_rounds + 1 if stuck is not None else 0
        if stuck is not None and stuck_rounds >= 3:
            with state.lock:
                for index in held:
                    entry = wanted[index][1]
                    assert entry is not None
                    state.release_reader_locked(entry.segment_id)
            key, entry = stuck
            for index in retry:  # nothing of this call stays held
                wanted[index] = (wanted[index][0], None)
            raise CorruptionError(
                f"page {key!r} names segment {entry.segment_id}, which the store does "
                "not have; run `kvstore recover PATH`"
            )
        if stuck is not None:
            time.sleep(0.001)  # let a segment free that is in progress finish
        todo = retry


def unhold(state: StoreState, wanted: Wanted) -> None:
    """Release what ``hold`` registered. Takes the state lock."""
    with state.lock:
        for _, entry in wanted:
            if entry is not None:
                state.release_reader_locked(entry.segment_id)


def retain_step_locked(state: StoreState, raw: bytes, retained: bool) -> bool | None:
    """Retain (or release) ``raw``: True if it changed, or already was so; False if a
    retain found no page; None when the LSN lease must be extended first (the caller
    does that outside the lock and tries again). Caller holds the state lock and
    made sure the store is writable."""
    if retained and state.table.get(raw) is None:
        return False
    if (raw in state.retains) == retained:
        return retained
    if state.next_lsn + 2 >= state.lease_until:
        return None
    state.pending.append(encode_retain(state.take_lsn_locked(), raw, retained))
    if retained:
        state.retains.add(raw)
    else:
        state.retains.discard(raw)
    return True
