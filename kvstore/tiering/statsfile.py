"""The tier manager's persisted statistics, ``<nvme_path>/tiering-stats.json``: the whole format.

The manager replaces the file atomically every ``persist_stats_s`` and on close
(docs/tiering.md, "Restart") through ``snapshot`` and ``write_stats_file``, and applies
it at open through ``parse_for_manager``; ``kvstore tier stat``, ``kvstore tier
metrics`` and the exporter read it beside a live manager. This module never imports
torch (nor the manager, which does).

Format, version 1 (JSON, one object; built by ``snapshot``)::

    version          1
    saved_at_unix_s  float: when it was written (wall clock)
    reuse            [[depth_bucket, reused, tag, reuses, non_reuses], ...]
    tau              {"tau": [hbm, dram, nvme], "gain": [...], "victim_vd": [...]}
    bandwidth        {path: {"bytes_per_s", "latency_s", "samples"}, ...}
    compute_flops    float: the fitted effective compute rate C_eff (FLOP/s)
    heat             [[hex_key, decayed_hits, age_s], ...], hottest first
    payoff           optional: the NVMe write gate per class of page (seen once,
                     seen again): {"open": [0|1, 0|1], "paid": [f, f], "unpaid": [f, f],
                     "occasions": [f, f] (optional)}
    summary          {"pages_by_tier", "used_bytes", "capacity_bytes",
                      "hits_by_tier": [hbm, dram, nvme], "misses", "lookups",
                      "nvme_pages_written", "nvme_bytes_written",
                      "counters": {name: int}, "kappa": [hbm, dram, nvme],
                      optional "remote": the remote tier's summary,
                      optional "nvme_displacement": {"on": bool, "moves": int,
                      "model_hits": [unfiltered, filtered]}: the displacement rule,
                      shown, never applied at open}

A reader accepts fields it does not know (a newer writer may add some) and
refuses a file that lacks one it reads, naming the file and the field. Non-finite
floats (``Infinity``: a κ with a free transfer) are read as written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from kvstore.errors import CorruptionError, FormatVersionError, KVStoreError, NotRegularFileError
from kvstore.format.names import TIERING_STATS_NAME
from kvstore.io.files import fsync_dir
from kvstore.log.regular import read_regular
from kvstore.tiering.results import TierStats

__all__ = [
    "STATS_FILE",
    "STATS_VERSION",
    "ManagerStats",
    "TierStatsCorruptError",
    "TierStatsNotFoundError",
    "TierStatsVersionError",
    "check_stats",
    "finite_or_none",
    "parse_for_manager",
    "read_stats_file",
    "reuse_probability",
    "snapshot",
    "stats_file_of",
    "stats_view_from_file",
    "summarize",
    "write_stats_file",
]

STATS_FILE = TIERING_STATS_NAME
STATS_VERSION = 1
TIER_NAMES = ("hbm", "dram", "nvme")
REUSE_PRIOR = (1.0, 3.0)  # the manager's default Beta prior (TierConfig.reuse_prior)
_TIER_LISTS = ("pages_by_tier", "used_bytes", "capacity_bytes", "hits_by_tier", "kappa")
_SUMMARY_INTS = ("misses", "lookups", "nvme_pages_written", "nvme_bytes_written")


class TierStatsNotFoundError(KVStoreError):
    """No tier statistics file where one was looked for.

    The tier manager writes ``tiering-stats.json`` in its ``nvme_path`` every
    ``persist_stats_s`` and on close; a store no tier manager has used has none.
    """

    hint = "pass the tier manager's nvme_path (the store directory) or the file itself"


class TierStatsCorruptError(CorruptionError):
    """The tier statistics file is not the JSON object the manager writes.

    The file is a cache (the manager starts cold without it, and counts
    ``restart:stats_unreadable``): move it aside; the manager writes a new one.
    """

    hint = "move the file aside; the tier manager writes a fresh one at its next persist"


class TierStatsVersionError(FormatVersionError):
    """The tier statistics file has a version this build cannot read."""

    hint = "read it with the kvstore version that wrote it, or move it aside"


def stats_file_of(path: str | Path) -> Path:
    """The statistics file for ``path``: the file itself, or ``STATS_FILE`` in a directory."""
    where = Path(path)
    return where / STATS_FILE if where.is_dir() else where


def read_stats_file(path: str | Path) -> dict[str, Any]:
    """The parsed statistics at ``path`` (a store directory or the file), checked.

    Raises ``TierStatsNotFoundError`` (missing), ``TierStatsCorruptError`` (not a
    regular file, not JSON, a field missing or of the wrong type) or
    ``TierStatsVersionError``; each message names the file.
    """
    file = stats_file_of(path)
    try:
        raw = read_regular(file)
    except FileNotFoundError as e:
        raise TierStatsNotFoundError(
            f"no tier statistics at {file} (the tier manager writes them every "
            "persist_stats_s and on close)"
        ) from e
    except NotRegularFileError as e:  # its hint names store files; this one is a cache
        raise TierStatsCorruptError(f"{file} is not a regular file") from e
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TierStatsCorruptError(f"{file} is not valid JSON: {e}") from e
    return check_stats(data, str(file))


def check_stats(data: object, where: str) -> dict[str, Any]:
    """``data``, if it has the version-1 shape; else ``TierStatsCorruptError`` or
    ``TierStatsVersionError``, with ``where`` naming the source in the message."""
    if not isinstance(data, dict):
        raise TierStatsCorruptError(f"{where}: not a JSON object")
    version = data.get("version")
    if version != STATS_VERSION:
        raise TierStatsVersionError(
            f"{where}: tier statistics version {version!r}; this build reads {STATS_VERSION}"
        )
    _number(data, "saved_at_unix_s", where)
    _number(data, "compute_flops", where)
    reuse = _field(data, "reuse", list, where)
    for row in reuse:
        if not (
            isinstance(row, list)
            and len(row) == 5
            and _is_int(row[0])
            and isinstance(row[1], bool)
            and isinstance(row[2], str)
            and _is_number(row[3])
            and _is_number(row[4])
        ):
            raise TierStatsCorruptError(
                f"{where}: reuse row {row!r} is not [depth_bucket, reused, tag, reuses, non_reuses]"
            )
    tau = _field(data, "tau", dict, where)
    _tier_list(tau, "tau", where, "tau.")
    bandwidth = _field(data, "bandwidth", dict, where)
    for name, fit in bandwidth.items():
        if not isinstance(fit, dict):
            raise TierStatsCorruptError(f"{where}: bandwidth.{name} is not an object")
        for key in ("bytes_per_s", "latency_s", "samples"):
            _number(fit, key, where, f"bandwidth.{name}.")
    heat = _field(data, "heat", list, where)
    if not all(isinstance(row, list) and len(row) == 3 for row in heat):
        raise TierStatsCorruptError(f"{where}: heat rows are not [hex_key, hits, age_s]")
    summary = _field(data, "summary", dict, where)
    for key in _TIER_LISTS:
        _tier_list(summary, key, where, "summary.")
    for key in _SUMMARY_INTS:
        _number(summary, key, where, "summary.")
    counters = _field(summary, "counters", dict, where, "summary.")
    for name, value in counters.items():
        if not _is_number(value):
            raise TierStatsCorruptError(f"{where}: summary.counters.{name} is not a number")
    return data


def _field(data: Mapping[str, Any], key: str, kind: type, where: str, prefix: str = "") -> Any:
    if key not in data:
        raise TierStatsCorruptError(f"{where}: field {prefix}{key} is missing")
    value = data[key]
    if not isinstance(value, kind):
        raise TierStatsCorruptError(
            f"{where}: field {prefix}{key} is {type(value).__name__}, not {kind.__name__}"
        )
    return value


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(data: Mapping[str, Any], key: str, where: str, prefix: str = "") -> None:
    if key not in data:
        raise TierStatsCorruptError(f"{where}: field {prefix}{key} is missing")
    if not _is_number(data[key]):
        raise TierStatsCorruptError(f"{where}: field {prefix}{key} is not a number")


def _tier_list(data: Mapping[str, Any], key: str, where: str, prefix: str) -> None:
    value = _field(data, key, list, where, prefix)
    if len(value) != 3 or not all(_is_number(item) for item in value):
        raise TierStatsCorruptError(
            f"{where}: field {prefix}{key} is not three numbers (hbm, dram, nvme)"
        )


def reuse_probability(reuses: float, non_reuses: float) -> float:
    """The manager's estimate for a class: the Beta(1, 3) posterior mean."""
    a, b = REUSE_PRIOR
    return (reuses + a) / (reuses + non_reuses + a + b)


