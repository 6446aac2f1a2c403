"""The ``bench`` click command (registered as ``kvstore bench``; also ``python -m kvstore.bench``).

Progress bars go to stderr. The tables go to stdout, or to stderr with
``--json`` (then stdout is exactly one JSON document). ``--out`` saves the JSON
too, ``--report`` re-prints a saved run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NoReturn

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, TaskID

from kvstore.bench.common import COLD_METHODS, KIB, MIB
from kvstore.bench.kv import HotPathConfig
from kvstore.bench.peers import PEERS
from kvstore.bench.report import render
from kvstore.bench.runner import BenchOptions, run_bench
from kvstore.bench.scaling import SWEEPS, ScalingConfig
from kvstore.clikit import EXIT_OPERATIONAL, echo_error_json, progress_bar
from kvstore.errors import KVStoreError

__all__ = ["bench"]


class _RichReporter:
    """Adapts ``Reporter`` to one rich progress bar per phase."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task: TaskID | None = None

    def start(self, label: str, total: int) -> None:
        self.finish()
        self.task = self.progress.add_task(label, total=total)

    def advance(self, count: int = 1) -> None:
        if self.task is not None:
            self.progress.advance(self.task, count)

    def finish(self) -> None:
        if self.task is not None:
            self.progress.stop_task(self.task)
            self.task = None


def _page_counts(max_pages: int) -> tuple[int, ...]:
    counts = []
    count = 1_000
    while count < max_pages:
        counts.append(count)
        count *= 10
    counts.append(max_pages)
    return tuple(counts)


def _fail(error: BaseException, as_json: bool) -> NoReturn:
    """A run that cannot go on: one line on stderr, JSON on stdout with ``--json``
    (the same shape as the other commands'), exit 8 (operational)."""
    Console(stderr=True).print(f"[red]error:[/red] {escape(str(error))}")
    if as_json:
        echo_error_json(error, EXIT_OPERATIONAL)
    sys.exit(EXIT_OPERATIONAL)


