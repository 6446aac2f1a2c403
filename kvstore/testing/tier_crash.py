"""Kill -9 workloads for the tier manager (tests/crash/test_kill9_tiering.py).

Importing torch takes seconds on a loaded 2-core machine, so the workloads do not
start a fresh interpreter each: they run in processes forked from one *zygote*
(``tier_crash.py serve``), an interpreter that has imported torch and
kvstore.tiering and done nothing else (no thread started, no torch op run), so a
fork of it is as good as a fresh process. The test's side, ``Zygote``, sends it one
JSON line per workload; the zygote forks, answers ``pid N``, and when the workload
process ends (the test SIGKILLs it) answers ``exit STATUS``.

A workload writes what it knows to a report file, one line per fact, each line with
one ``os.write`` of an ``O_APPEND`` descriptor: a line that was written survives the
kill, and a reader still ignores an unterminated last line.

Workloads (``run_workload``):

``writeback``
    A ``TierManager`` on the CPU with a real NVMe store and a DRAM of 16 pages, so
    pages are written back all the time, offers chains of pages whose bytes derive
    from their keys (``page_bytes``), pacing itself so writes are in flight when the
    kill lands. It reports ``ack KEY...`` for every page it knows is acknowledged on
    NVMe. The store's ``put_many`` (what the mover's write-back calls) returns with
    the pages readable but durable only at the next group commit
    (docs/reliability.md, promise 2: a page is acknowledged once a ``flush()`` that
    began after its put returned has returned). So a page counts as acknowledged
    here once ``tm.store.info(key)`` showed it and then a ``tm.store.flush()``,
    begun after that, returned. That is sound: the store publishes a page to its
    index under the same lock that queues the page's WAL record (``SegmentWriter._complete``),
    so a flush that begins after ``info`` sees the page commits its record.
``stats``
    Saves the manager's statistics (``tiering-stats.json``: temporary file, fsync,
    rename, fsync of the directory) in a loop, changing the page heat between saves.
    Before each save it reports ``begin T`` and after it ``saved T`` (T: the
    snapshot's ``saved_at_unix_s``), so the test knows which files may be on disk.
``replay``
    Replays requests of a generated trace through a manager with HBM, DRAM and NVMe
    (``replay``), reports the hit counts of the measured requests as one JSON line
    and then ``done``, and waits to be killed.

Each workload runs with ``hbm="owned"`` (the manager's own HBM pool, or none) or
``hbm="engine"`` (``hbm_options``): the engine keeps its own GPU cache, which the
workload plays (``EngineHBM``): an offer copies a page into DRAM and sets its HBM
bit, and the engine clears the bit with ``notify_hbm_evicted`` when its cache drops
the page. The manager cannot read the engine's copy, so it must keep a DRAM or NVMe
copy of every page the engine holds. The workloads report what breaks that, and
what breaks the manager's books (``accounting_errors``), as ``bad ...`` lines.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstore.tiering import ModelCost, OfferResult, TierConfig, TierManager
from kvstore.tiering.sim.trace import Request, generate

# The checkout or install that holds this package: the zygote imports the same one.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]

WRITEBACK_PAGE = 16 << 10
STATS_PAGE = 4 << 10
REPLAY_PAGE = 4 << 10
TRACE_KIND = "multi-turn"

HBM_MODES = ("owned", "engine")
ENGINE_HBM_PAGES = 8  # the engine's GPU cache in the write-back and statistics workloads

# Counters of the drops that may take the last copy the manager can read of a page,
# with admission "all" and NVMe unbounded (as here): write pressure, failed copies,
# NVMe capacity. With hbm="engine" a page the engine drops after one of these may be
# gone; after anything else it must still load from DRAM or NVMe.
LOSSY = (
    "evict:nvme:deleted",
    "evict:dram:paced",
    "evict:dram:emergency",
    "emergency_evictions",
    "evict:dram:write_failed",
    "write_failures",
    "offer_failures",
    "read_failures",
    "load_failures",
    "load:no_slot",
)
# hbm="engine" once dropped a page from DRAM (write pacing, NVMe declining it) while
# the engine held it, leaving it in HBM alone, unreadable, its offers answering
# "present" (test_engine_mode_keeps_a_readable_copy_of_every_page_the_engine_holds).
# Fixed: a paced page the engine holds waits, a dropped one is forgotten. With this
# False no page may be in HBM alone.
ENGINE_DRAM_DROP_DEFECT = False
ENGINE_DRAM_DROPS = ("evict:dram:paced", "evict:dram:emergency", "evict:dram:dropped")


# -- pages and configurations ----------------------------------------------------


def page_bytes(key: bytes, size: int) -> bytes:
    """The page stored under ``key``: its bytes follow from the key alone, so a
    checker needs no log of what was written to know what must be read back."""
    return hashlib.shake_128(key).digest(size)


def page_tensor(key: bytes, size: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(page_bytes(key, size)), dtype=torch.uint8)


def tier_config(path: Path, page: int, **overrides: Any) -> TierConfig:
    """A CPU manager on a real store at ``path``: no HBM unless asked, admission
    ``all`` (the test is about what reaches NVMe, not what τ admits), and a compute
    rate so low that loading a hit always beats recomputing it."""
    options: dict[str, Any] = dict(
        device="cpu",
        hbm="owned",
        hbm_bytes=0,
        dram_bytes=16 * page,
        page_bytes=page,
        tokens_per_page=16,
        nvme_path=str(path),
        nvme_options={"segment_bytes": 1 << 20, "gc_interval_s": 0},
        model=ModelCost(1e9, 8, 8, 64, page // 16),
        compute_flops=1e6,
        admission="all",
        hysteresis_s=0.0,
        probe_at_open=False,
        control_interval_s=0.002,
        watermark_low=0.5,
        watermark_warn=0.7,
        watermark_force=0.9,
    )
    options.update(overrides)
    return TierConfig(**options)


def hbm_options(hbm: str, page: int, pages: int = ENGINE_HBM_PAGES) -> dict[str, Any]:
    """``TierConfig`` overrides for an HBM mode: ``"owned"`` changes nothing (the
    workload's own HBM size), ``"engine"`` is the engine's cache of ``pages`` pages."""
    if hbm == "owned":
        return {}
    if hbm == "engine":
        return {"hbm": "engine", "hbm_bytes": pages * page}
    raise ValueError(f"hbm must be one of {HBM_MODES}, got {hbm!r}")


def chain_key(cycle: int, chain: int, index: int) -> bytes:
    return b"c%d.%d.%d" % (cycle, chain, index)


def chain_parent(key: bytes) -> bytes | None:
    """The parent of a ``chain_key``: the previous page of its chain (None: a root)."""
    head, _, index = key.rpartition(b".")
    return None if index == b"0" else head + b".%d" % (int(index) - 1)


# -- the report file ---------------------------------------------------------------


class Report:
    """Lines appended with one ``os.write`` each: what was written survives kill -9."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def line(self, text: str) -> None:
        os.write(self._fd, text.encode() + b"\n")


def read_report(path: Path) -> list[str]:
    """The report's whole lines (an unterminated last line is dropped)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = data.decode(errors="replace").split("\n")
    return lines[:-1]  # the text after the last newline is empty or cut short


# -- hbm="engine": the engine's cache; the manager's books --------------------------


class EngineHBM:
    """An engine's own GPU cache (``hbm="engine"``), as the workloads play it: the
    blocks of what it served (loaded, or offered and accepted), least recently used
    first, at most ``pages``; it reports what it drops past that with
    ``notify_hbm_evicted``. ``lost``: dropped keys the manager could no longer serve
    (no DRAM or NVMe copy) right after the notification."""

    def __init__(self, tm: TierManager, pages: int) -> None:
        self.tm = tm
        self.pages = pages
        self._held: dict[bytes, None] = {}  # an ordered set, least recent first
        self.notified = 0
        self.lost: list[bytes] = []

    def hold(self, keys: Sequence[bytes]) -> None:
        held = self._held
        for key in keys:
            held.pop(key, None)
            held[key] = None
        excess = len(held) - self.pages
        if excess <= 0:
            return
        dropped = list(itertools.islice(held, excess))
        for key in dropped:
            del held[key]
        self.tm.notify_hbm_evicted(dropped)
        self.notified += len(dropped)
        self.lost.extend(k for k in dropped if not servable(self.tm, k))

    def errors(self) -> list[str]:
        """The losses no counted drop explains (see ``LOSSY``)."""
        counters = dict(self.tm._counters)
        drops = sum(counters.get(name, 0) for name in LOSSY)
        if len(self.lost) <= drops:
            return []
        return [
            f"{len(self.lost)} pages lost when the engine dropped them, {drops} counted "
            f"drops (first {self.lost[0]!r}; counters {counters})"
        ]


def accepted(keys: Sequence[bytes], offered: OfferResult) -> list[bytes]:
    """The keys of an offer the manager placed (admitted or already present)."""
    return [k for k, tier in zip(keys, offered.tiers, strict=True) if tier is not None]


def engine_cache(tm: TierManager) -> EngineHBM | None:
    """The engine's cache for a manager with ``hbm="engine"`` (None otherwise): as
    many pages as its ``hbm_bytes`` holds."""
    if tm.config.hbm != "engine":
        return None
    return EngineHBM(tm, tm.config.hbm_bytes // tm.config.page_bytes)


def servable(tm: TierManager, key: bytes) -> bool:
    """The manager holds a copy of ``key`` it can load (owned HBM, DRAM or NVMe)."""
    with tm._lock:
        rec = tm._pages.get(key)
        return rec is not None and bool(rec.tiers & tm._readable_mask)


def accounting_errors(tm: TierManager) -> list[str]:
    """What the manager's books say that cannot be: a tier over its capacity, page
    counts or used bytes that are not its pages', and with ``hbm="engine"`` a page in
    the engine's HBM alone (the manager cannot read it: lost when the engine drops
    it), beyond the known defect's counted drops (``ENGINE_DRAM_DROP_DEFECT``)."""
    with tm._lock:
        stats = tm.stats()
        recs = list(tm._pages.values())
        counters = dict(tm._counters)
        slot = tm._slot_bytes
        owned_hbm = tm._owned_hbm
    errors = []
    for tier in range(3):
        if stats.used_bytes[tier] > stats.capacity_bytes[tier]:
            errors.append(
                f"tier {tier}: {stats.used_bytes[tier]} bytes used of {stats.capacity_bytes[tier]}"
            )
    counts = tuple(sum(1 for rec in recs if rec.tiers & bit) for bit in (1, 2, 4))
    if stats.pages_by_tier != counts or stats.pages != len(recs):
        errors.append(f"pages_by_tier {stats.pages_by_tier}, the pages say {counts}")
    hbm_bytes = counts[0] * slot if owned_hbm else sum(rec.nbytes for rec in recs if rec.tiers & 1)
    nvme_bytes = sum(rec.nbytes for rec in recs if rec.tiers & 4)
    if stats.used_bytes != (hbm_bytes, counts[1] * slot, nvme_bytes):
        errors.append(
            f"used_bytes {stats.used_bytes}, the pages say "
            f"{(hbm_bytes, counts[1] * slot, nvme_bytes)}"
        )
    if tm.config.hbm == "engine":
        alone = [rec.key for rec in recs if rec.tiers & 7 == 1]
        drops = sum(counters.get(name, 0) for name in ENGINE_DRAM_DROPS)
        if alone and not (ENGINE_DRAM_DROP_DEFECT and len(alone) <= drops):
            errors.append(
                f"{len(alone)} pages in the engine's HBM alone, which the manager cannot "
                f"read (first {alone[0]!r}); {drops} counted DRAM drops"
            )
    return errors


