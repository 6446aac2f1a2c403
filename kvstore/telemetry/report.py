"""``kvstore report PATH --html FILE``: one self-contained HTML page for an SRE.

Plots (matplotlib, Agg backend, PNGs embedded as base64 so the page is one file):
1. daily bytes written to the drive, stacked by kind, against the DWPD budget
   (max_dwpd, else the rating) x capacity, as a line;
2. write amplification per hour;
3. throughput per hour: host and store writes, reads (MB/s averaged over the hour);
4. latency per hour: mean and p99 (from the histogram buckets) of put, get, flush, gc.

Imports matplotlib; only the CLI's ``report`` command imports this module.
"""

from __future__ import annotations

import base64
import html
import importlib
import io
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from kvstore.telemetry import TelemetrySnapshot
from kvstore.telemetry.counters import (
    LATENCY_BOUNDS_S,
    LATENCY_OPS,
    SECONDS_PER_HOUR,
    WRITE_KINDS,
    HourBucket,
)

__all__ = ["build_figures", "percentile_from_buckets", "render_html"]

_DAY_S = 86_400
_COLOURS = {
    "host": "#4c72b0",
    "record_overhead": "#8172b3",
    "segment_header": "#937860",
    "gc_copy": "#dd8452",
    "wal": "#55a868",
    "index": "#c44e52",
    "telemetry": "#8c8c8c",
}


def percentile_from_buckets(counts: Sequence[int], quantile: float) -> float | None:
    """The upper bound of the bucket holding the ``quantile`` sample (None: no samples).
    The +Inf bucket reports the largest finite bound."""
    total = sum(counts)
    if total == 0:
        return None
    rank = quantile * total
    running = 0
    for bound, count in zip((*LATENCY_BOUNDS_S, LATENCY_BOUNDS_S[-1]), counts, strict=True):
        running += count
        if running >= rank:
            return bound
    return LATENCY_BOUNDS_S[-1]


def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _dates(mdates: Any, axis: Any) -> None:
    """Readable time ticks however many days are shown."""
    locator = mdates.AutoDateLocator(minticks=4, maxticks=8)
    axis.xaxis.set_major_locator(locator)
    axis.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))


def _when(hour: int) -> datetime:
    return datetime.fromtimestamp(hour * SECONDS_PER_HOUR, tz=UTC)


