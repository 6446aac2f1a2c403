"""The tier manager's costs on this machine, each beside a reference measured in the same run.

    .venv/bin/python tools/bench_tiering.py --dir ./bench-data/tiering --out run.json
    .venv/bin/python tools/bench_tiering.py --only bookkeeping plan --reps 15 --profile 14
    .venv/bin/python tools/bench_tiering.py --report run.json

Five parts (``--only`` picks some), judged against the targets in ``TARGETS``:

  bookkeeping  ``lookup`` of a 128-page prefix resident in DRAM and ``offer`` of a fresh
               128-page chain, on the fake mover (no bytes move: what is left is the
               manager's own work), as the calling thread's CPU time per page. Offer
               twice: into free slots, and into a full DRAM (every offer evicts). Beside
               them, a bare Python loop over the same keys (one dict lookup and two
               attribute reads per key): the floor any Python page table pays here.
               Then ``offer`` on the CPU mover with real tensors: the caller's CPU time
               (the copy runs on the mover's thread), and the wall time until
               ``hbm_release`` minus torch ``copy_`` of the same sources into the same
               slots.
  dram         ``prepare_load``/``wait``/``complete_load`` of pages resident in DRAM
               into destination tensors, against a loop of ``dst.copy_(slot)`` on the
               same buffers; runs alternate, medians compared.
  nvme         the same of pages on NVMe only (a fresh manager over the store, its
               DRAM empty and its arena touched once, as a manager's that has run a
               while), against ``KVStore.get_many_into`` of the same pages into the
               same destinations, and the first load of a fresh manager whose arena was
               never touched; the three take turns (the store reads with O_DIRECT, so
               the guest's page cache is not in the way; the host's may be), medians
               compared. The manager's time is split into its NVMe read, the wait for
               the harvest, and its copies out of DRAM.
  writeback    write-through of fresh pages, offered ``--offer-pages`` at a time, from
               the first ``offer`` until ``drain`` has every page on NVMe (the copies
               into DRAM and the mover's write-back from the DRAM slots), each round on
               a fresh store, against ``KVStore.put_many`` of the same pages in the
               same batches from 4 KiB-aligned memory, one batch after the other (what
               the mover did before it kept several batches in flight); turns, medians.
  plan         the load-vs-recompute decision on a generated trace, replayed through a
               real ``TierManager`` on the fake mover (as ``kvstore sim`` does), once on
               a disk slower than recomputing (κ_nvme < 1) and once on a faster one. Per
               request the manager's plan is compared with the two fixed answers for the
               same cache state: recompute everything, load every hit page (``PlanCost``
               ``ttft_recompute_s`` / ``ttft_load_all_s``). ``kvstore sim``'s peers
               (``recompute``, ``vllm``: always load, with their own caches) beside it.

CPU times are ``time.thread_time`` of the calling thread; the bookkeeping numbers are
the median of ``--reps`` batches (the minimum is in the JSON); ``--profile N`` adds
thread-CPU cProfiles of lookup and offer. ``--torch-threads``
(default 1) fixes torch's intra-op threads: on a small shared VM two threads make every
``copy_`` wait for the slower core. See docs/benchmarks.md, "Tier manager".

This module holds the measurements; kvstore/bench/tiering_cli.py the targets, the
report and the command line of tools/bench_tiering.py.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import shutil
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstore.bench.common import KIB, MIB
from kvstore.tiering import LookupState, ModelCost, TierConfig, TierManager
from kvstore.tiering.arena import Arena
from kvstore.tiering.config import MODEL_PRESETS
from kvstore.tiering.mover_api import Ticket
from kvstore.tiering.pages import PageRec
from kvstore.tiering.sim import Machine, kvstore_config
from kvstore.tiering.sim import run as sim_run
from kvstore.tiering.sim import trace as tier_trace

PARTS = ("bookkeeping", "dram", "nvme", "writeback", "plan")
PREFIX_PAGES = 128
FILL_CHAINS = 16  # fills a DRAM of 8 chains: every later offer evicts
# A model whose page of 8 tokens is 1 MiB (128 KiB of K and V per token, as Llama-3.1-8B).
MIB_PAGE_MODEL = ModelCost(8.03e9, 32, 32, 128, 128 * KIB)


# -- what the bench reads of the manager's internals --------------------------------
#
# No public call gives these, and the bench needs them to set a reference beside the
# manager: the DRAM slot that holds a page (torch's ``copy_`` of the same bytes), the
# DRAM arena (touched once outside the timing; whether it is pinned), the page table
# (the bare walk's floor) and the mover (its tickets give the time split). They are
# the manager's private attributes, read here and nowhere else in kvstore/bench.


def dram_arena(tm: TierManager) -> Arena:
    """The manager's DRAM arena (the fake mover's virtual slots are no arena)."""
    arena = tm._dram
    if not isinstance(arena, Arena):
        raise RuntimeError(f"the manager's DRAM is {type(arena).__name__}, not an Arena")
    return arena


def page_table(tm: TierManager) -> Mapping[bytes, PageRec]:
    return tm._pages


def dram_slots(tm: TierManager, keys: Sequence[bytes], page_bytes: int) -> list[torch.Tensor]:
    """The DRAM slots that hold ``keys``, as tensors of ``page_bytes``."""
    arena, pages = dram_arena(tm), page_table(tm)
    return [arena.view(pages[key].dram_slot, page_bytes) for key in keys]


# -- timing ----------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    """Per-page CPU (thread) and wall times of ``reps`` batches, in microseconds."""

    cpu_us: list[float] = field(default_factory=list)
    wall_us: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        return {
            "cpu_us_median": statistics.median(self.cpu_us),
            "cpu_us_min": min(self.cpu_us),
            "wall_us_median": statistics.median(self.wall_us),
            "wall_us_min": min(self.wall_us),
            "batches": len(self.cpu_us),
        }


@contextmanager
def per_page(sample: Sample, pages: int) -> Iterator[None]:
    """Add the thread CPU and wall time of the block, divided by ``pages``, to ``sample``."""
    cpu, wall = time.thread_time(), time.perf_counter()
    yield
    sample.cpu_us.append((time.thread_time() - cpu) / pages * 1e6)
    sample.wall_us.append((time.perf_counter() - wall) / pages * 1e6)


def alternate(
    first: Callable[[], None], second: Callable[[], None], reps: int
) -> tuple[list[float], list[float]]:
    """Seconds of ``reps`` runs each, the order swapped every round (drift hits both)."""
    times: tuple[list[float], list[float]] = ([], [])
    for rep in range(reps):
        order = ((0, first), (1, second)) if rep % 2 == 0 else ((1, second), (0, first))
        for index, run in order:
            start = time.perf_counter()
            run()
            times[index].append(time.perf_counter() - start)
    return times


def mb_per_s(nbytes: int, seconds: Sequence[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e6


def random_pages(count: int, nbytes: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
        for _ in range(count)
    ]


def check_equal(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], what: str) -> None:
    """Raise if any destination differs from its source (a fast wrong load is no result)."""
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        if not torch.equal(a[: b.numel()], b):
            raise RuntimeError(f"{what}: page {index} came back with different bytes")


# -- bookkeeping -------------------------------------------------------------------


def fake_config(dram_pages: int, **overrides: Any) -> TierConfig:
    """The fake mover with an NVMe bookkeeping tier: the manager moves no bytes."""
    options: dict[str, Any] = dict(
        mover="fake", control_interval_s=0, nvme_path=None, nvme_bytes=1 << 50
    )
    options.update(overrides)
    return cpu_config(dram_pages, MIB, **options)


def chain(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}/{i:05d}".encode() for i in range(count)]


def fill_dram(tm: TierManager, chains: int) -> None:
    """Offer ``chains`` fresh 128-page chains, each followed by a drain and a control
    step: DRAM fills, and write-back puts a copy below."""
    for index in range(chains):
        tm.offer(chain(f"fill{index}", PREFIX_PAGES), None)
        tm.drain()
        tm.step()


def bench_lookup(reps: int, calls: int) -> dict[str, Any]:
    """``lookup`` of a 128-page prefix resident in DRAM, and the bare-loop floor."""
    keys = chain("lookup", PREFIX_PAGES)
    with TierManager.open(fake_config(4 * PREFIX_PAGES)) as tm:
        if tm.offer(keys, None).admitted != PREFIX_PAGES:
            raise RuntimeError("lookup: the prefix was not admitted")
        tm.drain()
        result = tm.lookup(keys)
        if result.pages_by_tier != (0, PREFIX_PAGES, 0) or result.state is not LookupState.READY:
            raise RuntimeError(f"lookup: unexpected answer {result.state} {result.pages_by_tier}")
        sample, floor = Sample(), Sample()
        pages = page_table(tm)  # the floor walks the manager's own table
        for _ in range(reps):
            with per_page(sample, calls * PREFIX_PAGES):
                for _ in range(calls):
                    tm.lookup(keys)
            with per_page(floor, calls * PREFIX_PAGES):
                for _ in range(calls):
                    bare_walk(pages, keys)
    return {"lookup": sample.summary(), "bare_loop": floor.summary()}


def bare_walk(pages: Mapping[bytes, PageRec], keys: Sequence[bytes]) -> int:
    """One dict lookup and two attribute reads per key: a Python page table's floor."""
    total = 0
    for key in keys:
        rec = pages.get(key)
        if rec is None or not rec.tiers:
            break
        total += rec.nbytes
    return total