# -- workload: write-back ---------------------------------------------------------


def writeback_workload(
    path: Path, report: Report, seed: int, cycle: int, hbm: str = "owned"
) -> None:
    """Offer chains forever (until killed), acknowledging pages as they become durable.
    With ``hbm="engine"`` the engine's cache holds what it offered and drops the oldest
    pages; at every acknowledgement the workload reports its ``bad`` findings."""
    rng = random.Random(seed * 1000 + cycle)
    unacked: deque[bytes] = deque(maxlen=4096)  # a page dropped unwritten ages out
    # Group commits only every 250 ms: an acknowledgement rests on the explicit flush.
    options = {"segment_bytes": 1 << 20, "gc_interval_s": 0, "flush_interval_ms": 250.0}
    config = tier_config(
        path,
        WRITEBACK_PAGE,
        persist_stats_s=0.05,
        nvme_options=options,
        **hbm_options(hbm, WRITEBACK_PAGE),
    )
    tm = TierManager.open(config)
    engine = engine_cache(tm)
    report.line("ready")
    store = tm.store
    chain = 0
    next_ack = time.monotonic()
    while True:
        length = rng.randint(1, 6)
        keys = [chain_key(cycle, chain, i) for i in range(length)]
        chain += 1
        srcs = [page_tensor(k, WRITEBACK_PAGE) for k in keys]
        offered = tm.offer(keys, srcs)
        offered.hbm_release.wait(10)  # srcs may go once copied into DRAM
        placed = accepted(keys, offered)
        unacked.extend(placed)
        if engine is not None:
            engine.hold(placed)
        time.sleep(rng.uniform(0.0, 0.004))
        if time.monotonic() < next_ack:
            continue
        # Acknowledge every 5-30 ms, as an engine would: pages written since are in
        # flight, or on NVMe and not acknowledged yet, when the kill lands.
        next_ack = time.monotonic() + rng.uniform(0.005, 0.03)
        bad = accounting_errors(tm) + (engine.errors() if engine is not None else [])
        for text in bad:
            report.line("bad " + text)
        if engine is not None:
            report.line(f"engine {engine.notified} {len(engine.lost)}")  # dropped, lost
        visible = [k for k in unacked if store.info(k) is not None]
        if visible:
            store.flush()  # began after each of them was visible: all durable now
            stamp = f"{time.monotonic():.6f}"  # CLOCK_MONOTONIC: the test's clock too
            report.line(f"ack {stamp} " + " ".join(k.decode() for k in visible))
            done = set(visible)
            kept = [k for k in unacked if k not in done]
            unacked.clear()
            unacked.extend(kept)


