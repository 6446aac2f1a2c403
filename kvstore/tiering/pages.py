"""``PageRec`` and the prefix forest: which page is where, and whose child it is.

A page is keyed by the engine's chained block hash (bytes; an int key is stored as
``b"int:<decimal>"``). ``parent`` links make the prefix forest without storing
tokens: a prefix hit walks keys in order and stops at the first page resident in no
tier, so a page whose parent is gone is an orphan and is never admitted. The
parent link is also written into the NVMe page's meta so the forest is rebuilt on
open.

Invariants (kept by the manager, under its lock):
- ``tiers`` has bit ``1 << t`` set exactly while tier t holds a copy (or one is being
  written there, state WRITING).
- ``resident_children[t]`` (the slots ``resident_hbm``, ``resident_dram``,
  ``resident_nvme``) counts this page's children that hold it in tier t: in t,
  not leaving it (``leaving``: a demotion in flight), and with no copy below. A page
  with such a child is not a victim of t (leaves first: removing its only copy would
  orphan the child); copying it down (cleaning) is always allowed.
- a page with ``pins > 0`` or a state other than READY is never a victim.
- a WAITING page (an offered page queued for a DRAM slot) has no tier bit, no slot
  and is in no order: a lookup stops at it, as at a page not there.
"""

from __future__ import annotations

import enum

__all__ = ["DRAM", "HBM", "NVME", "TIER_NAMES", "PageRec", "PageState", "Tier", "page_key"]


class Tier(enum.IntEnum):
    HBM = 0
    DRAM = 1
    NVME = 2


HBM, DRAM, NVME = Tier.HBM, Tier.DRAM, Tier.NVME
TIER_NAMES = ("hbm", "dram", "nvme")
BIT = (1, 2, 4)
ABOVE_NVME = BIT[HBM] | BIT[DRAM]  # PageRec.tiers: a copy above NVMe


class PageState(enum.IntEnum):
    READY = 0
    WRITING = 1  # its bytes are being copied into a tier (offer, or a demotion)
    LOADING = 2  # an NVMe read into a DRAM slot is in flight
    EVICTING = 3  # leaving a tier: its source slot stays valid until the copy lands
    WAITING = 4  # offered, in no tier yet: waiting for a DRAM slot (Placement.serve_waiting)


def page_key(key: object) -> bytes:
    """The engine's key as bytes (the form the NVMe store keeps)."""
    if type(key) is bytes:
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return b"int:%d" % key
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key)
    if isinstance(key, str):
        return key.encode()
    raise TypeError(f"page keys are bytes, str or int, got {type(key).__name__}")


class PageRec:
    """One page's record. Slotted: the forest holds one per cached block."""

    __slots__ = (
        "admit_epoch",
        "admit_nvme",
        "children",
        "cost_ratio",
        "deadline_s",
        "demoted_at_s",
        "depth",
        "dram_slot",
        "hbm_clean",
        "hbm_slot",
        "hits",
        "key",
        "last_access_s",
        "leaving",
        "nbytes",
        "next_key",
        "parent",
        "pins",
        "promoted_at_s",
        "reads",
        "resident_dram",
        "resident_hbm",
        "resident_nvme",
        "retained",
        "reused",
        "shared",
        "state",
        "tag",
        "tiers",
        "tokens",
        "waiters",
    )

    def __init__(
        self, key: bytes, parent: bytes | None, depth: int, tokens: int, nbytes: int, now_s: float
    ) -> None:
        self.key = key
        self.parent = parent
        self.depth = depth
        self.tokens = tokens
        self.nbytes = nbytes
        self.tiers = 0
        self.dram_slot = -1
        self.hbm_slot = -1
        self.hbm_clean = False  # in the manager's HBM clean list (a DRAM copy too)
        self.pins = 0
        self.state = PageState.READY
        self.last_access_s = now_s
        self.hits = 0.0
        # Lookups that hit this page, decayed as ``hits`` is: Φ's frequency term scales
        # the hits by the share of reads that branched (hits / reads).
        self.reads = 0.0
        # The key that followed this page in the last lookup that hit it: a hit counts
        # toward ``hits`` only where the prefix branches (docs/tiering.md, "Eviction and
        # placement").
        self.next_key: object = None
        self.demoted_at_s = -1e18
        self.promoted_at_s = -1e18
        # resident_children, one int slot per tier: a list per page was one more object
        # for every full garbage collection to walk.
        self.resident_hbm = 0
        self.resident_dram = 0
        self.resident_nvme = 0
        self.leaving = 0  # tier bits this page is being demoted out of
        self.retained = False
        self.children = 0  # child records created under this page (a count, not a list)
        # A branch at or below this page: the prefix is shared by several continuations.
        self.shared = False
        self.reused = False
        self.deadline_s: float | None = None
        self.tag = ""
        self.waiters: list[object] | None = None
        self.admit_epoch = -1  # the manager's admission epoch admit_nvme was decided in
        self.admit_nvme = False
        # Φ's cost term, cached by the manager for a full page (it depends on the depth
        # alone); -1: not cached. Reset wherever ``nbytes`` changes.
        self.cost_ratio = -1.0

    @property
    def resident_children(self) -> tuple[int, int, int]:
        """Children holding this page in HBM, DRAM, NVMe (a snapshot)."""
        return (self.resident_hbm, self.resident_dram, self.resident_nvme)

    def in_tier(self, tier: int) -> bool:
        return bool(self.tiers & BIT[tier])

    def top_tier(self) -> int:
        """The fastest tier holding the page; -1 when none."""
        tiers = self.tiers
        if tiers & 1:
            return 0
        if tiers & 2:
            return 1
        if tiers & 4:
            return 2
        return -1

    def __repr__(self) -> str:
        where = "+".join(TIER_NAMES[t] for t in range(3) if self.tiers & BIT[t]) or "none"
        return (
            f"PageRec({self.key!r}, depth={self.depth}, {where}, {self.state.name}, "
            f"pins={self.pins}, hits={self.hits:.2f})"
        )