def summarize(
    data: Mapping[str, Any], *, now_s: float | None = None, top: int = 10
) -> dict[str, Any]:
    """What is where, from checked statistics: per tier pages, bytes, hits, hit rate
    (hits / (hits + misses)), τ and κ; NVMe writes, bandwidths, C_eff, the file's
    age, and the ``top`` reuse classes by p(reuse)."""
    check_stats(data, "tier statistics")
    summary = data["summary"]
    hits = [int(h) for h in summary["hits_by_tier"]]
    misses = int(summary["misses"])
    tiers: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(TIER_NAMES):
        used = int(summary["used_bytes"][index])
        capacity = int(summary["capacity_bytes"][index])
        tiers[name] = {
            "pages": int(summary["pages_by_tier"][index]),
            "used_bytes": used,
            "capacity_bytes": capacity,
            "used_ratio": used / capacity if capacity else None,
            "hits": hits[index],
            "hit_rate": _ratio(hits[index], hits[index] + misses),
            "tau_s_per_byte": float(data["tau"]["tau"][index]),
            "kappa": float(summary["kappa"][index]),
            "in_use": in_use(index, float(summary["kappa"][index]), capacity),
        }
    saved = float(data["saved_at_unix_s"])
    classes = sorted(
        (
            {
                "depth_bucket": int(depth),
                "reused": bool(reused),
                "tag": str(tag),
                "reuses": reuses,
                "non_reuses": non_reuses,
                "p_reuse": reuse_probability(float(reuses), float(non_reuses)),
            }
            for depth, reused, tag, reuses, non_reuses in data["reuse"]
        ),
        key=lambda row: (
            -row["p_reuse"],
            -(row["reuses"] + row["non_reuses"]),
            row["depth_bucket"],
        ),
    )
    return {
        "version": data["version"],
        "saved_at_unix_s": saved,
        "saved_age_s": (time.time() if now_s is None else now_s) - saved,
        "tiers": tiers,
        "misses": misses,
        "lookups": int(summary["lookups"]),
        "hit_rate": _ratio(sum(hits), sum(hits) + misses),
        "nvme_pages_written": int(summary["nvme_pages_written"]),
        "nvme_bytes_written": int(summary["nvme_bytes_written"]),
        "bandwidth": {
            name: {
                "bytes_per_s": float(fit["bytes_per_s"]),
                "latency_s": float(fit["latency_s"]),
                "samples": int(fit["samples"]),
            }
            for name, fit in sorted(data["bandwidth"].items())
        },
        "compute_flops": float(data["compute_flops"]),
        "heat_pages": len(data["heat"]),
        "reuse_classes": len(classes),
        "top_reuse_classes": classes[:top],
        "counters": dict(sorted(summary["counters"].items())),
        # the remote tier's section (RemoteTier.summary), None without one
        "remote": summary.get("remote") if isinstance(summary.get("remote"), dict) else None,
        "nvme_write_gate": _write_gate(data.get("payoff")),
        "nvme_displacement": _displacement(summary.get("nvme_displacement")),
    }


