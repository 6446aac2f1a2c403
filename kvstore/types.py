"""Values that cross the public boundary: frozen, slotted dataclasses.

The caller owns every instance it receives; the store never mutates one after
handing it out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

__all__ = ["Key", "Meta", "MetaValue", "PageInfo", "StoreStats"]

Key: TypeAlias = bytes | str
MetaValue: TypeAlias = str | int | float | bool | list["MetaValue"] | dict[str, "MetaValue"] | None
Meta = Mapping[str, MetaValue]


@dataclass(frozen=True, slots=True)
class PageInfo:
    """Where a page lives and what it is; returned by ``KVStore.info``."""

    key: bytes
    payload_bytes: int
    segment_id: int
    offset: int
    generation: int
    lsn: int
    checksum: int
    meta: Mapping[str, MetaValue]


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of the store's state; returned by ``KVStore.stats``."""

    path: str
    format_version: int
    io_engine: str
    direct_io: bool
    readonly: bool
    pages: int
    segments: int
    segment_bytes: int
    active_segment_id: int
    bytes_on_disk: int
    next_lsn: int
    durable_lsn: int
    checkpoint_lsn: int
    wal_files: int
    wal_bytes: int
    overlay_entries: int
    counters: Mapping[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict of every field."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}
