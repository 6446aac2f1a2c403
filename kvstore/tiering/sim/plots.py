"""The Pareto frontier of a ``kvstore sim`` run, and its plot.

A policy is a point (hit ratio, NVMe bytes written): more hits are better,
fewer writes are better (wear). ``q`` dominates ``p`` when ``q`` is at least as
good on both and strictly better on one. The frontier is the set of points no
other point dominates; it is taken over the real policies only, never over the
reference models (``REFERENCE_POLICIES``: an infinite cache hits everything and
writes nothing, so it would dominate every real policy and hide the trade-off;
recomputing everything is the trivial corner).

``frontier_notes`` is what the table and the plot both mark, so the two always
agree. matplotlib (Agg backend) is imported only by the plotting functions.
``plot_cluster`` draws ``kvstore sim --nodes`` (hit ratio and TTFT against nodes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "REFERENCE_POLICIES",
    "FrontierNote",
    "dominates",
    "frontier_notes",
    "is_kvstore",
    "pareto_frontier",
    "plot_cluster",
    "plot_results",
    "plot_workload",
]

REFERENCE_POLICIES = frozenset({"infinite", "recompute"})

_TIERS = ("hbm", "dram", "nvme")
_TIER_COLOURS = {"hbm": "#2b8cbe", "dram": "#7bccc4", "nvme": "#fdae6b"}
_KVSTORE_COLOUR = "#d62728"


def is_kvstore(policy: str) -> bool:
    """``kvstore`` or one of its overridden variants (``kvstore:KEY=VALUE``)."""
    return policy == "kvstore" or policy.startswith("kvstore:")


def _point(result: Mapping[str, Any]) -> tuple[float, int]:
    return float(result["hit_ratio"]), int(result["nvme_bytes_written"])


def dominates(q: Mapping[str, Any], p: Mapping[str, Any]) -> bool:
    """True when result ``q`` has at least ``p``'s hit ratio and at most its writes,
    and is strictly better on one of the two."""
    q_hits, q_writes = _point(q)
    p_hits, p_writes = _point(p)
    return q_hits >= p_hits and q_writes <= p_writes and (q_hits > p_hits or q_writes < p_writes)


def pareto_frontier(results: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The non-dominated results among ``results``, fewest writes first.

    Reference models are left out (see the module docstring); ties (the same
    point twice) are both on the frontier.
    """
    candidates = [r for r in results if r["policy"] not in REFERENCE_POLICIES]
    on = [p for p in candidates if not any(dominates(q, p) for q in candidates)]
    return sorted(on, key=lambda r: (_point(r)[1], _point(r)[0]))


@dataclass(frozen=True, slots=True)
class FrontierNote:
    """Where one policy stands, for the table's column and the plot's markers.

    ``dominated_by`` lists the policies (peers and kvstore) that dominate it.
    For a kvstore variant, ``against_peers`` is its standing against the
    peers' frontier alone: "above" (it dominates a peer on that frontier),
    "on" (no peer dominates it, it dominates none of the frontier) or
    "dominated"; ``peers_dominating`` / ``peers_dominated`` name them.
    """

    policy: str
    reference: bool
    on_frontier: bool
    dominated_by: tuple[str, ...]
    against_peers: str | None = None
    peers_dominating: tuple[str, ...] = ()
    peers_dominated: tuple[str, ...] = ()


def frontier_notes(results: Sequence[Mapping[str, Any]]) -> list[FrontierNote]:
    """One note per result, in the order given."""
    real = [r for r in results if r["policy"] not in REFERENCE_POLICIES]
    peers = [r for r in real if not is_kvstore(r["policy"])]
    peer_frontier = pareto_frontier(peers)
    notes = []
    for result in results:
        name = result["policy"]
        if name in REFERENCE_POLICIES:
            notes.append(FrontierNote(name, True, False, ()))
            continue
        dominated_by = tuple(q["policy"] for q in real if dominates(q, result))
        if not is_kvstore(name):
            notes.append(FrontierNote(name, False, not dominated_by, dominated_by))
            continue
        peers_dominating = tuple(q["policy"] for q in peers if dominates(q, result))
        peers_dominated = tuple(p["policy"] for p in peer_frontier if dominates(result, p))
        if peers_dominating:
            standing = "dominated"
        elif peers_dominated:
            standing = "above"
        else:
            standing = "on"
        notes.append(
            FrontierNote(
                name,
                False,
                not dominated_by,
                dominated_by,
                standing,
                peers_dominating,
                peers_dominated,
            )
        )
    return notes


def _byte_unit(largest: float) -> tuple[float, str]:
    for scale, unit in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if largest >= scale:
            return float(scale), unit
    return 1.0, "bytes"