@dataclass
class WritebackCheck:
    """What a reopened manager holds after a kill, against the acknowledgements."""

    acked: int = 0
    loaded: int = 0  # acknowledged pages read back through the manager
    lost: int = 0  # acknowledged, absent after the reopen
    wrong_bytes: int = 0  # any page whose bytes are not its key's
    wrong_meta: int = 0  # a page whose parent or depth in the meta is wrong
    stored: int = 0  # pages on NVMe after the reopen (acknowledged or not)
    rebuilt: int = 0  # of which the reopened manager knows (forest rebuilt)
    bad: list[str] = field(default_factory=list)  # the reopened manager's books

    @property
    def violations(self) -> int:
        return (
            self.lost
            + self.wrong_bytes
            + self.wrong_meta
            + (self.stored - self.rebuilt)
            + len(self.bad)
        )


def check_writeback(
    path: Path, acked: set[bytes], batch: int = 32, hbm: str = "owned"
) -> WritebackCheck:
    """Reopen ``path`` (in the workload's HBM mode) and check every acknowledged page
    (loaded through the manager) and every page on NVMe (its bytes and its parent
    link), and the reopened manager's books before and after the loads."""
    check = WritebackCheck(acked=len(acked))
    config = tier_config(
        path, WRITEBACK_PAGE, dram_bytes=128 * WRITEBACK_PAGE, **hbm_options(hbm, WRITEBACK_PAGE)
    )
    with TierManager.open(config) as tm:
        store = tm.store
        check.rebuilt = tm.stats().pages_by_tier[2]
        check.bad.extend(accounting_errors(tm))
        for key in store.keys():  # noqa: SIM118 (KVStore is not a Mapping)
            check.stored += 1
            info = store.info(key)
            data = store.get(key)
            if info is None or data is None:
                continue  # deleted meanwhile: nothing deletes here, the count shows it
            if data != page_bytes(key, WRITEBACK_PAGE):
                check.wrong_bytes += 1
            parent = chain_parent(key)
            depth = int(key.rpartition(b".")[2])
            want = {"kvt": 1, "parent": None if parent is None else parent.hex(), "depth": depth}
            if any(info.meta.get(name) != value for name, value in want.items()):
                check.wrong_meta += 1
        present = [k for k in sorted(acked) if store.info(k) is not None]
        check.lost = len(acked) - len(present)
        for start in range(0, len(present), batch):
            keys = present[start : start + batch]
            got = load_pages(tm, keys, WRITEBACK_PAGE)
            for key, tensor in zip(keys, got, strict=False):
                check.loaded += 1
                if bytes(tensor.numpy()) != page_bytes(key, WRITEBACK_PAGE):
                    check.wrong_bytes += 1
            check.lost += len(keys) - len(got)
        check.bad.extend(accounting_errors(tm))
    return check