def bench_offer_fake(reps: int, calls: int) -> dict[str, Any]:
    """``offer`` of fresh 128-page chains: into free DRAM slots, and into a full DRAM."""
    out: dict[str, Any] = {}
    free_pages = (reps * calls + 1) * PREFIX_PAGES
    full_pages = 8 * PREFIX_PAGES
    for name, dram_pages, prefill in (
        ("free_slots", free_pages, 0),
        ("full_dram", full_pages, FILL_CHAINS),
    ):
        sample = Sample()
        with TierManager.open(fake_config(dram_pages)) as tm:
            fill_dram(tm, prefill)
            for rep in range(reps):
                chains = [chain(f"offer{rep}-{c}", PREFIX_PAGES) for c in range(calls)]
                admitted = 0
                for keys in chains:
                    with per_page(sample, PREFIX_PAGES):
                        admitted += tm.offer(keys, None).admitted
                    tm.drain()  # between requests: copies land, the control cycle runs
                    tm.step()
                if admitted != calls * PREFIX_PAGES:
                    raise RuntimeError(f"offer ({name}): {admitted} of {calls * 128} admitted")
            stats = tm.stats()
        out[name] = {**sample.summary(), "evictions": dict(stats.evictions)}
    return out


def bench_offer_cpu(reps: int, page_bytes: int) -> dict[str, Any]:
    """``offer`` on the CPU mover with real tensors: caller CPU, and wall minus the copy."""
    count = PREFIX_PAGES
    sources = random_pages(count, page_bytes, seed=11)
    config = cpu_config((reps + 2) * count, page_bytes)
    caller_us: list[float] = []
    release_us: list[float] = []
    copy_us: list[float] = []
    with TierManager.open(config) as tm:
        dram_arena(tm).buffer().fill_(0)  # first touch outside the timing
        for rep in range(-1, reps):  # round -1 warms up
            keys = chain(f"cpu{rep}", count)
            cpu, wall = time.thread_time(), time.perf_counter()
            result = tm.offer(keys, sources)
            cpu = time.thread_time() - cpu
            if not result.hbm_release.wait(60) or result.admitted != count:
                raise RuntimeError("offer (cpu mover): not all pages admitted and copied")
            wall = time.perf_counter() - wall
            slots = dram_slots(tm, keys, page_bytes)
            check_equal(slots, sources, "offer (cpu mover)")
            start = time.perf_counter()
            for slot, source in zip(slots, sources, strict=True):
                slot.copy_(source)  # the same bytes again: the page is unchanged
            seconds = time.perf_counter() - start
            if rep >= 0:
                caller_us.append(cpu / count * 1e6)
                release_us.append(wall / count * 1e6)
                copy_us.append(seconds / count * 1e6)
    minus = [t - c for t, c in zip(release_us, copy_us, strict=True)]
    return {
        "page_bytes": page_bytes,
        "caller_cpu_us_median": statistics.median(caller_us),
        "caller_cpu_us_min": min(caller_us),
        "until_release_us_median": statistics.median(release_us),
        "torch_copy_us_median": statistics.median(copy_us),
        "until_release_minus_copy_us_median": statistics.median(minus),
    }