def plot_results(document: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a PNG of one run (the ``--json`` object of ``kvstore sim``) to ``path``.

    Left: hit ratio against NVMe bytes written, one point per policy, the
    Pareto frontier as the staircase of the best hit ratio reachable within a
    write budget, kvstore as red stars, the infinite cache as a dashed bound.
    Right: each policy's hit ratio split by the tier that served it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results: list[Mapping[str, Any]] = list(document["results"])
    notes = {note.policy: note for note in frontier_notes(results)}
    scale, unit = _byte_unit(max((r["nvme_bytes_written"] for r in results), default=0))
    figure, (scatter, bars) = plt.subplots(
        1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]}
    )
    try:
        _draw_scatter(scatter, results, notes, scale, unit, float(document["max_hit_ratio"]))
        _draw_bars(bars, results, float(document["max_hit_ratio"]))
        capacity = document["capacity_blocks"]
        figure.suptitle(
            f"{document['trace']}: {document['requests']:,} requests, "
            f"{document['block_accesses']:,} block accesses, {document['unique_blocks']:,} "
            f"unique; capacity (HBM, DRAM, NVMe) = {capacity[0]:,}, {capacity[1]:,}, "
            f"{capacity[2]:,} blocks",
            fontsize=10,
        )
        figure.tight_layout()
        figure.savefig(os.fspath(path), format="png", dpi=100)
    finally:
        plt.close(figure)