def load_pages(tm: TierManager, keys: Sequence[bytes], page: int) -> list[torch.Tensor]:
    """Look ``keys`` up and load the hit into fresh tensors (NaN-free zeros)."""
    result = tm.lookup(keys)
    dst = [torch.zeros(page, dtype=torch.uint8) for _ in range(result.plan.load_pages)]
    handle = tm.prepare_load(result.plan, dst)
    if not handle.wait(30):
        raise TimeoutError(f"a load of {len(dst)} pages did not finish in 30 s")
    loaded = tm.complete_load(handle)
    return dst[:loaded]


# -- workload: statistics saves -------------------------------------------------------


def stats_workload(path: Path, report: Report, seed: int, cycle: int, hbm: str = "owned") -> None:
    """Save the statistics in a loop (until killed), the heat changing between saves."""
    rng = random.Random(seed * 1000 + cycle)
    config = tier_config(
        path,
        STATS_PAGE,
        dram_bytes=4096 * STATS_PAGE,
        control_interval_s=0.0,
        persist_stats_s=0.0,
        **hbm_options(hbm, STATS_PAGE),
    )
    tm = TierManager.open(config)
    engine = engine_cache(tm)
    chains = [[chain_key(cycle, c, i) for i in range(8)] for c in range(250)]
    for keys in chains:  # 2,000 pages: a statistics file of some 150 KB
        offered = tm.offer(keys, [page_tensor(k, STATS_PAGE) for k in keys])
        offered.hbm_release.wait(10)
        if engine is not None:
            engine.hold(accepted(keys, offered))
    for text in accounting_errors(tm) + (engine.errors() if engine is not None else []):
        report.line("bad " + text)
    report.line("ready")
    while True:
        for _ in range(rng.randint(1, 20)):
            tm.lookup(rng.choice(chains))
        with tm._lock:
            snapshot = tm._stats_snapshot()
        stamp = repr(snapshot["saved_at_unix_s"])
        report.line(f"begin {stamp}")
        tm._write_stats(snapshot)
        report.line(f"saved {stamp}")


