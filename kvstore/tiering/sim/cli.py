"""The ``sim`` click command: ``kvstore sim``, also ``python -m kvstore.tiering.sim``.

It owns the command line only: reading or generating the trace, checking the
options, the progress bar, the table, ``--json`` and ``--plot``. The replay and
the JSON object are ``kvstore.tiering.sim.run``'s; ``--json`` prints that object
unchanged, so the table and the JSON never disagree. ``--suite`` runs the
held-out suite of ``suite.py`` (docs/tiering.md, "The suite"): a table of
pass/fail per run, ``--json``, a frontier plot per workload into ``--out DIR``.
``--nodes`` replays the trace across serving nodes with and without a shared tier
(``cluster.py``; docs/tiering.md, "Beyond one machine, by simulation"): a table per
(nodes, routing), ``--json`` (``run_cluster``'s object), ``--plot`` against nodes.

The progress bar and, with ``--json``, the table go to stderr: stdout is then
exactly one JSON document.

Exit codes (the house's, kvstore/clikit.py):
    0  success
    2  usage: a bad --capacity, --capacity-bytes, --policy, --model or machine
       figure; TRACE and --generate both given, or neither; with --suite, a bad
       --seeds, an option the suite does not take, a policy that is not kvstore's;
       with --nodes, a bad node count, routing, shared capacity or network figure,
       --suite, more than one policy or a peer's; a --nodes option without --nodes
    8  operational: the trace file is missing, unreadable or not a valid trace
       (the message names the line and field), --out or --plot cannot be written

A suite that ran exits 0 whatever its verdicts: they are its output.

With ``--json`` a failure prints ``{"error": {"type", "message"}, "exit_code"}``.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path
from typing import Any, NoReturn

import click
from click.core import ParameterSource
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvstore.clikit import (
    EXIT_OPERATIONAL,
    EXIT_USAGE,
    echo_error_json,
    err_console,
    progress_bar,
)
from kvstore.errors import KVStoreError
from kvstore.tiering.config import MODEL_PRESETS, ModelCost
from kvstore.tiering.sim.cluster import (
    DEFAULT_NETWORK,
    DEFAULT_SHARED_FRACTION,
    MAX_NODES,
    ROUTINGS,
    Network,
    cluster_replays,
    run_cluster,
)
from kvstore.tiering.sim.peers import PEER_MODELS_VERSION, POLICIES
from kvstore.tiering.sim.plots import (
    FrontierNote,
    frontier_notes,
    is_kvstore,
    plot_cluster,
    plot_results,
    plot_workload,
)
from kvstore.tiering.sim.replay import Machine, kvstore_config, parse_overrides, run
from kvstore.tiering.sim.suite import (
    HIT_SLACK,
    SEED_SPLITS,
    SUITE_CAPACITIES,
    TTFT_FACTOR,
    WRITE_FACTOR,
    Check,
    SuiteRun,
    by_workload,
    capacity_text,
    parse_seeds,
    peer_results,
    run_label,
    run_suite,
    suite_cases,
    summary,
)
from kvstore.tiering.sim.trace import (
    ALL_KINDS,
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_REQUESTS,
    Request,
    generate,
    load_trace,
    write_trace,
)

__all__ = [
    "kvstore_verdict",
    "main",
    "parse_capacity",
    "parse_capacity_bytes",
    "parse_nodes",
    "parse_routings",
    "render",
    "render_cluster",
    "render_suite",
    "sim",
    "validate_policies",
]

_UNATTENDED_WIDTH = 160  # a file or pipe has no width; 80 columns would wrap the table
_MACHINE = Machine()
_FRACTIONS = inspect.signature(run).parameters["capacity_fractions"].default


class _OperationalError(Exception):
    """A file could not be read or written; exit 8 (the ``OSError``'s text is kept)."""


# -- option parsing ----------------------------------------------------------


def parse_capacity(text: str) -> tuple[float, float, float]:
    """``"0.02,0.1,0.5"`` -> fractions of the trace's unique blocks (HBM, DRAM, NVMe)."""
    parts = _three(text, "--capacity")
    fractions = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--capacity {text!r}: {part!r} is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"--capacity {text!r}: fractions must be finite and >= 0, got {part}")
        fractions.append(value)
    return fractions[0], fractions[1], fractions[2]


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_capacity_bytes(text: str) -> tuple[int, int, int]:
    """``"1GiB,16GiB,1TB"`` -> bytes per tier; K/M/G/T and KiB.. are powers of 1024,
    KB/MB/GB/TB powers of 1000, a bare number is bytes.

    The product is exact (the number's decimal value, floored), so a size of any
    length is a size, not a float overflow.
    """
    parts = _three(text, "--capacity-bytes")
    sizes = []
    for part in parts:
        match = _SIZE.match(part)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"--capacity-bytes {text!r}: {part!r} is not a size "
                "(a number of bytes, or with a unit: KiB MiB GiB TiB, KB MB GB TB)"
            )
        sizes.append(math.floor(Fraction(match.group(1)) * _UNITS[unit]))
    return sizes[0], sizes[1], sizes[2]


def _three(text: str, option: str) -> list[str]:
    parts = [part.strip() for part in text.split(",")]
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"{option} {text!r}: need three comma-separated values: HBM,DRAM,NVMe")
    return parts


