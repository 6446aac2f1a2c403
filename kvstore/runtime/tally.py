"""The tally of one GC pass, frozen into the ``GCReport`` that ``KVStore.gc`` returns."""

from __future__ import annotations

import dataclasses

from kvstore.types import GCReport

__all__ = ["GCTally"]


@dataclasses.dataclass(slots=True)
class GCTally:
    segments_scanned: int = 0
    segments_freed: int = 0
    pages_moved: int = 0
    bytes_moved: int = 0
    pages_evicted: int = 0
    bytes_evicted: int = 0
    drift_segments: int = 0
    drift_bytes: int = 0

    def freeze(self, seconds: float) -> GCReport:
        return GCReport(
            self.segments_scanned,
            self.segments_freed,
            self.pages_moved,
            self.bytes_moved,
            self.pages_evicted,
            self.bytes_evicted,
            self.drift_segments,
            self.drift_bytes,
            seconds,
        )

    def did_work(self) -> bool:
        """Whether the pass changed anything (freed, moved, evicted or swept)."""
        return bool(
            self.segments_freed or self.pages_moved or self.pages_evicted or self.drift_segments
        )