def plot_workload(
    title: str,
    panels: Sequence[Sequence[tuple[str, Mapping[str, Any]]]],
    path: str | os.PathLike[str],
) -> None:
    """Write a PNG of one workload of ``kvstore sim --suite`` to ``path``: a grid of
    the frontier scatters of ``plot_results`` (hit ratio against NVMe bytes written,
    the peers' Pareto staircase, kvstore as red stars), one panel per run.

    ``panels`` is rows of (panel title, run document); the suite gives a row per
    capacity triple and a column per seed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [list(row) for row in panels if row]
    if not rows:
        raise ValueError("plot_workload needs at least one run")
    columns = max(len(row) for row in rows)
    figure, axes = plt.subplots(
        len(rows), columns, figsize=(6.5 * columns, 4.6 * len(rows)), squeeze=False
    )
    try:
        for i, row in enumerate(rows):
            for c in range(columns):
                axis = axes[i][c]
                if c >= len(row):
                    axis.set_visible(False)
                    continue
                name, document = row[c]
                results: list[Mapping[str, Any]] = list(document["results"])
                notes = {note.policy: note for note in frontier_notes(results)}
                largest = max((x["nvme_bytes_written"] for x in results), default=0)
                scale, unit = _byte_unit(largest)
                _draw_scatter(axis, results, notes, scale, unit, float(document["max_hit_ratio"]))
                axis.set_title(name, fontsize=9)
        figure.suptitle(title, fontsize=11)
        figure.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - 0.45 / figure.get_figheight()))
        figure.savefig(os.fspath(path), format="png", dpi=80)
    finally:
        plt.close(figure)


def _draw_scatter(
    axis: Any,
    results: Sequence[Mapping[str, Any]],
    notes: Mapping[str, FrontierNote],
    scale: float,
    unit: str,
    max_hit_ratio: float,
) -> None:
    frontier = pareto_frontier(results)
    if frontier:
        xs = [r["nvme_bytes_written"] / scale for r in frontier]
        ys = [r["hit_ratio"] for r in frontier]
        right = max(r["nvme_bytes_written"] for r in results) / scale
        # Within a write budget x the best reachable hit ratio is the best point
        # left of x: a staircase, flat to the right of each frontier point.
        axis.step(
            [*xs, max(right, xs[-1])],
            [*ys, ys[-1]],
            where="post",
            color="grey",
            linewidth=1,
            linestyle="-",
            label="Pareto frontier",
            zorder=1,
        )
    for result in results:
        name = result["policy"]
        x, y = result["nvme_bytes_written"] / scale, result["hit_ratio"]
        note = notes[name]
        if name == "infinite":
            axis.axhline(
                y, color="black", linestyle="--", linewidth=1, label=f"infinite cache ({y:.3f})"
            )
        elif is_kvstore(name):
            axis.scatter(
                [x],
                [y],
                marker="*",
                s=260,
                color=_KVSTORE_COLOUR,
                zorder=3,
                edgecolors="black",
                linewidths=0.5,
            )
        elif note.reference:
            axis.scatter([x], [y], marker="x", s=50, zorder=2, color="grey")
        else:  # filled on the frontier, hollow when dominated
            axis.scatter(
                [x],
                [y],
                marker="o",
                s=50,
                zorder=2,
                edgecolors="#1f77b4",
                color="#1f77b4" if note.on_frontier else "none",
            )
    _label_points(axis, [r for r in results if r["policy"] != "infinite"], scale)
    widest = max((r["nvme_bytes_written"] for r in results), default=0) / scale or 1.0
    axis.set_xlim(-0.04 * widest, 1.3 * widest)  # room for the labels of the rightmost points
    if max_hit_ratio > 0:
        axis.set_ylim(bottom=min(0.0, axis.get_ylim()[0]), top=max_hit_ratio * 1.1)
    axis.set_xlabel(f"NVMe bytes written ({unit})")
    axis.set_ylabel("hit ratio (of all block accesses)")
    axis.set_title(
        "hit ratio against NVMe writes (filled: on the frontier; star: kvstore)", fontsize=9
    )
    axis.grid(True, alpha=0.3)
    axis.legend(loc="lower right", fontsize=8)


def _label_points(axis: Any, results: Sequence[Mapping[str, Any]], scale: float) -> None:
    """One label per distinct point (policies on the same point share it), each
    moved off the labels already placed near it."""
    by_point: dict[tuple[float, int], list[str]] = {}
    for result in results:
        by_point.setdefault(_point(result), []).append(result["policy"])
    width = max((writes for _, writes in by_point), default=0) / scale or 1.0
    height = max((hits for hits, _ in by_point), default=0.0) or 1.0
    placed: list[tuple[float, float]] = []
    for (hits, writes), names in sorted(by_point.items(), key=lambda item: item[0][1]):
        x = writes / scale
        for offset in (0, -14, 14, -28, 28, -42, 42):
            spot = (x / width, hits / height + offset / 300)
            if all(abs(spot[0] - px) > 0.15 or abs(spot[1] - py) > 0.04 for px, py in placed):
                break
        placed.append(spot)
        bold = any(is_kvstore(name) for name in names)
        axis.annotate(
            " = ".join(names),
            (x, hits),
            textcoords="offset points",
            xytext=(6, 3 + offset),
            fontsize=7.5,
            fontweight="bold" if bold else "normal",
        )


def _draw_bars(axis: Any, results: Sequence[Mapping[str, Any]], max_hit_ratio: float) -> None:
    names = [r["policy"] for r in results]
    positions = list(range(len(names)))
    bottom = [0.0] * len(names)
    for tier in _TIERS:
        heights = [float(r["hit_ratio_by_tier"][tier]) for r in results]
        axis.barh(positions, heights, left=bottom, color=_TIER_COLOURS[tier], label=tier)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    axis.axvline(max_hit_ratio, color="black", linestyle="--", linewidth=1, label="infinite cache")
    axis.set_yticks(positions, names, fontsize=8)
    for label, name in zip(axis.get_yticklabels(), names, strict=True):
        if is_kvstore(name):
            label.set_color(_KVSTORE_COLOUR)
            label.set_fontweight("bold")
    axis.invert_yaxis()
    axis.set_xlim(0, max([max_hit_ratio, *bottom, 0.01]) * 1.05)
    axis.set_xlabel("hit ratio by serving tier")
    axis.set_title("where the hits were served from", fontsize=9)
    axis.grid(True, axis="x", alpha=0.3)
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncols=4, fontsize=8)


_ROUTING_COLOURS = {"random": "#1f77b4", "session": "#2ca02c", "prefix": "#d62728"}


def plot_cluster(document: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a PNG of ``kvstore sim --nodes`` (``run_cluster``'s object) to ``path``:
    hit ratio, TTFT p50 and TTFT p99 against the node count, a colour per routing,
    solid with the shared tier and dashed without it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries: list[Mapping[str, Any]] = list(document["configurations"])
    nodes = sorted({int(e["nodes"]) for e in entries})
    # A one-node point (routing "any": every routing is the same there) is on every line.
    routings = list(dict.fromkeys(str(e["routing"]) for e in entries if e["routing"] != "any"))
    routings = routings or ["any"]
    figure, axes = plt.subplots(1, 3, figsize=(16, 5))
    panels = (
        ("hit ratio", "hit_ratio", 1.0),
        ("TTFT p50 (ms)", "ttft_p50_s", 1e3),
        ("TTFT p99 (ms)", "ttft_p99_s", 1e3),
    )
    try:
        for axis, (label, key, scale) in zip(axes, panels, strict=True):
            for routing in routings:
                mine = sorted(
                    (e for e in entries if e["routing"] in (routing, "any")),
                    key=lambda e: int(e["nodes"]),
                )
                xs = [int(e["nodes"]) for e in mine]
                colour = _ROUTING_COLOURS.get(routing, "#555555")
                for side, style, name in (
                    ("with_shared", "-", "with the shared tier"),
                    ("without_shared", "--", "without"),
                ):
                    ys = [float(e[side][key]) * scale for e in mine]
                    axis.plot(xs, ys, style, marker="o", color=colour, label=f"{routing}, {name}")
            if key == "hit_ratio":
                axis.axhline(
                    float(document["max_hit_ratio"]),
                    color="#888888",
                    linestyle=":",
                    label="infinite cache",
                )
            axis.set_xscale("log", base=2)
            axis.set_xticks(nodes)
            axis.set_xticklabels([str(n) for n in nodes])
            axis.set_xlabel("nodes")
            axis.set_ylabel(label)
            axis.grid(True, alpha=0.3)
        axes[0].legend(fontsize=8)
        shared = document["shared"]
        figure.suptitle(
            f"{document['trace']}: {document['requests']:,} requests across nodes; "
            f"shared pool {int(shared['capacity_blocks']):,} blocks, "
            f"{float(shared['network_gbps']):g} GB/s",
            fontsize=10,
        )
        figure.tight_layout()
        figure.savefig(os.fspath(path), format="png", dpi=100)
    finally:
        plt.close(figure)
