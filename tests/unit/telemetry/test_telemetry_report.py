"""The report's figures read on a young store and on a long one.

Each test builds a ``TelemetrySnapshot`` by hand (no store, no disk) and inspects
the matplotlib figures ``build_figures`` returns: x-limits, line data, markers,
"no data" texts, tick labels, bar heights against the y-limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

matplotlib: Any = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
mdates: Any = pytest.importorskip("matplotlib.dates")
plt: Any = pytest.importorskip("matplotlib.pyplot")

from kvstore.telemetry import TelemetrySnapshot  # noqa: E402
from kvstore.telemetry import counters as tc  # noqa: E402
from kvstore.telemetry.counters import VECTOR_LEN, HourBucket, WearSettings  # noqa: E402
from kvstore.telemetry.report import build_figures, render_html  # noqa: E402

HOUR = 3600
DAY = 86_400
NOW = 1_796_400_000 + 40 * 60 + 17  # 2026-12-04 16:40:17 UTC, 40 minutes into an hour
NOW_HOUR = NOW // HOUR


def bucket(
    hour: int,
    *,
    host: int = 0,
    reads: int = 0,
    put_ms: float | None = None,
    gc_ms: float | None = None,
) -> HourBucket:
    values = [0] * VECTOR_LEN
    values[tc.HOST] = host
    values[tc.RECORD_OVERHEAD] = host // 10
    values[tc.WAL] = 4096 if host else 0
    values[tc.READ_BYTES] = reads
    if put_ms is not None:
        tc.observe(values, tc.OP_PUT, int(put_ms * 1e6))
        tc.observe(values, tc.OP_FLUSH, int(put_ms * 2e6))
    if gc_ms is not None:
        tc.observe(values, tc.OP_GC, int(gc_ms * 1e6))
    return HourBucket(hour, tuple(values))


def busy(hour: int, host: int = 2_000_000) -> HourBucket:
    return bucket(hour, host=host, reads=host // 2, put_ms=0.4, gc_ms=3.0)


def snapshot(
    buckets: Sequence[HourBucket],
    *,
    created_s: float,
    capacity: int | None = 275 * 10**9,
    max_dwpd: float = 0.0,
) -> TelemetrySnapshot:
    values = [sum(column) for column in zip(*(b.values for b in buckets), strict=True)]
    return TelemetrySnapshot(
        path="/store",
        values=tuple(values or [0] * VECTOR_LEN),
        buckets=tuple(buckets),
        now_s=float(NOW),
        created_s=created_s,
        saved_s=None,
        wear=WearSettings(rated_dwpd=1.0, max_dwpd=max_dwpd),
        drive_capacity_bytes=capacity,
        capacity_source="config",
        live=False,
    )


def young() -> TelemetrySnapshot:
    """Created 25 minutes ago; a few puts and gets in the hour in progress, no GC yet."""
    only = bucket(NOW_HOUR, host=1_000_000, reads=300_000, put_ms=0.4)
    return snapshot([only], created_s=NOW - 25 * 60)


def with_gap() -> TelemetrySnapshot:
    """Created 80 hours ago: busy 3 hours, closed 70, busy the last 8."""
    first = NOW_HOUR - 80
    hours = [*range(first, first + 3), *range(first + 73, NOW_HOUR + 1)]
    return snapshot([busy(hour) for hour in hours], created_s=first * HOUR + 5)


def long_history(days: int = 90) -> TelemetrySnapshot:
    first = NOW_HOUR - days * 24
    hours = [hour for hour in range(first, NOW_HOUR + 1) if (hour - first) % 240 >= 48]
    return snapshot(
        [busy(hour, host=500_000 + 400_000 * (hour % 24)) for hour in hours],
        created_s=first * HOUR,
        capacity=256 << 20,
        max_dwpd=2.0,
    )


@pytest.fixture
def figures() -> Iterator[Any]:
    built: list[Any] = []

    def _build(snap: TelemetrySnapshot, days: int = 30) -> list[Any]:
        pairs = build_figures(snap, days=days)
        built.extend(figure for figure, _ in pairs)
        return [figure for figure, _ in pairs]

    yield _build
    for figure in built:
        plt.close(figure)


def panels(figs: list[Any]) -> tuple[Any, list[Any]]:
    """(the daily panel, the hourly panels)."""
    daily, *rest = [axis for figure in figs for axis in figure.axes]
    return daily, rest


def num(seconds: float) -> float:
    return float(mdates.date2num(datetime.fromtimestamp(seconds, tz=UTC)))


def texts(axis: Any) -> str:
    return " ".join(text.get_text() for text in axis.texts)


def data_lines(axis: Any) -> list[Any]:
    return [line for line in axis.get_lines() if line.get_label() and line.get_label()[0] != "_"]


@pytest.mark.parametrize(
    ("make", "days", "start_s"),
    [
        (young, 30, (NOW - 25 * 60) // HOUR * HOUR),
        (with_gap, 30, (NOW_HOUR - 80) * HOUR),
        (long_history, 30, (NOW_HOUR - 30 * 24 + 1) * HOUR),
        (long_history, 90, (NOW_HOUR - 90 * 24 + 1) * HOUR),
    ],
)
def test_the_x_range_is_the_report_window(figures: Any, make: Any, days: int, start_s: int) -> None:
    """From the later of creation and now - days (whole hours; whole days for the
    daily bars) to the end of the hour in progress; not 2025-2029 for one point."""
    daily, hourly = panels(figures(make(), days))
    end_s = (NOW_HOUR + 1) * HOUR
    for axis in hourly:
        assert axis.get_xlim() == pytest.approx((num(start_s), num(end_s)), abs=1e-6), (
            axis.get_title()
        )
    assert daily.get_xlim() == pytest.approx(
        (num(start_s // DAY * DAY), num((NOW // DAY + 1) * DAY)), abs=1e-6
    )


def test_gaps_stay_gaps(figures: Any) -> None:
    """Hours with nothing recorded break the lines: no line across the 70 hours closed."""
    _, hourly = panels(figures(with_gap()))
    gap_from, gap_to = num((NOW_HOUR - 77) * HOUR), num((NOW_HOUR - 8) * HOUR)
    checked = 0
    for axis in hourly:
        for line in data_lines(axis):
            x = mdates.date2num(line.get_xdata())
            y = line.get_ydata()
            inside = [value for when, value in zip(x, y, strict=True) if gap_from < when < gap_to]
            assert inside and all(math.isnan(value) for value in inside), (
                axis.get_title(),
                line.get_label(),
            )
            checked += 1
    assert checked >= 1 + 3 + 2 * 3  # WA, throughput x3, mean and p99 of put/flush/gc


def test_sparse_series_get_markers(figures: Any) -> None:
    """One point per series on a young store: each drawn as a marker, not an invisible
    zero-length line."""
    _, hourly = panels(figures(young()))
    drawn = 0
    for axis in hourly:
        for line in data_lines(axis):
            finite = [value for value in line.get_ydata() if not math.isnan(value)]
            if finite:
                assert line.get_marker() not in (None, "", " ", "None"), line.get_label()
                assert line.get_markevery() is None or len(line.get_markevery()) == len(finite)
                drawn += 1
    assert drawn == 1 + 3 + 2 * 2  # WA, throughput x3, mean and p99 of put and flush


def test_isolated_hours_in_a_dense_series_are_marked(figures: Any) -> None:
    first = NOW_HOUR - 20 * 24
    hours = [*range(first, first + 24 * 10), first + 24 * 15, *range(NOW_HOUR - 24, NOW_HOUR + 1)]
    _, hourly = panels(figures(snapshot([busy(h) for h in hours], created_s=first * HOUR)))
    lone = num(first * HOUR + 24 * 15 * HOUR + HOUR // 2)
    for axis in hourly:
        for line in data_lines(axis):
            x = mdates.date2num(line.get_xdata())
            marked = line.get_markevery()
            assert line.get_marker() not in (None, "", " ", "None")
            assert marked is not None and len(marked) < len(hours)  # dense: not every point
            assert any(abs(x[index] - lone) < 1e-6 for index in marked), line.get_label()


def test_empty_panels_say_no_data(figures: Any) -> None:
    # A young store that never ran GC: the gc latency panel is empty.
    _, hourly = panels(figures(young()))
    by_title = {axis.get_title(): axis for axis in hourly}
    assert "no data" in texts(by_title["gc latency"])
    assert "no data" not in texts(by_title["put latency"])
    # Nothing written at all: every panel says so.
    daily, hourly = panels(figures(snapshot([], created_s=NOW - 60)))
    for axis in (daily, *hourly):
        assert "no data" in texts(axis), axis.get_title()


@pytest.mark.parametrize(
    ("make", "days"),
    [(young, 30), (with_gap, 30), (long_history, 30), (long_history, 90), (long_history, 7)],
)
def test_date_tick_labels_do_not_repeat(figures: Any, make: Any, days: int) -> None:
    figs = figures(make(), days)
    for figure in figs:
        figure.canvas.draw()
    for axis in (axis for figure in figs for axis in figure.axes):
        labels = [label.get_text() for label in axis.get_xticklabels() if label.get_text()]
        # The daily panel of a store younger than a day has one bar and one date.
        assert len(labels) >= (1 if axis.patches else 2), (axis.get_title(), labels)
        assert len(labels) == len(set(labels)), (axis.get_title(), labels)


def tallest_bar_share(axis: Any) -> float:
    top = max(patch.get_y() + patch.get_height() for patch in axis.patches)
    low, high = axis.get_ylim()
    return float((top - low) / (high - low))


def test_the_days_bar_shows_under_a_far_limit(figures: Any) -> None:
    """1 MB written against 275 GB/day: the bar fills the scale, the limit is a note."""
    daily, _ = panels(figures(young()))
    assert tallest_bar_share(daily) > 0.5
    assert "275 GB/day" in texts(daily)


def test_a_limit_within_reach_is_drawn_with_the_bars(figures: Any) -> None:
    """Days at about a quarter of a 0.54 GB/day budget: both the bars and the limit lines show."""
    daily, _ = panels(figures(long_history()))
    assert tallest_bar_share(daily) > 0.1
    limits = [line.get_ydata()[0] for line in daily.get_lines()]
    assert len(limits) == 2 and max(limits) < daily.get_ylim()[1]


def test_render_html_still_one_page_of_four_plots() -> None:
    page, images = render_html(young())
    assert len(images) == 4 and page.count("data:image/png;base64,") == 4
