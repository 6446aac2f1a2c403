"""DWPD budget: a token bucket that admits puts while the store's writes stay within
``max_dwpd`` drive writes per day.

Tokens are bytes. They refill at ``max_dwpd x drive capacity / 86400`` bytes per
second up to ``burst_bytes``. Every byte the store writes is charged, whatever its
kind (payload, record overhead, WAL, GC copies, index, telemetry): the charge is
read from the store-bytes counter at each admission, so writes nobody can decline
(GC, checkpoints) still spend the budget and later puts pay for them. A put is
admitted when the tokens cover its record; otherwise ``put`` returns False and
the decline is counted. Admission never waits and never raises. An admitted
record is charged when admitted (so concurrent batches cannot spend the same
tokens) and not again when the counter shows it written.

Not thread-safe: the store calls ``admit`` under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["DwpdBudget"]

DAY_S = 86_400.0


class DwpdBudget:
    """Admission by a byte token bucket; ``clock`` is seconds (injectable for tests)."""

    def __init__(
        self,
        *,
        max_dwpd: float,
        capacity_bytes: int,
        burst_s: float,
        clock: Callable[[], float],
        min_burst_bytes: int = 0,
        written_bytes: int = 0,
    ) -> None:
        if max_dwpd <= 0 or capacity_bytes <= 0:
            raise ValueError("max_dwpd and the drive capacity must be positive")
        self.max_dwpd = max_dwpd
        self.rate_bytes_per_s = max_dwpd * capacity_bytes / DAY_S
        self.burst_bytes = max(self.rate_bytes_per_s * burst_s, float(min_burst_bytes))
        self.clock = clock
        self.tokens = self.burst_bytes
        self._last_s = clock()
        self._last_written = written_bytes
        self._precharged = 0  # admitted record bytes not yet seen in the counter

    def admit(self, spans: Sequence[int], written_bytes: int) -> list[bool]:
        """Which of ``spans`` (record bytes of each put) to admit, in order.

        An admitted span is charged at once (it will be written); ``written_bytes`` is
        the store-bytes counter now, and what it grew by since the last call beyond
        the spans already charged (WAL, GC, index, telemetry) is charged too.
        """
        now = self.clock()
        growth = written_bytes - self._last_written
        self._last_written = written_bytes
        covered = min(growth, self._precharged)
        self._precharged -= covered
        self.tokens -= growth - covered
        elapsed = max(0.0, now - self._last_s)
        self._last_s = now
        self.tokens = min(self.burst_bytes, self.tokens + elapsed * self.rate_bytes_per_s)
        admitted = []
        for span in spans:
            ok = self.tokens >= span
            if ok:
                self.tokens -= span
                self._precharged += span
            admitted.append(ok)
        return admitted