def profile_bookkeeping(top: int) -> dict[str, str]:
    """cProfile of lookup, of offer into a full DRAM (fake mover) and of offer on the CPU
    mover: the ``top`` functions by own thread CPU time (a loaded machine's preemptions
    stay out), as text (file:line(function)). Profiling inflates call-heavy code; read
    the shares, not the totals."""
    out: dict[str, str] = {}
    keys = chain("profile", PREFIX_PAGES)
    with TierManager.open(fake_config(4 * PREFIX_PAGES)) as tm:
        tm.offer(keys, None)
        tm.drain()
        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
        for _ in range(500):
            tm.lookup(keys)
        profiler.disable()
        out["lookup"] = profile_text(profiler, top)
    with TierManager.open(fake_config(8 * PREFIX_PAGES)) as tm:
        fill_dram(tm, FILL_CHAINS)
        profiler = cProfile.Profile(time.thread_time)
        for index in range(40):
            batch = chain(f"p{index}", PREFIX_PAGES)
            profiler.enable()
            tm.offer(batch, None)
            profiler.disable()
            tm.drain()
            tm.step()
        out["offer_full_dram"] = profile_text(profiler, top)
    page_bytes = 64 * KIB
    sources = random_pages(PREFIX_PAGES, page_bytes, seed=41)
    rounds = 10
    config = cpu_config((rounds + 1) * PREFIX_PAGES, page_bytes)
    with TierManager.open(config) as tm:
        dram_arena(tm).buffer().fill_(0)
        profiler = cProfile.Profile(time.thread_time)
        for index in range(rounds):
            batch = chain(f"cpu{index}", PREFIX_PAGES)
            profiler.enable()
            result = tm.offer(batch, sources)
            profiler.disable()
            result.hbm_release.wait(60)
        out["offer_cpu_mover_64k"] = profile_text(profiler, top)
    return out