# -- workload: trace replay -----------------------------------------------------------


@dataclass
class HitCount:
    """Hits of the measured requests, in blocks (pages)."""

    requests: int = 0
    blocks: int = 0  # blocks looked up
    hit: int = 0  # of which in the resident prefix (any tier)
    nvme_copy: int = 0  # of which had a copy on NVMe when looked up
    served: list[int] = field(default_factory=lambda: [0, 0, 0])  # the hit, by serving tier

    @property
    def nvme_hit_rate(self) -> float:
        """Block accesses that hit a page with an NVMe copy: what NVMe contributes,
        whichever tier served the page (a DRAM page promoted from NVMe keeps its copy)."""
        return self.nvme_copy / self.blocks if self.blocks else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit / self.blocks if self.blocks else 0.0


def replay_config(path: Path, **overrides: Any) -> TierConfig:
    """HBM 64 pages, DRAM 256, NVMe unbounded: the trace's working set (about 1,500
    blocks of live sessions) spills to NVMe, so its hits are measurable there. The
    watermarks and clean reserves are the defaults (``overrides`` may change them)."""
    options: dict[str, Any] = dict(
        hbm_bytes=64 * REPLAY_PAGE,
        dram_bytes=256 * REPLAY_PAGE,
        control_interval_s=0.0,  # the replay steps the manager once per request
        persist_stats_s=0.5,
    )
    options.update(overrides)
    return tier_config(path, REPLAY_PAGE, **options)


def trace(seed: int, requests: int) -> list[Request]:
    return generate(TRACE_KIND, seed=seed, requests=requests)


def block_key(block: int) -> bytes:
    return b"%d" % block


def replay(
    tm: TierManager,
    requests: Sequence[Request],
    count: HitCount | None,
    *,
    settle: bool = False,
    engine: EngineHBM | None = None,
) -> None:
    """Serve each request as an engine would: look its chain up, load the hit, offer
    the blocks it computed (chained to the hit), step the manager. ``settle``: also
    wait for the moves each request started (the same decisions on every run).
    ``engine`` (hbm="engine"): the engine's cache then holds the request's blocks,
    the loaded ones and the offered ones the manager accepted."""
    store = tm.store
    for request in requests:
        keys = [block_key(b) for b in request.blocks]
        result = tm.lookup(keys, tokens=request.input_tokens)
        hit = result.hit_pages
        if count is not None:
            count.requests += 1
            count.blocks += len(keys)
            count.hit += hit
            count.nvme_copy += sum(store.info(k) is not None for k in keys[:hit])
            for tier, pages in enumerate(result.pages_by_tier):
                count.served[tier] += pages
        loaded = 0
        if result.plan.load_pages:
            dst = [
                torch.empty(REPLAY_PAGE, dtype=torch.uint8) for _ in range(result.plan.load_pages)
            ]
            handle = tm.prepare_load(result.plan, dst)
            handle.wait(30)
            loaded = tm.complete_load(handle)
        rest = keys[loaded:]
        held = keys[:loaded]
        if rest:
            meta = {"parent": keys[loaded - 1]} if loaded else None
            # The sources are fresh tensors the copies keep alive: no need to wait for them.
            offered = tm.offer(rest, [page_tensor(k, REPLAY_PAGE) for k in rest], meta=meta)
            held += accepted(rest, offered)
        if engine is not None:
            engine.hold(held)
        tm.step()
        if settle:
            tm.drain()
            tm.step()


