"""Opens of the tier manager under hostile measurement conditions, and what stays resident.

The scenario of the tier manager's soundness issue (docs/tiering.md, "Measurements"):
a CPU manager with owned HBM of 8 pages, DRAM of 16, an NVMe store, 16 tokens per
page and an 8B model; 20 chains of 8 pages offered one after another, each offer
followed by ``hbm_release.wait()``, ``step()`` and a drain (the engine's next prefill
takes longer than writing the pages back). Then every offered page is looked up: the
share resident in some tier is the verdict (>= 0.9 expected).

Conditions (``Case``): a fresh store or one reopened with its statistics; an idle
host or one with busy processes spinning beside the manager; the first copies of
each path made 100x slower (``slow_first_copies``); the persisted bandwidths made
1000x too low before the open (``poison_stats``); the C_eff prior of a GPU (the
old default, 4e14 FLOP/s, where a wrong copy estimate gives kappa < 1). For the
hostile cases the report also gives how long after the open every tier was in use
again (``in_use_after_s``).

``main`` is the command line of tools/tier_soundness.py; tests use ``run_case``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "CASES",
    "Case",
    "Outcome",
    "busy_host",
    "main",
    "poison_stats",
    "run_case",
    "slow_first_copies",
]

CHAINS = 20
CHAIN_PAGES = 8


@dataclass(frozen=True)
class Case:
    page_bytes: int = 256 << 10
    reopen: bool = False  # a store that was open before (statistics persisted)
    # The first N tickets of each path 100x slower. 5: two are discarded as cold, three
    # in a row then move the estimate (a smaller N never reaches it).
    slow_first: int = 0
    poisoned_stats: bool = False  # persisted bandwidths 1000x too low before the open
    compute_flops: float | None = None  # None: the device class's prior
    busy: int = 0  # processes spinning beside the manager
    calibrate: bool = True  # probe_at_open: False leaves a bad estimate to exploration


@dataclass
class Outcome:
    case: Case
    offered: int
    resident: int
    kappa: tuple[float, float, float]
    in_use: tuple[bool, bool, bool]
    in_use_after_s: (
        float | None
    )  # every tier in use this long after open returned (None: not in 10 s)
    open_s: float  # how long TierManager.open took (calibration included)
    seconds: float
    bandwidth_mb_s: dict[str, float] = field(default_factory=dict)

    @property
    def resident_share(self) -> float:
        return self.resident / self.offered if self.offered else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["resident_share"] = self.resident_share
        return out


def config(path: str, case: Case, **overrides: Any) -> Any:
    from kvstore.tiering import ModelCost, TierConfig

    page = case.page_bytes
    base: dict[str, Any] = dict(
        device="cpu",
        hbm="owned",
        hbm_bytes=8 * page,
        dram_bytes=16 * page,
        page_bytes=page,
        tokens_per_page=16,
        nvme_path=path,
        model=ModelCost(8e9, 32, 32, 128, 16 << 10),
        compute_flops=case.compute_flops,
        probe_at_open=case.calibrate,
        # Every page is offered once and must stay somewhere: what is measured here is
        # the bandwidth and compute fits, not the NVMe write gate (which declines pages
        # seen once until their ghosts show they are asked for again).
        nvme_write_payoff=None,
    )
    base.update(overrides)
    return TierConfig(**base)


@contextlib.contextmanager
def slow_first_copies(count: int, factor: float = 100.0) -> Iterator[None]:
    """The CPU mover's first ``count`` tickets of each path take ``factor`` times
    as long (a cold or preempted copy): each waits before it completes, on the
    thread that finished it (a worker's, or the store's for a pipelined NVMe batch)."""
    from kvstore.tiering.mover import CPUMover

    if count <= 0:
        yield
        return
    original = CPUMover._finish
    seen: dict[object, int] = {}
    seen_lock = threading.Lock()

    def finish(self: Any, ticket: Any) -> None:
        with seen_lock:
            n = seen.get(ticket.path, 0)
            seen[ticket.path] = n + 1
        if n < count and ticket.started_s is not None:
            time.sleep((factor - 1) * max(0.0, time.monotonic() - ticket.started_s))
        original(self, ticket)

    CPUMover._finish = finish  # type: ignore[method-assign]
    try:
        yield
    finally:
        CPUMover._finish = original  # type: ignore[method-assign]


def poison_stats(path: str, factor: float = 1000.0) -> None:
    """Divide every persisted bandwidth in ``path``'s statistics file by ``factor``."""
    from kvstore.format.names import TIERING_STATS_NAME

    file = Path(path) / TIERING_STATS_NAME
    data = json.loads(file.read_text())
    for fit in data["bandwidth"].values():
        fit["bytes_per_s"] = fit["bytes_per_s"] / factor
    file.write_text(json.dumps(data))


def _spin() -> None:  # pragma: no cover - runs in a child
    while True:
        pass


@contextlib.contextmanager
def busy_host(processes: int) -> Iterator[None]:
    """``processes`` children spinning on the CPU while the block runs."""
    children = [
        multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
        for _ in range(processes)
    ]
    for child in children:
        child.start()
    try:
        yield
    finally:
        for child in children:
            child.kill()
            child.join()