def _displacement(rule: object) -> dict[str, Any] | None:
    """The displacement rule from the summary's optional field (docs/tiering.md,
    "Admission against the displaced page"); None where none was saved or it is damaged
    (it is shown, never applied)."""
    if not isinstance(rule, dict):
        return None
    try:
        hits = [float(h) for h in rule["model_hits"]]
        if len(hits) != 2 or not all(math.isfinite(h) and h >= 0 for h in hits):
            return None
        return {"on": bool(rule["on"]), "moves": int(rule["moves"]), "model_hits": hits}
    except (KeyError, TypeError, ValueError):
        return None


def _write_gate(payoff: object) -> dict[str, dict[str, Any]] | None:
    """The NVMe write gate per class, from the optional ``payoff`` field: open or not,
    and the share of writes read back (None before any evidence). None: no gate saved."""
    if not isinstance(payoff, dict):
        return None
    try:
        out = {}
        for index, name in enumerate(("seen_once", "seen_again")):
            paid = float(payoff["paid"][index])
            unpaid = float(payoff["unpaid"][index])
            out[name] = {
                "open": bool(payoff["open"][index]),
                "read_back_share": paid / (paid + unpaid) if paid + unpaid > 0 else None,
            }
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return out


def in_use(tier: int, kappa: float, capacity: int) -> bool:
    """Whether a tier is used for loads: HBM always; DRAM and NVMe where they exist
    and loading from them is faster than recomputing (κ >= 1)."""
    return tier == 0 or (capacity > 0 and kappa >= 1.0)


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def stats_view_from_file(data: Mapping[str, Any]) -> TierStats:
    """A ``TierStats`` from checked statistics, for the exporter and ``tier metrics``.

    What the file does not keep reads as zero or empty: the total page count (a page
    may sit in several tiers), the emergency flag, in-flight bytes, the offload
    latency histograms, the page table's size and the policy names. The counters
    (admissions, evictions, ...) come from ``summary.counters`` by their prefixes.
    """
    check_stats(data, "tier statistics")
    summary = data["summary"]
    counters: Mapping[str, int] = {k: int(v) for k, v in summary["counters"].items()}
    bandwidth = data["bandwidth"]
    return TierStats(
        pages=0,
        used_bytes=_ints(summary["used_bytes"]),
        capacity_bytes=_ints(summary["capacity_bytes"]),
        pages_by_tier=_ints(summary["pages_by_tier"]),
        hits_by_tier=_ints(summary["hits_by_tier"]),
        misses=int(summary["misses"]),
        lookups=int(summary["lookups"]),
        admissions=_prefixed(counters, "admission:"),
        evictions=_prefixed(counters, "evict:"),
        demotions=counters.get("demotions", 0),
        promotions=counters.get("promotions", 0),
        hysteresis_blocks=counters.get("hysteresis", 0),
        thrash=counters.get("thrash", 0),
        recompute_decisions=_prefixed(counters, "recompute:"),
        emergency_evictions=counters.get("emergency_evictions", 0),
        emergency=False,
        tau=_floats(data["tau"]["tau"]),
        kappa=_floats(summary["kappa"]),
        bandwidth_bytes_per_s={name: float(fit["bytes_per_s"]) for name, fit in bandwidth.items()},
        latency_s={name: float(fit["latency_s"]) for name, fit in bandwidth.items()},
        compute_flops=float(data["compute_flops"]),
        in_flight_bytes={},
        nvme_bytes_written=int(summary["nvme_bytes_written"]),
        nvme_pages_written=int(summary["nvme_pages_written"]),
        load_failures=counters.get("load_failures", 0),
        offload_latency_s={},
        page_table_bytes=0,
        mover="",
        placement="",
        admission="",
        eviction="",
        in_use=(
            in_use(0, 0.0, 0),
            in_use(1, float(summary["kappa"][1]), int(summary["capacity_bytes"][1])),
            in_use(2, float(summary["kappa"][2]), int(summary["capacity_bytes"][2])),
        ),
        remote=summary.get("remote") if isinstance(summary.get("remote"), dict) else None,
        nvme_write_gate=_gate_open(data.get("payoff")),
        nvme_displacement=_displacement(summary.get("nvme_displacement")),
    )


