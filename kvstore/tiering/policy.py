"""Admission (value density, the anchors' modes), reuse estimates, τ, eviction orders.

- ``ReuseEstimator``: a bounded history of recently seen keys (the ghost map). A key
  seen again while still in it counts a reuse for the class it was recorded under;
  one that falls out unseen counts a non-reuse. p per class is the Beta-smoothed,
  slowly decaying ratio. Classes: (depth bucket, reused yet, engine tag).
- ``Admission``: the value density VD (docs/tiering.md, "Admission") against τ per
  tier, or the anchors' frequency modes (``all``, ``freq2``, ``store_threshold:N``).
- ``TauController``: τ_h tracks the value density of what tier h has been evicting
  (admitting below it would displace something worth more), scaled up while the tier
  is above its warn watermark and, for NVMe, while writes run over the DWPD budget;
  it relaxes back to ``tau_initial`` when the pressure goes.
- Eviction orders, one per tier, pluggable: ``LRUOrder`` (O(1)), ``PhiOrder`` (Φ, in a
  lazy heap, O(log n)), ``ARCOrder``. ``victims`` returns up to n pages
  the caller's predicate accepts, lowest first; the caller ``remove``s each one when
  it actually leaves the tier (a demotion in flight keeps its place until it lands).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

from kvstore.tiering.pages import NVME, PageRec

__all__ = [
    "ARCOrder",
    "Admission",
    "EvictionOrder",
    "LRUOrder",
    "PhiOrder",
    "ReuseEstimator",
    "TauController",
    "make_order",
]

_COUNT_DECAY = 0.9995  # per event: class statistics follow a workload over ~2,000 events
_DEPTH_BUCKETS = 8
# depth_bucket by table for the depths a walk meets (depth.bit_length(), capped).
_BUCKET_TABLE = 1 << (_DEPTH_BUCKETS - 1)
_BUCKET_OF = tuple(min(d.bit_length(), _DEPTH_BUCKETS - 1) for d in range(_BUCKET_TABLE))

# ReuseEstimator's history entries, packed into an int (see its __init__). The class
# table is shared by every estimator: (depth bucket, reused, tag) -> a small id.
_LOOKED, _PENDING = 1, 2
_COUNT_SHIFT = 24
_ONE = 1 << _COUNT_SHIFT
_CLASS_MASK = (1 << (_COUNT_SHIFT - 2)) - 1
_CLASS_IDS: dict[tuple[int, bool, str], int] = {}
_CLASS_OF: list[tuple[int, bool, str]] = []


def _class_id(bucket: int, reused: bool, tag: str) -> int:
    cls = (bucket, reused, tag)
    cid = _CLASS_IDS.get(cls)
    if cid is None:
        if len(_CLASS_OF) > _CLASS_MASK:
            raise ValueError(f"more than {_CLASS_MASK + 1} reuse classes (engine tags)")
        cid = _CLASS_IDS[cls] = len(_CLASS_OF)
        _CLASS_OF.append(cls)
    return cid


def depth_bucket(depth: int) -> int:
    """0, 1, 2-3, 4-7, ... capped: reuse falls with depth in every trace we have."""
    return min(depth.bit_length(), _DEPTH_BUCKETS - 1)


class ReuseEstimator:
    """p(reuse) per class from a bounded map of recently seen keys."""

    __slots__ = ("_classes", "_history", "_limit", "_log_p", "_log_p_at", "_prior", "_version")

    def __init__(self, entries: int, prior: tuple[float, float]) -> None:
        self._limit = entries
        self._prior = prior
        # key -> one int: access count << 24 | class id << 2 | pending trial << 1 |
        # looked up since last offer (_COUNT_SHIFT, _CLASS_MASK, _PENDING, _LOOKED). An
        # int is no object the garbage collector tracks: a list per key (the map holds
        # ~half the cache's pages) made every full collection walk them all.
        self._history: OrderedDict[bytes, int] = OrderedDict()
        self._classes: dict[tuple[int, bool, str], list[float]] = {}
        # ln max(p, floor) of the classes of pages seen once, as of ``_version`` (a
        # count of changes to ``_classes``): an eviction scan scores dozens of pages of
        # a few classes between two changes (``log_p_first``).
        self._version = 0
        self._log_p: dict[tuple[int, str], float] = {}
        self._log_p_at = -1

    def __len__(self) -> int:
        return len(self._history)

    def access(self, key: bytes, depth: int, tag: str, *, lookup: bool) -> int:
        """Count one access of ``key``; returns how often it has been seen (horizon:
        the map's size). A lookup marks the entry so the offer that follows it in
        the same request is not counted twice."""
        history = self._history
        entry = history.get(key)
        bucket = depth.bit_length()  # depth_bucket, inlined: this runs once per page
        if bucket >= _DEPTH_BUCKETS:
            bucket = _DEPTH_BUCKETS - 1
        looked = _LOOKED if lookup else 0
        if entry is None:
            cid = _class_id(bucket, False, tag)
            history[key] = _ONE | cid << 2 | _PENDING | looked
            if len(history) > self._limit:
                _, old = history.popitem(last=False)
                if old & _PENDING:
                    self._count(_CLASS_OF[old >> 2 & _CLASS_MASK], reused=False)
            return 1
        history.move_to_end(key)
        if not lookup and entry & _LOOKED:
            history[key] = entry & ~_LOOKED
            return entry >> _COUNT_SHIFT
        cid = entry >> 2 & _CLASS_MASK
        cls = _CLASS_OF[cid]
        if entry & _PENDING:
            self._count(cls, reused=True)
        count = (entry >> _COUNT_SHIFT) + 1
        if cls[0] != bucket or not cls[1] or cls[2] != tag:
            cid = _class_id(bucket, True, tag)
        history[key] = count << _COUNT_SHIFT | cid << 2 | _PENDING | looked
        return count

    def access_offer(self, key: bytes, depth: int, tag: str) -> tuple[int, bool]:
        """``access(key, depth, tag, lookup=False)`` and whether it counted (False: the
        lookup of the same request already did): ``seen`` before and after, in one call."""
        history = self._history
        entry = history.get(key)
        if entry is None:  # access's first case, inlined: a key never seen (or forgotten)
            bucket = _BUCKET_OF[depth] if depth < _BUCKET_TABLE else _DEPTH_BUCKETS - 1
            history[key] = _ONE | _class_id(bucket, False, tag) << 2 | _PENDING
            if len(history) > self._limit:
                _, old = history.popitem(last=False)
                if old & _PENDING:
                    self._count(_CLASS_OF[old >> 2 & _CLASS_MASK], reused=False)
            return 1, True
        if entry & _LOOKED:
            history[key] = entry & ~_LOOKED
            history.move_to_end(key)
            return entry >> _COUNT_SHIFT, False
        return self.access(key, depth, tag, lookup=False), True

    def access_lookup(self, keys: list[bytes], tag: str) -> None:
        """``access(key, depth, tag, lookup=True)`` for ``keys[depth]`` in order: a
        lookup's walk in one call (the same counts, without a call per page)."""
        history = self._history
        classes = self._classes
        limit = self._limit
        buckets = _BUCKET_OF
        deep = _DEPTH_BUCKETS - 1
        class_of = _CLASS_OF
        for depth, key in enumerate(keys):
            entry = history.get(key)
            bucket = buckets[depth] if depth < _BUCKET_TABLE else deep
            if entry is None:
                history[key] = _ONE | _class_id(bucket, False, tag) << 2 | _PENDING | _LOOKED
                if len(history) > limit:
                    _, old = history.popitem(last=False)
                    if old & _PENDING:
                        self._count(class_of[old >> 2 & _CLASS_MASK], reused=False)
                continue
            history.move_to_end(key)
            cid = entry >> 2 & _CLASS_MASK
            cls = class_of[cid]
            if entry & _PENDING:
                stats = classes.get(cls)
                if stats is None:
                    stats = classes[cls] = [0.0, 0.0]
                stats[0] = stats[0] * _COUNT_DECAY + 1.0
                stats[1] *= _COUNT_DECAY
                self._version += 1
            if cls[0] != bucket or not cls[1] or cls[2] != tag:
                cid = _class_id(bucket, True, tag)
            count = (entry >> _COUNT_SHIFT) + 1
            history[key] = count << _COUNT_SHIFT | cid << 2 | _PENDING | _LOOKED

    def seen(self, key: bytes) -> int:
        entry = self._history.get(key)
        return 0 if entry is None else entry >> _COUNT_SHIFT

    def _count(self, cls: tuple[int, bool, str], *, reused: bool) -> None:
        stats = self._classes.get(cls)
        if stats is None:
            stats = self._classes[cls] = [0.0, 0.0]
        stats[0] *= _COUNT_DECAY
        stats[1] *= _COUNT_DECAY
        stats[0 if reused else 1] += 1.0
        self._version += 1

    def p_first(self, rec: PageRec) -> float:
        """p(reuse) of a page seen once so far, for Φ's probation term: its class's
        (depth, not reused, tag), raised to that of any deeper class with counts.

        A page is reused only with its prefix, so along a chain p can only fall with
        depth; the classes pool different chains, and a deeper class measured above a
        shallower one would rank a chain's pages above their parents. DRAM's order then
        led with parents that cannot go before their children (`kvstore sim --generate
        long-docs`: 47 entries scanned per block access, 17,000 accesses/s; 27,000 with
        the classes raised, and the suite's verdicts as good: docs/tiering.md)."""
        return self._p_first_bucket(depth_bucket(rec.depth), rec.tag)

    def _p_first_bucket(self, bucket: int, tag: str) -> float:
        best = self._p_class(bucket, False, tag)
        for deeper in range(bucket + 1, _DEPTH_BUCKETS):
            if (deeper, False, tag) in self._classes:  # a class without counts raises nothing
                best = max(best, self._p_class(deeper, False, tag))
        return best

    def log_p_first(self, rec: PageRec, floor: float) -> float:
        """ln max(``p_first(rec)``, ``floor``), the same float, cached per class until
        the estimator's counts next change (Φ's probation term, read at every entry
        an eviction scan visits)."""
        if self._log_p_at != self._version:
            self._log_p.clear()
            self._log_p_at = self._version
        depth = rec.depth
        key = (_BUCKET_OF[depth] if depth < _BUCKET_TABLE else _DEPTH_BUCKETS - 1, rec.tag)
        value = self._log_p.get(key)
        if value is None:
            p = self._p_first_bucket(key[0], key[1])
            value = self._log_p[key] = math.log(max(p, floor))
        return value

    def p(self, depth: int, reused: bool, tag: str) -> float:
        bucket = _BUCKET_OF[depth] if depth < _BUCKET_TABLE else _DEPTH_BUCKETS - 1
        return self._p_class(bucket, reused, tag)  # depth_bucket, by its table

    def _p_class(self, bucket: int, reused: bool, tag: str) -> float:
        """The Beta-smoothed p of one class (the prior's mean without counts)."""
        stats = self._classes.get((bucket, reused, tag))
        a, b = self._prior
        if stats is None:
            return a / (a + b)
        return (stats[0] + a) / (stats[0] + stats[1] + a + b)

    def to_json(self) -> list[list[object]]:
        return [[c[0], c[1], c[2], s[0], s[1]] for c, s in self._classes.items()]

    def load_json(self, rows: list[list[object]]) -> None:
        for depth, reused, tag, hits, misses in rows:
            self._classes[(int(depth), bool(reused), str(tag))] = [  # type: ignore[call-overload]
                float(hits),  # type: ignore[arg-type]
                float(misses),  # type: ignore[arg-type]
            ]
        self._version += 1


class TauController:
    """τ per tier: the admission bar in seconds saved per byte."""

    __slots__ = ("_gain", "_victim_vd", "initial", "pressure", "tau", "updated_s")

    STEP = 0.1  # gain change per update
    PERIOD_S = 1.0

    def __init__(self, initial: float, *, pressure: bool = True) -> None:
        self.initial = initial
        # False: τ_nvme answers only the DWPD budget; a full NVMe is left to its
        # eviction order (the simulator found the pressure term cost hits, docs/tiering.md).
        self.pressure = pressure
        self.tau = [initial, initial, initial]
        self._victim_vd = [0.0, 0.0, 0.0]
        self._gain = [0.0, 0.0, 0.0]
        self.updated_s = -math.inf

    def on_evict(self, tier: int, vd: float) -> None:
        """A victim of ``tier`` had value density ``vd`` when it went."""
        self._victim_vd[tier] = 0.9 * self._victim_vd[tier] + 0.1 * vd

    def update(
        self,
        now_s: float,
        usage: tuple[float, float, float],
        warn: float,
        low: float,
        write_over_budget: float,
    ) -> bool:
        """Once per PERIOD_S: tighten tiers above ``warn``, relax those below ``low``.
        ``write_over_budget`` is NVMe write rate / budget (0 without a budget)."""
        if now_s - self.updated_s < self.PERIOD_S:
            return False
        self.updated_s = now_s
        # HBM and DRAM keep τ at its initial value: a demotion down the memory tiers
        # costs no wear, and their eviction order already ranks what stays. NVMe's
        # bar rises with its pressure and with writes over the DWPD budget.
        for tier in (NVME,):
            gain = self._gain[tier]
            if self.pressure:
                if usage[tier] >= warn:
                    gain += self.STEP
                elif usage[tier] < low:
                    gain -= self.STEP
            elif write_over_budget <= 1.0:
                gain -= self.STEP  # only the budget moves it: relax while within it
            if write_over_budget > 1.0:
                gain += self.STEP * min(write_over_budget - 1.0, 10.0)
            gain = min(max(gain, 0.0), 2.0 if tier == NVME else 1.0)
            self._gain[tier] = gain
            self.tau[tier] = self.initial + gain * max(self._victim_vd[tier], 0.0)
        return True

    def to_json(self) -> dict[str, list[float]]:
        return {"tau": list(self.tau), "gain": list(self._gain), "victim_vd": self._victim_vd}

    def load_json(self, data: dict[str, list[float]]) -> None:
        self.tau = [float(v) for v in data["tau"]][:3]
        self._gain = [float(v) for v in data["gain"]][:3]
        self._victim_vd = [float(v) for v in data["victim_vd"]][:3]


class Admission:
    """Whether a page may enter a tier."""

    __slots__ = ("_value_density", "mode", "threshold")

    def __init__(
        self,
        mode: str,
        threshold: int,
        value_density: Callable[[PageRec, int], float],
    ) -> None:
        self.mode = mode
        self.threshold = threshold
        self._value_density = value_density

    def admit(self, rec: PageRec, tier: int, seen: int, tau: float) -> bool:
        """Retained pages always enter; HBM always takes a page the engine just
        computed; otherwise the mode decides. Value density gates NVMe only: a
        demotion into DRAM costs no wear, DRAM's order ranks what stays, and a load
        plan decides per hit whether DRAM is worth loading from (docs/tiering.md)."""
        if rec.retained or tier == 0:
            return True
        mode = self.mode
        if mode == "value_density":
            return tier == 1 or self._value_density(rec, tier) >= tau
        if mode == "all":
            return True
        if mode == "freq2":
            return seen >= 2 if tier == NVME else True
        return seen >= self.threshold  # store_threshold:N, both lower tiers


class EvictionOrder(Protocol):
    """The order in which one tier gives up its pages. ``victims`` only chooses:
    the caller removes a victim (``remove``) when it actually leaves the tier."""

    name: str

    def __len__(self) -> int: ...
    def add(self, rec: PageRec) -> None: ...
    def touch(self, rec: PageRec) -> None: ...
    def remove(self, rec: PageRec) -> None: ...
    def victims(self, n: int, eligible: Callable[[PageRec], bool], scan: int) -> list[PageRec]: ...
    def take(self, n: int, eligible: Callable[[PageRec], bool], scan: int) -> list[PageRec]: ...
    def __iter__(self) -> Iterator[PageRec]: ...
    def unordered(self) -> list[PageRec]: ...


# Far below any gap between two requests' access times, far above float rounding.
_DEPTH_TIE_S = 1e-6
# The least p(reuse) Φ's probation term takes (ln 1e-6 ≈ −13.8: a bound, not a rank).
_P_FLOOR = 1e-6
# Φ's hits term counts only where at least this share of a page's reads branched. An
# agent's backtrack makes every page above it shared for good (one branch among the
# session's reads), and a third of a hit, held for the hits' half-life, outranked live
# sessions' pages in HBM and DRAM: `kvstore sim --generate agent` (66% of its accesses
# are to shared pages, the tool prefixes a fraction of them) at `0.01,0.05,0.25`,
# TTFT p50 210.8 -> 192.3 ms with the same hits. Prompts' and documents' pages branch at
# nearly every read and keep their hits whole. Tuning seeds: 51 -> 54 of 75 (at 0.3 also
# 54; at 0.7, 51: `rag` and `system-prompts` lose runs).
_BRANCHED_MIN = 0.5


def _certain(rec: PageRec) -> float:
    """p(reuse) where no estimator is given (the probation term is then off)."""
    return 1.0


class PhiOrder:
    """Φ lowest first, in a lazy heap.

    Φ_i = w1·Recency + w2·log1p(decayed hits) + w3·T_recompute/M_KV − w4·SLO_deficit
    + w_p·ln p(reuse) (docs/tiering.md, "Eviction and placement"), the hits term for
    shared pages only (``PageRec.shared``), the last for pages not yet reused
    (``PageRec.reused`` False; ``reuse_p``: the reuse estimator's p for the page's
    class). Recency is ``last_access_s / recency_scale_s``: a linear decay in time, so
    Φ of an untouched page falls by the same amount for every page and the heap's
    order stays valid between touches. A touch only raises a page's Φ, so an entry is
    re-filed lazily: when it reaches the head with a Φ below its page's current one.
    Hits, cost, deficit and p(reuse) are read when the entry is (re-)filed (a class's
    p that falls later leaves its filed pages where they were until they are re-filed).

    The heap holds bare floats, each filed Φ unique (``_at`` maps it to its page): a
    float compares several times faster than a (Φ, seq, page) tuple, and the pops are
    most of an eviction's cost. A Φ already filed is moved up to the next free float,
    which orders ties by filing, as a sequence number would.
    """

    name = "phi"

    def __init__(
        self,
        weights: tuple[float, float, float, float],
        recency_scale_s: float,
        cost_ratio: Callable[[PageRec], float],
        reuse_weight: float = 0.0,
        reuse_p: Callable[[PageRec], float] | None = None,
    ) -> None:
        self._w = weights
        self._scale = recency_scale_s
        self._cost_ratio = cost_ratio
        # Probation: a page not yet reused ranks lower by w_p·ln p(reuse) of its class.
        self._wp = reuse_weight if reuse_p is not None else 0.0
        self._reuse_p: Callable[[PageRec], float] = reuse_p or _certain
        self._heap: list[float] = []
        # Every filed Φ still in the heap or pending -> its page. An entry is
        # live while its page's ``_member`` value is that Φ; a stale one is dropped
        # when it is popped (or at ``_compact``).
        self._at: dict[float, PageRec] = {}
        self._member: dict[bytes, float] = {}
        # Victims ``victims`` handed out, filed back lazily (before the heap is next
        # read) if still members: most leave the order first, and are then dropped
        # here instead of being pushed now and popped as stale entries later.
        self._pending: list[float] = []
        self._compact_at = 1024  # the heap size at which _compact looks again
        self._score: Callable[[PageRec], float] = self._fast_score() or self.score

    def __len__(self) -> int:
        return len(self._member)

    def _live(self) -> list[tuple[float, PageRec]]:
        if self._pending:
            self._flush()
        member, at = self._member, self._at
        out = []
        for phi in self._heap:
            rec = at[phi]
            if member.get(rec.key) == phi:
                out.append((phi, rec))
        return out

    def __iter__(self) -> Iterator[PageRec]:
        return iter([rec for _, rec in sorted(self._live(), key=lambda e: e[0])])

    def unordered(self) -> list[PageRec]:
        return [rec for _, rec in self._live()]

    def score(self, rec: PageRec) -> float:
        w1, w2, w3, w4 = self._w
        # Pages touched at one instant (a request's blocks): the deeper goes first, so
        # a chain leaves a tier from its tail (vLLM and SGLang free tails first too).
        phi = w1 * (rec.last_access_s - _DEPTH_TIE_S * rec.depth) / self._scale
        if rec.shared:
            # Frequency only where the prefix branches (a system prompt, a shared
            # document): a chain re-read by its own next turn is ranked by recency,
            # which its every turn renews (`kvstore sim`: multi-turn vs mixed traces).
            # Scaled by the share of the page's reads that branched: a shared prompt's
            # page that branches at nearly every read counts all of its hits; a page
            # where fewer than half of the reads branched (a session's page after a
            # backtrack) counts none: see _BRANCHED_MIN.
            hits, reads = rec.hits, rec.reads
            if reads > hits:
                share = hits / reads
                hits = hits * share if share >= _BRANCHED_MIN else 0.0
            phi += w2 * math.log1p(hits)
        if w3:
            ratio = rec.cost_ratio  # the manager's cache (full pages); -1: ask it
            phi += w3 * (ratio if ratio >= 0 else self._cost_ratio(rec))
        if w4 and rec.deadline_s is not None and rec.last_access_s > rec.deadline_s:
            phi -= w4 * (rec.last_access_s - rec.deadline_s) / self._scale
        if self._wp and not rec.reused:
            phi += self._wp * math.log(max(self._reuse_p(rec), _P_FLOOR))
        return phi

    def _fast_score(self) -> Callable[[PageRec], float] | None:
        """``score`` as a closure over the weights when the cost term is off: the same
        arithmetic, in the same order, without the general one's attribute reads (it
        runs for every entry a scan visits)."""
        if type(self).score is not PhiOrder.score:
            return None  # LRUOrder or another override: its own score
        w1, w2, w3, w4 = self._w
        if w3:
            return None
        scale = self._scale
        log1p, log = math.log1p, math.log
        tie = _DEPTH_TIE_S
        branched_min = _BRANCHED_MIN
        wp, reuse_p, floor = self._wp, self._reuse_p, _P_FLOOR
        # The manager's estimator: its cached ln p of the class (the same float).
        estimator = getattr(reuse_p, "__self__", None)
        log_p: Callable[[PageRec, float], float] | None = None
        if getattr(reuse_p, "__func__", None) is ReuseEstimator.p_first:
            assert isinstance(estimator, ReuseEstimator)
            log_p = estimator.log_p_first

        def fast(rec: PageRec) -> float:
            last = rec.last_access_s
            phi = w1 * (last - tie * rec.depth) / scale
            if rec.shared:
                hits, reads = rec.hits, rec.reads
                if reads > hits:
                    share = hits / reads
                    hits = hits * share if share >= branched_min else 0.0
                phi += w2 * log1p(hits)
            if w4:
                deadline = rec.deadline_s
                if deadline is not None and last > deadline:
                    phi -= w4 * (last - deadline) / scale
            if wp and not rec.reused:
                if log_p is not None:
                    phi += wp * log_p(rec, floor)
                else:
                    phi += wp * log(max(reuse_p(rec), floor))
            return phi

        return fast

    def _file(self, rec: PageRec, phi: float) -> None:
        at = self._at
        while phi in at:  # taken (ties: the later filing goes after)
            phi = math.nextafter(phi, math.inf)
        at[phi] = rec
        self._member[rec.key] = phi
        heapq.heappush(self._heap, phi)

    def add(self, rec: PageRec) -> None:
        self._file(rec, self._score(rec))
        if len(self._heap) > self._compact_at:
            self._compact()

    def touch(self, rec: PageRec) -> None:
        """Nothing to do at the access: an entry's rank is checked when it reaches the
        head (``victims`` re-files an entry whose page was touched since it was filed),
        so a lookup or offer pays no heap push per page."""

    def remove(self, rec: PageRec) -> None:
        self._member.pop(rec.key, None)  # its entry goes stale

    def _flush(self) -> None:
        member, at, heap = self._member, self._at, self._heap
        pending, self._pending = self._pending, []
        for phi in pending:
            if member.get(at[phi].key) == phi:
                heapq.heappush(heap, phi)
            else:
                del at[phi]

    def _compact(self) -> None:
        """Drop the stale entries once they are 4x the live ones (the order the heap
        gives is the same with or without them)."""
        member = self._member
        if len(self._heap) <= 4 * len(member) + 1024:
            self._compact_at = len(self._heap) + 1024  # not yet: ask again later
            return
        if self._pending:
            self._flush()
        at = self._at
        self._heap = [phi for phi in self._heap if member.get(at[phi].key) == phi]
        heapq.heapify(self._heap)
        self._at = {phi: at[phi] for phi in self._heap}
        self._compact_at = 4 * len(member) + 1024

    def victims(self, n: int, eligible: Callable[[PageRec], bool], scan: int) -> list[PageRec]:
        return self.take(n, eligible, scan, True)

    def take(
        self,
        n: int,
        eligible: Callable[[PageRec], bool],
        scan: int,
        refile_victims: bool = False,
    ) -> list[PageRec]:
        """``victims`` for a caller that removes every one before it next asks this
        order anything: their heap entries are not filed back, which spares a push now
        and the pop of a stale entry later (the member map still holds them until
        ``remove``). ``refile_victims``: ``victims`` (they are filed back)."""
        if self._pending:
            self._flush()
        out: list[PageRec] = []
        if n <= 0:
            return out
        heap = self._heap
        at = self._at
        member_phi = self._member.get
        score = self._score
        pop, push = heapq.heappop, heapq.heappush
        kept: list[float] = []
        while heap and scan > 0:
            phi = pop(heap)
            rec = at[phi]
            if member_phi(rec.key) != phi:
                del at[phi]
                continue  # stale: removed (or re-filed) since
            scan -= 1
            current = score(rec)
            if current > phi:
                # Touched since it was filed: re-file it at its rank now.
                del at[phi]
                self._file(rec, current)
                continue
            if eligible(rec):
                out.append(rec)
                if refile_victims:
                    self._pending.append(phi)
                else:
                    del at[phi]
                if len(out) >= n:
                    break
                continue
            kept.append(phi)
        for phi in kept:
            push(heap, phi)
        return out


class LRUOrder(PhiOrder):
    """Least recently used first: Φ with recency alone (ties: the older entry first).

    A heap keyed by the last access rather than a linked list, so that a page that
    leaves the order (it gained a resident child) and comes back keeps its rank.
    """

    name = "lru"

    def __init__(self) -> None:
        super().__init__((1.0, 0.0, 0.0, 0.0), 1.0, lambda rec: 0.0)

    def score(self, rec: PageRec) -> float:
        return rec.last_access_s - _DEPTH_TIE_S * rec.depth


class ARCOrder:
    """Adaptive replacement (Megiddo & Modha): recency list T1, frequency list T2,
    ghost lists B1/B2 that move the target size p of T1."""

    name = "arc"

    def __init__(self) -> None:
        self._t1: OrderedDict[bytes, PageRec] = OrderedDict()
        self._t2: OrderedDict[bytes, PageRec] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._p = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __iter__(self) -> Iterator[PageRec]:
        return iter(self.unordered())

    def unordered(self) -> list[PageRec]:
        return [*self._t1.values(), *self._t2.values()]

    def add(self, rec: PageRec) -> None:
        key = rec.key
        size = max(len(self), 1)
        if key in self._b1:
            self._p = min(self._p + max(1.0, len(self._b2) / max(len(self._b1), 1)), size)
            del self._b1[key]
            self._t2[key] = rec
        elif key in self._b2:
            self._p = max(self._p - max(1.0, len(self._b1) / max(len(self._b2), 1)), 0.0)
            del self._b2[key]
            self._t2[key] = rec
        elif key in self._t1 or key in self._t2:
            self.touch(rec)
        else:
            self._t1[key] = rec

    def touch(self, rec: PageRec) -> None:
        key = rec.key
        if self._t1.pop(key, None) is not None:
            self._t2[key] = rec
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, rec: PageRec) -> None:
        """The page left the tier: remember it in the ghost list of where it was."""
        key = rec.key
        if self._t1.pop(key, None) is not None:
            self._b1[key] = None
        elif self._t2.pop(key, None) is not None:
            self._b2[key] = None
        else:
            return
        limit = max(len(self), 64)
        for ghosts in (self._b1, self._b2):
            while len(ghosts) > limit:
                ghosts.popitem(last=False)

    def victims(self, n: int, eligible: Callable[[PageRec], bool], scan: int) -> list[PageRec]:
        out: list[PageRec] = []
        first, second = (
            (self._t1, self._t2)
            if len(self._t1) > self._p or not self._t2
            else (self._t2, self._t1)
        )
        for pages in (first, second):
            for rec in itertools.islice(pages.values(), scan):
                if eligible(rec):
                    out.append(rec)
                    if len(out) >= n:
                        return out
        return out

    def take(self, n: int, eligible: Callable[[PageRec], bool], scan: int) -> list[PageRec]:
        return self.victims(n, eligible, scan)


def make_order(
    name: str,
    weights: tuple[float, float, float, float],
    recency_scale_s: float,
    cost_ratio: Callable[[PageRec], float],
    reuse_weight: float = 0.0,
    reuse_p: Callable[[PageRec], float] | None = None,
) -> EvictionOrder:
    if name == "lru":
        return LRUOrder()
    if name == "arc":
        return ARCOrder()
    if name == "phi":
        return PhiOrder(weights, recency_scale_s, cost_ratio, reuse_weight, reuse_p)
    raise ValueError(f"unknown eviction policy {name!r}; known: phi, lru, arc")
