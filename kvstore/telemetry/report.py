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
import math
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


def _pyplot() -> Any:
    # matplotlib's stubs reject datetime axes that it handles fine: treat it as untyped.
    matplotlib: Any = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


_SPARSE_POINTS = 48  # a series with at most this many points marks every one
_FAR_LIMIT = 10.0  # a daily limit this many times the tallest day is a note, not a line
_NAN = float("nan")
# Tick steps tried for the time axes, finest first.
_MINUTE_STEPS = (10, 15, 20, 30)
_HOUR_STEPS = (1, 2, 3, 4, 6, 12)
_DAY_STEPS = (1, 2, 3, 7, 14)
_MONTH_STEPS = (1, 2, 3, 6, 12)


def _num(mdates: Any, seconds: float) -> float:
    return float(mdates.date2num(datetime.fromtimestamp(seconds, tz=UTC)))


def _window(snapshot: TelemetrySnapshot, days: int) -> tuple[int, int]:
    """The report window as whole hours: (first hour, hour in progress), inclusive.

    From the later of the store's creation and ``now - days`` to now."""
    now_hour = int(snapshot.now_s // SECONDS_PER_HOUR)
    first = max(now_hour - days * 24 + 1, int(snapshot.created_s // SECONDS_PER_HOUR))
    return min(first, now_hour), now_hour


def _unit(largest: float, per: str) -> tuple[float, str]:
    """(divisor, name) that shows ``largest`` bytes as a number from 1 to 1000."""
    for divisor, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if largest >= divisor:
            return divisor, f"{name}{per}"
    return 1.0, f"bytes{per}"


def _time_axis(mdates: Any, axis: Any, start_s: float, end_s: float, max_ticks: int) -> None:
    """x from ``start_s`` to ``end_s`` (the report window) with ticks whose labels do
    not repeat: times of day alone within one UTC day, with the date across days,
    dates (and years where the window spans two) for longer windows."""
    axis.set_xlim(_num(mdates, start_s), _num(mdates, end_s))
    span = end_s - start_s
    locator: Any = None
    step_s = 0.0
    # Times of day only for windows of up to two days: longer ones tick by date.
    for minutes in _MINUTE_STEPS if span <= 2 * _DAY_S else ():
        if span / (minutes * 60) <= max_ticks:
            locator, step_s = mdates.MinuteLocator(byminute=range(0, 60, minutes)), minutes * 60
            break
    else:
        for hours in _HOUR_STEPS if span <= 2 * _DAY_S else ():
            if span / (hours * 3600) <= max_ticks:
                locator, step_s = mdates.HourLocator(byhour=range(0, 24, hours)), hours * 3600
                break
        else:
            for days in _DAY_STEPS:
                if span / (days * _DAY_S) <= max_ticks:
                    locator = mdates.DayLocator(interval=days)
                    step_s = days * _DAY_S
                    break
            else:
                months = next(
                    (m for m in _MONTH_STEPS if span / (m * 30.4 * _DAY_S) <= max_ticks), 12
                )
                locator = mdates.MonthLocator(interval=months)
                step_s = months * 30.4 * _DAY_S
    first, last = _utc(start_s), _utc(end_s - 1)
    if step_s < _DAY_S:
        one_day = first.date() == last.date()
        text = "%H:%M" if one_day else "%H:%M\n%b %d"
    else:
        text = "%b %d" if first.year == last.year else "%Y-%m-%d"
    axis.xaxis.set_major_locator(locator)
    axis.xaxis.set_major_formatter(mdates.DateFormatter(text, tz=UTC))
    axis.set_xlabel(
        f"UTC, {first:%Y-%m-%d}"
        if first.date() == last.date()
        else f"UTC, {first:%Y-%m-%d} to {last:%Y-%m-%d}"
    )


def _utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def _plot(axis: Any, x: Sequence[datetime], y: Sequence[float], **style: Any) -> None:
    """A series with NaN at missing hours: the line breaks there. Every point is marked
    when there are few; otherwise only points with no neighbour (no line to show them)."""
    finite = [not math.isnan(value) for value in y]
    size = 3
    if sum(finite) <= _SPARSE_POINTS:
        markevery: list[int] | None = None
        size = 4
    else:
        markevery = [
            index
            for index, present in enumerate(finite)
            if present
            and (index == 0 or not finite[index - 1])
            and (index == len(y) - 1 or not finite[index + 1])
        ]
    axis.plot(x, y, marker="o", markersize=size, markevery=markevery, **style)


def _no_data(axis: Any, note: str = "no data") -> None:
    axis.text(
        0.5,
        0.5,
        note,
        transform=axis.transAxes,
        ha="center",
        va="center",
        color="#666666",
        fontsize=11,
    )
    axis.set_yticks([])


def _top(*series: Sequence[float]) -> float:
    """A y-limit above every point (markers on the edge are half hidden)."""
    largest = max((v for values in series for v in values if not math.isnan(v)), default=0.0)
    return largest * 1.1 if largest > 0 else 1.0


def _has_data(*series: Sequence[float]) -> bool:
    return any(not math.isnan(value) for values in series for value in values)


def build_figures(snapshot: TelemetrySnapshot, *, days: int = 30) -> list[tuple[Any, str]]:
    """The report's matplotlib figures, each with its caption, in page order.

    Every x-axis is the report window (``_window``); hours with nothing recorded are
    gaps. The caller owns the figures: ``matplotlib.pyplot.close`` each when done."""
    plt = _pyplot()
    mdates: Any = importlib.import_module("matplotlib.dates")
    days = max(days, 1)
    wear = snapshot.wear_report()
    first_hour, now_hour = _window(snapshot, days)
    by_hour = {b.hour: b for b in snapshot.buckets if first_hour <= b.hour <= now_hour}
    grid = range(first_hour, now_hour + 1)
    start_s, end_s = first_hour * SECONDS_PER_HOUR, (now_hour + 1) * SECONDS_PER_HOUR
    built: list[tuple[Any, str]] = []

    # 1. daily writes vs budget
    first_day = start_s // _DAY_S
    last_day = (now_hour * SECONDS_PER_HOUR) // _DAY_S
    by_day: dict[int, list[int]] = {}
    for bucket in by_hour.values():
        day = bucket.hour * SECONDS_PER_HOUR // _DAY_S
        row = by_day.setdefault(day, [0] * len(WRITE_KINDS))
        for position in range(len(WRITE_KINDS)):
            row[position] += bucket.values[position]
    days_sorted = sorted(day for day, row in by_day.items() if any(row))
    tallest = max((sum(by_day[day]) for day in days_sorted), default=0)
    limit_dwpd = wear.max_dwpd or wear.rated_dwpd
    limit_name = "max_dwpd budget" if wear.max_dwpd else "rated DWPD"
    budget = limit_dwpd * wear.drive_capacity_bytes if wear.drive_capacity_bytes else None
    far = budget is not None and budget > _FAR_LIMIT * tallest
    divisor, unit = _unit(max(tallest, 0 if far or budget is None else budget), "/day")
    figure, axis = plt.subplots(figsize=(10, 4))
    x = [_num(mdates, day * _DAY_S + _DAY_S / 2) for day in days_sorted]
    bottom = [0.0] * len(days_sorted)
    for position, kind in enumerate(WRITE_KINDS):
        heights = [by_day[day][position] / divisor for day in days_sorted]
        if any(heights):
            axis.bar(x, heights, bottom=bottom, width=0.8, label=kind, color=_COLOURS[kind])
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    limit_text = ""
    if budget is not None:
        budget_divisor, budget_unit = _unit(budget, "/day")
        limit_text = (
            f"{limit_name} ({limit_dwpd:g}) x capacity = "
            f"{budget / budget_divisor:,.3g} {budget_unit}"
        )
        if not far:
            axis.axhline(budget / divisor, color="red", linestyle="--", label=limit_text)
            axis.axhline(0.8 * budget / divisor, color="orange", linestyle=":", label="80% (alert)")
            axis.set_ylim(0, max(tallest, budget) / divisor * 1.12)
        elif tallest:
            axis.set_ylim(0, tallest / divisor * 1.25)
            axis.text(
                0.99,
                0.97,
                f"{limit_text},\n{budget / tallest:,.0f}x the largest day: off this scale",
                transform=axis.transAxes,
                ha="right",
                va="top",
                fontsize=8,
                bbox={"facecolor": "white", "edgecolor": "#cccccc", "alpha": 0.9},
            )
    if not days_sorted:
        _no_data(axis, "no data" + (f"\n{limit_text}" if limit_text else ""))
    else:
        axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, framealpha=0.9)
    axis.set_xlim(_num(mdates, first_day * _DAY_S), _num(mdates, (last_day + 1) * _DAY_S))
    n_days = last_day - first_day + 1
    every = max(1, math.ceil(n_days / 10))
    axis.set_xticks(
        [_num(mdates, (first_day + i) * _DAY_S + _DAY_S / 2) for i in range(0, n_days, every)]
    )
    same_year = _utc(first_day * _DAY_S).year == _utc(last_day * _DAY_S).year
    axis.xaxis.set_major_formatter(
        mdates.DateFormatter("%b %d" if same_year else "%Y-%m-%d", tz=UTC)
    )
    axis.set_xlabel(f"UTC day, {_utc(first_day * _DAY_S):%Y}" if same_year else "UTC day")
    axis.set_ylabel(f"{unit.removesuffix('/day')} written per day")
    axis.set_title("Daily writes to the drive, by kind, against the DWPD limit")
    built.append(
        (
            figure,
            "Bars: bytes the store wrote each UTC day, stacked by kind. Red dashed line: the "
            "daily limit (DWPD x capacity); orange dotted: the 80% alert threshold. A limit "
            "more than ten times the largest day is stated in the corner instead, so that "
            "the bars stay readable."
            + ("" if budget is not None else " No drive capacity is known: no limit drawn."),
        )
    )

    times = [_utc(hour * SECONDS_PER_HOUR + SECONDS_PER_HOUR / 2) for hour in grid]
    hours: list[HourBucket | None] = [by_hour.get(hour) for hour in grid]

    # 2. write amplification per hour
    figure, axis = plt.subplots(figsize=(10, 3))
    wa = [b.store_bytes / b.values[0] if b and b.values[0] else _NAN for b in hours]
    if _has_data(wa):
        _plot(axis, times, wa, linewidth=0.8, color="#4c72b0", label="write amplification")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.margins(y=0.1)
    else:
        _no_data(axis)
    axis.set_ylabel("store bytes / host byte")
    axis.set_title(f"Write amplification per hour (lifetime {wear.write_amplification:.3f})")
    _time_axis(mdates, axis, start_s, end_s, 8)
    built.append((figure, "Each point is one clock hour. Hours with no host writes are gaps."))

    # 3. throughput per hour
    figure, axis = plt.subplots(figsize=(10, 3))
    series = {
        "host writes": [b.values[0] if b else _NAN for b in hours],
        "store writes": [b.store_bytes if b else _NAN for b in hours],
        "reads": [b.get("read_bytes") if b else _NAN for b in hours],
    }
    largest = max((v for values in series.values() for v in values if not math.isnan(v)), default=0)
    divisor, unit = _unit(largest / SECONDS_PER_HOUR, "/s")
    if _has_data(*series.values()):
        for label, values in series.items():
            rates = [v / SECONDS_PER_HOUR / divisor for v in values]
            _plot(axis, times, rates, linewidth=1.0, label=label)
        axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        axis.set_ylim(0, _top([largest / SECONDS_PER_HOUR / divisor]))
    else:
        _no_data(axis)
    axis.set_ylabel(f"{unit} (hourly average)")
    axis.set_title("Throughput")
    _time_axis(mdates, axis, start_s, end_s, 8)
    built.append(
        (
            figure,
            "Averages over each clock hour, drawn at the middle of the hour; the last point "
            "is the hour in progress. Hours with nothing recorded (the store closed, or "
            "idle) are gaps.",
        )
    )

    # 4. latency per hour
    figure, grid_axes = plt.subplots(2, 2, figsize=(11, 6))
    axes = [axis for row in grid_axes for axis in row]
    for index, (axis, op) in enumerate(zip(axes, LATENCY_OPS, strict=True)):
        means: list[float] = []
        p99s: list[float] = []
        for entry in hours:
            counts, sum_ns = entry.latency(op) if entry else ((), 0)
            if sum(counts):
                means.append(sum_ns / sum(counts) / 1e6)
                p99 = percentile_from_buckets(counts, 0.99)
                p99s.append((p99 or 0.0) * 1e3)
            else:
                means.append(_NAN)
                p99s.append(_NAN)
        if _has_data(means):
            _plot(axis, times, means, linewidth=1.0, color="#1f77b4", label="mean")
            _plot(axis, times, p99s, linewidth=1.0, color="#ff7f0e", label="p99 (bucket bound)")
            axis.set_ylim(0, _top(means, p99s))
        else:
            _no_data(axis)
        axis.set_title(f"{op} latency")
        axis.set_ylabel("ms")
        _time_axis(mdates, axis, start_s, end_s, 5)
        if index < 2:
            axis.set_xlabel("")
    handles = [
        plt.Line2D([], [], color="#1f77b4", marker="o", markersize=3, label="mean"),
        plt.Line2D([], [], color="#ff7f0e", marker="o", markersize=3, label="p99 (bucket bound)"),
    ]
    figure.legend(handles=handles, loc="upper center", ncols=2, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0, 1, 0.96))
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
    days = max(days, 1)
    plural = "" if days == 1 else "s"
    first_hour, _ = _window(snapshot, days)
    window = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(first_hour * SECONDS_PER_HOUR))
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
<p>{html.escape(snapshot.path)} &mdash; generated {generated}. Plots from {window} (the last
{days} day{plural}, or since the counters began), hourly resolution. Counters since {since}.</p>
<table>{table}</table>
<ul>{notes}</ul>
{figures}
<p>What each number means and what to do: docs/operations.md, "Wear and performance".</p>
</body></html>
"""
    return page, [base64.b64decode(image) for image in images]
