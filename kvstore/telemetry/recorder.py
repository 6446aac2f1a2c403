"""The store's telemetry recorder: one counter vector, its persistence, the throughput
samples and the DWPD budget (docs/operations.md, "Wear and performance").

``KVStore`` counts into ``Recorder.values`` (the one counter vector of
``telemetry.counters``) under its state lock; the recorder loads the vector at open,
saves it through ``IndexEnv.write`` and derives every report from it. ``stats().counters``
is the vector's growth since open (``session_counters``).

Locks: ``persist`` needs the store's checkpoint lock held (it is the only other LMDB
write transaction of the store); every read or write of ``values`` holds the store's
state lock, which the recorder is given and takes itself (innermost, as everywhere).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

from kvstore.config import StoreConfig
from kvstore.errors import KVStoreError
from kvstore.format.constants import record_span
from kvstore.format.names import INDEX_DIR
from kvstore.index.lmdb_env import IndexEnv
from kvstore.telemetry import TelemetrySnapshot, resolve_capacity, snapshot_of
from kvstore.telemetry import counters as tc
from kvstore.telemetry.budget import DwpdBudget

__all__ = ["THROUGHPUT_WINDOWS_S", "Recorder"]

# Throughput windows reported by stats() and the exporter (seconds).
THROUGHPUT_WINDOWS_S = {"10s": 10.0, "1m": 60.0, "5m": 300.0}

_Sample = tuple[float, int, int, int, int, int]


class Recorder:
    """Loads the persisted counters (LMDB ``telemetry`` database) and sets up the wear
    model and the DWPD budget. Never fails an open for a counting problem: such
    problems become ``notes`` (the store adds them to ``recovery_notes``). Raises
    ValueError only for a bad option (``max_dwpd`` without a known drive capacity)."""

    def __init__(
        self,
        root: Path,
        config: StoreConfig,
        env: IndexEnv,
        lock: threading.Lock,
        *,
        readonly: bool,
    ) -> None:
        self._root = root
        self._env = env
        self._lock = lock
        self._readonly = readonly
        self.telemetry = tc.Telemetry(
            config.telemetry_clock or time.time, config.telemetry_retention_hours
        )
        self.notes: list[str] = []  # for recovery_notes, from this open only
        self._db: Any = None
        self._saved: list[int] | None = None
        # The store's gauges (fill levels, a degraded open), saved with the counters so
        # readers beside the writer export them; set once the writer's open is done.
        # Called under the state lock.
        self.gauges_locked: Callable[[], dict[str, float]] | None = None
        self._saved_gauges: dict[str, float] | None = None
        self.last_save = time.monotonic()
        self._samples: deque[_Sample] = deque(maxlen=512)
        try:
            self._db = env.env.open_db(tc.TELEMETRY_DB, create=not readonly)
        except lmdb.NotFoundError:
            self._db = None  # read-only open of a store no writer has counted yet
        except lmdb.Error as e:  # counting must never keep the store from opening
            self._db = None
            self.telemetry.notes.append(f"cannot open the telemetry database: {e}")
        if self._db is not None:
            try:
                self.telemetry.load(env.env, self._db)
            except lmdb.Error as e:
                self.telemetry.notes.append(f"cannot read the counters ({e}); starting at zero")
                self.telemetry.values[:] = [0] * tc.VECTOR_LEN
            self.notes.extend(f"telemetry: {note}" for note in self.telemetry.notes)
        if not readonly:
            self.telemetry.wear = tc.WearSettings(
                config.drive_capacity_bytes or 0,
                config.rated_dwpd or 0.0,
                config.warranty_years or 0.0,
                config.max_dwpd or 0.0,
            )
        self.values = self.telemetry.values  # load() replaced the list; never rebound again
        self._at_open = list(self.values)
        self.drive_capacity, self.capacity_source = resolve_capacity(root, self.telemetry.wear)
        self.budget: DwpdBudget | None = None
        if config.max_dwpd is not None and not readonly:
            if not self.drive_capacity:
                raise ValueError(
                    "max_dwpd needs the drive's capacity, which could not be read: "
                    "set drive_capacity_bytes"
                )
            self.budget = DwpdBudget(
                max_dwpd=config.max_dwpd,
                capacity_bytes=self.drive_capacity,
                burst_s=config.max_dwpd_burst_s,
                clock=self.telemetry.clock,
                min_burst_bytes=record_span(config.max_page_bytes),
                written_bytes=tc.store_bytes(self.values),
            )

    def start_session(self) -> None:
        """Counting for ``session_counters`` starts now (the end of a writer's open)."""
        self._at_open = list(self.values)

    def session_counters(self, stale_reads: int) -> dict[str, int]:
        """``StoreStats.counters``: what this open counted. Caller holds the state lock."""
        now, base = self.values, self._at_open

        def grown(index: int) -> int:
            return now[index] - base[index]

        return {
            "puts": grown(tc.PUTS),
            "host_bytes_written": grown(tc.HOST),
            "segment_bytes_written": grown(tc.HOST) + grown(tc.RECORD_OVERHEAD) + grown(tc.GC_COPY),
            "gets": grown(tc.GETS),
            "hits": grown(tc.HITS),
            "misses": grown(tc.MISSES),
            "bytes_read": grown(tc.READ_BYTES),
            "deletes": grown(tc.DELETES),
            "commits": grown(tc.COMMITS),
            "checkpoints": grown(tc.CHECKPOINTS),
            "gc_bytes_copied": grown(tc.GC_COPY),
            "gc_pages_moved": grown(tc.GC_MOVED_PAGES),
            "segments_freed": grown(tc.SEGMENTS_FREED),
            "wal_bytes_written": grown(tc.WAL),
            "stale_reads": stale_reads,
        }

    def count_commit_locked(self, elapsed_ns: int, wal_bytes: int) -> None:
        """A group commit took ``elapsed_ns`` and appended ``wal_bytes``. Caller holds
        the state lock."""
        tv = self.values
        tv[tc.COMMITS] += 1
        tc.observe(tv, tc.OP_FLUSH, elapsed_ns)
        tv[tc.WAL] += wal_bytes

    # -- the telemetry thread ------------------------------------------------

    def tick(self, interval_s: float, checkpoint_lock: threading.Lock) -> None:
        """One beat of the telemetry thread: a throughput sample, and the counters
        persisted when ``interval_s`` has passed since the last save. Never raises."""
        try:
            with self._lock:
                self._samples.append(self._sample())
            if time.monotonic() - self.last_save >= interval_s:
                with checkpoint_lock:
                    self.persist()
        except Exception as e:  # counting must never stop for good: keep the reason
            self.note(f"the telemetry thread met {type(e).__name__}: {e}")

    def note(self, note: str) -> None:
        if note not in self.telemetry.notes:
            self.telemetry.notes.append(note)

    def persist(self) -> None:
        """Write the counters to LMDB if they changed. Caller holds the store's
        checkpoint lock (so no other LMDB write transaction of the store runs).

        Never raises: a failed save is retried at the next one, and the error is kept
        in the telemetry notes (``kvstore stat`` and ``wear`` show them)."""
        if self._readonly or self._db is None:
            return
        try:
            self._save()
        except (lmdb.Error, OSError, KVStoreError) as e:  # IndexEnv.write: IOFailure
            self.note(f"saving the counters failed: {e}")

    def _save(self) -> None:
        self.last_save = time.monotonic()
        with self._lock:
            snapshot = list(self.values)
            gauges = self.gauges_locked() if self.gauges_locked is not None else None
        # Its own bytes do not count as a change, or an idle store would write forever.
        snapshot_key = snapshot[: tc.TELEMETRY] + snapshot[tc.TELEMETRY + 1 :]
        telemetry = self.telemetry
        if (
            self._saved == snapshot_key
            and gauges == self._saved_gauges
            and (int(telemetry.clock() // tc.SECONDS_PER_HOUR) == telemetry.hour)
        ):
            return
        before = tc.read_io_wchar()
        telemetry.save(self._env.write, self._db, snapshot, telemetry.clock(), gauges)
        after = tc.read_io_wchar()
        self._saved = snapshot_key
        self._saved_gauges = gauges
        if before is not None and after is not None:
            with self._lock:
                self.values[tc.TELEMETRY] += after - before

    # -- reports -------------------------------------------------------------

    def _sample(self) -> _Sample:
        """(time, host bytes, store bytes, bytes read, puts, gets). Caller holds the lock."""
        tv = self.values
        return (
            time.monotonic(),
            tv[tc.HOST],
            tc.store_bytes(tv),
            tv[tc.READ_BYTES],
            tv[tc.PUTS],
            tv[tc.GETS],
        )

    def throughput(self) -> dict[str, dict[str, float]]:
        """Rates over the recent windows, from the telemetry thread's 1 s samples."""
        with self._lock:
            samples = list(self._samples)
            now = self._sample()
        rates: dict[str, dict[str, float]] = {}
        for name, window in THROUGHPUT_WINDOWS_S.items():
            older = [sample for sample in samples if now[0] - sample[0] <= window]
            if not older:
                continue
            first = older[0]
            seconds = now[0] - first[0]
            if seconds <= 0:
                continue
            rates[name] = {
                "seconds": seconds,
                "host_write_bytes_per_s": (now[1] - first[1]) / seconds,
                "store_write_bytes_per_s": (now[2] - first[2]) / seconds,
                "read_bytes_per_s": (now[3] - first[3]) / seconds,
                "puts_per_s": (now[4] - first[4]) / seconds,
                "gets_per_s": (now[5] - first[5]) / seconds,
            }
        return rates

    def snapshot(
        self, values: list[int], gauges: dict[str, float], *, path: str
    ) -> TelemetrySnapshot:
        """The snapshot of ``values`` (a copy taken under the state lock) with the
        store's gauges and the index file's size."""
        index_file = self._root / INDEX_DIR / "data.mdb"
        try:
            gauges["page_table_bytes"] = float(index_file.stat().st_size)
        except OSError:
            pass
        return snapshot_of(
            self.telemetry,
            values,
            path=path,
            capacity_bytes=self.drive_capacity,
            capacity_source=self.capacity_source,
            live=not self._readonly,
            throughput=self.throughput() if not self._readonly else None,
            gauges=gauges,
        )