def parse_nodes(text: str) -> list[int]:
    """``"2,8,64"`` -> node counts, each 1..MAX_NODES, ascending, duplicates dropped."""
    counts: set[int] = set()
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise ValueError(f"--nodes {text!r}: need node counts separated by commas, e.g. 2,8,64")
    for part in parts:
        if not (part.isascii() and part.isdigit()):
            raise ValueError(f"--nodes {text!r}: {part!r} is not a whole number of nodes")
        count = int(part)
        if not 1 <= count <= MAX_NODES:
            raise ValueError(f"--nodes {text!r}: a node count must be 1..{MAX_NODES}, got {count}")
        counts.add(count)
    return sorted(counts)


def parse_routings(texts: Sequence[str]) -> list[str]:
    """``("random,session", "prefix")`` -> routings in the order given, duplicates
    dropped; none given: every routing."""
    chosen: list[str] = []
    for text in texts:
        for part in (p.strip() for p in text.split(",")):
            if part not in ROUTINGS:
                raise ValueError(
                    f"--routing {text!r}: {part!r} is not a routing; known: {', '.join(ROUTINGS)}"
                )
            if part not in chosen:
                chosen.append(part)
    return chosen or list(ROUTINGS)


def parse_fraction(option: str, text: str) -> float:
    """One capacity fraction: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{option} {text!r}: not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{option} {text!r}: a fraction must be finite and >= 0")
    return value


def parse_size(option: str, text: str) -> int:
    """One size, read as each of ``--capacity-bytes``'s three is."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{option} {text!r}: not a size "
            "(a number of bytes, or with a unit: KiB MiB GiB TiB, KB MB GB TB)"
        )
    return math.floor(Fraction(match.group(1)) * _UNITS[unit])


def validate_policies(
    policies: Sequence[str], model: ModelCost, block_tokens: int, machine: Machine
) -> list[str] | None:
    """The policies to run, duplicates dropped; None for the default (every one).

    A ``kvstore:KEY=VALUE,...`` variant is built into a ``TierConfig`` here, so a
    field that does not exist or a value it refuses fails before any replay.
    """
    chosen: list[str] = []
    for name in policies:
        if name in chosen:
            continue
        if is_kvstore(name):
            try:
                overrides = parse_overrides(name)
                kvstore_config((1, 1, 1), model, block_tokens, machine, overrides)
            except (ValueError, TypeError) as e:
                message = str(e)
                if "--policy" not in message:
                    message = f"--policy {name!r}: {message}"
                raise ValueError(message) from e
        elif name not in POLICIES:
            known = ", ".join([*POLICIES, "kvstore", "kvstore:FIELD=VALUE,..."])
            raise ValueError(f"--policy {name!r}: unknown policy; known: {known}")
        chosen.append(name)
    return chosen or None


def _positive(option: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{option} must be a finite number > 0, got {value}")


# -- the trace -----------------------------------------------------------------


def _requests(
    trace_path: Path | None,
    kind: str | None,
    seed: int,
    count: int | None,
    limit: int | None,
    block_tokens: int,
    out: Path | None,
) -> tuple[list[Request], str]:
    """The requests to replay and the trace's name for the report."""
    if (trace_path is None) == (kind is None):
        raise ValueError("give a TRACE file or --generate KIND (one of the two)")
    if out is not None and kind is None:
        raise ValueError("--out saves a generated trace; it needs --generate")
    if trace_path is not None:
        try:
            return load_trace(trace_path, limit=limit), str(trace_path)
        except OSError as e:
            raise _OperationalError(f"cannot read trace {trace_path}: {e.strerror or e}") from e
    assert kind is not None
    requests = generate(kind, seed=seed, requests=count, block_tokens=block_tokens)
    if limit is not None:
        requests = requests[:limit]
    if out is not None:
        try:
            write_trace(requests, out)
        except OSError as e:
            raise _OperationalError(f"cannot write trace {out}: {e.strerror or e}") from e
    return requests, f"generated:{kind}:seed={seed}:requests={len(requests)}"


# -- output --------------------------------------------------------------------


def _milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def _bytes(count: int) -> str:
    for scale, unit in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if count >= scale:
            return f"{count / scale:,.1f} {unit}"
    return f"{count:,} B"


def _names(names: Sequence[str], most: int = 2) -> str:
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} +{len(names) - most} more"


def _standing(note: FrontierNote) -> str:
    if note.reference:
        return "[dim]reference[/dim]"
    if note.on_frontier:
        return "[green]frontier[/green]"
    return f"dominated by: {escape(_names(note.dominated_by))}"


def kvstore_verdict(note: FrontierNote) -> str:
    """One line on a kvstore variant against the peers' frontier (plain text)."""
    if note.against_peers == "dominated":
        return (
            f"{note.policy} is below the peers' frontier: dominated by "
            f"{', '.join(note.peers_dominating)} (as many hits or more, as few NVMe writes "
            "or fewer)"
        )
    if note.against_peers == "above":
        return (
            f"{note.policy} is above the peers' frontier: it dominates "
            f"{', '.join(note.peers_dominated)}"
        )
    return f"{note.policy} is on the peers' frontier: no peer dominates it"