def profile_text(profiler: cProfile.Profile, top: int) -> str:
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    return text.getvalue()


# -- loads -------------------------------------------------------------------------


def cpu_config(dram_pages: int, page_bytes: int, **overrides: Any) -> TierConfig:
    """The CPU mover, no HBM, DRAM for ``dram_pages``, every page admitted, no probe."""
    options: dict[str, Any] = dict(
        device="cpu",
        hbm_bytes=0,
        dram_bytes=dram_pages * page_bytes,
        page_bytes=page_bytes,
        tokens_per_page=8,
        model=MIB_PAGE_MODEL,
        admission="all",
        probe_at_open=False,
    )
    options.update(overrides)
    return TierConfig(**options)


def load_config(pages: int, page_bytes: int, **overrides: Any) -> TierConfig:
    """A CPU manager whose plan always loads (recomputing a page is made slow)."""
    return cpu_config(pages + 8, page_bytes, compute_flops=1e9, **overrides)


def bench_dram(pages: int, page_bytes: int, reps: int) -> dict[str, Any]:
    keys = chain("dram", pages)
    sources = random_pages(pages, page_bytes, seed=21)
    destinations = [torch.zeros(page_bytes, dtype=torch.uint8) for _ in range(pages)]
    splits: list[dict[str, float]] = []
    with TierManager.open(load_config(pages, page_bytes)) as tm:
        offered = tm.offer(keys, sources)
        if not offered.hbm_release.wait(60) or offered.tiers != (1,) * pages:
            raise RuntimeError(f"dram: pages not placed in DRAM: {offered.reasons[:3]}")
        tm.drain()
        slots = dram_slots(tm, keys, page_bytes)
        tickets = TicketLog(tm)

        def manager() -> None:
            splits.append(load_once(tm, tickets, keys, destinations, LookupState.READY))

        def reference() -> None:
            for destination, slot in zip(destinations, slots, strict=True):
                destination.copy_(slot)

        manager()  # warm-up: first touch of the destinations
        reference()
        splits.clear()
        check_equal(destinations, sources, "dram load")
        manager_s, reference_s = alternate(manager, reference, reps)
        check_equal(destinations, sources, "dram load")
        control = tm.config.control_interval_s
    return {
        **load_result(pages, page_bytes, manager_s, reference_s, splits),
        "control_interval_s": control,
    }