def _gate_open(payoff: object) -> tuple[bool, bool] | None:
    gate = _write_gate(payoff)
    if gate is None:
        return None
    return bool(gate["seen_once"]["open"]), bool(gate["seen_again"]["open"])


def _ints(values: list[Any]) -> tuple[int, int, int]:
    return int(values[0]), int(values[1]), int(values[2])


def _floats(values: list[Any]) -> tuple[float, float, float]:
    return float(values[0]), float(values[1]), float(values[2])


def _prefixed(counters: Mapping[str, int], prefix: str) -> dict[str, int]:
    return {k[len(prefix) :]: v for k, v in counters.items() if k.startswith(prefix)}


def finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None, for strict JSON output."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    return value


# -- the manager's side: write, and parse what it applies at open --------------------


def snapshot(
    *,
    reuse: list[list[object]],
    tau: Mapping[str, list[float]],
    bandwidth: Mapping[str, Mapping[str, float]],
    compute_flops: float,
    heat: list[list[object]],
    summary: Mapping[str, Any],
    payoff: Mapping[str, list[float]] | None = None,
) -> dict[str, Any]:
    """One version-1 statistics object, stamped with the wall clock."""
    extra = {} if payoff is None else {"payoff": dict(payoff)}
    return {
        "version": STATS_VERSION,
        "saved_at_unix_s": time.time(),
        "reuse": reuse,
        "tau": dict(tau),
        "bandwidth": dict(bandwidth),
        "compute_flops": compute_flops,
        "heat": heat,
        "summary": dict(summary),
        **extra,
    }