def render(document: Mapping[str, Any], console: Console) -> None:
    """Print one run (``sim.run``'s object) as a table and the kvstore verdicts."""
    results: list[Mapping[str, Any]] = list(document["results"])
    notes = frontier_notes(results)
    capacity = document["capacity_blocks"]
    machine = document.get("machine", {})
    console.print(
        f"[bold]kvstore sim[/bold] {escape(str(document['trace']))}: "
        f"{document['requests']:,} requests, {document['block_accesses']:,} block accesses, "
        f"{document['unique_blocks']:,} unique blocks (an infinite cache hits "
        f"{document.get('max_hit_ratio', 0.0):.1%}); capacity HBM {capacity[0]:,}, "
        f"DRAM {capacity[1]:,}, NVMe {capacity[2]:,} blocks"
        + (
            f"; NVMe {machine['nvme_gbps']:g} GB/s, PCIe {machine['pcie_gbps']:g} GB/s, "
            f"{machine['tflops']:g} TFLOP/s"
            if machine
            else ""
        )
    )
    table = Table()
    for column in (
        "policy",
        "hit ratio",
        "HBM",
        "DRAM",
        "NVMe",
        "NVMe writes",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "recomputed tokens",
        "wall s",
        "Pareto",
    ):
        left = column in ("policy", "Pareto")
        table.add_column(column, justify="left" if left else "right", no_wrap=column == "policy")
    for result, note in zip(results, notes, strict=True):
        by_tier = result["hit_ratio_by_tier"]
        name = escape(result["policy"])
        table.add_row(
            f"[bold red]{name}[/bold red]" if is_kvstore(result["policy"]) else name,
            f"{result['hit_ratio']:.3f}",
            f"{by_tier['hbm']:.3f}",
            f"{by_tier['dram']:.3f}",
            f"{by_tier['nvme']:.3f}",
            f"{result['nvme_blocks_written']:,} ({_bytes(result['nvme_bytes_written'])})",
            _milliseconds(result["ttft_p50_s"]),
            _milliseconds(result["ttft_p99_s"]),
            f"{result['recompute_tokens']:,}",
            f"{result['wall_s']:.2f}",
            _standing(note),
        )
    console.print(table)
    peers = [n for n in notes if not n.reference and not is_kvstore(n.policy)]
    for note in notes:
        if note.against_peers is not None and peers:
            console.print(escape(kvstore_verdict(note)), highlight=False)
    for result in results:
        line = occupancy_line(result)
        if line is not None:
            console.print(escape(line), highlight=False)


def occupancy_line(result: Mapping[str, Any]) -> str | None:
    """How full a kvstore replay kept its tiers (``details.occupancy``), or None."""
    occupancy = result.get("details", {}).get("occupancy")
    if not occupancy:
        return None
    names = {"hbm": "HBM", "dram": "DRAM", "nvme": "NVMe"}
    shares = ", ".join(
        f"{names.get(tier, tier)} {'-' if share is None else f'{share:.0%}'}"
        for tier, share in occupancy.items()
    )
    return f"{result['policy']}'s tiers ran {shares} full (mean before each request's lookup)"


# -- the suite ------------------------------------------------------------------


def _check_cell(check: Check) -> str:
    if check.target == "ttft":
        mine = _milliseconds(check.kvstore)
        theirs = "-" if check.reference is None else _milliseconds(check.reference)
    elif check.target == "hit_ratio":
        mine = f"{check.kvstore:.4f}"
        theirs = "-" if check.reference is None else f"{check.reference:.4f}"
    else:
        mine = f"{int(check.kvstore):,}"
        theirs = "-" if check.reference is None else f"{int(check.reference):,}"
    peer = f" {escape(check.peer)}" if check.peer else " (no peer within 0.5 pp)"
    return f"{mine} / {theirs}{peer}"


def _mark(passed: bool) -> str:
    return "[green]pass[/green]" if passed else "[bold red]FAIL[/bold red]"


def render_suite(runs: Sequence[SuiteRun], header: Mapping[str, Any], console: Console) -> None:
    """The suite's table: a row per run and kvstore policy, each target's numbers
    (kvstore / the peer it is held to) and pass or FAIL; then the summary."""
    variants = {v.policy for r in runs for v in r.verdicts}
    table = Table(title="kvstore sim --suite: kvstore against the best peer, per run")
    table.add_column("run", no_wrap=True)
    if len(variants) > 1:
        table.add_column("policy", no_wrap=True)
    table.add_column(f"TTFT p50 ms (a: <= {TTFT_FACTOR:g}x best)", justify="right")
    table.add_column("(a)")
    table.add_column(f"hit ratio (b: >= best - {HIT_SLACK * 100:g} pp)", justify="right")
    table.add_column("(b)")
    table.add_column(f"NVMe blocks written (c: <= {WRITE_FACTOR:g}x fewest near)", justify="right")
    table.add_column("(c)")
    table.add_column("all")
    for r in runs:
        for verdict in r.verdicts:
            cells = [escape(run_label(r.workload, r.seed, r.capacity))]
            if len(variants) > 1:
                cells.append(escape(verdict.policy))
            for check in verdict.checks:
                cells += [_check_cell(check), _mark(check.passed)]
            cells.append(_mark(verdict.passed))
            table.add_row(*cells)
    console.print(table)
    totals = header["summary"]
    by_target = totals["by_target"]
    n = totals["verdicts"]
    seeds = header["suite"]["seeds"]
    console.print(
        f"suite, seeds {seeds['split']} ({', '.join(map(str, seeds['seeds']))}): "
        f"{totals['passed']} of {totals['runs']} runs meet all three targets; "
        f"(a) TTFT {by_target['ttft']}/{n}, (b) hit ratio {by_target['hit_ratio']}/{n}, "
        f"(c) NVMe writes {by_target['nvme_writes']}/{n}; {header['wall_s']:.1f} s",
        highlight=False,
    )
    source = header["suite"].get("peers_from")
    if source is not None:
        console.print(
            f"peers' results reused from {escape(source)} in {totals['peers_reused']} of "
            f"{totals['runs']} runs (the others replayed the peers)",
            highlight=False,
        )
    if seeds["split"] == "holdout":
        console.print(
            "held-out seeds: judge a policy on these, never tune on them "
            '(docs/tiering.md, "The suite")',
            highlight=False,
        )


