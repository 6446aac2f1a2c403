"""fio on the bench directory: the device limit every kvstore number is judged against.

The job files live in ``fio_profiles/`` at the repository root; each reads its
directory, size and time cap from ``BENCH_DIR``, ``BENCH_SIZE`` and
``BENCH_RUNTIME``. When fio is not installed the phase returns no rows and the
report says so (``FioStatus.available`` is False).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.bench.common import Measurement, Reporter

__all__ = ["FIO_PROFILES", "FioStatus", "find_fio", "run_fio_profiles"]

PROFILES_DIR = Path(__file__).resolve().parent.parent.parent / "fio_profiles"

# profile -> what it stands for in kvstore's terms
FIO_PROFILES: dict[str, str] = {
    "seq_write_1m": "1 MiB sequential appends, qd32 (segment writes)",
    "seq_write_256k_sync": "256 KiB sequential appends, qd32, fdatasync every 64 (durable puts)",
    "randread_256k_qd1": "256 KiB random reads, qd1 (single get)",
    "randread_256k_qd32": "256 KiB random reads, qd32 (get_many)",
    "mixed_70_30": "256 KiB random 70% read / 30% write, qd32 (serving + offload)",
    "wal_append": "4 KiB appends + fdatasync each (WAL group commit)",
}
WAL_RUNTIME_S = 5


@dataclass(frozen=True, slots=True)
class FioStatus:
    """Whether fio ran, and why not when it did not."""

    available: bool
    path: str | None
    version: str
    reason: str = ""


def find_fio(explicit: str | None = None) -> FioStatus:
    """Locate fio: ``explicit`` (a path, or "none" to skip), else ``$PATH``."""
    if explicit == "none":
        return FioStatus(False, None, "", "fio disabled (--fio none)")
    if not PROFILES_DIR.is_dir():
        return FioStatus(False, None, "", f"fio profiles not found at {PROFILES_DIR}")
    path = explicit if explicit else shutil.which("fio")
    if not path or not os.access(path, os.X_OK):
        return FioStatus(False, None, "", f"fio not found ({explicit or 'not on PATH'})")
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return FioStatus(False, path, "", f"fio --version failed: {e}")
    return FioStatus(True, path, done.stdout.strip())


def _pct_us(stats: dict[str, Any], pct: str) -> float | None:
    value = stats.get("percentile", {}).get(pct)
    return None if value is None else value / 1000.0


def _size_bytes(text: str) -> int:
    """fio's ``bs=256k`` / ``1M`` / ``4096`` -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower()
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text or 0)


def parse_fio(profile: str, document: dict[str, Any]) -> Measurement:
    """One fio ``--output-format=json`` document -> one Measurement."""
    job = document["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio profile {profile} failed with error {job['error']}")
    read, write, sync = job["read"], job["write"], job.get("sync", {})
    seconds = job["job_runtime"] / 1000.0
    moved = int(read["io_bytes"]) + int(write["io_bytes"])
    ops = int(read["total_ios"]) + int(write["total_ios"])
    p50 = p99 = None
    if profile == "wal_append":
        p50 = _pct_us(sync.get("lat_ns", {}), "50.000000")
        p99 = _pct_us(sync.get("lat_ns", {}), "99.000000")
    elif read["total_ios"]:
        p50 = _pct_us(read["lat_ns"], "50.000000") or _pct_us(read["clat_ns"], "50.000000")
        p99 = _pct_us(read["lat_ns"], "99.000000") or _pct_us(read["clat_ns"], "99.000000")
    extra = {
        "read_mb_per_s": read["bw_bytes"] / 1e6,
        "write_mb_per_s": write["bw_bytes"] / 1e6,
        "usr_cpu_pct": float(job["usr_cpu"]),
        "sys_cpu_pct": float(job["sys_cpu"]),
    }
    clat50 = _pct_us(read["clat_ns"], "50.000000") if read["total_ios"] else None
    if clat50 is not None:
        extra["read_clat_p50_us"] = clat50
    return Measurement(
        name=f"fio.{profile}",
        label=f"fio {FIO_PROFILES.get(profile, profile)}",
        group="fio",
        page_bytes=_size_bytes(job["job options"].get("bs", "0")),
        ops=ops,
        bytes_moved=moved,
        seconds=seconds,
        p50_us=p50,
        p99_us=p99,
        cold="O_DIRECT" if read["total_ios"] else "",
        extra=extra,
    )


def run_fio_profiles(
    status: FioStatus,
    bench_dir: Path,
    size_mib: int,
    runtime_s: int,
    reporter: Reporter,
    profiles: tuple[str, ...] = tuple(FIO_PROFILES),
) -> list[Measurement]:
    """Run each profile against ``bench_dir``; no rows when fio is unavailable."""
    if not status.available or status.path is None:
        return []
    work = bench_dir / "fio"
    work.mkdir(parents=True, exist_ok=True)
    found: list[Measurement] = []
    reporter.start("fio profiles", len(profiles))
    try:
        for profile in profiles:
            env = dict(os.environ)
            env.update(
                BENCH_DIR=str(work.resolve()),
                BENCH_SIZE=f"{size_mib}m",
                BENCH_RUNTIME=str(min(runtime_s, WAL_RUNTIME_S)),
            )
            if profile != "wal_append":
                env["BENCH_RUNTIME"] = str(runtime_s)
            with tempfile.NamedTemporaryFile(prefix="fio-", suffix=".json", dir=work) as out:
                command = [
                    status.path,
                    "--output-format=json",
                    f"--output={out.name}",
                    str(PROFILES_DIR / f"{profile}.fio"),
                ]
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(
                        f"fio {profile} exited {done.returncode}: {done.stderr.strip()}"
                    )
                text = Path(out.name).read_text()
            # fio may print notes before the JSON document; start at the first brace.
            found.append(parse_fio(profile, json.loads(text[text.index("{") :])))
            reporter.advance()
    finally:
        reporter.finish()
        shutil.rmtree(work, ignore_errors=True)
    return found