def write_stats_file(path: Path, data: Mapping[str, Any]) -> None:
    """Atomically: a temporary file (mode 0644), fsync, rename, fsync the directory.
    Raises ``OSError`` or ``IOFailure``; the old file stays whole on any failure. One
    writer at a time per file (the temporary name is fixed)."""
    tmp = path.with_name(path.name + ".tmp")
    body = json.dumps(data, separators=(",", ":")).encode()
    # The temporary name is ours: whatever is there (a stale file, a FIFO that would
    # block the open for ever, a link) is removed, then created anew.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o644)
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


class ManagerStats(NamedTuple):
    """The statistics file's fields the manager applies, every one checked."""

    reuse: list[list[object]]
    tau: dict[str, list[float]]
    bandwidth: dict[str, tuple[float, float]]  # path -> (bytes/s, latency s)
    compute_flops: float
    heat: list[tuple[bytes, float, float]]  # key, decayed hits, age s
    payoff: dict[str, list[float]] | None = None  # the NVMe write gate, when saved


def _finite_number(value: object, *, positive: bool = False) -> bool:
    """A finite number >= 0 (> 0 with ``positive``); never a bool."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return value > 0 if positive else value >= 0


def parse_for_manager(data: object, where: str) -> ManagerStats:
    """``data`` checked before anything is applied: the shape by the reader's
    ``check_stats``, then the values (rates and C_eff > 0, three finite τ values each,
    hex keys). Raises ValueError or a ``KVStoreError`` naming ``where``."""
    checked = check_stats(data, where)
    reuse = checked["reuse"]
    if not all(_finite_number(row[3]) and _finite_number(row[4]) for row in reuse):
        raise ValueError(f"{where}: a reuse count is negative or not finite")
    tau: dict[str, list[float]] = {}
    for name in ("tau", "gain", "victim_vd"):
        values = checked["tau"].get(name)
        finite = isinstance(values, list) and all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            for v in values
        )
        if not finite or len(values) != 3:
            raise ValueError(f"{where}: tau.{name} is not three finite numbers")
        tau[name] = [float(v) for v in values]
    bandwidth = {}
    for name, fit in checked["bandwidth"].items():
        rate, latency_s = fit["bytes_per_s"], fit["latency_s"]
        if not (_finite_number(rate, positive=True) and _finite_number(latency_s)):
            raise ValueError(f"{where}: bandwidth.{name} is not a rate > 0 and a latency >= 0")
        bandwidth[name] = (float(rate), float(latency_s))
    compute_flops = checked["compute_flops"]
    if not _finite_number(compute_flops, positive=True):
        raise ValueError(f"{where}: compute_flops {compute_flops!r} is not > 0")
    heat = []
    for hex_key, hits, age_s in checked["heat"]:
        if not (isinstance(hex_key, str) and _finite_number(hits) and _finite_number(age_s)):
            raise ValueError(f"{where}: heat row {[hex_key, hits, age_s]!r} is damaged")
        heat.append((bytes.fromhex(hex_key), float(hits), float(age_s)))
    payoff = None
    if "payoff" in checked:  # optional: written since the NVMe write gate exists
        raw = checked["payoff"]
        payoff = {}
        for name in ("open", "paid", "unpaid", "occasions"):
            if name == "occasions" and isinstance(raw, dict) and name not in raw:
                continue  # optional: written since the gate counts occasions
            values = raw.get(name) if isinstance(raw, dict) else None
            if not (isinstance(values, list) and len(values) == 2):
                raise ValueError(f"{where}: payoff.{name} is not two numbers")
            if not all(_finite_number(v) for v in values):
                raise ValueError(f"{where}: payoff.{name} has a negative or non-finite number")
            payoff[name] = [float(v) for v in values]
    return ManagerStats(reuse, tau, bandwidth, float(compute_flops), heat, payoff)