def _file_name(workload: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", workload) or "trace"


def _write_suite_outputs(runs: Sequence[SuiteRun], document: Mapping[str, Any], out: Path) -> None:
    """suite.json and one frontier plot per workload (rows: capacities, columns: seeds)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "suite.json").write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
        for workload, group in by_workload(runs):
            rows: dict[tuple[float, ...], list[tuple[str, Mapping[str, Any]]]] = {}
            for r in group:
                named = len(r.verdicts) > 1
                failed = [
                    f"({label}) {v.policy}" if named else f"({label})"
                    for v in r.verdicts
                    for label, check in zip("abc", v.checks, strict=True)
                    if not check.passed
                ]
                verdict = "all three met" if not failed else "fails " + ", ".join(failed)
                seed = "" if r.seed is None else f"seed {r.seed}, "
                name = f"{seed}capacity {capacity_text(r.capacity)}: {verdict}"
                rows.setdefault(r.capacity, []).append((name, r.document))
            plot_workload(
                f"kvstore sim --suite: {workload}",
                list(rows.values()),
                out / f"{_file_name(workload)}.png",
            )
    except OSError as e:
        raise _OperationalError(f"cannot write to {out}: {e.strerror or e}") from e


def _saved_peers(path: Path, model_name: str, block_tokens: int) -> Any:
    """``--peers-from``: an earlier suite's peer results; a file that cannot be read is
    an operational error (exit 8), one that is no suite of these settings a bad option."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise _OperationalError(f"cannot read --peers-from {path}: {reason}") from e
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--peers-from {path}: not JSON ({e})") from e
    try:
        return peer_results(document, model=model_name, block_tokens=block_tokens)
    except ValueError as e:
        raise ValueError(f"--peers-from {path}: {e}") from e


def _given(name: str) -> bool:
    source = click.get_current_context().get_parameter_source(name)
    return source not in (None, ParameterSource.DEFAULT)


def _run_suite_command(
    *,
    trace_path: Path | None,
    limit: int | None,
    request_count: int | None,
    seeds_text: str | None,
    kinds: tuple[str, ...],
    capacity: str | None,
    policies: tuple[str, ...],
    jobs: int,
    out: Path | None,
    model_name: str,
    model: ModelCost,
    block_tokens: int,
    machine: Machine,
    peers_from: Path | None,
) -> tuple[list[SuiteRun], dict[str, Any]]:
    for option, name in (
        ("--generate", "kind"),
        ("--seed", "seed"),
        ("--capacity-bytes", "capacity_bytes"),
        ("--plot", "plot"),
    ):
        if _given(name):
            hint = {
                "--generate": "choose kinds with --kind",
                "--seed": "choose seeds with --seeds",
                "--capacity-bytes": "the suite's capacities are fractions (--capacity)",
                "--plot": "--out DIR takes the suite's plots",
            }[option]
            raise ValueError(f"--suite does not take {option}: {hint}")
    if limit is not None and trace_path is None:
        raise ValueError("--limit with --suite cuts the TRACE given; there is none")
    split, seeds = parse_seeds(seeds_text or "tune")
    variants = list(dict.fromkeys(policies)) or ["kvstore"]
    for name in variants:
        if not is_kvstore(name):
            raise ValueError(
                f"--policy {name!r}: the suite runs every peer and judges kvstore policies; "
                "give kvstore or kvstore:FIELD=VALUE,..."
            )
    validate_policies(variants, model, block_tokens, machine)
    capacities = [parse_capacity(capacity)] if capacity is not None else list(SUITE_CAPACITIES)
    chosen_kinds = list(dict.fromkeys(kinds)) or list(ALL_KINDS)
    traces = [str(trace_path)] if trace_path is not None else []
    if request_count == 0:
        raise ValueError("--requests with --suite must be >= 1: a run needs requests to judge")
    if trace_path is not None:  # a bad trace fails before the replays, not after them
        try:
            load_trace(trace_path, limit=limit)
        except OSError as e:
            raise _OperationalError(f"cannot read trace {trace_path}: {e.strerror or e}") from e
    reuse = None if peers_from is None else _saved_peers(peers_from, model_name, block_tokens)
    cases = suite_cases(
        chosen_kinds, seeds, capacities, traces=traces, requests=request_count, limit=limit
    )
    total = sum(len(case.capacities) for case in cases)
    started = time.perf_counter()
    with progress_bar(transient=True) as progress:
        task = progress.add_task("suite", total=total)

        def on_progress(label: str, done: int) -> None:
            progress.update(task, completed=done, description=f"suite: {label}")

        runs = run_suite(
            cases,
            model=model,
            block_tokens=block_tokens,
            machine=machine,
            variants=variants,
            jobs=jobs,
            progress=on_progress,
            reuse=reuse,
        )
        progress.update(task, completed=total)
    document: dict[str, Any] = {
        "suite": {
            "seeds": {"split": split, "seeds": list(seeds)},
            "seed_splits": {name: list(values) for name, values in SEED_SPLITS.items()},
            "kinds": chosen_kinds,
            "traces": traces,
            "capacities": [list(c) for c in capacities],
            "policies": variants,
            "targets": {
                "ttft_p50_factor": TTFT_FACTOR,
                "hit_ratio_slack": HIT_SLACK,
                "nvme_write_factor": WRITE_FACTOR,
            },
            "model": model_name,
            "block_tokens": block_tokens,
            "peer_models": PEER_MODELS_VERSION,
            "peers_from": None if peers_from is None else str(peers_from),
            "jobs": jobs,
        },
        "summary": summary(runs),
        "wall_s": time.perf_counter() - started,
        "runs": [r.to_json() for r in runs],
    }
    if out is not None:
        _write_suite_outputs(runs, document, out)
    return runs, document


# -- across nodes ----------------------------------------------------------------


def _blocks_and_bytes(blocks: int, page: int) -> str:
    return f"{blocks:,} ({_bytes(blocks * page)})"


def render_cluster(document: Mapping[str, Any], console: Console) -> None:
    """Print ``run_cluster``'s object: what each node and the pool hold, then a pair
    of rows per (nodes, routing): without the shared tier and with it."""
    page = int(document["page_bytes"])
    shared = document["shared"]
    sessions = document.get("sessions")
    console.print(
        f"[bold]kvstore sim[/bold] {escape(str(document['trace']))} across nodes: "
        f"{document['requests']:,} requests, {document['block_accesses']:,} block accesses, "
        f"{document['unique_blocks']:,} unique blocks (an infinite cache hits "
        f"{document['max_hit_ratio']:.1%})"
        + (f"; {sessions:,} sessions derived" if sessions is not None else "")
        + f"; policy {escape(str(document['policy']))}"
    )
    seen: set[int] = set()
    for entry in document["configurations"]:
        if entry["nodes"] in seen:
            continue
        seen.add(entry["nodes"])
        h, d, n = entry["capacity_blocks_per_node"]
        console.print(
            f"  {entry['nodes']} node{'s' if entry['nodes'] != 1 else ''}: each node HBM "
            f"{_blocks_and_bytes(h, page)}, DRAM {_blocks_and_bytes(d, page)}, NVMe "
            f"{_blocks_and_bytes(n, page)} blocks",
            highlight=False,
        )
    machine = document["machine"]
    console.print(
        f"  the shared pool: {_blocks_and_bytes(shared['capacity_blocks'], page)} blocks, "
        f"network {shared['network_gbps']:g} GB/s, {shared['network_latency_s'] * 1e6:g} µs "
        f"per batch; κ remote {shared['kappa_remote']:.2f} (DRAM {machine['kappa_dram']:.2f}, "
        f"NVMe {machine['kappa_nvme']:.2f})",
        highlight=False,
    )
    table = Table()
    for column in (
        "nodes",
        "routing",
        "pool",
        "hit ratio",
        "HBM",
        "DRAM",
        "NVMe",
        "remote",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "NVMe blocks written",
        "net read",
        "net written",
        "busiest",
    ):
        left = column in ("routing", "pool")
        table.add_column(column, justify="left" if left else "right", no_wrap=True)
    for entry in document["configurations"]:
        for label, key in (("no", "without_shared"), ("yes", "with_shared")):
            side = entry[key]
            tiers = side["hit_ratio_by_tier"]
            remote = tiers.get("remote")
            table.add_row(
                f"{entry['nodes']:,}",
                escape(entry["routing"]),
                label,
                f"{side['hit_ratio']:.4f}",
                f"{tiers['hbm']:.3f}",
                f"{tiers['dram']:.3f}",
                f"{tiers['nvme']:.3f}",
                "-" if remote is None else f"{remote:.3f}",
                _milliseconds(side["ttft_p50_s"]),
                _milliseconds(side["ttft_p99_s"]),
                f"{side['nvme_blocks_written']:,}",
                _bytes(side["network_bytes_read"]),
                _bytes(side["network_bytes_written"]),
                f"{entry['busiest_node_share']:.1%}",
            )
    console.print(table)
    wall = sum(float(entry["wall_s"]) for entry in document["configurations"])
    console.print(
        "One replay per (nodes, routing) gives both rows: the pool changes what a miss "
        "costs, not what a node holds. busiest: the busiest node's share of the requests. "
        f"{len(document['configurations'])} replays in {wall:.1f} s.",
        highlight=False,
    )


_CLUSTER_OPTIONS = (
    ("--routing", "routings"),
    ("--shared-capacity", "shared_capacity"),
    ("--shared-capacity-bytes", "shared_capacity_bytes"),
    ("--net-gbps", "net_gbps"),
    ("--net-latency-us", "net_latency_us"),
)


def _run_cluster_command(
    *,
    nodes_text: str,
    routings: tuple[str, ...],
    shared_capacity: str | None,
    shared_capacity_bytes: str | None,
    net_gbps: float | None,
    net_latency_us: float | None,
    capacity: str | None,
    capacity_bytes: str | None,
    policies: tuple[str, ...],
    trace_path: Path | None,
    kind: str | None,
    seed: int,
    request_count: int | None,
    limit: int | None,
    out: Path | None,
    model: ModelCost,
    block_tokens: int,
    machine: Machine,
) -> dict[str, Any]:
    """``kvstore sim --nodes``: check every option, then replay (module docstring)."""
    nodes = parse_nodes(nodes_text)
    chosen_routings = parse_routings(routings)
    if capacity is not None and capacity_bytes is not None:
        raise ValueError("give --capacity or --capacity-bytes, not both")
    capacity_kwargs: dict[str, Any] = {}
    if capacity_bytes is not None:
        capacity_kwargs["capacity_bytes"] = parse_capacity_bytes(capacity_bytes)
    elif capacity is not None:
        capacity_kwargs["capacity_fractions"] = parse_capacity(capacity)
    if shared_capacity is not None and shared_capacity_bytes is not None:
        raise ValueError("give --shared-capacity or --shared-capacity-bytes, not both")
    if shared_capacity_bytes is not None:
        capacity_kwargs["shared_bytes"] = parse_size(
            "--shared-capacity-bytes", shared_capacity_bytes
        )
    elif shared_capacity is not None:
        capacity_kwargs["shared_fraction"] = parse_fraction("--shared-capacity", shared_capacity)
    _positive("--net-gbps", net_gbps)
    if net_latency_us is not None and not (math.isfinite(net_latency_us) and net_latency_us >= 0):
        raise ValueError(f"--net-latency-us must be a finite number >= 0, got {net_latency_us}")
    network = Network(
        gbps=DEFAULT_NETWORK.gbps if net_gbps is None else net_gbps,
        latency_s=DEFAULT_NETWORK.latency_s if net_latency_us is None else net_latency_us * 1e-6,
    )
    chosen = validate_policies(policies, model, block_tokens, machine) or ["kvstore"]
    if len(chosen) > 1 or not is_kvstore(chosen[0]):
        raise ValueError(
            f"--policy with --nodes: each node runs one tier manager; give kvstore or one "
            f"kvstore:FIELD=VALUE,... (got {', '.join(chosen)})"
        )
    requests, trace_name = _requests(
        trace_path, kind, seed, request_count, limit, block_tokens, out
    )
    total = len(requests) * cluster_replays(nodes, chosen_routings)
    with progress_bar(transient=True) as progress:
        task = progress.add_task("replaying", total=total)

        def on_progress(label: str, done: int) -> None:
            progress.update(task, completed=done, description=f"replaying {label}")

        document = run_cluster(
            requests,
            nodes=nodes,
            routings=chosen_routings,
            network=network,
            model=model,
            block_tokens=block_tokens,
            machine=machine,
            policy=chosen[0],
            seed=seed,
            trace_name=trace_name,
            progress=on_progress,
            **capacity_kwargs,
        )
        progress.update(task, completed=total)
    return document


# -- the command ---------------------------------------------------------------


@contextmanager
def _failures(as_json: bool) -> Iterator[None]:
    """Errors -> one line on stderr (and ``error_json`` with ``--json``), the house's
    exit code: a trace file that is missing or bad, or an unwritable output, is
    operational (8); an option the command refuses is a usage error (2)."""
    try:
        yield
    except (KVStoreError, _OperationalError) as e:  # TraceError is a KVStoreError
        _exit(e, EXIT_OPERATIONAL, as_json)
    except (ValueError, TypeError) as e:
        _exit(e, EXIT_USAGE, as_json)


def _exit(error: BaseException, code: int, as_json: bool) -> NoReturn:
    # err_console is soft_wrap: one line however long (a path and a hint), for logs and grep
    err_console.print(f"[red]error:[/red] {escape(str(error))}", highlight=False)
    if as_json:
        echo_error_json(error, code)
    sys.exit(code)


def _console(stderr: bool) -> Console:
    console = Console(stderr=stderr)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, width=_UNATTENDED_WIDTH)
    return console


