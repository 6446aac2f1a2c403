"""When a logged change applies: the one set of WAL-apply rules.

The store's replay at open (``index.recovery``), its live page table
(``index.table``) and ``kvstore recover`` (kvstore/recover.py) all decide with
these functions. ``now`` is what is known of the key when the record is applied:
its live entry (a ``PageEntry``), a delete (anything else with an ``lsn``: the
table's ``Tombstone``), or None when nothing is known of it.

- A PUT applies unless the key's state is newer (equal LSNs: the later record wins;
  replay is idempotent).
- A DELETE applies likewise.
- A MOVE (compaction copied the page, keeping its LSN) applies when the page is
  still where compaction found it with that LSN, so an overwrite or delete logged
  meanwhile wins. It also applies when the known state is older than the moved
  page, or when nothing is known: the MOVE then proves a PUT of that LSN existed,
  and its record is the newest news of the page. In a sound WAL replayed over its
  checkpoint that never happens (the PUT precedes every MOVE of it, and a key the
  checkpointed index lacks is dead as of the checkpoint: callers pass that as a
  delete at ``checkpoint_lsn - 1``); it happens to ``kvstore recover`` when the
  index is missing and the PUT's WAL file was dropped at a checkpoint.
"""

from __future__ import annotations

from typing import Protocol

from kvstore.format.entries import PageEntry

__all__ = ["Known", "delete_applies", "move_applies", "put_applies"]


class Known(Protocol):
    """A key's known state: a ``PageEntry`` (live) or a tombstone (deleted)."""

    @property
    def lsn(self) -> int: ...


def put_applies(now: Known | None, lsn: int) -> bool:
    """Newer or equal wins (equal: the later record; replay is idempotent)."""
    return now is None or now.lsn <= lsn


delete_applies = put_applies  # a DELETE follows the PUT's rule


def move_applies(now: Known | None, lsn: int, old_location: tuple[int, int, int]) -> bool:
    """``old_location``: (segment id, generation, offset) the page was moved from."""
    if now is None or now.lsn < lsn:
        return True
    return (
        isinstance(now, PageEntry)
        and now.lsn == lsn
        and (now.segment_id, now.generation, now.offset) == old_location
    )
