"""NVMe admission against the page a write would displace, switched on by measurement.

A write into a full NVMe deletes NVMe's lowest-ranked page. Where NVMe's pages are a
popular few (documents many users read) and the pages leaving DRAM a torrent seen
once, every such write trades a page that will be read again for one that will not.
``Displacement`` counts how often each page was asked for lately in a count-min
sketch (``FrequencySketch``: TinyLFU's, Einziger, Friedman and Manes, "TinyLFU: A
Highly Efficient Cache Admission Policy", 2017) and, while its rule is on, admits a
write into a full NVMe only if the page was asked for more often than the victim it
would displace and at least twice (docs/tiering.md, "Admission against the displaced
page").

The same rule loses where new pages are what the next requests want: a session's
newest turn has been asked for once, the pages of sessions that ended many times. So
it is measured, not tuned: two miniature models of NVMe (LRU sets of keys as large
as NVMe, over a hash sample of the keys where NVMe is large) take the same
candidates (every page written to NVMe, every page the rule kept out) and the same
lookups; one admits every candidate, the other applies the rule against its own LRU
victim. A lookup of a page that neither HBM nor DRAM holds is a hit of each model
holding it. The rule turns on when the filtered model's hits (decayed) exceed the
other's by ``_ON`` and off when they no longer exceed them: a workload that changes
moves it back.

Deterministic for a trace (xxh3 of the key, no process-seeded hash). State under the
manager's lock; nothing of it is persisted (after a restart the rule starts off and
the sketch and models fill again).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from xxhash import xxh3_64_intdigest

__all__ = ["Displacement", "FrequencySketch"]

_ROWS = 4
_MAX_COUNT = 15  # four-bit counters, as TinyLFU's: the rule compares small counts
_HALF = bytes(i >> 1 for i in range(256))  # every counter halved (bytes.translate)
# The sketch halves its counters after this many additions per page of cache: how
# far back "lately" reaches (TinyLFU's sample size, W = 10 x the cache).
_PERIOD_PER_PAGE = 10
# The models hold at most this many keys each; above it they take a hash sample of
# 1/2, 1/4, ... of the keys, and NVMe's pages in the same proportion.
_SHADOW_MAX_PAGES = 1 << 15
# The rule turns on when the filtered model's hits exceed the unfiltered one's by this
# factor, and off when they no longer exceed them.
_ON = 1.05
_OFF = 1.0
_DECAY = 0.999  # per model hit: the evidence of the last ~1,000 hits
_MIN_EVIDENCE = 32.0  # model hits (decayed) before the rule may move


class FrequencySketch:
    """How often each key was counted lately: a count-min sketch of four rows of
    four-bit counters, every counter halved after ``10 x pages`` additions (the
    period), each row as wide as the period (a power of two, 1 Ki to 16 Mi: a row of
    counters per addition keeps the keys counted once, most of them, from sharing a
    counter with a page counted often). Conservative update: an addition raises only
    the counters at the key's least."""

    __slots__ = ("_additions", "_mask", "_period", "_rows")

    def __init__(self, pages: int) -> None:
        self._period = _PERIOD_PER_PAGE * max(pages, 1)
        width = 1 << max(10, min(24, (self._period - 1).bit_length()))
        self._mask = width - 1
        self._rows = [bytearray(width) for _ in range(_ROWS)]
        self._additions = 0

    def _slots(self, h: int) -> tuple[int, int, int, int]:
        # Four indexes from one 64-bit hash (Kirsch and Mitzenmacher's double hashing).
        mask = self._mask
        h1 = h & 0xFFFFFFFF
        h2 = (h >> 32) | 1
        return h1 & mask, (h1 + h2) & mask, (h1 + 2 * h2) & mask, (h1 + 3 * h2) & mask

    def add_hashed(self, h: int) -> None:
        """Count one access of the key whose xxh3-64 is ``h``."""
        r0, r1, r2, r3 = self._rows
        i0, i1, i2, i3 = self._slots(h)
        least = min(r0[i0], r1[i1], r2[i2], r3[i3])
        if least < _MAX_COUNT:
            if r0[i0] == least:
                r0[i0] = least + 1
            if r1[i1] == least:
                r1[i1] = least + 1
            if r2[i2] == least:
                r2[i2] = least + 1
            if r3[i3] == least:
                r3[i3] = least + 1
        self._additions += 1
        if self._additions >= self._period:
            self._age()

    def add(self, key: bytes) -> None:
        self.add_hashed(xxh3_64_intdigest(key))

    def estimate(self, key: bytes) -> int:
        """The key's count (never below the truth, above it only by collisions)."""
        h = xxh3_64_intdigest(key)
        return min(row[i] for row, i in zip(self._rows, self._slots(h), strict=True))

    def _age(self) -> None:
        for row in self._rows:
            row[:] = row.translate(_HALF)
        self._additions //= 2