class TicketLog:
    """Wraps a manager's mover to keep the tickets it hands out (for the time split)."""

    def __init__(self, tm: TierManager) -> None:
        self.tickets: list[Ticket] = []
        mover = tm._mover  # the manager's own mover: its calls are wrapped to log tickets
        for name in ("copy", "nvme_read"):
            setattr(mover, name, self._wrap(getattr(mover, name)))

    def _wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def logged(*args: Any, **kwargs: Any) -> Any:
            ticket = method(*args, **kwargs)
            self.tickets.append(ticket)
            return ticket

        return logged

    def split(self, started_s: float, woke_s: float) -> dict[str, float]:
        """Milliseconds from the lookup (monotonic ``started_s``) to each phase's end:
        the NVMe read, the first copy's start, the last copy's end, ``wait`` returning."""
        reads = [t for t in self.tickets if t.path.value == "nvme_read"]
        copies = [t for t in self.tickets if t.path.value != "nvme_read"]
        self.tickets.clear()
        out = {
            "copy_start_ms": (min(_at(t.started_s) for t in copies) - started_s) * 1e3,
            "copy_end_ms": (max(_at(t.finished_s) for t in copies) - started_s) * 1e3,
            "wait_returned_ms": (woke_s - started_s) * 1e3,
        }
        if reads:
            out["read_end_ms"] = (max(_at(t.finished_s) for t in reads) - started_s) * 1e3
        return out


def _at(seconds: float | None) -> float:
    """A finished ticket's time (set once the load's ``wait`` returned)."""
    if seconds is None:
        raise RuntimeError("a ticket of a finished load has no time")
    return seconds


def load_once(
    tm: TierManager,
    tickets: TicketLog,
    keys: list[bytes],
    destinations: list[torch.Tensor],
    state: LookupState,
) -> dict[str, float]:
    """lookup -> prepare_load -> wait -> complete_load of every page; the time split."""
    started = time.monotonic()
    result = tm.lookup(keys)
    if result.state is not state or result.plan.load_pages != len(keys):
        raise RuntimeError(f"lookup said {result.state} ({result.plan.reason}), not {state}")
    handle = tm.prepare_load(result.plan, destinations)
    if not handle.wait(120):
        raise RuntimeError("the load did not finish in 120 s")
    woke = time.monotonic()
    if tm.complete_load(handle) != len(keys):
        raise RuntimeError(f"the load came back with {handle.loaded_pages} pages")
    return tickets.split(started, woke)


