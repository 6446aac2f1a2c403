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

Without CUDA it checks and measures the CPU path only. Exit status 1 if any
correctness check failed. The cuda and gds parts have not yet been run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvstore import KVStore
from kvstore.gpu import GDSUnavailableError, TensorIO
from kvstore.gpu._tensors import byte_view, device_checksum

MIB = 1 << 20
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8]
SIZES = [64 << 10, 256 << 10, 1 * MIB, 4 * MIB]


def random_tensor(dtype: Any, nbytes: int, device: torch.device, seed: int) -> Any:
    generator = torch.Generator().manual_seed(seed)
    count = nbytes // torch.empty((), dtype=dtype).element_size()
    if dtype.is_floating_point:
        flat = torch.randn(count, generator=generator).to(dtype)
    else:
        flat = torch.randint(-128, 128, (count,), generator=generator).to(dtype)
    return flat.reshape(-1, 128).to(device)


def poisoned(tensor: Any) -> Any:
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


def timed(device: torch.device, run: Any, moved_bytes: int) -> float:
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
            rates[f"store -> {device.type} via {backend}"] = timed(
                device, lambda t=tensor_io: t.load(keys, destinations).wait(), total
            )
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, help="where the store goes (the disk to test)")
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--page-mib", type=float, default=1.0)
    parser.add_argument("--no-fio", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    page_bytes = int(args.page_mib * MIB) // 4096 * 4096
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
    print("correctness:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
