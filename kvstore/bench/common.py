"""What every benchmark shares: the result record, timing, cold caches, machine facts.

A ``Measurement`` is one row of the report: how many operations moved how many
bytes in how many seconds, with latency percentiles when each operation was
timed on its own. Throughput is payload bytes per second in MB/s (10^6 bytes),
the unit of fio's ``bw_bytes``.

Cold reads: kvstore and the O_DIRECT baseline bypass the page cache, so their
reads are cold by construction. Buffered baselines (file per page, LMDB,
safetensors) are made cold before their read phase by ``CacheDropper``:
``fadvise`` (``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file after
``sync``; drops only their data pages) or ``drop_caches`` (``sync`` then
``3 > /proc/sys/vm/drop_caches``; root only, also drops dentries and inodes,
and every other process's cache). ``resident_fraction`` checks the result with
``preadv(RWF_NOWAIT)``, which fails with EAGAIN when the data is not cached.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import random
import resource
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

__all__ = [
    "KIB",
    "MIB",
    "CacheDropper",
    "CpuTimes",
    "Measurement",
    "NullReporter",
    "Reporter",
    "drop_page_cache",
    "finite",
    "machine_info",
    "mount_of",
    "payload_pool",
    "percentile",
    "read_sysfs",
    "remove_tree",
    "resident_fraction",
]

KIB = 1 << 10
MIB = 1 << 20
COLD_METHODS = ("fadvise", "drop_caches")


@dataclass(frozen=True, slots=True)
class Measurement:
    """One measured workload. ``name`` is stable (JSON key, target lookups)."""

    name: str
    label: str
    group: str  # "kvstore", "hot_path", "peer" or "fio"
    page_bytes: int = 0
    ops: int = 0
    bytes_moved: int = 0
    seconds: float = 0.0
    p50_us: float | None = None
    p99_us: float | None = None
    durable: bool | None = None  # writes: every batch durable before the next starts
    cold: str = ""  # reads: "O_DIRECT", "fadvise", "drop_caches"; empty for writes
    extra: Mapping[str, float] = field(default_factory=dict)
    notes: str = ""

    @property
    def mb_per_s(self) -> float | None:
        if not self.bytes_moved or self.seconds <= 0:
            return None
        return self.bytes_moved / self.seconds / 1e6

    @property
    def ops_per_s(self) -> float | None:
        if not self.ops or self.seconds <= 0:
            return None
        return self.ops / self.seconds

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict: every field plus the derived rates."""
        return {
            "name": self.name,
            "label": self.label,
            "group": self.group,
            "page_bytes": self.page_bytes,
            "ops": self.ops,
            "bytes_moved": self.bytes_moved,
            "seconds": self.seconds,
            "mb_per_s": self.mb_per_s,
            "ops_per_s": self.ops_per_s,
            "p50_us": self.p50_us,
            "p99_us": self.p99_us,
            "durable": self.durable,
            "cold": self.cold,
            "extra": dict(self.extra),
            "notes": self.notes,
        }


class Reporter(Protocol):
    """Progress sink: the CLI shows rich progress bars, tests pass ``NullReporter``."""

    def start(self, label: str, total: int) -> None: ...

    def advance(self, count: int = 1) -> None: ...

    def finish(self) -> None: ...