def load_result(
    pages: int,
    page_bytes: int,
    manager_s: list[float],
    reference_s: list[float],
    splits: list[dict[str, float]],
) -> dict[str, Any]:
    nbytes = pages * page_bytes
    return {
        "pages": pages,
        "page_bytes": page_bytes,
        "manager_mbps": mb_per_s(nbytes, manager_s),
        "reference_mbps": mb_per_s(nbytes, reference_s),
        "ratio": statistics.median(reference_s) / statistics.median(manager_s),
        "manager_split_median_ms": {
            name: statistics.median(s[name] for s in splits) for name in splits[0]
        },
        "manager_s": manager_s,
        "reference_s": reference_s,
    }


def nvme_config(path: Path, pages: int, page_bytes: int, **overrides: Any) -> TierConfig:
    segment = max(64 * MIB, 4 * page_bytes)
    return load_config(
        pages,
        page_bytes,
        nvme_path=str(path),
        nvme_options={"segment_bytes": segment, "gc_interval_s": 0},
        warm_dram_on_open=False,
        **overrides,
    )


def write_nvme_pages(path: Path, keys: list[bytes], sources: list[torch.Tensor]) -> None:
    """Put the pages on NVMe (write-through), then close: the next open finds them there."""
    shutil.rmtree(path, ignore_errors=True)
    config = nvme_config(path, len(keys), sources[0].numel(), placement="write_through")
    with TierManager.open(config) as tm:
        offered = tm.offer(keys, sources)
        if not offered.hbm_release.wait(60) or not tm.drain(120):
            raise RuntimeError("nvme: the write-through did not finish")
        if tm.stats().pages_by_tier[2] != len(keys):
            raise RuntimeError(f"nvme: {tm.stats().pages_by_tier} pages by tier after writing")


@contextmanager
def nvme_only(path: Path, pages: int, page_bytes: int, *, touch: bool) -> Iterator[TierManager]:
    """A manager over the store with an empty DRAM (a fresh open); ``touch``: its DRAM
    arena written once first, as a manager that has run a while has it."""
    with TierManager.open(nvme_config(path, pages, page_bytes)) as tm:
        if tm.stats().pages_by_tier != (0, 0, pages):
            raise RuntimeError(f"nvme: reopened with {tm.stats().pages_by_tier} by tier")
        if touch:
            dram_arena(tm).buffer().fill_(0)
        yield tm


def bench_nvme(directory: Path, pages: int, page_bytes: int, reps: int) -> dict[str, Any]:
    """Each round: a fresh manager's first load (its DRAM arena never touched), then a
    load by a manager whose arena was touched and ``get_many_into``, in turns."""
    keys = chain("nvme", pages)
    sources = random_pages(pages, page_bytes, seed=31)
    path = directory / "nvme"
    write_nvme_pages(path, keys, sources)
    # Both paths read into the same 4 KiB-aligned destinations (as the DRAM slots are).
    arena = Arena(pages * page_bytes, page_bytes, "cpu", name="destinations")
    destinations = [arena.view(i, page_bytes) for i in range(pages)]
    arrays = [d.numpy() for d in destinations]
    runs: dict[str, list[float]] = {"fresh": [], "manager": [], "reference": []}
    splits: dict[str, list[dict[str, float]]] = {"fresh": [], "manager": []}
    direct_io = None
    for rep in range(reps + 1):  # round 0 warms up
        arena.buffer().fill_(0)
        names = ("fresh", "manager", "reference")
        for name in names[rep % 3 :] + names[: rep % 3]:  # each in every place in turn
            touch = name != "fresh"
            with nvme_only(path, pages, page_bytes, touch=touch) as tm:
                direct_io = tm.store.direct_io
                tickets = TicketLog(tm)
                start = time.perf_counter()
                if name == "reference":
                    if tm.store.get_many_into(keys, arrays) != [page_bytes] * pages:
                        raise RuntimeError("nvme: get_many_into missed pages")
                else:
                    split = load_once(tm, tickets, keys, destinations, LookupState.PENDING)
                seconds = time.perf_counter() - start
            check_equal(destinations, sources, f"nvme load ({name})")
            if rep:
                runs[name].append(seconds)
                if name != "reference":
                    splits[name].append(split)
    shutil.rmtree(path, ignore_errors=True)
    out = load_result(pages, page_bytes, runs["manager"], runs["reference"], splits["manager"])
    fresh = load_result(pages, page_bytes, runs["fresh"], runs["reference"], splits["fresh"])
    return {
        **out,
        "direct_io": direct_io,
        "fresh_open": {k: fresh[k] for k in ("manager_mbps", "ratio", "manager_split_median_ms")},
        "fresh_s": runs["fresh"],
    }


