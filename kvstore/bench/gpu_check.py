"""One prepared check of the HBM path on a machine with a GPU (and, reduced, on one without).

    python tools/gpu_check.py --dir /nvme/kvstore-gpu-check [--pages 256] [--page-mib 1]

1. Correctness: fp16/bf16/fp32/int8 pages of 64 KiB - 4 MiB, random data, are
   saved, then loaded into destinations poisoned with NaN (or -1) first, and
   every byte is compared; for each backend this host has (cpu; or pinned and
   gds on CUDA). Also checks that the device checksum agrees between CPU and GPU.
2. Bandwidth (one table): store -> HBM via pinned, via GDS, a pageable-memory
   baseline (get_into a plain host buffer, then .to(device)), torch's pinned
   host -> device copy ceiling, and fio's O_DIRECT read rate on the same
   directory; each as GB/s and as a ratio of fio's rate.
3. Tier manager (``--tier-only`` runs just these, ``--no-tier`` skips them): DRAM ->
   HBM loads against torch's pinned H2D copies, loads overlapping matmuls, and an
   offer whose source is overwritten right after its release event, loaded back and
   checksummed (see "tier manager" below). Skipped without CUDA; ``--tier-dry-run``
   runs the parts that make sense on the CPU mover.

Without CUDA it checks and measures the CPU path only. Exit status 1 if any
correctness check failed. This module is the command line of tools/gpu_check.py.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from kvstore import KVStore
from kvstore.bench.common import MIB
from kvstore.bench.tiering import dram_arena, dram_slots
from kvstore.gpu import GDSUnavailableError, TensorIO
from kvstore.gpu._tensors import byte_view, device_checksum
from kvstore.tiering import LookupState, ModelCost, TierConfig, TierManager
from kvstore.tiering.results import ReleaseHandle

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8]
SIZES = [64 << 10, 256 << 10, 1 * MIB, 4 * MIB]


def random_tensor(dtype: torch.dtype, nbytes: int, device: torch.device, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    count = nbytes // torch.empty((), dtype=dtype).element_size()
    if dtype.is_floating_point:
        flat = torch.randn(count, generator=generator).to(dtype)
    else:
        flat = torch.randint(-128, 128, (count,), generator=generator).to(dtype)
    return flat.reshape(-1, 128).to(device)


def poisoned(tensor: Tensor) -> Tensor:
    out = torch.empty_like(tensor)
    return out.fill_(float("nan") if tensor.dtype.is_floating_point else -1)


def backends(device: torch.device) -> list[str]:
    return ["pinned", "gds"] if device.type == "cuda" else ["cpu"]


def open_tensor_io(store: KVStore, device: torch.device, backend: str) -> TensorIO | None:
    try:
        return TensorIO(store, device, backend=backend)
    except GDSUnavailableError as e:
        print(f"  {backend}: unavailable: {e}")
        return None


def check_correctness(store: KVStore, device: torch.device) -> bool:
    ok = True
    for backend in backends(device):
        tensor_io = open_tensor_io(store, device, backend)
        if tensor_io is None:
            continue
        with tensor_io:
            for dtype in DTYPES:
                for nbytes in SIZES:
                    keys = [f"check/{backend}/{dtype}/{nbytes}/{i}" for i in range(3)]
                    sources = [random_tensor(dtype, nbytes, device, i) for i in range(3)]
                    tensor_io.save(keys, sources, sync=True).wait()
                    destinations = [poisoned(s) for s in sources]
                    tensor_io.load(keys, destinations).wait()
                    good = all(
                        torch.equal(byte_view(s), byte_view(d))
                        for s, d in zip(sources, destinations, strict=True)
                    )
                    ok &= good
                    verdict = "ok" if good else "FAILED"
                    print(f"  {backend:6} {dtype!s:15} {nbytes >> 10:5} KiB  {verdict}")
    if device.type == "cuda":
        data = torch.randint(0, 256, (MIB + 3,), dtype=torch.uint8)
        good = device_checksum(data) == device_checksum(data.to(device))
        ok &= good
        print(f"  device checksum cpu == cuda: {'ok' if good else 'FAILED'}")
    return ok


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, run: Callable[[], object], moved_bytes: int) -> float:
    run()  # warm-up
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return moved_bytes / (time.perf_counter() - start) / 1e9


def bandwidth(
    store: KVStore, device: torch.device, pages: int, page_bytes: int
) -> dict[str, float]:
    rates: dict[str, float] = {}
    keys = [f"bw/{i}" for i in range(pages)]
    sources = [random_tensor(torch.float16, page_bytes, device, i) for i in range(pages)]
    destinations = [torch.empty_like(s) for s in sources]
    total = pages * page_bytes
    for backend in backends(device):
        tensor_io = open_tensor_io(store, device, backend)
        if tensor_io is None:
            continue
        with tensor_io:
            if backend == backends(device)[0]:
                tensor_io.save(keys, sources, sync=True).wait()

            def load(loader: TensorIO = tensor_io) -> None:
                loader.load(keys, destinations).wait()

            rates[f"store -> {device.type} via {backend}"] = timed(device, load, total)
    host = bytearray(page_bytes)

    def pageable() -> None:
        for key, destination in zip(keys, destinations, strict=True):
            store.get_into(key, host)
            byte_view(destination).copy_(torch.frombuffer(host, dtype=torch.uint8))

    rates["pageable baseline (get_into + copy)"] = timed(device, pageable, total)
    if device.type == "cuda":
        pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        target = torch.empty(total, dtype=torch.uint8, device=device)
        rates["torch pinned H2D ceiling"] = timed(
            device, lambda: target.copy_(pinned, non_blocking=True), total
        )
    return rates


def fio_rate(directory: Path, page_bytes: int, total_bytes: int) -> float | None:
    if shutil.which("fio") is None:
        print("  fio not found: no disk reference")
        return None
    target = directory / "fio.dat"
    command = [
        "fio", "--name=read", f"--filename={target}", "--rw=read", f"--bs={page_bytes}",
        "--direct=1", f"--size={max(total_bytes, 256 * MIB)}", "--ioengine=io_uring",
        "--iodepth=32", "--output-format=json",
    ]  # fmt: skip
    try:
        done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
        report = json.loads(done.stdout)
        return float(report["jobs"][0]["read"]["bw_bytes"]) / 1e9
    except (subprocess.SubprocessError, KeyError, ValueError) as e:
        print(f"  fio failed: {e}")
        return None
    finally:
        target.unlink(missing_ok=True)


# -- tier manager ------------------------------------------------------------------
#
# The TierManager on CUDA (docs/benchmarks.md, "The tier manager"). Three checks, each
# skipped without CUDA (``--tier-dry-run`` runs the first and the last on the CPU
# mover, to check this script, not the GPU):
#
# 1. DRAM -> HBM loads >= 0.8x torch's pinned H2D rate: prepare_load of pages resident
#    in the pinned DRAM arena into device tensors, timed to the handle's CUDA event
#    (what an engine's stream waits on) and to ``handle.wait()`` returning (the host
#    path, which includes the control thread's harvest), against a loop of
#    ``dst.copy_(slot, non_blocking=True)`` on the same buffers, and the one-copy
#    ceiling of a single pinned buffer.
# 2. Loads overlap compute: matmuls on an engine-like stream, timed alone, the load
#    alone, then both at once; the overlap is the share of the shorter one hidden.
# 3. Offer, then overwrite the source right after the release event (rules R1/R2 of
#    docs/tiering.md): the payload is written on a compute stream behind a long matmul,
#    the offer waits on the producer's event, the compute stream waits on
#    ``hbm_release.event`` and then overwrites the source at once; loaded back, every
#    page's checksum must equal the payload's. Into DRAM (D2H) and into the owned HBM
#    pool (D2D).

TIER_OVERLAP_FLOOR = 0.5  # at least half of the shorter of the two hidden
TIER_LOAD_FLOOR = 0.8


def tier_config(device: torch.device, pages: int, page_bytes: int, hbm_pages: int) -> TierConfig:
    return TierConfig(
        device=str(device),
        hbm_bytes=hbm_pages * page_bytes,
        dram_bytes=(pages + 8) * page_bytes,
        page_bytes=page_bytes,
        tokens_per_page=8,
        # 128 KiB of K and V per token (Llama-3.1-8B); recompute made slow: plans load.
        model=ModelCost(8.03e9, 32, 32, 128, max(page_bytes // 8, 1)),
        compute_flops=1e9,
        admission="all",
        hysteresis_s=0.0,
    )


def tier_keys(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}/{i:05d}".encode() for i in range(count)]


def tier_sources(device: torch.device, pages: int, page_bytes: int, seed: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=generator).to(device)
        for _ in range(pages)
    ]


def offer_and_settle(tm: TierManager, keys: list[bytes], sources: list[Tensor], tier: int) -> None:
    result = tm.offer(keys, sources)
    if not result.hbm_release.wait(60) or result.tiers != (tier,) * len(keys):
        raise RuntimeError(
            f"offer placed {set(result.tiers)}, not tier {tier}: {result.reasons[:2]}"
        )
    tm.drain()


def timed_load(
    tm: TierManager, keys: list[bytes], destinations: list[Tensor], *, sync_first: bool = True
) -> dict[str, float]:
    """One lookup/prepare_load/wait/complete_load; seconds to each milestone. Without
    a CUDA event (the CPU mover) the bytes are there when ``wait`` returns."""
    if sync_first:
        synchronize(destinations[0].device)
    start = time.perf_counter()
    result = tm.lookup(keys)
    if result.state is not LookupState.READY or result.plan.load_pages != len(keys):
        raise RuntimeError(f"lookup said {result.state} ({result.plan.reason})")
    looked_up = time.perf_counter()
    handle = tm.prepare_load(result.plan, destinations)
    prepared = time.perf_counter()
    event = handle.event
    if event is not None:
        event.synchronize()  # the bytes are on the device: an engine's stream may go on
    on_device = time.perf_counter()
    if not handle.wait(60) or tm.complete_load(handle) != len(keys):
        raise RuntimeError("the load did not finish")
    waited = time.perf_counter()
    if event is None:
        on_device = waited
    return {
        "lookup_s": looked_up - start,
        "prepare_s": prepared - looked_up,
        "device_s": on_device - start,
        "wait_s": waited - start,
    }


def median_of(runs: list[dict[str, float]], name: str) -> float:
    return sorted(run[name] for run in runs)[len(runs) // 2]


def tier_bandwidth(
    device: torch.device, pages: int, page_bytes: int, reps: int = 7
) -> tuple[bool, dict[str, float]]:
    keys = tier_keys("bw", pages)
    sources = tier_sources(device, pages, page_bytes, seed=5)
    destinations = [torch.zeros(page_bytes, dtype=torch.uint8, device=device) for _ in keys]
    total = pages * page_bytes
    with TierManager.open(tier_config(device, pages, page_bytes, hbm_pages=0)) as tm:
        offer_and_settle(tm, keys, sources, tier=1)
        slots = dram_slots(tm, keys, page_bytes)
        runs = [timed_load(tm, keys, destinations) for _ in range(reps + 1)][1:]
        ok = all(torch.equal(d, s) for d, s in zip(destinations, sources, strict=True))

        def loop() -> None:
            for destination, slot in zip(destinations, slots, strict=True):
                destination.copy_(slot, non_blocking=True)

        reference = sorted(seconds_of(device, loop) for _ in range(reps))[reps // 2]
        pinned_flag = dram_arena(tm).pinned
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty(total, dtype=torch.uint8, device=device)
    ceiling = sorted(
        seconds_of(device, lambda: target.copy_(pinned, non_blocking=True)) for _ in range(reps)
    )[reps // 2]
    device_s = median_of(runs, "device_s")
    rates = {
        "manager, to the handle's event": total / device_s / 1e9,
        "manager, to handle.wait() returning": total / median_of(runs, "wait_s") / 1e9,
        "torch copy_ loop, same buffers": total / reference / 1e9,
        "torch one pinned copy (ceiling)": total / ceiling / 1e9,
    }
    ratio = reference / device_s
    print(
        f"  dram arena pinned: {pinned_flag}; host time per page: lookup "
        f"{median_of(runs, 'lookup_s') / pages * 1e6:.1f} us, prepare_load "
        f"{median_of(runs, 'prepare_s') / pages * 1e6:.1f} us"
    )
    for name, rate in rates.items():
        print(f"  {name:40} {rate:8.2f} GB/s")
    met = ratio >= TIER_LOAD_FLOOR
    print(
        f"  DRAM -> {device.type} {ratio:.2f}x the copy_ loop (>= {TIER_LOAD_FLOOR}): "
        f"{'met' if met else 'NOT MET'}; bytes {'ok' if ok else 'WRONG'}"
    )
    return ok, rates


def seconds_of(device: torch.device, run: Callable[[], object]) -> float:
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def tier_overlap(device: torch.device, pages: int, page_bytes: int) -> bool:
    """Loads during matmuls on another stream: the copies must not wait for compute."""
    keys = tier_keys("overlap", pages)
    sources = tier_sources(device, pages, page_bytes, seed=6)
    destinations = [torch.zeros(page_bytes, dtype=torch.uint8, device=device) for _ in keys]
    compute: torch.cuda.Stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    a = torch.randn(8192, 8192, device=device, dtype=torch.float16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.float16)
    with TierManager.open(tier_config(device, pages, page_bytes, hbm_pages=0)) as tm:
        offer_and_settle(tm, keys, sources, tier=1)
        timed_load(tm, keys, destinations)  # warm-up
        load_s = timed_load(tm, keys, destinations)["device_s"]
        torch.matmul(a, b)  # warm-up: cuBLAS picks its kernel
        one = seconds_of(device, lambda: torch.matmul(a, b))
        count = max(2, math.ceil(load_s / max(one, 1e-6)))

        def matmuls() -> None:
            compute.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(compute):
                for _ in range(count):
                    torch.matmul(a, b)

        def matmuls_alone() -> None:
            matmuls()
            compute.synchronize()

        matmul_s = seconds_of(device, matmuls_alone)
        synchronize(device)
        start = time.perf_counter()
        matmuls()
        timed_load(tm, keys, destinations, sync_first=False)  # no device-wide sync here
        compute.synchronize()
        both_s = time.perf_counter() - start
        ok = all(torch.equal(d, s) for d, s in zip(destinations, sources, strict=True))
    hidden = (matmul_s + load_s - both_s) / min(matmul_s, load_s)
    met = hidden >= TIER_OVERLAP_FLOOR
    print(
        f"  {count} matmuls {matmul_s * 1e3:.2f} ms, load {load_s * 1e3:.2f} ms, both "
        f"{both_s * 1e3:.2f} ms: {hidden:.0%} of the shorter hidden "
        f"(>= {TIER_OVERLAP_FLOOR:.0%}): {'met' if met else 'NOT MET'}; "
        f"bytes {'ok' if ok else 'WRONG'}"
    )
    return ok  # the overlap is a measurement; only wrong bytes fail the check


def tier_overwrite_race(device: torch.device, pages: int, page_bytes: int) -> bool:
    """Offer, overwrite the sources right after the release event, load back, compare."""
    ok = True
    cuda = device.type == "cuda"
    for hbm_pages, tier in ((0, 1), (pages + 8, 0)):
        if not cuda and tier == 0:
            continue  # an owned HBM pool needs a device
        keys = tier_keys(f"race{tier}", pages)
        payload = tier_sources(device, pages, page_bytes, seed=7 + tier)
        want = [device_checksum(p) for p in payload]
        sources = [torch.zeros_like(p) for p in payload]
        with TierManager.open(tier_config(device, pages, page_bytes, hbm_pages)) as tm:
            produced = write_late(device, sources, payload)
            result = tm.offer(keys, sources, event=produced)
            if result.tiers != (tier,) * pages:
                raise RuntimeError(f"race: offer placed {set(result.tiers)}, not {tier}")
            release = result.hbm_release.event
            overwrite_after(device, sources, release, result.hbm_release)
            tm.drain()
            destinations = [torch.zeros_like(p) for p in payload]
            timed_load(tm, keys, destinations)
            got = [device_checksum(d) for d in destinations]
        bad = sum(1 for g, w in zip(got, want, strict=True) if g != w)
        ok &= bad == 0
        where = "HBM (D2D)" if tier == 0 else f"DRAM ({'D2H' if cuda else 'host copy'})"
        how = "release event" if release is not None else "release.wait() (no event)"
        print(
            f"  offer -> overwrite after {how} -> load, into {where}: "
            f"{pages - bad}/{pages} checksums equal {'ok' if bad == 0 else 'FAILED'}"
        )
    return ok


def write_late(
    device: torch.device, sources: list[Tensor], payload: list[Tensor]
) -> torch.cuda.Event | None:
    """Write the payload into the sources behind a long matmul on a compute stream; the
    producer's event (R1) after it. A mover that ignored the event would copy zeros."""
    if device.type != "cuda":
        for source, data in zip(sources, payload, strict=True):
            source.copy_(data)
        return None
    compute: torch.cuda.Stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    compute.wait_stream(torch.cuda.current_stream(device))
    a = torch.randn(8192, 8192, device=device, dtype=torch.float16)
    with torch.cuda.stream(compute):
        for _ in range(8):
            a = torch.matmul(a, a).clamp_(-1, 1)
        for source, data in zip(sources, payload, strict=True):
            source.copy_(data)
    produced: torch.cuda.Event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    produced.record(compute)
    for source in sources:
        source.record_stream(compute)
    return produced


