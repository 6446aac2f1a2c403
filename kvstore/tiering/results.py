"""The values the tier manager hands to engines: frozen, slotted, owned by the caller.

``LookupResult`` (READY / PENDING / MISS, pages per tier, the load plan),
``OfferResult`` (what was admitted where, and why the rest was not), ``LoadHandle``
(an in-flight load: wait on it, then ``TierManager.complete_load``), ``TierStats``.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore.tiering.cost import PlanCost

__all__ = [
    "UNBOUNDED_BYTES",
    "LoadHandle",
    "LoadPlan",
    "LookupResult",
    "LookupState",
    "OfferResult",
    "ReleaseHandle",
    "RequestContext",
    "TierStats",
    "check_count",
]

# The capacity the manager gives a tier without a bound (an NVMe store without
# capacity_bytes): larger than any drive. The exporter exports no capacity sample for
# it (docs/tiering.md, "Metrics").
UNBOUNDED_BYTES = 1 << 62


class LookupState(enum.Enum):
    """READY: every page of the plan can be copied now. PENDING: some are still on
    their way up (an NVMe read or an offer's copy in flight); ``prepare_load`` works
    anyway, or look up again later. MISS: recomputing is at least as fast (or
    nothing hit): load nothing."""

    READY = "ready"
    PENDING = "pending"
    MISS = "miss"


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What the manager may know about the request a call is for (all optional)."""

    request_id: str = ""
    tokens: int | None = None  # the prompt's length; the plan recomputes the rest
    deadline_s: float | None = None  # the SLO, on the manager's clock
    tag: str = ""  # an engine-chosen class (tenant, model, adapter) for reuse estimates

    def __post_init__(self) -> None:
        if self.tokens is not None:
            check_count("RequestContext.tokens", self.tokens, low=0)
        if self.deadline_s is not None and not (
            isinstance(self.deadline_s, int | float) and math.isfinite(self.deadline_s)
        ):
            raise ValueError(
                f"RequestContext.deadline_s must be a finite number, got {self.deadline_s!r}"
            )
        if not isinstance(self.tag, str):
            raise TypeError(f"RequestContext.tag must be a str, not {type(self.tag).__name__}")


# Counts the cost model multiplies (tokens, context): ints, well inside a float's
# exact range, so FLOP counts stay finite.
MAX_COUNT = 1 << 40


def check_count(name: str, value: object, *, low: int) -> int:
    """``value`` as a count the cost model can use: an int in ``low..MAX_COUNT``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not low <= value <= MAX_COUNT:
        raise ValueError(f"{name} must be {low}..{MAX_COUNT}, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Which leading pages of a hit to load: ``keys[:load_pages]`` from ``tiers``."""

    keys: tuple[bytes, ...]
    tiers: tuple[int, ...]
    load_pages: int
    cost: PlanCost
    reason: str


@dataclass(frozen=True, slots=True)
class LookupResult:
    state: LookupState
    hit_pages: int  # the resident prefix run
    pages_by_tier: tuple[int, int, int]  # of the hit run: served from hbm, dram, nvme
    plan: LoadPlan
    # The pages after the hit run being read from the remote tier into DRAM (docs/tiering.md,
    # "The remote tier"): look up again shortly and they are DRAM hits. 0 without one.
    remote_pending: int = 0


@dataclass(frozen=True, slots=True)
class OfferResult:
    """Per key: the tier the page went to (0 HBM, 1 DRAM, 2 NVMe) or None, and why.
    ``waiting``: DRAM, once a write-back frees a slot (``hbm_release`` covers that copy
    too); declined after ``offer_wait_s``, as an evicted page would be."""

    tiers: tuple[int | None, ...]
    reasons: tuple[str, ...]
    hbm_release: ReleaseHandle

    @property
    def admitted(self) -> int:
        return sum(1 for tier in self.tiers if tier is not None)

    @property
    def declined(self) -> int:
        return sum(1 for reason in self.reasons if reason not in _KEPT)


_KEPT = frozenset({"admitted", "present", "waiting"})


class ReleaseHandle:
    """When the engine may reuse the source blocks it offered (rule R2 of docs/tiering.md,
    "The mover and the ordering rules")."""

    __slots__ = ("_done", "_pump", "event")

    def __init__(self, done: Callable[[], bool], pump: Callable[[], None], event: Any) -> None:
        self._done = done
        self._pump = pump
        self.event = event  # CUDA event after the last copy; None on CPU

    def done(self) -> bool:
        return self._done()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._pump()
        return True


class LoadHandle:
    """An in-flight load. ``results[i]``: None pending, else bytes loaded (> 0) or 0
    for a page that could not be loaded (missing, failed read): the engine uses the
    ``loaded_pages`` leading pages and recomputes the rest. Never a wrong byte."""

    __slots__ = ("_pump", "_settled", "event", "pinned", "plan", "records", "remaining", "results")

    def __init__(self, plan: LoadPlan, records: list[Any], pump: Callable[[], None]) -> None:
        self.plan = plan
        self.records = records
        self.results: list[int | None] = [None] * len(records)
        self.remaining = len(records)
        self.event: Any = None
        self.pinned: set[int] = set()  # pages the load still pins (until each copy lands)
        self._pump = pump
        self._settled = threading.Event()
        if not records:
            self._settled.set()

    def settle(self, index: int, nbytes: int) -> None:
        """The manager, under its lock: page ``index`` is done (``nbytes`` 0: failed)."""
        if self.results[index] is None:
            self.results[index] = nbytes
            self.remaining -= 1
            if self.remaining == 0:
                self._settled.set()

    def done(self) -> bool:
        return self._settled.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._settled.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._pump()
        return True

    @property
    def loaded_pages(self) -> int:
        count = 0
        for result in self.results:
            if not result:
                break
            count += 1
        return count

    @property
    def failed_pages(self) -> int:
        return sum(1 for result in self.results if result == 0)


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of the manager; ``TierManager.stats``. Tier tuples are (hbm, dram, nvme)."""

    pages: int
    used_bytes: tuple[int, int, int]
    capacity_bytes: tuple[int, int, int]
    pages_by_tier: tuple[int, int, int]
    hits_by_tier: tuple[int, int, int]
    misses: int
    lookups: int
    admissions: Mapping[str, int]  # "tier:decision" -> count
    evictions: Mapping[str, int]  # "tier:reason" -> count
    demotions: int
    promotions: int
    hysteresis_blocks: int
    thrash: int
    recompute_decisions: Mapping[str, int]
    emergency_evictions: int
    emergency: bool
    tau: tuple[float, float, float]
    kappa: tuple[float, float, float]
    bandwidth_bytes_per_s: Mapping[str, float]
    latency_s: Mapping[str, float]
    compute_flops: float
    in_flight_bytes: Mapping[str, int]
    nvme_bytes_written: int
    nvme_pages_written: int
    load_failures: int
    offload_latency_s: Mapping[str, tuple[tuple[float, ...], tuple[int, ...], float, int]]
    page_table_bytes: int
    mover: str
    placement: str
    admission: str
    eviction: str
    # Per tier: used for loads (HBM always; DRAM and NVMe while κ >= 1: loading from
    # them is measured faster than recomputing). A tier out of use is re-measured by
    # probes (docs/tiering.md, "Measurements").
    in_use: tuple[bool, bool, bool] = (True, True, True)
    # Page loads that failed, by reason ("reason" -> count; the reasons add up to at
    # most load_failures, the rest is exported as reason="unknown"): nvme_read (the
    # NVMe read failed or came back short), no_slot (no DRAM slot to stage into),
    # copy (the copy to the destination failed), unreadable (the page was gone).
    load_failure_reasons: Mapping[str, int] = field(default_factory=dict)
    # The remote tier's summary (RemoteTier.summary: state, hits, misses by reason,
    # published pages, kappa, bandwidths); None without a remote tier.
    remote: Mapping[str, Any] | None = None
    # The NVMe write gate (docs/tiering.md, "Admission by payoff"): whether NVMe takes
    # the writes of pages seen once, and of pages seen again; None without the gate.
    nvme_write_gate: tuple[bool, bool] | None = None
    # The displacement rule (docs/tiering.md, "Admission against the displaced page"):
    # on, how often it turned on or off, and its two NVMe models' decayed hits
    # (admitting every page, applying the rule); None without the rule.
    nvme_displacement: Mapping[str, Any] | None = None