class NullReporter:
    def start(self, label: str, total: int) -> None:
        pass

    def advance(self, count: int = 1) -> None:
        pass

    def finish(self) -> None:
        pass


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Nearest-rank percentile (``pct`` in 0..100); None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100.0 * len(ordered)))
    return float(ordered[rank - 1])


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Process CPU seconds (all threads): user (Python and C code) and system (kernel)."""

    user_s: float
    system_s: float

    @classmethod
    def now(cls) -> CpuTimes:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return cls(usage.ru_utime, usage.ru_stime)

    def since(self, earlier: CpuTimes) -> CpuTimes:
        return CpuTimes(self.user_s - earlier.user_s, self.system_s - earlier.system_s)


def payload_pool(page_bytes: int, count: int = 8, seed: int = 7) -> list[bytes]:
    """``count`` distinct incompressible pages, reused round-robin by the workloads."""
    rng = random.Random(seed)
    return [rng.randbytes(page_bytes) for _ in range(count)]


def remove_tree(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


class CacheDropper:
    """Makes buffered files cold before a read phase (see the module docstring)."""

    def __init__(self, method: str) -> None:
        if method not in COLD_METHODS:
            raise ValueError(f"cold method must be one of {COLD_METHODS}, got {method!r}")
        self.method = method

    def drop(self, paths: Iterable[Path]) -> None:
        os.sync()  # DONTNEED skips dirty pages: write them back first
        if self.method == "drop_caches":
            with open("/proc/sys/vm/drop_caches", "w") as control:
                control.write("3\n")
            return
        for path in paths:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def drop_page_cache() -> bool:
    """``sync`` then ``3 > /proc/sys/vm/drop_caches`` (root only): False where refused."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def finite(value: object) -> object:
    """``value`` with every NaN/inf float, at any depth of dicts, lists and tuples,
    replaced by None: what ``json.dumps(..., allow_nan=False)`` accepts (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def drop_caches_allowed() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def resident_fraction(paths: Sequence[Path], offsets: Sequence[int] = (0,)) -> float:
    """Fraction of probed 4 KiB blocks found in the page cache (``preadv`` + RWF_NOWAIT)."""
    probe = bytearray(4096)
    hits = probes = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for offset in offsets:
                probes += 1
                try:
                    os.preadv(fd, [probe], offset, os.RWF_NOWAIT)
                    hits += 1
                except BlockingIOError:
                    pass
        finally:
            os.close(fd)
    return hits / probes if probes else 0.0


def read_sysfs(path: str) -> str:
    """A /proc or /sys file's text, stripped; "" when it cannot be read."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def mount_of(path: Path) -> dict[str, str]:
    """The /proc/mounts entry (device, mount point, fs, options) that holds ``path``."""
    best: dict[str, str] = {}
    resolved = str(path.resolve())
    for line in read_sysfs("/proc/mounts").splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        mount_point = parts[1]
        inside = resolved == mount_point or resolved.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best.get("mount_point", "")):
            best = {"device": parts[0], "mount_point": mount_point, "fs": parts[2]}
            best["options"] = parts[3]
    return best


def code_version() -> dict[str, object]:
    """Which kvstore is measured: git HEAD, whether kvstore/ is dirty, a hash of its sources."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())

    def git(*command: str) -> str:
        try:
            done = subprocess.run(
                ["git", "-C", str(package.parent), *command],
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip()

    return {
        "package_dir": str(package),
        "git_head": git("rev-parse", "--short", "HEAD"),
        "git_subject": git("log", "-1", "--format=%s"),
        "kvstore_dirty": bool(git("status", "--porcelain", "--", "kvstore")),
        "kvstore_sha256": digest.hexdigest()[:16],
    }


def machine_info(bench_dir: Path) -> dict[str, object]:
    """Where the run happened: CPU, memory, kernel, file system, code version, load."""
    meminfo = read_sysfs("/proc/meminfo").splitlines()
    mem_kib = next((int(line.split()[1]) for line in meminfo if line.startswith("MemTotal")), 0)
    cpu_model = next(
        (
            line.split(":", 1)[1].strip()
            for line in read_sysfs("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    usage = shutil.disk_usage(bench_dir)
    return {
        "hostname": platform.node(),
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model,
        "mem_gib": round(mem_kib / (1 << 20), 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "bench_dir": str(bench_dir.resolve()),
        "mount": mount_of(bench_dir),
        "disk_free_gib": round(usage.free / (1 << 30), 1),
        "loadavg": list(os.getloadavg()),
        "code": code_version(),
        "io_engine": _engine_in_force(),
        "unix_time": time.time(),
    }


def _engine_in_force() -> str:
    """Which engine a default store gets here, and why (kvstore.io.probe's verdict)."""
    from kvstore.io.engine import make_engine

    try:
        engine = make_engine()
    except (OSError, ValueError) as e:
        return f"unknown ({e})"
    try:
        return engine.why
    finally:
        engine.close()