@click.command("bench")
@click.option(
    "--dir",
    "bench_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("./bench-data"),
    show_default=True,
    help="Directory on the file system to measure; scratch data is deleted after each phase.",
)
@click.option("--compare", is_flag=True, help="Also run fio and the peers' paths, same directory.")
@click.option("--scaling", is_flag=True, help="Also run the scaling sweeps (and plot them).")
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout; tables go to stderr.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Save the JSON here.")
@click.option(
    "--plots", type=click.Path(file_okay=False, path_type=Path), help="Write scaling PNGs here."
)
@click.option("--page-kib", default=256, show_default=True, help="Page size of the comparison.")
@click.option("--size-mib", default=1024, show_default=True, help="Bytes written per workload.")
@click.option("--runtime", default=30.0, show_default=True, help="Time cap per phase (seconds).")
@click.option("--io-depth", default=32, show_default=True, help="Store io_depth and pool threads.")
@click.option("--fio", "fio_path", default=None, help="fio binary, or 'none' (default: $PATH).")
@click.option("--fio-size-mib", default=1024, show_default=True)
@click.option("--fio-runtime", default=10, show_default=True, help="Seconds cap per fio profile.")
@click.option(
    "--cold",
    type=click.Choice(COLD_METHODS),
    default="fadvise",
    show_default=True,
    help="How buffered peers are made cold before reads (kvstore reads are O_DIRECT).",
)
@click.option("--peer-reads", default=2000, show_default=True, help="Cold reads per peer.")
@click.option("--peer", "peers", multiple=True, type=click.Choice(tuple(PEERS)))
@click.option("--hot-pages", default=20_000, show_default=True, help="Pages for the hot paths.")
@click.option("--sweep", "sweeps", multiple=True, type=click.Choice(SWEEPS))
@click.option("--max-pages", default=1_000_000, show_default=True, help="Page-count sweep top.")
@click.option("--scaling-mib", default=256, show_default=True, help="Bytes per sweep point.")
@click.option("--fill-mib", default=1024, show_default=True, help="Capacity of the fill sweep.")
@click.option("--settle", default=1.0, show_default=True, help="Pause after sync between phases.")
@click.option("--quick", is_flag=True, help="Tiny sizes: a smoke test, not a measurement.")
@click.option(
    "--report",
    "report_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Re-print the tables of a saved JSON run and exit.",
)
@click.option(
    "--against-fio",
    is_flag=True,
    help="The ratio table of the Done-when targets instead: fio before and after kvstore "
    "on --dir (durable puts, get_many, get latency); --quick, --json, --out, --io-depth, "
    "--fio, --settle and --report apply. Every option: python tools/bench.py --help.",
)
@click.option("--allow-buffered", is_flag=True, hidden=True)
def bench(
    bench_dir: Path,
    compare: bool,
    scaling: bool,
    as_json: bool,
    out: Path | None,
    plots: Path | None,
    page_kib: int,
    size_mib: int,
    runtime: float,
    io_depth: int,
    fio_path: str | None,
    fio_size_mib: int,
    fio_runtime: int,
    cold: str,
    peer_reads: int,
    peers: tuple[str, ...],
    hot_pages: int,
    sweeps: tuple[str, ...],
    max_pages: int,
    scaling_mib: int,
    fill_mib: int,
    settle: float,
    quick: bool,
    report_path: Path | None,
    against_fio: bool,
    allow_buffered: bool,
) -> None:
    """Measure kvstore (durable puts, cold gets, mixed, hot paths) and, with --compare,
    fio and the peers' write paths on the same directory; print a table and the
    Done-when targets. See docs/benchmarks.md."""
    if against_fio:
        from kvstore.bench import fio_ratios

        argv = ["--dir", str(bench_dir), "--io-depth", str(io_depth), "--settle", str(settle)]
        argv += ["--quick"] if quick else []
        argv += ["--json"] if as_json else []
        argv += ["--out", str(out)] if out is not None else []
        argv += ["--report", str(report_path)] if report_path is not None else []
        if fio_path == "none":
            argv.append("--skip-fio")
        elif fio_path is not None:
            argv += ["--fio", fio_path]
        sys.exit(fio_ratios.main(argv))
    table_console = Console(stderr=as_json, width=170)
    if report_path is not None:
        render(json.loads(report_path.read_text()), table_console)
        return
    if quick:
        size_mib, runtime, fio_size_mib, fio_runtime = min(size_mib, 64), min(runtime, 5.0), 64, 2
        peer_reads, hot_pages, max_pages = min(peer_reads, 200), min(hot_pages, 2000), 10_000
        scaling_mib, fill_mib = min(scaling_mib, 32), min(fill_mib, 192)
    page_bytes = page_kib * KIB
    fill_segment = 16 * MIB if fill_mib >= 512 else 4 * MIB
    options = BenchOptions(
        bench_dir=bench_dir,
        compare=compare,
        scaling=scaling,
        page_bytes=page_bytes,
        total_bytes=size_mib * MIB,
        runtime_s=runtime,
        io_depth=io_depth,
        fio=fio_path,
        fio_size_mib=fio_size_mib,
        fio_runtime_s=fio_runtime,
        cold_method=cold,
        peer_reads=peer_reads,
        peers=peers or tuple(PEERS),
        hot=HotPathConfig(pages=hot_pages, runtime_s=min(10.0, runtime)),
        scaling_config=ScalingConfig(
            bytes_per_point=scaling_mib * MIB,
            fill_capacity_bytes=fill_mib * MIB,
            fill_segment_bytes=fill_segment,
            page_counts=_page_counts(max_pages),
            runtime_s=runtime,
        ),
        sweeps=sweeps or SWEEPS,
        plots_dir=plots,
        settle_s=settle,
        allow_buffered=allow_buffered,
    )
    with progress_bar(transient=False) as progress:
        try:
            document = run_bench(options, _RichReporter(progress))
        except (KVStoreError, OSError, RuntimeError, ValueError) as e:
            _fail(e, as_json)
    if quick:
        document["quick"] = True  # render() says the verdicts are a smoke test's
    text = json.dumps(document, indent=2, sort_keys=False)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    render(document, table_console)
    if as_json:
        sys.stdout.write(text + "\n")