def bench_writeback(
    directory: Path, pages: int, page_bytes: int, reps: int, per_offer: int
) -> dict[str, Any]:
    """Each round, on a fresh store: the manager's write-through of ``pages`` offered
    ``per_offer`` at a time, and ``put_many`` of the same batches, in turns."""
    keys = chain("wb", pages)
    sources = random_pages(pages, page_bytes, seed=41)
    aligned = Arena(pages * page_bytes, page_bytes, "cpu", name="sources")
    for index, source in enumerate(sources):
        aligned.view(index, page_bytes).copy_(source)
    batches = [range(i, min(i + per_offer, pages)) for i in range(0, pages, per_offer)]
    path = directory / "writeback"
    runs: dict[str, list[float]] = {"manager": [], "reference": []}
    for rep in range(reps + 1):  # round 0 warms up
        names = ("manager", "reference")
        for name in names[rep % 2 :] + names[: rep % 2]:
            shutil.rmtree(path, ignore_errors=True)
            config = nvme_config(path, pages, page_bytes, placement="write_through")
            if name == "manager":
                with TierManager.open(config) as tm:
                    start = time.perf_counter()
                    for batch in batches:
                        parent = keys[batch[0] - 1] if batch[0] else None
                        tm.offer(
                            [keys[i] for i in batch],
                            [sources[i] for i in batch],
                            meta={"parent": parent} if parent is not None else None,
                        )
                    if not tm.drain(120):
                        raise RuntimeError("writeback: the write-through did not finish")
                    seconds = time.perf_counter() - start
                    if tm.stats().pages_by_tier[2] != pages:
                        raise RuntimeError(f"writeback: {tm.stats().pages_by_tier} by tier")
            else:
                from kvstore.store import KVStore

                options: dict[str, Any] = {"create": True, "max_page_bytes": page_bytes}
                options.update(config.nvme_options)
                with KVStore.open(path, **options) as store:
                    start = time.perf_counter()
                    for batch in batches:
                        items = [(keys[i], aligned.view(i, page_bytes).numpy()) for i in batch]
                        if store.put_many(items) != [True] * len(items):
                            raise RuntimeError("writeback: put_many declined pages")
                    seconds = time.perf_counter() - start
            if rep:
                runs[name].append(seconds)
    shutil.rmtree(path, ignore_errors=True)
    nbytes = pages * page_bytes
    return {
        "pages": pages,
        "page_bytes": page_bytes,
        "per_offer": per_offer,
        "manager_mbps": mb_per_s(nbytes, runs["manager"]),
        "reference_mbps": mb_per_s(nbytes, runs["reference"]),
        "ratio": statistics.median(runs["reference"]) / statistics.median(runs["manager"]),
        "manager_s": runs["manager"],
        "reference_s": runs["reference"],
    }


# -- the plan ----------------------------------------------------------------------


@dataclass(slots=True)
class PlanReplay:
    """Per request of one replay: the plan's TTFT and the two fixed answers'."""

    kvstore: list[float] = field(default_factory=list)
    recompute: list[float] = field(default_factory=list)
    load_all: list[float] = field(default_factory=list)
    states: dict[str, int] = field(default_factory=dict)
    nvme_only_hits: int = 0
    nvme_only_miss: int = 0
    loaded_pages: int = 0
    loaded_from_nvme: int = 0
    hit_pages: int = 0