class _Model:
    """A miniature NVMe: an LRU set of (sampled) keys, ``capacity`` of them."""

    __slots__ = ("capacity", "hits", "keys")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[bytes, None] = OrderedDict()
        self.hits = 0.0


class Displacement:
    """The rule (``admits``), its sketch, and the two models that switch it."""

    __slots__ = ("_filtered", "_plain", "_sample_mask", "moves", "on", "sketch")

    def __init__(self, nvme_pages: int, cache_pages: int) -> None:
        self.sketch = FrequencySketch(cache_pages)
        shift = 0
        while (max(nvme_pages, 1) >> shift) > _SHADOW_MAX_PAGES:
            shift += 1
        self._sample_mask = (1 << shift) - 1  # a key is modelled when its hash's top bits are 0
        capacity = max(1, nvme_pages >> shift)
        self._plain = _Model(capacity)  # admits every candidate
        self._filtered = _Model(capacity)  # applies the rule against its LRU victim
        self.on = False
        self.moves = 0  # how often the rule turned on or off

    def _sampled(self, h: int) -> bool:
        return not (h >> 40) & self._sample_mask

    # -- what the manager tells it --------------------------------------------------

    def counted(self, key: bytes) -> None:
        """An offer's page the reuse estimator counted (not a lookup's page again)."""
        self.sketch.add(key)

    def looked_up(self, walked: Iterable[bytes], above_nvme: Callable[[bytes], bool]) -> None:
        """A lookup's walked keys (its hit prefix and first miss, as the reuse estimator
        counts them): each counts once, and each that HBM and DRAM do not hold
        (``above_nvme`` False) is a hit of the models holding it.

        The models see the manager's own prefix only: a page past the manager's first
        miss is not looked up, so the evidence leans toward the rule's current state
        (docs/tiering.md, "Admission against the displaced page", measured both ways)."""
        add = self.sketch.add_hashed
        plain, filtered = self._plain, self._filtered
        plain_keys, filtered_keys = plain.keys, filtered.keys
        sample_mask = self._sample_mask
        for key in walked:
            h = xxh3_64_intdigest(key)
            add(h)
            if (sample_mask and (h >> 40) & sample_mask) or above_nvme(key):
                continue
            in_plain = key in plain_keys
            in_filtered = key in filtered_keys
            if not (in_plain or in_filtered):
                continue
            plain.hits *= _DECAY
            filtered.hits *= _DECAY
            if in_plain:
                plain.hits += 1.0
                plain_keys.move_to_end(key)
            if in_filtered:
                filtered.hits += 1.0
                filtered_keys.move_to_end(key)
            self._judge()

    def candidate(self, key: bytes) -> None:
        """A page that left DRAM for NVMe, or that the rule kept out: both models see it."""
        h = xxh3_64_intdigest(key)
        if not self._sampled(h):
            return
        plain = self._plain.keys
        if key in plain:
            plain.move_to_end(key)
        else:
            plain[key] = None
            if len(plain) > self._plain.capacity:
                plain.popitem(last=False)
        filtered = self._filtered.keys
        if key in filtered:
            filtered.move_to_end(key)
        elif len(filtered) < self._filtered.capacity:
            filtered[key] = None
        else:
            victim = next(iter(filtered))
            if self._beats(key, victim):
                filtered.popitem(last=False)
                filtered[key] = None

    # -- the rule ---------------------------------------------------------------------

    def admits(self, key: bytes, victim: bytes) -> bool:
        """Whether a write of ``key`` into a full NVMe may displace ``victim``: always
        while the rule is off, else only a page asked for at least twice lately and
        more often than the victim."""
        return not self.on or self._beats(key, victim)

    def _beats(self, key: bytes, victim: bytes) -> bool:
        """The rule's test, in NVMe and in the filtered model alike."""
        count = self.sketch.estimate(key)
        # A page asked for once is the torrent's: it does not replace even a page no
        # one asked for lately (which may be a document read again after a while).
        return count >= 2 and count > self.sketch.estimate(victim)

    def model_hits(self) -> tuple[float, float]:
        """(unfiltered, filtered) models' hits, decayed: the evidence behind ``on``."""
        return self._plain.hits, self._filtered.hits

    def summary(self) -> dict[str, object]:
        """What ``TierStats.nvme_displacement`` reports."""
        return {
            "on": self.on,
            "moves": self.moves,
            "model_hits": [round(self._plain.hits, 3), round(self._filtered.hits, 3)],
        }

    def _judge(self) -> None:
        plain, filtered = self._plain.hits, self._filtered.hits
        if plain + filtered < _MIN_EVIDENCE:
            return
        now = filtered > (_OFF if self.on else _ON) * plain
        if now != self.on:
            self.on = now
            self.moves += 1
