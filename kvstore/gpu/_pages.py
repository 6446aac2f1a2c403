"""What the backends share: one page of a transfer, the store interface they use, counters."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvstore.config import StoreConfig
from kvstore.types import HeldExtent, Key, Meta, PageInfo

__all__ = ["Page", "PageStore", "PipelineCounters"]


class PageStore(Protocol):
    """The part of ``KVStore``'s public API the HBM path uses (tests wrap it to slow reads)."""

    root: Path
    config: StoreConfig
    readonly: bool

    def put_many(
        self,
        items: Iterable[tuple[Key, object] | tuple[Key, object, Meta | None]],
        *,
        sync: bool = False,
    ) -> list[bool]: ...

    def get_into(self, key: Key, buffer: object) -> int | None: ...

    def info(self, key: Key) -> PageInfo | None: ...

    def flush(self) -> None: ...

    def pinned(self, keys: Iterable[Key]) -> AbstractContextManager[list[bool]]: ...

    def held_extents(
        self, keys: Iterable[Key]
    ) -> AbstractContextManager[list[HeldExtent | None]]: ...


@dataclass(slots=True)
class Page:
    """One page of a transfer; owned by the pipeline while the transfer runs."""

    key: bytes
    tensor: Any  # torch.Tensor, contiguous, on the TensorIO's device
    nbytes: int
    meta: Mapping[str, Any]


@dataclass(slots=True)
class PipelineCounters:
    """Running totals of a backend; ``snapshot`` copies them under the lock.

    ``max_reads_during_copy`` is the most staging reads that were running
    (started, not finished) at the start or end of a staging->device copy:
    above 1 means the pipeline kept several reads in flight while it copied.
    """

    pages_loaded: int = 0
    pages_saved: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    reads_running: int = 0
    max_reads_running: int = 0
    max_reads_during_copy: int = 0
    copies: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def read_started(self) -> None:
        with self.lock:
            self.reads_running += 1
            self.max_reads_running = max(self.max_reads_running, self.reads_running)

    def read_finished(self) -> None:
        with self.lock:
            self.reads_running -= 1

    def sample_during_copy(self) -> None:
        with self.lock:
            self.max_reads_during_copy = max(self.max_reads_during_copy, self.reads_running)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {
                "pages_loaded": self.pages_loaded,
                "pages_saved": self.pages_saved,
                "bytes_loaded": self.bytes_loaded,
                "bytes_saved": self.bytes_saved,
                "max_reads_running": self.max_reads_running,
                "max_reads_during_copy": self.max_reads_during_copy,
                "copies": self.copies,
            }