def replay_plan(requests: Sequence[tier_trace.Request], config: TierConfig) -> PlanReplay:
    """``kvstore sim``'s replay, keeping every plan's three TTFTs."""
    out = PlanReplay()
    with TierManager.open(config) as tm:
        clock = tm.clock
        if clock is None:
            raise RuntimeError("plan: the replay needs the fake mover's clock")
        for request in requests:
            if request.timestamp_s > clock.now():
                clock.set(request.timestamp_s)
            tm.step()
            keys = [b"%d" % block for block in request.blocks]
            result = tm.lookup(keys, tokens=max(request.input_tokens, 1))
            cost = result.plan.cost
            out.kvstore.append(cost.ttft_s)
            out.recompute.append(cost.ttft_recompute_s)
            out.load_all.append(cost.ttft_load_all_s)
            out.states[result.state.value] = out.states.get(result.state.value, 0) + 1
            out.hit_pages += result.hit_pages
            out.loaded_pages += result.plan.load_pages
            out.loaded_from_nvme += result.plan.tiers[: result.plan.load_pages].count(2)
            if result.hit_pages and result.pages_by_tier[2] == result.hit_pages:
                out.nvme_only_hits += 1
                out.nvme_only_miss += result.state is LookupState.MISS
            tm.offer(keys, None)
    return out


def ttft_summary(values: Sequence[float]) -> dict[str, float]:
    return {"p50_s": statistics.median(values), "mean_s": statistics.fmean(values)}


def bench_plan(requests: int, fractions: tuple[float, float, float]) -> dict[str, Any]:
    trace = tier_trace.generate("multi-turn", seed=7, requests=requests)
    facts = tier_trace.trace_facts(trace)
    model = "llama-3.1-8b"
    block_tokens = tier_trace.DEFAULT_BLOCK_TOKENS
    capacity = tier_trace.capacity_blocks(fractions, facts.unique_blocks)
    out: dict[str, Any] = {
        "trace": f"generate('multi-turn', seed=7, requests={requests})",
        "unique_blocks": facts.unique_blocks,
        "capacity_blocks": list(capacity),
        "model": model,
    }
    cost_model = MODEL_PRESETS[model]
    for name, gbps, best in (("slow_disk", 1.0, "recompute"), ("fast_disk", 12.0, "load_all")):
        machine = Machine(nvme_gbps=gbps)
        # admission=all: every page reaches NVMe, so the slow disk really holds the hits
        # (value density alone would keep them off a disk not worth reading).
        config = kvstore_config(capacity, cost_model, block_tokens, machine, {"admission": "all"})
        replay = replay_plan(trace, config)
        peers = sim_run(
            trace,
            capacity_fractions=fractions,
            model=model,
            block_tokens=block_tokens,
            machine=machine,
            policies=["kvstore", "recompute", "vllm"],
        )
        page = config.page_bytes
        kappa = machine.cost_model(cost_model, block_tokens).kappa(2, page)
        reference = replay.recompute if best == "recompute" else replay.load_all
        out[name] = {
            "nvme_gbps": gbps,
            "kappa_nvme": kappa,
            "states": replay.states,
            "hit_pages": replay.hit_pages,
            "loaded_pages": replay.loaded_pages,
            "loaded_from_nvme": replay.loaded_from_nvme,
            "nvme_only_hits": replay.nvme_only_hits,
            "nvme_only_answered_miss": replay.nvme_only_miss,
            "ttft": {
                "kvstore": ttft_summary(replay.kvstore),
                "recompute": ttft_summary(replay.recompute),
                "load_all": ttft_summary(replay.load_all),
            },
            "ratio_to": best,
            "ratio_mean": statistics.fmean(replay.kvstore) / statistics.fmean(reference),
            "ratio_p50": statistics.median(replay.kvstore) / statistics.median(reference),
            "sim_peers": [
                {k: r[k] for k in ("policy", "hit_ratio", "ttft_p50_s", "ttft_p99_s")}
                for r in peers["results"]
            ],
        }
    return out