def _hours(snapshot: TelemetrySnapshot, days: int) -> list[HourBucket]:
    first = int(snapshot.now_s // SECONDS_PER_HOUR) - days * 24
    return [bucket for bucket in snapshot.buckets if bucket.hour > first]


def _pyplot() -> Any:
    # matplotlib's stubs reject datetime axes that it handles fine: treat it as untyped.
    matplotlib: Any = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def build_figures(snapshot: TelemetrySnapshot, *, days: int = 30) -> list[tuple[Any, str]]:
    """The report's matplotlib figures, each with its caption, in page order.

    The caller owns the figures: ``matplotlib.pyplot.close`` each when done."""
    plt = _pyplot()
    mdates: Any = importlib.import_module("matplotlib.dates")
    wear = snapshot.wear_report()
    hours = _hours(snapshot, days)
    built: list[tuple[Any, str]] = []

    # 1. daily writes vs budget
    by_day: dict[int, list[int]] = {}
    for bucket in hours:
        day = bucket.hour * SECONDS_PER_HOUR // _DAY_S
        row = by_day.setdefault(day, [0] * len(WRITE_KINDS))
        for position in range(len(WRITE_KINDS)):
            row[position] += bucket.values[position]
    days_sorted = sorted(by_day)
    figure, axis = plt.subplots(figsize=(10, 4))
    x = [datetime.fromtimestamp(day * _DAY_S, tz=UTC) for day in days_sorted]
    bottom = [0.0] * len(days_sorted)
    for position, kind in enumerate(WRITE_KINDS):
        heights = [by_day[day][position] / 1e9 for day in days_sorted]
        if any(heights):
            axis.bar(x, heights, bottom=bottom, width=0.8, label=kind, color=_COLOURS[kind])
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    limit_dwpd = wear.max_dwpd or wear.rated_dwpd
    limit_name = "max_dwpd budget" if wear.max_dwpd else "rated DWPD"
    if wear.drive_capacity_bytes:
        budget_gb = limit_dwpd * wear.drive_capacity_bytes / 1e9
        axis.axhline(budget_gb, color="red", linestyle="--", label=f"{limit_name} ({limit_dwpd:g})")
        axis.axhline(0.8 * budget_gb, color="orange", linestyle=":", label="80% (alert)")
    axis.set_ylabel("GB written per day (UTC)")
    axis.set_title("Daily writes to the drive, by kind, against the DWPD limit")
    axis.xaxis.set_major_formatter(mdates.DateFormatter("%m-%d"))
    axis.legend(loc="upper left", fontsize=7, ncols=2, framealpha=0.9)
    built.append(
        (
            figure,
            "Bars: bytes the store wrote each day, stacked by kind. Red dashed line: the "
            "daily limit (DWPD x capacity); orange dotted: the 80% alert threshold.",
        )
    )

    times = [_when(bucket.hour) for bucket in hours]

    # 2. write amplification per hour
    figure, axis = plt.subplots(figsize=(10, 3))
    wa = [
        bucket.store_bytes / bucket.values[0] if bucket.values[0] else float("nan")
        for bucket in hours
    ]
    axis.plot(times, wa, marker=".", markersize=3, linewidth=0.8, color="#4c72b0")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_ylabel("store bytes / host byte")
    axis.set_title(f"Write amplification per hour (lifetime {wear.write_amplification:.3f})")
    _dates(mdates, axis)
    built.append((figure, "Hours with no host writes are gaps."))

    # 3. throughput per hour
    figure, axis = plt.subplots(figsize=(10, 3))
    axis.plot(times, [b.values[0] / SECONDS_PER_HOUR / 1e6 for b in hours], label="host writes")
    axis.plot(times, [b.store_bytes / SECONDS_PER_HOUR / 1e6 for b in hours], label="store writes")
    axis.plot(times, [b.get("read_bytes") / SECONDS_PER_HOUR / 1e6 for b in hours], label="reads")
    axis.set_ylabel("MB/s (hourly average)")
    axis.set_title("Throughput")
    axis.legend(fontsize=8)
    _dates(mdates, axis)
    built.append((figure, "Averages over each clock hour; the last point is the hour in progress."))

    # 4. latency per hour
    figure, axes = plt.subplots(2, 2, figsize=(11, 6))
    axes = [axis for row in axes for axis in row]
    for axis, op in zip(axes, LATENCY_OPS, strict=True):
        means, p99s, op_times = [], [], []
        for bucket, when in zip(hours, times, strict=True):
            counts, sum_ns = bucket.latency(op)
            if sum(counts):
                op_times.append(when)
                means.append(sum_ns / sum(counts) / 1e6)
                p99 = percentile_from_buckets(counts, 0.99)
                p99s.append((p99 or 0.0) * 1e3)
        axis.plot(op_times, means, marker=".", label="mean")
        axis.plot(op_times, p99s, marker=".", label="p99 (bucket bound)")
        axis.set_title(f"{op} latency")
        axis.set_ylabel("ms")
        _dates(mdates, axis)
        axis.legend(fontsize=7)
    figure.tight_layout()
    built.append(
        (figure, "p99 is the upper bound of the histogram bucket holding the 99th percentile.")
    )

    return built


def render_html(snapshot: TelemetrySnapshot, *, days: int = 30) -> tuple[str, list[bytes]]:
    """The page, and the PNGs it embeds (for callers that want to look at them)."""
    plt = _pyplot()
    images: list[str] = []
    captions: list[str] = []
    for figure, caption in build_figures(snapshot, days=days):
        images.append(_png(figure))
        captions.append(caption)
        plt.close(figure)
    wear = snapshot.wear_report()
    rows = [
        ("host bytes (lifetime)", f"{wear.host_bytes:,}"),
        ("store bytes (lifetime)", f"{wear.store_bytes:,}"),
        *(
            (f"&nbsp;&nbsp;{kind}", f"{value:,}")
            for kind, value in wear.store_bytes_by_kind.items()
        ),
        ("write amplification", f"{wear.write_amplification:.4f}"),
        *((f"DWPD {window}", f"{value:.4f}") for window, value in wear.dwpd.items()),
        ("rated DWPD", f"{wear.rated_dwpd:g} ({wear.rated_dwpd_source})"),
        ("max_dwpd budget", "none" if wear.max_dwpd is None else f"{wear.max_dwpd:g}"),
        (
            "drive capacity",
            f"{wear.drive_capacity_bytes or 0:,} bytes ({wear.capacity_source})",
        ),
        (
            "projected life",
            "n/a" if wear.projected_life_days is None else f"{wear.projected_life_days:,.0f} days",
        ),
        ("declined puts", f"{snapshot.counter('declined_puts'):,}"),
        ("hits / misses", f"{snapshot.counter('hits'):,} / {snapshot.counter('misses'):,}"),
        ("evicted pages", f"{snapshot.counter('evicted_pages'):,}"),
    ]
    table = "\n".join(
        f"<tr><th>{name}</th><td>{html.escape(value)}</td></tr>" for name, value in rows
    )
    notes = "".join(f"<li>{html.escape(note)}</li>" for note in wear.notes)
    figures = "\n".join(
        f'<figure><img alt="plot {index}" src="data:image/png;base64,{image}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        for index, (image, caption) in enumerate(zip(images, captions, strict=True), 1)
    )
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(snapshot.now_s))
    since = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(snapshot.created_s))
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>kvstore wear report: {html.escape(snapshot.path)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 1100px; }}
table {{ border-collapse: collapse; }} th, td {{ padding: 2px 10px; text-align: left; }}
th {{ font-weight: normal; color: #444; }} td {{ font-family: monospace; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }} figcaption {{ color: #555; }}
</style></head><body>
<h1>kvstore wear and performance</h1>
<p>{html.escape(snapshot.path)} &mdash; generated {generated}; last {days} days, hourly
resolution. Counters since {since}.</p>
<table>{table}</table>
<ul>{notes}</ul>
{figures}
<p>What each number means and what to do: docs/operations.md, "Wear and performance".</p>
</body></html>
"""
    return page, [base64.b64decode(image) for image in images]