def overwrite_after(
    device: torch.device,
    sources: list[Tensor],
    event: torch.cuda.Event | None,
    release: ReleaseHandle,
) -> None:
    """Overwrite every source as soon as the manager says it may be (R2): on the GPU
    behind the release event, without a host wait; else after ``release.wait()``."""
    if event is None:
        if not release.wait(60):
            raise RuntimeError("race: the release never came")
        for source in sources:
            source.fill_(0xA5)
        return
    stream: torch.cuda.Stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    stream.wait_event(event)
    with torch.cuda.stream(stream):
        for source in sources:
            source.fill_(0xA5)
            source.record_stream(stream)
    stream.synchronize()


def check_tier(device: torch.device, pages: int, page_bytes: int, dry_run: bool) -> bool:
    """The tier manager's GPU checks; skipped (True) without CUDA unless ``dry_run``."""
    if device.type != "cuda" and not dry_run:
        print("tier manager: skipped: no CUDA (--tier-dry-run runs the CPU parts)")
        return True
    print(f"tier manager ({'dry run on the CPU mover' if device.type != 'cuda' else device}):")
    ok, _ = tier_bandwidth(device, pages, page_bytes)
    if device.type == "cuda":
        ok &= tier_overlap(device, pages, page_bytes)
    else:
        print("  overlap with a matmul: needs CUDA, skipped")
    ok &= tier_overwrite_race(device, min(pages, 64), page_bytes)
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, help="where the store goes (the disk to test)")
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--page-mib", type=float, default=1.0)
    parser.add_argument("--no-fio", action="store_true")
    parser.add_argument("--tier-only", action="store_true", help="only the tier manager checks")
    parser.add_argument("--no-tier", action="store_true", help="skip the tier manager checks")
    parser.add_argument(
        "--tier-dry-run", action="store_true", help="without CUDA, run the tier checks on the CPU"
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    page_bytes = int(args.page_mib * MIB) // 4096 * 4096
    if args.tier_only:
        print(f"device: {device}")
        ok = check_tier(device, args.pages, page_bytes, args.tier_dry_run)
        print("tier manager:", "PASSED" if ok else "FAILED")
        return 0 if ok else 1
    base = args.dir or Path(tempfile.mkdtemp(prefix="kvstore-gpu-check-"))
    base.mkdir(parents=True, exist_ok=True)
    path = base / "store"
    shutil.rmtree(path, ignore_errors=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "no CUDA"
    print(f"device: {device} ({name})")
    with KVStore.open(path, create=True, segment_bytes=256 * MIB, max_page_bytes=4 * MIB) as store:
        print(f"store: {path} io_engine={store.stats().io_engine} direct_io={store.direct_io}")
        print("correctness:")
        ok = check_correctness(store, device)
        print(f"bandwidth: {args.pages} pages of {page_bytes >> 10} KiB")
        rates = bandwidth(store, device, args.pages, page_bytes)
    shutil.rmtree(path, ignore_errors=True)
    reference = None if args.no_fio else fio_rate(base, page_bytes, args.pages * page_bytes)
    if reference is not None:
        rates["fio O_DIRECT read, same disk"] = reference
    print(f"{'path':40} {'GB/s':>8} {'x fio':>7}")
    for name, rate in rates.items():
        ratio = f"{rate / reference:7.2f}" if reference else "      -"
        print(f"{name:40} {rate:8.2f} {ratio}")
    if not args.no_tier:
        ok &= check_tier(device, args.pages, page_bytes, args.tier_dry_run)
    print("correctness:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1
