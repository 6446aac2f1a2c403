"""What each mover ticket the tier manager submits is for: one typed tag per kind.

The manager hands one of these to the mover as a ticket's ``tag`` and, when the
ticket completes, ``TierManager._harvest`` dispatches on its type (docs/tiering.md,
"The mover and the ordering rules"): no string tags, no positional unpacking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.tiering.pages import PageRec
from kvstore.tiering.results import LoadHandle

__all__ = ["Demotion", "Load", "OfferCopy", "Probe", "Read", "WriteBack"]


@dataclass(frozen=True, slots=True)
class OfferCopy:
    """An offer's copy of fresh pages into ``tier`` (HBM: D2D, DRAM: D2H)."""

    recs: list[PageRec]
    tier: int


@dataclass(frozen=True, slots=True)
class Demotion:
    """HBM -> DRAM for a batch whose DRAM slots are taken; ``keep``: they stay in HBM
    too (the clean reserve)."""

    recs: list[PageRec]
    keep: bool


@dataclass(frozen=True, slots=True)
class WriteBack:
    """DRAM -> NVMe; with ``demote`` each page's DRAM slot goes once it is written."""

    recs: list[PageRec]
    demote: bool


@dataclass(frozen=True, slots=True)
class Read:
    """NVMe -> DRAM for pages whose DRAM slots are taken (a demand read, a prefetch,
    a warm-up read)."""

    recs: list[PageRec]


@dataclass(frozen=True, slots=True)
class Load:
    """Copies into one load's destinations: ``items`` are (plan index, source, dst)."""

    handle: LoadHandle
    items: list[tuple[int, Any, Any]]


@dataclass(frozen=True, slots=True)
class Probe:
    """A measurement of ``path`` (exploration); ``rate_before`` is the estimate when it
    was submitted."""

    path: str
    rate_before: float