def replay_workload(
    path: Path,
    report: Report,
    seed: int,
    total: int,
    start: int,
    measured: int,
    overrides: dict[str, Any],
) -> None:
    """Replay requests [0, start + measured) of a ``total``-request trace, count the
    last ``measured``; report, hold. (The trace is generated at its full length in
    every process: a shorter one need not be its prefix.)"""
    requests = trace(seed, total)[: start + measured]
    tm = TierManager.open(replay_config(path, **overrides))
    engine = engine_cache(tm)
    report.line("ready")
    replay(tm, requests[:start], None, engine=engine)
    count = HitCount()
    replay(tm, requests[start:], count, engine=engine)
    for text in accounting_errors(tm) + (engine.errors() if engine is not None else []):
        report.line("bad " + text)
    report.line("count " + json.dumps(asdict(count)))
    report.line("done")
    while True:  # killed here: DRAM and HBM are lost; write-backs in flight may be
        time.sleep(0.05)
        tm.step()


# -- the zygote -------------------------------------------------------------------------


def run_workload(spec: dict[str, Any]) -> None:
    path = Path(spec["dir"])
    report = Report(Path(spec["report"]))
    mode = spec["mode"]
    hbm = spec.get("hbm", "owned")
    if mode == "writeback":
        writeback_workload(path, report, spec["seed"], spec["cycle"], hbm)
    elif mode == "stats":
        stats_workload(path, report, spec["seed"], spec["cycle"], hbm)
    elif mode == "replay":
        replay_workload(
            path,
            report,
            spec["seed"],
            spec["total"],
            spec["start"],
            spec["measured"],
            spec.get("config", {}),
        )
    else:
        raise ValueError(f"unknown workload {mode!r}")


def serve() -> int:
    """The zygote: fork one workload process per JSON line on stdin."""
    for line in sys.stdin:
        spec = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.setpgid(0, 0)
                run_workload(spec)
            except BaseException as e:
                with contextlib.suppress(Exception):
                    Report(Path(spec["report"])).line(f"error {type(e).__name__}: {e}")
                code = 1
            os._exit(code)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {status}", flush=True)
    return 0


class Zygote:
    """The test's handle on a ``serve`` process: start workloads, kill them."""

    def __init__(self) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
        }
        self._process = subprocess.Popen(
            [sys.executable, "-m", "kvstore.testing.tier_crash", "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=PACKAGE_ROOT,
            env=env,
        )

    def _read(self, prefix: str) -> str:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line.startswith(prefix):
            raise RuntimeError(f"the zygote answered {line!r}, expected {prefix!r}")
        return line[len(prefix) :].strip()

    @contextlib.contextmanager
    def workload(self, report: Path, **spec: Any) -> Iterator[Workload]:
        """Start a workload; on leaving, SIGKILL it (if still running) and reap it."""
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps({**spec, "report": str(report)}) + "\n")
        self._process.stdin.flush()
        work = Workload(int(self._read("pid ")), report)
        try:
            yield work
        finally:
            work.kill()
            work.status = int(self._read("exit "))

    def close(self) -> None:
        """Stop the zygote (idle between workloads: nothing of it to keep)."""
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.kill()
        self._process.wait()


class Workload:
    """One forked workload process and its report."""

    def __init__(self, pid: int, report: Path) -> None:
        self.pid = pid
        self.report = report
        self.status: int | None = None
        self.killed = False

    def lines(self) -> list[str]:
        return read_report(self.report)

    def wait_for(self, word: str, timeout_s: float) -> list[str]:
        """Poll the report until a line starts with ``word``; its lines then."""
        deadline = time.monotonic() + timeout_s
        while True:
            lines = self.lines()
            errors = [line for line in lines if line.startswith("error ")]
            if errors:
                raise RuntimeError(f"the workload failed: {errors[0]}")
            if any(line.split(" ", 1)[0] == word for line in lines):
                return lines
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {word!r} from the workload in {timeout_s} s: {lines[-3:]}")
            time.sleep(0.01)

    def kill(self) -> None:
        if not self.killed:
            self.killed = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("mode", choices=["serve"])
    parser.parse_args(argv)
    return serve()


if __name__ == "__main__":
    sys.exit(main())