def _offer_chains(tm: Any, page: int, chains: int, watch: list[float | None]) -> int:
    import torch

    opened = time.monotonic()
    offered = 0
    for c in range(chains):
        keys = [f"chain{c}/p{i}".encode() for i in range(CHAIN_PAGES)]
        srcs = [torch.full((page,), (c * 8 + i) % 251, dtype=torch.uint8) for i in range(8)]
        result = tm.offer(keys, srcs)
        result.hbm_release.wait(10)
        tm.step()
        tm.drain(10)
        offered += len(keys)
        if watch[0] is None and all(tm.stats().in_use):
            watch[0] = time.monotonic() - opened
    return offered


def run_case(case: Case, path: str | None = None, *, chains: int = CHAINS) -> Outcome:
    """One open under ``case``; the share of offered pages resident afterwards."""
    from kvstore.tiering import TierManager

    with contextlib.ExitStack() as stack:
        if path is None:
            path = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvt-sound-"))
        store = os.path.join(path, "nvme")
        if case.reopen or case.poisoned_stats:
            # A first life that leaves statistics (and pages) behind.
            with TierManager.open(config(store, Case(page_bytes=case.page_bytes))) as tm:
                _offer_chains(tm, case.page_bytes, 2, [0.0])
        if case.poisoned_stats:
            poison_stats(store)
        stack.enter_context(busy_host(case.busy))
        stack.enter_context(slow_first_copies(case.slow_first))
        start = time.monotonic()
        watch: list[float | None] = [None]
        with TierManager.open(config(store, case)) as tm:
            open_s = time.monotonic() - start
            start = time.monotonic()
            # The recovery window: a tier a bad measurement took out of use is probed
            # back (within seconds); the chains are offered after it (or after 10 s).
            deadline = time.monotonic() + 10
            while not all(tm.stats().in_use) and time.monotonic() < deadline:
                time.sleep(0.02)
            if all(tm.stats().in_use):
                watch[0] = time.monotonic() - start
            offered = _offer_chains(tm, case.page_bytes, chains, [0.0])
            tm.drain(10)
            resident = 0
            for c in range(chains):
                for i in range(CHAIN_PAGES):
                    if tm.lookup([f"chain{c}/p{i}".encode()]).hit_pages:
                        resident += 1
            stats = tm.stats()
        seconds = time.monotonic() - start
    return Outcome(
        case=case,
        offered=offered,
        resident=resident,
        kappa=stats.kappa,
        in_use=stats.in_use,
        in_use_after_s=watch[0],
        open_s=open_s,
        seconds=seconds,
        bandwidth_mb_s={
            name: round(rate / 1e6, 1) for name, rate in stats.bandwidth_bytes_per_s.items()
        },
    )


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    shares = [o.resident_share for o in outcomes]
    recovered = [o.in_use_after_s for o in outcomes if o.in_use_after_s is not None]
    return {
        "opens": len(outcomes),
        "min_resident_share": min(shares) if shares else math.nan,
        "opens_below_0.9": sum(1 for s in shares if s < 0.9),
        "max_in_use_after_s": max(recovered) if recovered else None,
    }


# -- the command line (tools/tier_soundness.py) ------------------------------------

CLI_DESCRIPTION = (
    "Repeated opens of the tier manager under hostile measurements: what stays resident."
)
CASES = {
    "fresh": Case(),
    "reopened": Case(reopen=True),
    "slow-first-copies": Case(slow_first=5),
    "poisoned-stats": Case(poisoned_stats=True),
    "gpu-prior": Case(compute_flops=4e14),
    "gpu-prior-slow-first": Case(compute_flops=4e14, slow_first=5),
    "gpu-prior-poisoned": Case(compute_flops=4e14, poisoned_stats=True),
    # No calibration at open: only exploration can correct the poisoned estimates.
    "gpu-prior-poisoned-uncalibrated": Case(
        compute_flops=4e14, poisoned_stats=True, calibrate=False
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=CLI_DESCRIPTION)
    parser.add_argument("--opens", type=int, default=3, help="opens per case")
    parser.add_argument("--pages", default="65536,262144,2097152", help="page sizes, bytes")
    parser.add_argument("--cases", default=",".join(CASES), help="which cases")
    parser.add_argument("--busy", default="0,2", help="spinning processes, per host load")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args(argv)
    outcomes = []
    for page in (int(p) for p in args.pages.split(",")):
        for busy in (int(b) for b in args.busy.split(",")):
            for name in args.cases.split(","):
                for _ in range(args.opens):
                    case = replace(CASES[name], page_bytes=page, busy=busy)
                    outcome = run_case(case)
                    outcomes.append((name, outcome))
                    if not args.json:
                        print(
                            f"{page >> 10:5} KiB busy={busy} {name:22} resident "
                            f"{outcome.resident:3}/{outcome.offered} "
                            f"kappa=({', '.join(f'{k:.3g}' for k in outcome.kappa)}) "
                            f"open {outcome.open_s:.2f} s, every tier in use "
                            f"{outcome.in_use_after_s} s after it",
                            flush=True,
                        )
    # The verdict is over the CPU-class cases; with a GPU's C_eff on this CPU host a
    # slow disk is rightly out of use (kappa < 1 measured true), so those report only
    # how fast the estimates came back.
    report = summarize([o for _, o in outcomes if o.case.compute_flops is None])
    if args.json:
        body = {"summary": report, "opens": [dict(o.to_json(), name=n) for n, o in outcomes]}
        print(json.dumps(body, indent=2))
    else:
        print(json.dumps(report))
    return 1 if report["opens_below_0.9"] else 0
