"""The targets, the report and the command line of tools/bench_tiering.py; the
measurements are kvstore/bench/tiering.py's (its docstring says what each part times,
against what). See docs/benchmarks.md, "The tier manager".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore.bench import tiering
from kvstore.bench.common import KIB, finite
from kvstore.bench.common import machine_info as common_machine_info
from kvstore.bench.tiering import (
    PARTS,
    bench_dram,
    bench_lookup,
    bench_nvme,
    bench_offer_cpu,
    bench_offer_fake,
    bench_plan,
    bench_writeback,
    profile_bookkeeping,
)
from kvstore.clikit import progress_line

REPO = Path(__file__).resolve().parents[2]  # the checkout: bench-data/ goes there


@dataclass(frozen=True, slots=True)
class Target:
    """``metric`` against ``bound``: at most (``upper``) or at least."""

    metric: str
    bound: float
    upper: bool
    text: str


TARGETS = (
    Target("lookup_us_per_page", 1.5, True, "lookup of a 128-page prefix <= 1.5 us/page"),
    Target("offer_us_per_page", 10.0, True, "offer bookkeeping <= 10 us/page"),
    Target("dram_load_ratio", 0.8, False, "DRAM -> destination >= 0.8x torch copy_"),
    Target("nvme_load_ratio", 0.9, False, "NVMe -> DRAM >= 0.9x get_many_into"),
    Target("slow_disk_ttft_ratio", 1.01, True, "kappa < 1: TTFT within 1% of recompute"),
    Target("fast_disk_ttft_ratio", 1.01, True, "kappa > 1: TTFT within 1% of always-load"),
)


# -- the run -----------------------------------------------------------------------


def machine_info(directory: Path) -> dict[str, Any]:
    """``kvstore bench``'s machine facts, with torch's and this run's directory."""
    info: dict[str, Any] = dict(common_machine_info(directory))
    info.update(
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        cuda=torch.cuda.is_available(),
        dir=str(directory.resolve()),
        loadavg_start=os.getloadavg(),
    )
    return info


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target that this run measured."""
    values: dict[str, float] = {}
    book = results.get("bookkeeping")
    if book:
        values["lookup_us_per_page"] = book["lookup"]["lookup"]["cpu_us_median"]
        values["offer_us_per_page"] = max(
            book["offer_fake"]["free_slots"]["cpu_us_median"],
            book["offer_fake"]["full_dram"]["cpu_us_median"],
        )
    if "dram" in results:
        values["dram_load_ratio"] = results["dram"]["ratio"]
    if "nvme" in results:
        values["nvme_load_ratio"] = results["nvme"]["ratio"]
    if "plan" in results:
        for name in ("slow_disk", "fast_disk"):
            part = results["plan"][name]
            values[f"{name}_ttft_ratio"] = max(part["ratio_mean"], part["ratio_p50"])
    rows = []
    for target in TARGETS:
        if target.metric not in values:
            continue
        value = values[target.metric]
        met = value <= target.bound if target.upper else value >= target.bound
        rows.append({"target": target.text, "value": value, "met": met})
    return rows


def print_report(document: dict[str, Any]) -> None:
    results = document["results"]
    machine = document["machine"]
    code = machine["code"]
    print(
        f"tier manager bench - {machine['nproc']} CPUs, {machine['cpu_model']}, "
        f"{machine['mount'].get('fs', '?')}, torch threads {machine['torch_threads']}, "
        f"load {machine['loadavg_start'][0]:.2f}, kvstore {code['git_head']}"
        f"{'+dirty' if code['kvstore_dirty'] else ''} ({code.get('package_dir', '?')})"
    )
    book = results.get("bookkeeping")
    if book:
        lookup = book["lookup"]
        print("bookkeeping, us per page (thread CPU, median / min of batches; the walk's median):")
        rows = [
            ("lookup, 128-page prefix in DRAM", lookup["lookup"]),
            ("  reference: bare dict walk of the keys", lookup["bare_loop"]),
            ("offer, fake mover, free slots", book["offer_fake"]["free_slots"]),
            ("offer, fake mover, full DRAM (evicts)", book["offer_fake"]["full_dram"]),
        ]
        floor = lookup["bare_loop"]["cpu_us_median"]
        for label, row in rows:
            print(
                f"  {label:44} {row['cpu_us_median']:8.2f} / {row['cpu_us_min']:.2f}"
                f"  ({row['cpu_us_median'] / floor:5.0f}x the bare walk)"
            )
        cpu = book["offer_cpu"]
        kib = cpu["page_bytes"] // KIB
        print(
            f"  offer, CPU mover, {kib} KiB pages: caller CPU {cpu['caller_cpu_us_median']:.2f};"
            f" until release {cpu['until_release_us_median']:.2f} - torch copy "
            f"{cpu['torch_copy_us_median']:.2f} = {cpu['until_release_minus_copy_us_median']:.2f}"
        )
    writeback = results.get("writeback")
    if writeback:
        print(
            f"writeback: {writeback['pages']} x {writeback['page_bytes'] // KIB} KiB, "
            f"{writeback['per_offer']} per offer: manager {writeback['manager_mbps']:,.0f} MB/s"
            f", put_many batch by batch {writeback['reference_mbps']:,.0f} MB/s, "
            f"ratio {writeback['ratio']:.3f}"
        )
    for name in ("dram", "nvme"):
        part = results.get(name)
        if not part:
            continue
        print(
            f"{name}: {part['pages']} x {part['page_bytes'] // KIB} KiB: manager "
            f"{part['manager_mbps']:,.0f} MB/s, reference {part['reference_mbps']:,.0f} MB/s, "
            f"ratio {part['ratio']:.3f}"
        )
        print(f"  manager, ms from lookup (medians): {format_split(part)}")
        fresh = part.get("fresh_open")
        if fresh:
            print(
                f"  first load of a fresh open (DRAM arena untouched): "
                f"{fresh['manager_mbps']:,.0f} MB/s, ratio {fresh['ratio']:.3f}; "
                f"{format_split(fresh)}"
            )
    plan = results.get("plan")
    if plan:
        print(f"plan: {plan['trace']}, capacity blocks {plan['capacity_blocks']}")
        for name in ("slow_disk", "fast_disk"):
            part = plan[name]
            ttft = part["ttft"]
            print(
                f"  {name} ({part['nvme_gbps']} GB/s, kappa_nvme {part['kappa_nvme']:.2f}): "
                f"states {part['states']}, NVMe-only hits answered MISS "
                f"{part['nvme_only_answered_miss']}/{part['nvme_only_hits']}, loaded "
                f"{part['loaded_pages']}/{part['hit_pages']} hit pages "
                f"({part.get('loaded_from_nvme', '?')} from NVMe)"
            )
            for policy in ("kvstore", "recompute", "load_all"):
                print(
                    f"    {policy:10} TTFT p50 {ttft[policy]['p50_s'] * 1e3:8.2f} ms, "
                    f"mean {ttft[policy]['mean_s'] * 1e3:8.2f} ms"
                )
            print(
                f"    kvstore / {part['ratio_to']}: p50 {part['ratio_p50']:.4f}, "
                f"mean {part['ratio_mean']:.4f}"
            )
            for peer in part["sim_peers"]:
                print(
                    f"    sim {peer['policy']:10} hit ratio {peer['hit_ratio']:.3f}, "
                    f"TTFT p50 {peer['ttft_p50_s'] * 1e3:.2f} ms"
                )
    for name, text in results.get("profiles", {}).items():
        print(f"cProfile, {name}:")
        print(text)
    print("targets:")
    for row in document["verdicts"]:
        verdict = "met" if row["met"] else "NOT MET"
        print(f"  {row['target']:48} {row['value']:10.4f}  {verdict}")


def format_split(part: dict[str, Any]) -> str:
    split = part["manager_split_median_ms"]
    names = ("read_end_ms", "copy_start_ms", "copy_end_ms", "wait_returned_ms")
    return ", ".join(f"{n[:-3].replace('_', ' ')} {split[n]:.1f}" for n in names if n in split)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(tiering.__doc__ or "").split("\n")[0])
    parser.add_argument("--dir", type=Path, default=REPO / "bench-data" / "tiering")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--reps", type=int, default=9, help="batches / alternating runs")
    parser.add_argument("--calls", type=int, default=50, help="lookups or offers per batch")
    parser.add_argument("--pages", type=int, default=64, help="pages per load")
    parser.add_argument("--page-kib", type=int, default=1024, help="page size of the loads")
    parser.add_argument("--offer-page-kib", type=int, default=64, help="CPU-mover offer pages")
    parser.add_argument("--offer-pages", type=int, default=8, help="pages per offer (writeback)")
    parser.add_argument("--requests", type=int, default=1500, help="trace length (plan)")
    parser.add_argument(
        "--capacity",
        type=float,
        nargs=3,
        default=(0.0, 0.05, 1.0),
        metavar=("HBM", "DRAM", "NVME"),
        help="tier capacities as fractions of the trace's unique blocks (plan)",
    )
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="cProfile lookup and offer: top N"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--report", type=Path, default=None, help="print a saved --out JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        print_report(json.loads(args.report.read_text()))
        return 0
    torch.set_num_threads(args.torch_threads)
    args.dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info(args.dir)
    started = time.time()
    results: dict[str, Any] = {}
    page_bytes = args.page_kib * KIB
    if "bookkeeping" in args.only:
        progress_line("bookkeeping: lookup")
        lookup = bench_lookup(args.reps, args.calls)
        progress_line("bookkeeping: offer")
        results["bookkeeping"] = {
            "lookup": lookup,
            "offer_fake": bench_offer_fake(args.reps, max(1, args.calls // 10)),
            "offer_cpu": bench_offer_cpu(args.reps, args.offer_page_kib * KIB),
        }
    if args.profile:
        progress_line("bookkeeping: cProfile")
        results["profiles"] = profile_bookkeeping(args.profile)
    if "dram" in args.only:
        progress_line("dram -> destination")
        results["dram"] = bench_dram(args.pages, page_bytes, 2 * args.reps + 1)
    if "nvme" in args.only:
        progress_line("nvme -> destination")
        results["nvme"] = bench_nvme(args.dir, args.pages, page_bytes, args.reps)
    if "writeback" in args.only:
        progress_line("writeback: dram -> nvme")
        results["writeback"] = bench_writeback(
            args.dir, args.pages, page_bytes, args.reps, args.offer_pages
        )
    if "plan" in args.only:
        progress_line("plan: replaying the trace")
        results["plan"] = bench_plan(args.requests, tuple(args.capacity))
    document = {
        "machine": machine,
        "settings": {**vars(args), "command": " ".join([sys.executable, *sys.argv])},
        "started_unix": started,
        "elapsed_s": time.time() - started,
        "loadavg_end": os.getloadavg(),
        "results": results,
    }
    document["verdicts"] = verdicts(results)
    text = json.dumps(finite(document), indent=2, default=str, allow_nan=False)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print_report(document)
    return 0