# TRACE is not dir_okay=False: click would refuse a directory as a usage error (2);
# reading it fails as the operational error (8) that any unreadable trace is.
@click.command("sim")
@click.argument("trace_path", metavar="[TRACE]", required=False, type=click.Path(path_type=Path))
@click.option(
    "--generate",
    "kind",
    type=click.Choice(ALL_KINDS),
    help='Replay a synthetic trace of this kind instead of TRACE (docs/tiering.md, "Workloads").',
)
@click.option(
    "--seed", default=0, show_default=True, help="Seed of --generate (and of --routing random)."
)
@click.option(
    "--requests",
    "request_count",
    type=click.IntRange(min=0),
    help="Requests of --generate (and of each generated trace of --suite) [default: the "
    "kind's: "
    + ", ".join(f"{kind} {count:,}" for kind, count in DEFAULT_REQUESTS.items() if count != 2000)
    + ", 2,000 the others].",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="Also save the generated trace here (Mooncake JSONL). With --suite: a "
    "directory for suite.json and a frontier plot per workload.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    help="Replay only the first N requests (with --suite: of TRACE).",
)
@click.option(
    "--block-tokens",
    default=DEFAULT_BLOCK_TOKENS,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens per block (hash_ids entry).",
)
@click.option(
    "--model",
    "model_name",
    default="llama-3.1-8b",
    show_default=True,
    help=f"Model preset for KV bytes and prefill cost: {', '.join(MODEL_PRESETS)}.",
)
@click.option(
    "--nvme-gbps", type=float, help=f"NVMe read bandwidth, GB/s [default: {_MACHINE.nvme_gbps:g}]."
)
@click.option(
    "--pcie-gbps",
    type=float,
    help=f"PCIe bandwidth each way, GB/s [default: {_MACHINE.pcie_gbps:g}].",
)
@click.option(
    "--tflops", type=float, help=f"Effective prefill TFLOP/s [default: {_MACHINE.tflops:g}]."
)
@click.option(
    "--capacity",
    help="HBM,DRAM,NVMe capacities as fractions of the trace's unique blocks "
    f"(floored to blocks) [default: {','.join(f'{f:g}' for f in _FRACTIONS)}]. "
    "With --suite: one triple instead of the suite's three.",
)
@click.option(
    "--capacity-bytes",
    help="HBM,DRAM,NVMe capacities in bytes, e.g. 4GiB,64GiB,1TB (instead of --capacity).",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    help="A policy to replay (repeatable; default: every peer model and kvstore). "
    "kvstore:FIELD=VALUE[,FIELD=VALUE] is the manager with TierConfig fields overridden. "
    "With --suite: the kvstore policies to judge [default: kvstore].",
)
@click.option(
    "--suite",
    is_flag=True,
    help="Run the suite: every workload kind (and TRACE, if given) x seeds x the "
    "capacity triples " + "; ".join(capacity_text(c) for c in SUITE_CAPACITIES) + ", every "
    "peer beside kvstore, with pass/fail on the three targets (docs/tiering.md, "
    '"The suite").',
)
@click.option(
    "--seeds",
    "seeds_text",
    metavar="tune|holdout|N,N,...",
    help="Seeds of --suite: "
    + "; ".join(f"{name} = {','.join(map(str, v))}" for name, v in SEED_SPLITS.items())
    + " (tune on tune, judge on holdout), or a list [default: tune].",
)
@click.option(
    "--kind",
    "kinds",
    multiple=True,
    type=click.Choice(ALL_KINDS),
    help="A workload kind of --suite (repeatable) [default: all].",
)
@click.option(
    "--peers-from",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE",
    help="With --suite: the peers' results of an earlier suite (its --json output or "
    "suite.json) where a run is the same (trace, capacities, machine): only kvstore's "
    "policies are replayed there.",
)
@click.option(
    "--jobs",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Processes for --suite (one per workload and seed at a time).",
)
@click.option(
    "--nodes",
    "nodes_text",
    metavar="N[,N...]",
    help="Replay across N serving nodes (e.g. 2,8,64; 1.."
    f"{MAX_NODES}), each with its own tier manager, with and without a shared "
    'cluster tier (docs/tiering.md, "Beyond one machine, by simulation"). --capacity '
    "is then the whole cluster's, 1/N per node; --capacity-bytes is per node.",
)
@click.option(
    "--routing",
    "routings",
    multiple=True,
    metavar="random|session|prefix",
    help="With --nodes: how requests reach nodes (repeatable or comma-separated) "
    "[default: all three].",
)
@click.option(
    "--shared-capacity",
    metavar="FRACTION",
    help="With --nodes: the shared pool's capacity as a fraction of the trace's unique "
    f"blocks [default: {DEFAULT_SHARED_FRACTION:g}]; 0 is no pool.",
)
@click.option(
    "--shared-capacity-bytes",
    metavar="SIZE",
    help="With --nodes: the shared pool's capacity in bytes, e.g. 2TiB (instead of "
    "--shared-capacity).",
)
@click.option(
    "--net-gbps",
    type=float,
    help="With --nodes: each node's network bandwidth to the pool, GB/s "
    f"[default: {DEFAULT_NETWORK.gbps:g}].",
)
@click.option(
    "--net-latency-us",
    type=float,
    help="With --nodes: a pool read batch's latency, µs "
    f"[default: {DEFAULT_NETWORK.latency_s * 1e6:g}].",
)
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout; the table goes to stderr.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write a PNG: hit ratio against NVMe writes with the Pareto frontier, and "
    "hit ratio by tier. With --nodes: hit ratio and TTFT against nodes, with and "
    "without the shared tier.",
)
def sim(
    trace_path: Path | None,
    kind: str | None,
    seed: int,
    request_count: int | None,
    out: Path | None,
    limit: int | None,
    block_tokens: int,
    model_name: str,
    nvme_gbps: float | None,
    pcie_gbps: float | None,
    tflops: float | None,
    capacity: str | None,
    capacity_bytes: str | None,
    policies: tuple[str, ...],
    suite: bool,
    seeds_text: str | None,
    kinds: tuple[str, ...],
    peers_from: Path | None,
    jobs: int,
    nodes_text: str | None,
    routings: tuple[str, ...],
    shared_capacity: str | None,
    shared_capacity_bytes: str | None,
    net_gbps: float | None,
    net_latency_us: float | None,
    as_json: bool,
    plot: Path | None,
) -> None:
    """Replay a trace through the tier manager and the peers' policies.

    TRACE is a Mooncake-format JSONL file, gzipped or not (timestamp ms,
    input_length, output_length, hash_ids), or the name of the trace shipped
    with kvstore: mooncake-conversation (the Mooncake FAST'25 conversation
    trace, 12,031 requests); or --generate KIND makes one. Every policy sees
    the same requests, capacities and machine; the real TierManager runs on the
    fake mover and a virtual clock. Hit ratios are fractions of all block
    accesses. The Pareto column compares hit ratio against NVMe bytes written
    (the reference models infinite and recompute stay out of it).

    --suite runs every workload kind x seeds x three capacity triples and
    prints, per run, whether kvstore meets its targets against the best peer:
    (a) TTFT p50 <= 1.01x, (b) hit ratio within 0.5 pp, (c) NVMe blocks
    written <= 2x the fewest of the peers with as many hits (within 0.5 pp).

    --nodes N[,N...] replays the trace across N nodes, a tier manager each, routed
    by --routing random|session|prefix, and reports each with and without a
    shared pool (--shared-capacity, --net-gbps, --net-latency-us): hit ratio by
    local tier and remote, TTFT p50/p99, NVMe writes, network bytes.

    \b
    Exit codes:
      0  success (a suite that ran, whatever its verdicts)
      2  a bad option (--capacity, --capacity-bytes, --policy, --model, --seeds, ...)
      8  the trace file is missing or invalid; --out or --plot not writable
    """
    table_console = _console(stderr=as_json)
    with _failures(as_json):
        model = ModelCost.preset(model_name)
        for option, value in (
            ("--nvme-gbps", nvme_gbps),
            ("--pcie-gbps", pcie_gbps),
            ("--tflops", tflops),
        ):
            _positive(option, value)
        if nodes_text is None:
            for option, name in _CLUSTER_OPTIONS:
                if _given(name):
                    raise ValueError(f"{option} is an option of --nodes")
        elif suite:
            raise ValueError("--nodes and --suite are different runs: give one of the two")
        machine = Machine(
            nvme_gbps=_MACHINE.nvme_gbps if nvme_gbps is None else nvme_gbps,
            pcie_gbps=_MACHINE.pcie_gbps if pcie_gbps is None else pcie_gbps,
            tflops=_MACHINE.tflops if tflops is None else tflops,
        )
        if suite:
            runs, document = _run_suite_command(
                trace_path=trace_path,
                limit=limit,
                request_count=request_count,
                seeds_text=seeds_text,
                kinds=kinds,
                capacity=capacity,
                policies=policies,
                jobs=jobs,
                out=out,
                model_name=model_name,
                model=model,
                block_tokens=block_tokens,
                machine=machine,
                peers_from=peers_from,
            )
        else:
            for option, name in (
                ("--seeds", "seeds_text"),
                ("--kind", "kinds"),
                ("--jobs", "jobs"),
                ("--peers-from", "peers_from"),
            ):
                if _given(name):
                    raise ValueError(f"{option} is an option of --suite")
    if suite:
        render_suite(runs, document, table_console)
        if out is not None:
            table_console.print(f"wrote {escape(str(out))}/", highlight=False)
        if as_json:
            sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return
    if nodes_text is not None:
        with _failures(as_json):
            document = _run_cluster_command(
                nodes_text=nodes_text,
                routings=routings,
                shared_capacity=shared_capacity,
                shared_capacity_bytes=shared_capacity_bytes,
                net_gbps=net_gbps,
                net_latency_us=net_latency_us,
                capacity=capacity,
                capacity_bytes=capacity_bytes,
                policies=policies,
                trace_path=trace_path,
                kind=kind,
                seed=seed,
                request_count=request_count,
                limit=limit,
                out=out,
                model=model,
                block_tokens=block_tokens,
                machine=machine,
            )
            if plot is not None:
                try:
                    plot_cluster(document, plot)
                except OSError as e:
                    raise _OperationalError(f"cannot write plot {plot}: {e.strerror or e}") from e
        render_cluster(document, table_console)
        if plot is not None:
            table_console.print(f"wrote {escape(str(plot))}", highlight=False)
        if as_json:
            sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return
    with _failures(as_json):
        if capacity is not None and capacity_bytes is not None:
            raise ValueError("give --capacity or --capacity-bytes, not both")
        capacity_kwargs: dict[str, Any] = {}
        if capacity_bytes is not None:
            capacity_kwargs["capacity_bytes"] = parse_capacity_bytes(capacity_bytes)
        elif capacity is not None:
            capacity_kwargs["capacity_fractions"] = parse_capacity(capacity)
        chosen = validate_policies(policies, model, block_tokens, machine)
        requests, trace_name = _requests(
            trace_path, kind, seed, request_count, limit, block_tokens, out
        )
        total = len(chosen) if chosen else len(POLICIES) + 1
        with progress_bar(transient=True) as progress:
            task = progress.add_task("replaying", total=total)
            started = [0]

            def on_policy(name: str) -> None:
                if started[0]:
                    progress.advance(task)
                started[0] += 1
                progress.update(task, description=f"replaying {name}")

            document = run(
                requests,
                model=model,
                block_tokens=block_tokens,
                machine=machine,
                policies=chosen,
                trace_name=trace_name,
                progress=on_policy,
                **capacity_kwargs,
            )
            progress.update(task, completed=total)
        if plot is not None:
            try:
                plot_results(document, plot)
            except OSError as e:
                raise _OperationalError(f"cannot write plot {plot}: {e.strerror or e}") from e
    render(document, table_console)
    if plot is not None:
        table_console.print(f"wrote {escape(str(plot))}", highlight=False)
    if as_json:
        sys.stdout.write(json.dumps(document, indent=2) + "\n")


def main() -> None:
    """``python -m kvstore.tiering.sim``: the same command as ``kvstore sim``."""
    sim()
