"""NVMe admission by measured payoff: write a class of pages only while it pays.

Every NVMe write wears the drive; it pays when the page is read back from NVMe
before it leaves. ``WritePayoff`` measures that online, per class of page (seen once
when it leaves DRAM, or seen again: a reuse already observed), and keeps each class's
gate open while its measured payoff is at least ``threshold`` (docs/tiering.md,
"Admission by payoff"):

- an open class is judged by its writes: a written page read back from NVMe pays; one
  deleted from NVMe unread, or still unread after as many later writes as NVMe holds
  pages, did not;
- a closed class is judged by ghosts: a page dropped from DRAM because its class was
  closed is remembered (a FIFO as long as NVMe holds pages); asked for again while
  remembered, it would have paid; falling out unasked, it would not have.

Both sides count the same event (a read-back before the page would have left NVMe),
so the gate can open and close on evidence alone. The counts decay (``_DECAY`` per
settled page): the gate follows a workload that changes. A class opens at
``threshold`` with at least ``_MIN_PAID`` read-backs behind it, on at least two
occasions (``_MIN_OCCASIONS``: a lookup that finds ghosts, or a run of read-backs with
no other event of the gate between them), and closes below ``threshold * _CLOSE``: no
flapping on a class at the bar, and no class opened by one page, or one document,
asked for again.

The prior is a frequency filter: pages seen again are admitted, pages seen once are
not until their ghosts show they would be read back. State under the manager's lock.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["ONCE", "REUSED", "WritePayoff"]

ONCE, REUSED = 0, 1  # the classes: seen once when leaving DRAM, or seen again
# Per settled page: the evidence of the last ~2,000 pages per class. (~500 closed
# `long-prompts`' seen-once class between two bursts of read-backs, each a long prompt
# re-read, though 2% of its writes were read back: tuning seeds, 47 -> 49 of 72 with
# the two occasions below.)
_DECAY = 0.9995
_MIN_EVIDENCE = 16.0  # settled pages (decayed) before a class's gate may move
_CLOSE = 0.5  # a class closes below threshold x this (opens at the threshold)
# A closed class opens only on this many read-backs (decayed) as well: at a bar of
# 0.001 a single ghost asked again among hundreds met the share, and the class then
# wrote until NVMe turned over before a write could count as unpaid (`kvstore sim
# --generate long-docs` at 0.005,0.02,0.1: 7,714 writes after one read-back).
_MIN_PAID = 3.0
# ... and on two occasions at least (decayed: the earlier within ~1,400 settled pages of
# the later). One lookup found four ghosts of one document in `long-docs` seed 2 at
# 0.005,0.02,0.1, the class opened, and it wrote 8,400 pages nobody read back
# (`kvstore sim --generate long-docs`: the peers near it write 48).
_MIN_OCCASIONS = 1.5
_PRIOR = (False, True)  # gates at open: seen once closed, seen again open


class WritePayoff:
    """Per class: the gate, and the decayed paid / unpaid counts behind it."""

    __slots__ = (
        "_capacity",
        "_ghosts",
        "_in_occasion",
        "_occasions",
        "_paid",
        "_unpaid",
        "_written",
        "changes",
        "open",
        "threshold",
    )

    def __init__(self, threshold: float, horizon_pages: int) -> None:
        self.threshold = threshold
        self._capacity = max(horizon_pages, 1)
        self.open = list(_PRIOR)  # the prior: write pages seen again, not the others
        self._paid = [0.0, 0.0]
        self._unpaid = [0.0, 0.0]
        self._occasions = [0.0, 0.0]  # decayed, as the counts: times read-backs came
        # Bit per class: the last events of the gate were read-backs of it (a run goes on).
        self._in_occasion = 0
        # Written and not yet read back, oldest first: key -> class.
        self._written: OrderedDict[bytes, int] = OrderedDict()
        # Dropped from DRAM unwritten (class closed), oldest first: key -> class.
        self._ghosts: OrderedDict[bytes, int] = OrderedDict()
        self.changes = 0  # gate moves so far (the manager's admission epoch follows)

    @staticmethod
    def horizon(nvme_pages: int) -> int:
        """How many later writes (and drops) a write (a ghost) waits to be read back:
        as many as NVMe holds pages (a page still unread then would have left it),
        at most 4 Mi (the ghosts' memory)."""
        return min(nvme_pages, 1 << 22)

    def has_ghosts(self) -> bool:
        return bool(self._ghosts)

    def admits(self, seen: int) -> bool:
        return self.open[REUSED if seen > 1 else ONCE]

    def payoff(self, cls: int) -> float:
        """Read-backs per settled page of ``cls`` (0.0 without evidence)."""
        total = self._paid[cls] + self._unpaid[cls]
        return self._paid[cls] / total if total else 0.0

    # -- events ----------------------------------------------------------------

    def written(self, key: bytes, seen: int) -> None:
        """A page reached NVMe."""
        self._in_occasion = 0
        written = self._written
        written[key] = REUSED if seen > 1 else ONCE
        written.move_to_end(key)
        self._ghosts.pop(key, None)
        while len(written) > self._capacity:  # as many later writes as NVMe holds
            _, cls = written.popitem(last=False)
            self._settle(cls, paid=False)

    def read_back(self, key: bytes) -> None:
        """A page was read from NVMe (a load, a prefetch, a warm-up)."""
        cls = self._written.pop(key, None)
        if cls is not None:
            self._settle(cls, paid=True)

    def deleted(self, key: bytes) -> None:
        """A page left NVMe (evicted or failed)."""
        self._in_occasion = 0
        cls = self._written.pop(key, None)
        if cls is not None:
            self._settle(cls, paid=False)

    def declined(self, key: bytes, seen: int) -> None:
        """A dirty page left DRAM unwritten because its class was closed."""
        self._in_occasion = 0
        ghosts = self._ghosts
        ghosts[key] = REUSED if seen > 1 else ONCE
        ghosts.move_to_end(key)
        while len(ghosts) > self._capacity:
            _, cls = ghosts.popitem(last=False)
            self._settle(cls, paid=False)

    def missed(self, keys: list[bytes]) -> None:
        """``keys`` were asked for and found nowhere, in prefix order: the ghosts among
        their head would have been NVMe hits (one occasion, however many)."""
        ghosts = self._ghosts
        if not ghosts:
            return
        self._in_occasion = 0
        for key in keys:
            cls = ghosts.pop(key, None)
            if cls is None:
                return
            self._settle(cls, paid=True)

    def _settle(self, cls: int, *, paid: bool) -> None:
        paid_counts, unpaid_counts, occasions = self._paid, self._unpaid, self._occasions
        occasions[cls] *= _DECAY
        if paid and not self._in_occasion >> cls & 1:
            occasions[cls] += 1.0
            self._in_occasion |= 1 << cls
        paid_counts[cls] = paid_counts[cls] * _DECAY + (1.0 if paid else 0.0)
        unpaid_counts[cls] = unpaid_counts[cls] * _DECAY + (0.0 if paid else 1.0)
        total = paid_counts[cls] + unpaid_counts[cls]
        if total < _MIN_EVIDENCE:
            return
        share = paid_counts[cls] / total
        was = self.open[cls]
        if was:
            now = share >= self.threshold * _CLOSE
        else:
            now = (
                share >= self.threshold
                and paid_counts[cls] >= _MIN_PAID
                and occasions[cls] >= _MIN_OCCASIONS
            )
        if now != was:
            self.open[cls] = now
            self.changes += 1

    # -- persistence ----------------------------------------------------------------

    def to_json(self) -> dict[str, list[float]]:
        return {
            "open": [float(o) for o in self.open],
            "paid": list(self._paid),
            "unpaid": list(self._unpaid),
            "occasions": list(self._occasions),
        }

    def load_json(self, data: dict[str, list[float]]) -> None:
        self.open = [bool(v) for v in data["open"]][:2]
        self.changes += 1  # cached admissions follow the loaded gates
        self._paid = [float(v) for v in data["paid"]][:2]
        self._unpaid = [float(v) for v in data["unpaid"]][:2]
        # Optional (files written before the occasions were counted): none yet.
        self._occasions = [float(v) for v in data.get("occasions", [0.0, 0.0])][:2]
