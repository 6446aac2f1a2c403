"""Eviction policies and their registry.

A policy sees every put, read and delete of a page and answers two questions
when the store must make room:

- ``choose_segment``: which sealed segment to empty next (a policy that keeps
  segments whole, like FIFO, makes eviction nearly free of copying);
- ``keep``: for each live page in that segment, relocate it (True) or evict it.

Pages that are pinned or retained are never offered for eviction; the store
relocates retained pages and skips segments that hold pinned ones.

Page-granular policies (LRU, the cost-aware score) also rank individual
pages: ``victims`` names the pages to evict first, wherever they live; the
store then compacts the segments those evictions left sparse.

Register a new policy with ``@register_policy("name")``; choose one with
``KVStore.open(..., eviction_policy="name")``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "POLICIES",
    "CostAwarePolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "SegmentFIFOPolicy",
    "SegmentView",
    "make_policy",
    "register_policy",
]


@dataclass(frozen=True, slots=True)
class SegmentView:
    """What a policy may know about a sealed segment when choosing one."""

    segment_id: int
    live_bytes: int
    live_pages: int
    created_unix_ns: int
    has_pins: bool


class EvictionPolicy:
    """Base class: segment-FIFO order, evict everything not retained."""

    name: ClassVar[str] = "base"
    page_granular: ClassVar[bool] = False

    def on_put(self, key: bytes, size_bytes: int, meta: Mapping[str, Any]) -> None:
        """A page was stored (or overwritten)."""

    def on_read(self, key: bytes) -> None:
        """A page was read."""

    def on_delete(self, key: bytes) -> None:
        """A page was deleted or evicted."""

    def choose_segment(self, segments: list[SegmentView]) -> int | None:
        """The segment to empty next, or None. Default: the oldest without pins."""
        candidates = [view for view in segments if not view.has_pins]
        if not candidates:
            return None
        return min(candidates, key=lambda view: view.segment_id).segment_id

    def keep(self, key: bytes) -> bool:
        """Relocate this live page out of the victim segment instead of evicting it."""
        return False

    def victims(self, candidates: Iterable[bytes], count: int) -> list[bytes]:
        """Page-granular policies: up to ``count`` keys to evict first.

        Unlike the other methods (called under the store's lock), this one runs
        without it, since ranking every page may take a while: ``on_put``,
        ``on_read`` and ``on_delete`` may change the policy's state meanwhile, so
        iterate over a copy of it.
        """
        return []


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {}


def register_policy(name: str) -> Callable[[type[EvictionPolicy]], type[EvictionPolicy]]:
    def decorate(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        if name in POLICIES:
            raise ValueError(f"eviction policy {name!r} is already registered")
        cls.name = name
        POLICIES[name] = cls
        return cls

    return decorate


def make_policy(name: str) -> EvictionPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; registered: {', '.join(sorted(POLICIES))}"
        ) from None
    return factory()


@register_policy("fifo")
class SegmentFIFOPolicy(EvictionPolicy):
    """Segment FIFO with reinsertion of pages read since they were written.

    Flash friendly: the oldest segment is emptied whole, so eviction costs no
    copying except for pages that proved hot (read at least once since their
    last write or reinsertion); those are copied forward once and lose their
    mark, like CLOCK's second chance.
    """

    def __init__(self) -> None:
        self._referenced: set[bytes] = set()

    def on_put(self, key: bytes, size_bytes: int, meta: Mapping[str, Any]) -> None:
        self._referenced.discard(key)

    def on_read(self, key: bytes) -> None:
        self._referenced.add(key)

    def on_delete(self, key: bytes) -> None:
        self._referenced.discard(key)

    def keep(self, key: bytes) -> bool:
        if key in self._referenced:
            self._referenced.discard(key)
            return True
        return False


@register_policy("lru")
class LRUPolicy(EvictionPolicy):
    """Least recently used pages go first, wherever they live.

    Page granular: evictions leave holes in many segments, which compaction
    must copy out, so expect higher write amplification than FIFO.
    """

    page_granular = True

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def _touch(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_put(self, key: bytes, size_bytes: int, meta: Mapping[str, Any]) -> None:
        self._touch(key)

    def on_read(self, key: bytes) -> None:
        self._touch(key)

    def on_delete(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victims(self, candidates: Iterable[bytes], count: int) -> list[bytes]:
        # Keys never seen since open (from an earlier run) count as oldest.
        allowed = set(candidates)
        order = list(self._order)  # one C-level copy: on_read() may run meanwhile
        chosen = [key for key in allowed if key not in self._order]
        chosen = sorted(chosen)[:count]
        for key in order:
            if len(chosen) >= count:
                break
            if key in allowed:
                chosen.append(key)
        return chosen


@register_policy("cost")
class CostAwarePolicy(EvictionPolicy):
    """The score from the design notes; the lowest Φ is evicted first.

    Φ = w1·Recency + w2·RefCount + w3·(T_recompute / M_KV) - w4·SLO_deficit

    - Recency: 1 / (1 + age), age counted in page accesses since the last touch.
    - RefCount: reads since the page was written (how shared it is).
    - T_recompute / M_KV: prefill cost is quadratic in the prefix length, so a
      page whose meta says ``tokens = S`` (its position's prefix length) costs
      S² per byte to recompute; pages without ``tokens`` count as 1 token.
    - SLO_deficit: ``meta["slo_deficit"]`` if the engine supplies it, else 0.
    """

    page_granular = True
    weights: ClassVar[tuple[float, float, float, float]] = (1.0, 0.1, 1.0, 1.0)

    def __init__(self) -> None:
        self._clock = 0
        self._state: dict[bytes, list[float]] = {}  # last_touch, refcount, cost, slo

    def on_put(self, key: bytes, size_bytes: int, meta: Mapping[str, Any]) -> None:
        self._clock += 1
        tokens = meta.get("tokens", 1)
        tokens = float(tokens) if isinstance(tokens, int | float) else 1.0
        slo = meta.get("slo_deficit", 0.0)
        slo = float(slo) if isinstance(slo, int | float) else 0.0
        cost = tokens * tokens / max(size_bytes, 1)
        self._state[key] = [float(self._clock), 0.0, cost, slo]

    def on_read(self, key: bytes) -> None:
        self._clock += 1
        state = self._state.get(key)
        if state is not None:
            state[0] = float(self._clock)
            state[1] += 1.0

    def on_delete(self, key: bytes) -> None:
        self._state.pop(key, None)

    def score(self, key: bytes) -> float:
        state = self._state.get(key)
        if state is None:
            return -math.inf
        last, refcount, cost, slo = state
        w1, w2, w3, w4 = self.weights
        recency = 1.0 / (1.0 + self._clock - last)
        return w1 * recency + w2 * refcount + w3 * cost - w4 * slo

    def victims(self, candidates: Iterable[bytes], count: int) -> list[bytes]:
        return sorted(candidates, key=lambda key: (self.score(key), key))[:count]
