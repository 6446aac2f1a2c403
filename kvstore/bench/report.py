"""Targets, the JSON document and the rich tables of one bench run.

A target is either a ratio of two measurements taken in the same run (kvstore
over a peer, same pages, same directory) or an absolute rate. Its status is
"met", "not met", or "not measured" when a side is missing (a phase skipped,
fio absent).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from kvstore.bench.common import Measurement, finite

__all__ = ["TARGETS", "Target", "evaluate_targets", "render", "to_json_ready"]

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class Target:
    """``numerator.metric / denominator.metric`` (or the numerator alone) against ``bound``."""

    key: str
    text: str
    numerator: str
    metric: str  # "mb_per_s", "ops_per_s", or "extra:<name>"
    bound: float
    higher_is_better: bool = True
    denominator: str | None = None


TARGETS: tuple[Target, ...] = (
    Target(
        "durable_writes_vs_lmcache",
        "kvstore durable writes >= 3x LMCache-style file per page + fsync",
        "kvstore.put_durable",
        "mb_per_s",
        3.0,
        denominator="peer.file_per_page_fsync",
    ),
    Target(
        "durable_writes_vs_lmdb64",
        "kvstore durable writes >= 2x LMDB blobs, 64 pages per txn",
        "kvstore.put_durable",
        "mb_per_s",
        2.0,
        denominator="peer.lmdb_64_per_txn",
    ),
    Target(
        "cold_reads_vs_files",
        "kvstore get_many cold >= 4x serial file-per-page cold reads",
        "kvstore.get_many_cold",
        "mb_per_s",
        4.0,
        denominator="peer.file_per_page_read_cold",
    ),
    Target(
        "cold_reads_into_vs_files",
        "kvstore get_many_into (reused buffers) cold >= 4x serial file-per-page cold reads",
        "kvstore.get_many_into_cold",
        "mb_per_s",
        4.0,
        denominator="peer.file_per_page_read_cold",
    ),
    Target(
        "lookups",
        "page-table lookups >= 500k/s from Python (entries in LMDB)",
        "hot.lookup",
        "ops_per_s",
        500_000,
    ),
    Target(
        "pin_unpin",
        "pin/unpin pairs >= 200k/s from Python (entries in LMDB)",
        "hot.pin_unpin",
        "ops_per_s",
        200_000,
    ),
    Target(
        "pin_unpin_batched",
        "pin/unpin pairs >= 200k/s via pin_many/unpin_many(64) (where the store has them)",
        "hot.pin_unpin_batched",
        "ops_per_s",
        200_000,
    ),
    Target(
        "metadata_group_commit",
        "durable metadata updates >= 100k/s, group commit of 256",
        "hot.meta_updates_g256",
        "ops_per_s",
        100_000,
    ),
    Target(
        "cpu_per_page_put",
        "user CPU per page, put_many (16 KiB pages) <= 20 us",
        "hot.cpu_put_many",
        "extra:user_us_per_page",
        20.0,
        higher_is_better=False,
    ),
    Target(
        "cpu_per_page_get",
        "user CPU per page, get_many (16 KiB pages) <= 20 us",
        "hot.cpu_get_many",
        "extra:user_us_per_page",
        20.0,
        higher_is_better=False,
    ),
    Target(
        "scaling_pages",
        "per-page put cost, 10^3 -> max pages: log-log slope <= 0.1 (not super-linear)",
        "scaling.pages",
        "extra:put_cost_slope",
        0.1,
        higher_is_better=False,
    ),
    Target(
        "read_ceiling",
        "device ceiling for the read target: fio qd32 / serial file-per-page (context)",
        "fio.randread_256k_qd32",
        "mb_per_s",
        4.0,
        denominator="peer.file_per_page_read_cold",
    ),
    Target(
        "vs_fio_writes",
        "kvstore durable writes / fio 256 KiB qd32 + fdatasync/64 (context, >= 0.7x)",
        "kvstore.put_durable",
        "mb_per_s",
        0.7,
        denominator="fio.seq_write_256k_sync",
    ),
    Target(
        "vs_fio_reads",
        "kvstore get_many cold / fio 256 KiB random read qd32 (context, >= 0.8x)",
        "kvstore.get_many_cold",
        "mb_per_s",
        0.8,
        denominator="fio.randread_256k_qd32",
    ),
)


def _value(measurement: Measurement | None, metric: str) -> float | None:
    if measurement is None:
        return None
    if metric.startswith("extra:"):
        return measurement.extra.get(metric[6:])
    value = getattr(measurement, metric)
    return None if value is None else float(value)


def evaluate_targets(measurements: Sequence[Measurement]) -> list[dict[str, Any]]:
    by_name = {m.name: m for m in measurements}
    rows = []
    for target in TARGETS:
        top = _value(by_name.get(target.numerator), target.metric)
        bottom = (
            _value(by_name.get(target.denominator), target.metric) if target.denominator else 1.0
        )
        value = None
        if top is not None and bottom:
            value = top / bottom
        status = "not measured"
        if value is not None and math.isfinite(value):
            ok = value >= target.bound if target.higher_is_better else value <= target.bound
            status = "met" if ok else "not met"
        per_cpu = None
        if target.denominator is None and target.numerator in by_name:
            per_cpu = by_name[target.numerator].extra.get("ops_per_cpu_s")
        rows.append(
            {
                "key": target.key,
                "text": target.text,
                "numerator": target.numerator,
                "denominator": target.denominator,
                "metric": target.metric,
                "bound": target.bound,
                "higher_is_better": target.higher_is_better,
                "numerator_value": top,
                "denominator_value": bottom if target.denominator else None,
                "value": value,
                "ops_per_cpu_s": per_cpu,
                "status": status,
            }
        )
    return rows


def to_json_ready(document: Mapping[str, Any]) -> dict[str, Any]:
    """Replace NaN/inf by None so the JSON is strict."""
    result = finite(document)
    assert isinstance(result, dict)
    return result


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.{digits}f}"


def _size(page_bytes: int) -> str:
    if not page_bytes:
        return "-"
    if page_bytes >= 1 << 20 and page_bytes % (1 << 20) == 0:
        return f"{page_bytes >> 20} MiB"
    return f"{page_bytes >> 10} KiB"


# Which kvstore row each fio or peer row is set against in the "kvstore x" column.
_COUNTERPART = {
    "fio.seq_write_256k_sync": "kvstore.put_durable",
    "fio.randread_256k_qd1": "kvstore.get_single_cold",
    "fio.randread_256k_qd32": "kvstore.get_many_cold",
    "fio.mixed_70_30": "kvstore.mixed_70_30",
}


def _compare(measurement: Measurement, by_name: Mapping[str, Measurement]) -> str:
    """kvstore's rate over this row's rate, for rows kvstore is judged against."""
    if measurement.group not in ("peer", "fio") or measurement.mb_per_s is None:
        return ""
    if measurement.group == "fio":
        counterpart = _COUNTERPART.get(measurement.name)
    else:
        writes = measurement.durable is not None
        counterpart = "kvstore.put_durable" if writes else "kvstore.get_many_cold"
    mine = by_name.get(counterpart or "")
    if mine is None or mine.mb_per_s is None or measurement.page_bytes != mine.page_bytes:
        return ""
    return f"{mine.mb_per_s / measurement.mb_per_s:.2f}x"


# --quick's tiny sizes and short caps measure nothing a target is about: its
# met / not met and PASS / FAIL say the code ran, not how fast it is.
SMOKE_TEST_CAVEAT = "--quick: a smoke test, not a measurement; its verdicts judge nothing"


def render(document: Mapping[str, Any], console: Console) -> None:
    """Print the measurement table and the targets table."""
    measurements = [Measurement(**_fields(m)) for m in document["measurements"]]
    by_name = {m.name: m for m in measurements}
    table = Table(title=document.get("title", "kvstore bench"), show_lines=False)
    for column, justify in (
        ("workload", "left"),
        ("page", "right"),
        ("MB/s", "right"),
        ("ops/s", "right"),
        ("p50 us", "right"),
        ("p99 us", "right"),
        ("durable / cold", "left"),
        ("kvstore x", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for m in measurements:
        mode = m.cold or ("durable" if m.durable else ("not durable" if m.durable is False else ""))
        table.add_row(
            m.label,
            _size(m.page_bytes),
            _fmt(m.mb_per_s),
            _fmt(m.ops_per_s),
            _fmt(m.p50_us, 1 if (m.p50_us or 0) < 100 else 0),
            _fmt(m.p99_us, 1 if (m.p99_us or 0) < 100 else 0),
            mode,
            _compare(m, by_name),
        )
    console.print(table)
    fio = document.get("fio", {})
    if not fio.get("available", False):
        console.print(f"fio unavailable: {fio.get('reason', '')}")
    title = "Done-when targets (this run)"
    if document.get("quick"):
        title = f"Done-when targets (this run; {SMOKE_TEST_CAVEAT})"
    targets = Table(title=title)
    for column in ("target", "measured", "bound", "status", "per CPU-second"):
        targets.add_column(column)
    for row in document.get("targets", []):
        value = row["value"]
        digits = 2 if value is not None and abs(value) < 100 else 0
        style = {"met": "green", "not met": "red"}.get(row["status"], "yellow")
        op = ">=" if row["higher_is_better"] else "<="
        targets.add_row(
            row["text"],
            _fmt(value, digits),
            f"{op} {row['bound']:,g}",
            f"[{style}]{row['status']}[/{style}]",
            _fmt(row.get("ops_per_cpu_s")),
        )
    console.print(targets)
    if document.get("quick"):
        console.print(f"[yellow]{SMOKE_TEST_CAVEAT}[/yellow]: rerun without --quick to measure")


def _fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    names = Measurement.__dataclass_fields__
    return {key: value for key, value in raw.items() if key in names}
