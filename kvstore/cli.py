"""The ``kvstore`` command line: thin commands, one library call each.

Exit codes (documented in README.md and docs/operations.md):
    0  success
    1  a key was not found (``get``)
    2  usage error (click's own, a key or meta the store refuses, ``init`` of an
       existing store)
    3  the store is locked by another writer
    4  corruption was found
    8  operational error (I/O failure, missing store, bad format version)

``fsck`` has its own codes, after e2fsck: 0 clean, 1 errors corrected,
4 errors left uncorrected, 8 operational error (cannot open, lock held,
newer format version). ``recover``: 0, 4 pages dropped, 8 operational.

With ``--json`` a command prints JSON whatever its exit code: on an error, an
object ``{"error": {"type", "message"}, "exit_code"}`` (``fsck``: its findings
list, holding one finding of kind ``operational``).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from kvstore.bench.cli import bench as bench_command
from kvstore.check import Finding, Findings, check_path, check_store, set_aside_findings
from kvstore.clikit import (
    EXIT_CORRUPT,
    EXIT_LOCKED,
    EXIT_NOT_FOUND,
    EXIT_OPERATIONAL,
    EXIT_USAGE,
    console,
    echo_error_json,
    err_console,
    message_of,
    os_reason,
)
from kvstore.errors import CorruptionError, KVStoreError, LockedError
from kvstore.format.names import DEMO_MARKER_NAME, SUPERBLOCK_NAME
from kvstore.store import KVStore
from kvstore.tiering.sim.cli import sim as sim_command

__all__ = ["main"]

F = TypeVar("F", bound=Callable[..., Any])


def _exit_code_of(error: BaseException) -> int:
    if isinstance(error, LockedError):
        return EXIT_LOCKED
    if isinstance(error, CorruptionError):
        return EXIT_CORRUPT
    if isinstance(error, KVStoreError | OSError):
        return EXIT_OPERATIONAL  # an OSError kvstore did not wrap: I/O, all the same
    return EXIT_USAGE  # ValueError / TypeError: a key, meta or option the store refuses


def _fail(message: str, code: int) -> NoReturn:
    """One error line on stderr, then exit ``code``."""
    err_console.print(f"[red]error:[/red] {escape(message)}")
    sys.exit(code)


@contextmanager
def _errors(as_json: bool = False) -> Iterator[None]:
    """Turn library errors into a one-line message and a documented exit code.

    With ``as_json`` the error is also printed to stdout as ``error_json``.
    """
    try:
        yield
    except (KVStoreError, ValueError, TypeError, OSError) as e:
        code = _exit_code_of(e)
        label = "corruption" if code == EXIT_CORRUPT else "error"
        err_console.print(f"[red]{label}:[/red] {escape(message_of(e))}")
        if as_json:
            echo_error_json(e, code)
        sys.exit(code)


@click.group()
@click.version_option(package_name="kvstore")
def main() -> None:
    """kvstore: a crash-safe store of LLM KV-cache pages on local NVMe."""


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--segment-mib", default=256, show_default=True, help="Segment file size.")
@click.option("--max-page-mib", default=16, show_default=True, help="Largest page accepted.")
def init(path: Path, segment_mib: int, max_page_mib: int) -> None:
    """Create an empty store at PATH."""
    with _errors():
        if (path / SUPERBLOCK_NAME).exists():
            raise click.UsageError(f"{path} already holds a kvstore")
        with KVStore.open(
            path, create=True, segment_bytes=segment_mib << 20, max_page_bytes=max_page_mib << 20
        ) as store:
            console.print(f"created {store.root} (format {store.stats().format_version})")


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def stat(path: Path, as_json: bool) -> None:
    """Show the state of the store at PATH (opens it read-only).

    Includes the lifetime telemetry: host_bytes, store_bytes (by kind),
    write_amplification, dwpd over 1h/24h/7d (see docs/operations.md, "Wear").
    """
    with _errors(as_json), KVStore.open(path, readonly=True) as store:
        stats = store.stats().as_dict()
        if as_json:
            click.echo(json.dumps(stats, indent=2, sort_keys=True))
            return
        table = Table(title=f"kvstore {path}", show_header=False)
        for name, value in stats.items():
            if name in ("counters", "telemetry", "throughput", "degraded_reasons"):
                continue
            table.add_row(name, _human(name, value))
        console.print(table)
        if stats["degraded"]:  # loud: the store opened around damage
            err_console.print(
                f"[red]DEGRADED[/red]: {path} opened around damage; run `kvstore fsck {path}` "
                "for the repairs"
            )
            for reason in stats["degraded_reasons"]:  # type: ignore[attr-defined]
                err_console.print(f"  - {reason}")


def _human(name: str, value: object) -> str:
    """A value of ``stats`` / ``wear`` in words: no Python reprs, no raw unix times."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if name.endswith("_unix_s") and isinstance(value, int | float):
        when = datetime.datetime.fromtimestamp(value, tz=datetime.UTC)
        return when.strftime("%Y-%m-%d %H:%M:%S UTC")
    if isinstance(value, int) and "bytes" in name:
        return f"{value:,} ({value / (1 << 20):,.1f} MiB)"
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, dict):
        if not value:
            return "none"
        return ", ".join(f"{key}={_human(name, item)}" for key, item in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(_human(name, item) for item in value) or "none"
    return str(value)


def _json_kind(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "null"


def _parse_meta(meta: str | None) -> Any:
    """``--meta``'s JSON, or a usage error naming --meta."""
    if not meta:
        return None
    try:
        parsed = json.loads(meta)
    except json.JSONDecodeError as e:
        raise click.BadParameter(
            f"not JSON ({e.msg} at column {e.colno})", param_hint="--meta"
        ) from None
    if not isinstance(parsed, dict):
        raise click.BadParameter(
            f"must be a JSON object ({{...}}), not {_json_kind(parsed)}", param_hint="--meta"
        )
    return parsed


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.argument("key")
@click.argument("source", type=click.File("rb"), default="-")
@click.option("--meta", help="JSON object stored with the page.")
def put(path: Path, key: str, source: Any, meta: str | None) -> None:
    """Store the bytes of SOURCE (a file, or - for stdin) under KEY, durably."""
    data = source.read()
    with _errors():
        parsed = _parse_meta(meta)
        with KVStore.open(path) as store:
            store.put(key, data, meta=parsed, sync=True)
        console.print(f"stored {len(data)} bytes under {key!r}")


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.argument("key")
@click.option("-o", "--output", type=click.File("wb"), default="-", help="Where to write.")
def get(path: Path, key: str, output: Any) -> None:
    """Write the verified bytes stored under KEY to OUTPUT (exit 1 if absent)."""
    with _errors(), KVStore.open(path, readonly=True) as store:
        data = store.get(key)
    if data is None:
        err_console.print(f"not found: {key!r}")
        sys.exit(EXIT_NOT_FOUND)
    output.write(data)


# -- fsck --------------------------------------------------------------------

FSCK_CLEAN = 0
FSCK_CORRECTED = 1
FSCK_UNCORRECTED = 4
FSCK_OPERATIONAL = EXIT_OPERATIONAL


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--deep", is_flag=True, help="Also read every payload and verify its checksum.")
@click.option("--repair", is_flag=True, help="Fix what is safe (opens the store for writing).")
@click.option("--json", "as_json", is_flag=True, help="Print findings as a JSON list.")
def fsck(path: Path, deep: bool, repair: bool, as_json: bool) -> None:
    """Check the store at PATH for damage and inconsistency.

    Opens the store read-only unless --repair. Finding kinds are explained in
    docs/operations.md.

    \b
    Exit codes (as e2fsck):
      0  no errors found
      1  errors were found and all of them corrected
      4  errors were left uncorrected
      8  operational error: no store, lock held by a writer, a newer format
         version, I/O failure
    """
    try:
        try:
            store = KVStore.open(path, readonly=not repair)
        except CorruptionError as e:
            # The store refuses to open: check what can be checked without opening it.
            findings = check_path(path, open_error=e)
        else:
            with store:
                findings = _run_fsck(store, deep=deep, repair=repair, quiet=as_json)
        findings.extend(set_aside_findings(path))  # listed (docs/operations.md)
    except (KVStoreError, ValueError) as e:  # FormatVersionError too: exit 8, as README says
        err_console.print(f"[red]error:[/red] {escape(message_of(e))}")
        if as_json:
            failed = Finding("error", "operational", message_of(e), str(path))
            click.echo(json.dumps([failed.as_dict()], indent=2))
        sys.exit(FSCK_OPERATIONAL)
    if as_json:
        click.echo(json.dumps([finding.as_dict() for finding in findings], indent=2))
    else:
        _print_findings(path, findings)
    sys.exit(fsck_exit_code(findings))


def fsck_exit_code(findings: list[Finding]) -> int:
    """e2fsck-style: 4 if an error is left, else 1 if anything was repaired, else 0."""
    if any(f.severity == "error" and not f.repaired for f in findings):
        return FSCK_UNCORRECTED
    if any(f.repaired for f in findings):
        return FSCK_CORRECTED
    return FSCK_CLEAN


def _run_fsck(store: KVStore, *, deep: bool, repair: bool, quiet: bool) -> Findings:
    degraded = set(store.stats().degraded_reasons)  # check_store reports these, with repairs
    findings = Findings(
        _recovery_finding(note) for note in store.recovery_notes if note not in degraded
    )
    if not deep or quiet:
        checked = check_store(store, deep=deep, repair=repair)
    else:
        with _progress(err_console) as progress:
            task = progress.add_task("verify payloads", total=None)

            def report(done_bytes: int, total_bytes: int) -> None:
                progress.update(task, completed=done_bytes, total=total_bytes)

            checked = check_store(store, deep=True, repair=repair, progress=report)
    findings.extend(checked)
    findings.changed_while_checking = checked.changed_while_checking
    if checked.changed_while_checking:  # a live writer beside a read-only check
        err_console.print(
            f"note: {checked.changed_while_checking} objects a live writer changed while "
            "checking were skipped (docs/operations.md, fsck beside a writer)"
        )
    return findings


def _recovery_finding(note: str) -> Finding:
    """What opening the store (a writer open, with --repair) already fixed."""
    if note.startswith("removed orphan segment file"):
        return Finding("error", "orphan-segment", note, repaired=True)
    return Finding("warning", "recovery", note)


def _print_findings(path: Path, findings: list[Finding]) -> None:
    if not findings:
        console.print(f"[green]clean[/green]: {path}")
        return
    table = Table(title=f"kvstore fsck {path}")
    for column in ("severity", "kind", "where", "message", "repaired"):
        table.add_column(column)
    for finding in findings:
        where = " ".join(
            part
            for part in (
                f"key={finding.key!r}" if finding.key is not None else "",
                f"segment={finding.segment_id}" if finding.segment_id is not None else "",
                f"offset={finding.offset}" if finding.offset is not None else "",
                finding.path or "" if finding.key is None and finding.segment_id is None else "",
            )
            if part
        )
        colour = "red" if finding.severity == "error" else "yellow"
        table.add_row(
            f"[{colour}]{finding.severity}[/{colour}]",
            finding.kind,
            where,
            finding.message,
            "yes" if finding.repaired else "no",
        )
    console.print(table)
    errors = sum(1 for f in findings if f.severity == "error")
    repaired = sum(1 for f in findings if f.repaired)
    console.print(f"{errors} errors, {len(findings) - errors} warnings, {repaired} repaired")


# -- recover -----------------------------------------------------------------

RECOVER_OK = 0
RECOVER_LOST = 4
RECOVER_OPERATIONAL = EXIT_OPERATIONAL


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--salvage", is_flag=True, help="Also keep the newest unvouched version of a key.")
@click.option(
    "--dry-run", is_flag=True, help="Report what would be kept and dropped; change nothing."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report (with lists) as JSON.")
def recover(path: Path, salvage: bool, dry_run: bool, as_json: bool) -> None:
    """Rebuild the index and WAL of the store at PATH from its segments.

    For a store whose WAL or LMDB index is damaged or missing. Rules, and what
    each drop reason means, are in docs/operations.md ("recover").

    \b
    Exit codes:
      0  recovered; nothing dropped except superseded, deleted or freed records
      4  recovered, but records were dropped as corrupt or unvouched, or an
         index entry named a missing record: pages may have to be recomputed
      8  operational error: no or invalid superblock, writer lock held, I/O failure
    """
    from kvstore.recover import recover_store

    try:
        report = recover_store(path, salvage=salvage, dry_run=dry_run)
    except KVStoreError as e:
        err_console.print(f"[red]error:[/red] {escape(message_of(e))}")
        if as_json:
            echo_error_json(e, RECOVER_OPERATIONAL)
        sys.exit(RECOVER_OPERATIONAL)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        verb = "would keep" if dry_run else "kept"
        console.print(
            f"{'dry run: ' if dry_run else ''}{path}: {verb} {len(report.kept):,} pages"
            f"{_by(report.kept_by_source, 'from')}; dropped {len(report.dropped):,} records"
            f"{_by(report.dropped_by_reason, 'as')}; index was {report.index_state}; "
            f"new checkpoint LSN {report.new_checkpoint_lsn}"
        )
        for note in report.notes:
            console.print(f"  note: {note}")
        healthy = (
            report.index_state == "ok"
            and not report.lost
            and not report.notes
            and not report.damaged_segments
            and not report.superblock_rebuilt
        )
        if healthy:
            console.print(
                f"  the store {'is' if dry_run else 'was'} healthy: its index read whole and "
                "nothing was lost (recover is for a store that will not open; "
                f"`kvstore fsck {path}` first)"
            )
        if report.moved_aside:
            console.print(
                f"  moved aside: {', '.join(report.moved_aside)} (the store no longer uses "
                "them; fsck lists them as set-aside until you remove them)"
            )
    sys.exit(RECOVER_LOST if report.lost else RECOVER_OK)


def _by(counts: dict[str, int], word: str) -> str:
    """`` (3 from index, 1 from wal)``: a count per reason, in words, or nothing."""
    if not counts:
        return ""
    return " (" + ", ".join(f"{n:,} {word} {name}" for name, n in counts.items()) + ")"


# -- gc ----------------------------------------------------------------------


@main.command("gc")
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "--full", is_flag=True, help="First recompute every segment's live bytes (mark and sweep)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the GC report as JSON.")
def gc_command(path: Path, full: bool, as_json: bool) -> None:
    """Run one GC pass on the store at PATH and print what it did.

    Frees empty segments, compacts sparse ones and, over the capacity, evicts
    down to the low watermark; with --full it first recomputes every segment's
    live bytes and pages from the page table and fixes any drift. It opens the
    store as the writer: while another process writes to the store it refuses
    (exit 3), as that writer's own GC thread runs these passes.

    \b
    Exit codes:
      0  the pass ran
      3  another process holds the writer lock: nothing was done
      4  the store is damaged (it refuses to open; see kvstore fsck)
      8  operational error: no store at PATH, I/O failure, newer format version
    """
    import dataclasses

    from rich.markup import escape

    def failed(error: BaseException, code: int, prefix: str, message: str) -> NoReturn:
        err_console.print(f"{prefix} {escape(message)}")
        if as_json:  # the shape every --json command prints on an error
            described = {"type": type(error).__name__, "message": message}
            click.echo(json.dumps({"error": described, "exit_code": code}, indent=2))
        sys.exit(code)

    try:
        with KVStore.open(path, gc_interval_s=0) as store:  # this pass only, no GC thread
            if as_json:
                report = store.gc(full=full)
            else:
                label = "GC pass (mark and sweep first)" if full else "GC pass"
                with err_console.status(f"{label} on {path} ..."):
                    report = store.gc(full=full)
    except LockedError as e:
        message = (
            f"not run: {e.args[0]}. kvstore gc needs the writer lock; the running writer's "
            "own GC thread (gc_interval_s) does these passes, or call store.gc() in it"
        )
        failed(e, EXIT_LOCKED, "[yellow]refused:[/yellow]", message)
    except CorruptionError as e:
        failed(e, EXIT_CORRUPT, "[red]corruption:[/red]", message_of(e))
    except (KVStoreError, ValueError) as e:
        failed(e, EXIT_OPERATIONAL, "[red]error:[/red]", message_of(e))
    if as_json:
        click.echo(json.dumps({"path": str(path), "full": full, **dataclasses.asdict(report)}))
        return
    table = Table(title=f"kvstore gc {path}{' --full' if full else ''}", show_header=False)
    for name, value in dataclasses.asdict(report).items():
        table.add_row(name, f"{value:.3f}" if isinstance(value, float) else _human(name, value))
    console.print(table)
    console.print(
        f"freed {report.segments_freed} segments, moved {report.pages_moved} pages, "
        f"evicted {report.pages_evicted} pages in {report.seconds:.2f} s"
    )


# -- wear, metrics, report ---------------------------------------------------


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--device", help="Block device for SMART (default: the one holding PATH).")
@click.option(
    "--capacity-bytes",
    type=click.IntRange(min=1),
    help="Drive capacity for DWPD (overrides).",
)
@click.option(
    "--rated-dwpd",
    type=click.FloatRange(min=0, min_open=True),
    help="The drive's rated DWPD (overrides; > 0).",
)
@click.option(
    "--warranty-years",
    type=click.FloatRange(min=0, min_open=True),
    help="The drive's warranty (overrides; > 0).",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Sample the device and the store twice this many seconds apart, to show the "
    "store's share of the device's writes meanwhile.",
)
def wear(
    path: Path,
    as_json: bool,
    device: str | None,
    capacity_bytes: int | None,
    rated_dwpd: float | None,
    warranty_years: float | None,
    interval: float,
) -> None:
    """How fast the store at PATH wears its drive: WA, DWPD, SMART, projected life.

    Reads the persisted counters (works beside a live writer; at most one
    telemetry flush interval old). What each number means: docs/operations.md.
    """
    import dataclasses

    from kvstore.telemetry import read_snapshot
    from kvstore.telemetry.smart import read_smart
    from kvstore.telemetry.wear import detect_drive

    with _errors(as_json):
        snapshot = read_snapshot(path, device=device, capacity_bytes=capacity_bytes)
        if rated_dwpd is not None or warranty_years is not None:
            settings = snapshot.wear
            snapshot = dataclasses.replace(
                snapshot,
                wear=dataclasses.replace(
                    settings,
                    rated_dwpd=rated_dwpd or settings.rated_dwpd,
                    warranty_years=warranty_years or settings.warranty_years,
                ),
            )
        drive = detect_drive(path, device)
        smart = read_smart(device or drive.name, sysfs_written=drive.written_bytes_since_boot)
        report = snapshot.wear_report().as_dict()
        report["drive"] = dataclasses.asdict(drive)
        report["smart"] = smart.as_dict()
        if smart.data_written_bytes:
            report["store_share_of_device_lifetime_writes"] = (
                report["store_bytes"] / smart.data_written_bytes  # type: ignore[operator]
            )
        if interval > 0:
            report["interval"] = _sample_share(path, device, drive.name, interval)
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True, default=str))
        return
    table = Table(title=f"kvstore wear {path}", show_header=False)
    for name, value in report.items():
        if name in ("drive", "smart", "notes", "interval"):
            continue
        table.add_row(name, _human(name, value))
    console.print(table)
    if smart.available:
        console.print(
            f"SMART ({smart.source}, {smart.device}): data written "
            f"{smart.data_written_bytes or 0:,} bytes, percentage used {smart.percentage_used}%, "
            f"power-on hours {smart.power_on_hours}"
        )
    else:
        console.print(f"[yellow]{smart.reason}[/yellow]")
        if smart.written_bytes_since_boot is not None:
            console.print(
                f"sysfs: {smart.written_bytes_since_boot:,} bytes written to "
                f"{smart.device} since boot (block layer, not drive wear)"
            )
    if "interval" in report:
        console.print(f"interval: {report['interval']}")
    for note in report["notes"]:  # type: ignore[attr-defined]
        console.print(f"note: {note}")


def _sample_share(
    path: Path, device: str | None, drive_name: str | None, seconds: float
) -> dict[str, object]:
    """The store's share of the device's writes over ``seconds`` (SMART, else sysfs)."""
    from kvstore.telemetry import read_snapshot
    from kvstore.telemetry.smart import read_smart
    from kvstore.telemetry.wear import detect_drive

    def device_written() -> tuple[int | None, str]:
        drive = detect_drive(path, device)
        smart = read_smart(device or drive_name, sysfs_written=drive.written_bytes_since_boot)
        if smart.data_written_bytes is not None:
            return smart.data_written_bytes, smart.source
        return drive.written_bytes_since_boot, "sysfs"

    store_before = read_snapshot(path).wear_report().store_bytes
    device_before, source = device_written()
    time.sleep(seconds)
    store_after = read_snapshot(path).wear_report().store_bytes
    device_after, _ = device_written()
    out: dict[str, object] = {
        "seconds": seconds,
        "store_bytes": store_after - store_before,
        "device_source": source,
    }
    if device_before is not None and device_after is not None:
        out["device_bytes"] = device_after - device_before
        if device_after > device_before:
            out["store_share"] = (store_after - store_before) / (device_after - device_before)
    return out


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    required=True,
    help="HTTP port for /metrics (0: any free port).",
)
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--device", help="Also export the drive's SMART wear (runs nvme/smartctl).")
@click.option(
    "--tier/--no-tier",
    default=None,
    help="Also serve the tier manager's statistics (PATH/tiering-stats.json, re-read at "
    "each scrape). Default: when PATH holds that file at start; --tier requires it.",
)
def metrics(path: Path, port: int, addr: str, device: str | None, tier: bool | None) -> None:
    """Serve the store's Prometheus metrics on http://ADDR:PORT/metrics.

    Reads the persisted counters at each scrape, so it runs beside the writer
    (an engine can instead mount KVStore.metrics_registry()). With the tier
    manager's statistics, its kv_cache_hit_total, kv_offload_latency_seconds and
    kv_page_table_size_bytes (every layer) replace the store's (layer 2 only).
    """
    from prometheus_client import start_http_server

    from kvstore.telemetry import read_snapshot
    from kvstore.telemetry.prometheus import StoreCollector, registry_for
    from kvstore.telemetry.smart import SmartReport, read_smart
    from kvstore.tiering.statsfile import STATS_FILE, read_stats_file

    with _errors():
        read_snapshot(path)  # fail now, not at the first scrape, if PATH is no store
        if tier:
            read_stats_file(path)  # --tier: fail now if there are no readable statistics
    with_tier = tier if tier is not None else (path / STATS_FILE).exists()

    smart_reader = None
    if device is not None:

        def smart_reader() -> SmartReport:
            return read_smart(device)

    if with_tier:
        from kvstore.tiering.metrics import StatsFileCollector, registry_beside_store

        store_collector = StoreCollector(lambda: read_snapshot(path), smart_reader)
        registry = registry_beside_store(store_collector, StatsFileCollector(path))
    else:
        registry = registry_for(lambda: read_snapshot(path), smart_reader)
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # before the server thread starts
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as e:  # the port in use, an address not of this host
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
        _fail(f"cannot serve metrics on {addr}:{port}: {os_reason(e)}", EXIT_OPERATIONAL)
    beside = f" with the tier statistics of {path / STATS_FILE}" if with_tier else ""
    click.echo(f"serving metrics of {path} on http://{addr}:{server.server_port}/metrics{beside}")
    sys.stdout.flush()
    try:
        signal.sigwait(stop_signals)
    finally:
        server.shutdown()
        thread.join()


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--html", "html_path", type=click.Path(path_type=Path), required=True)
@click.option("--days", default=30, show_default=True, help="How many days to plot.")
@click.option("--png-dir", type=click.Path(path_type=Path), help="Also write each plot here.")
def report(path: Path, html_path: Path, days: int, png_dir: Path | None) -> None:
    """Write a self-contained HTML report of the store's wear and performance.

    Daily writes against the DWPD budget, write amplification, throughput and
    latency over time (matplotlib plots embedded in the page).
    """
    from kvstore.telemetry import read_snapshot
    from kvstore.telemetry.report import render_html

    with _errors():
        page, images = render_html(read_snapshot(path), days=days)
    target = html_path
    try:
        html_path.write_text(page)
        if png_dir is not None:
            target = png_dir
            png_dir.mkdir(parents=True, exist_ok=True)
            for index, image in enumerate(images, 1):
                target = png_dir / f"plot{index}.png"
                target.write_bytes(image)
    except OSError as e:  # a missing directory, no permission, a full disk
        _fail(f"cannot write {target}: {os_reason(e)}", EXIT_OPERATIONAL)
    console.print(f"wrote {html_path} ({len(page):,} bytes, {len(images)} plots)")


# -- tier --------------------------------------------------------------------


@main.group()
def tier() -> None:
    """The tier manager's persisted statistics (PATH/tiering-stats.json).

    PATH is the tier manager's nvme_path (a store directory) or the file itself.
    The manager rewrites the file every persist_stats_s and on close, so these
    commands run beside it.

    \b
    Exit codes:
      0  success
      4  the file is damaged (not JSON, a field missing): move it aside
      8  no statistics at PATH, a newer file version, I/O failure
    """


@tier.command("stat")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--top", default=10, show_default=True, help="Reuse classes to list.")
def tier_stat(path: Path, as_json: bool, top: int) -> None:
    """What is where: pages, bytes, hit rate, tau and kappa per tier; NVMe writes,
    bandwidths, C_eff and the likeliest reuse classes (docs/tiering.md)."""
    from kvstore.tiering.statsfile import (
        finite_or_none,
        read_stats_file,
        stats_file_of,
        summarize,
    )

    with _errors(as_json):
        summary = summarize(read_stats_file(path), top=top)
    file = stats_file_of(path)
    if as_json:
        out = {"path": str(file), **finite_or_none(summary)}
        click.echo(json.dumps(out, indent=2, sort_keys=True))
        return
    _print_tier_summary(file, summary)


def _print_tier_summary(file: Path, summary: dict[str, Any]) -> None:
    saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(summary["saved_at_unix_s"]))
    tiers = Table(title=f"kvstore tier {file}")
    for column in ("tier", "pages", "used", "capacity", "hits", "hit rate", "tau (s/B)", "kappa"):
        tiers.add_column(column, justify="left" if column == "tier" else "right")
    for name, row in summary["tiers"].items():
        tiers.add_row(
            name,
            f"{row['pages']:,}",
            _mib(row["used_bytes"]),
            _mib(row["capacity_bytes"]),
            f"{row['hits']:,}",
            _percent(row["hit_rate"]),
            f"{row['tau_s_per_byte']:.3e}",
            f"{row['kappa']:.2f}",
        )
    console.print(tiers)
    for name, row in summary["tiers"].items():
        if not row["in_use"] and row["capacity_bytes"]:
            console.print(
                f"{name} is not in use: loading a page from it is measured slower than "
                f"recomputing it (kappa {row['kappa']:.3g} < 1); the manager re-measures it"
            )
    overall = Table(show_header=False)
    for name, value in (
        ("saved", f"{saved} ({summary['saved_age_s']:,.0f} s ago)"),
        ("lookups", f"{summary['lookups']:,}"),
        ("misses", f"{summary['misses']:,}"),
        ("hit rate (all tiers)", _percent(summary["hit_rate"])),
        ("nvme_pages_written", f"{summary['nvme_pages_written']:,}"),
        ("nvme_bytes_written", _human("bytes", summary["nvme_bytes_written"])),
        ("C_eff (FLOP/s)", f"{summary['compute_flops']:.3e}"),
        ("heat_pages", f"{summary['heat_pages']:,}"),
        *_write_gate_rows(summary.get("nvme_write_gate")),
        *_displacement_rows(summary.get("nvme_displacement")),
    ):
        overall.add_row(name, value)
    console.print(overall)
    bandwidth = Table(title="transfer paths (fitted)")
    for column in ("path", "GB/s", "latency (us)", "samples"):
        bandwidth.add_column(column, justify="left" if column == "path" else "right")
    for name, fit in summary["bandwidth"].items():
        bandwidth.add_row(
            escape(name),
            f"{fit['bytes_per_s'] / 1e9:,.2f}",
            f"{fit['latency_s'] * 1e6:,.1f}",
            f"{fit['samples']:,}",
        )
    console.print(bandwidth)
    remote = summary.get("remote")
    if remote:
        _print_remote(remote)
    if summary["top_reuse_classes"]:
        reuse = Table(
            title=f"reuse classes (top {len(summary['top_reuse_classes'])} "
            f"of {summary['reuse_classes']} by p)"
        )
        for column in ("depth bucket", "reused", "tag", "reuses", "non-reuses", "p(reuse)"):
            reuse.add_column(column)
        for row in summary["top_reuse_classes"]:
            reuse.add_row(
                str(row["depth_bucket"]),
                "yes" if row["reused"] else "no",
                escape(row["tag"]) or "-",
                f"{row['reuses']:,.1f}",
                f"{row['non_reuses']:,.1f}",
                f"{row['p_reuse']:.3f}",
            )
        console.print(reuse)


def _displacement_rows(rule: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The displacement rule's row of ``kvstore tier stat`` (docs/tiering.md, "Admission
    against the displaced page"): on or off, and its two models' hits (with the rule,
    without it)."""
    if not rule:
        return []
    plain, filtered = rule["model_hits"]
    state = "on" if rule["on"] else "off"
    return [("NVMe displacement rule", f"{state}: {filtered:,.0f} model hits vs {plain:,.0f}")]


def _write_gate_rows(gate: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The NVMe write gate's rows of ``kvstore tier stat`` (docs/tiering.md,
    "Admission by payoff")."""
    if not gate:
        return []
    rows = []
    for name, label in (("seen_once", "pages seen once"), ("seen_again", "pages seen again")):
        row = gate[name]
        share = row["read_back_share"]
        read_back = "no evidence yet" if share is None else f"{share:.1%} of writes read back"
        state = "written" if row["open"] else "not written"
        rows.append((f"NVMe: {label}", f"{state} ({read_back})"))
    return rows


def _print_remote(remote: dict[str, Any]) -> None:
    """The remote tier's section of ``kvstore tier stat`` (docs/tiering.md)."""
    table = Table(title="remote tier", show_header=False)
    backend = remote.get("backend", {})
    state = remote["state"] + (
        f": {remote['degraded_reason']}" if remote["degraded_reason"] else ""
    )
    for name, value in (
        ("backend", escape(", ".join(f"{k}={v}" for k, v in backend.items()))),
        ("namespace", escape(str(remote["namespace"]))),
        ("state", escape(state)),
        ("hits (pages)", f"{remote['hits']:,}"),
        ("misses", f"{remote['misses']:,}"),
        (
            "misses by reason",
            ", ".join(f"{k} {v:,}" for k, v in remote["miss_reasons"].items()) or "-",
        ),
        ("published (pages)", f"{remote['published']:,}"),
        ("read / written", f"{_mib(remote['bytes_read'])} / {_mib(remote['bytes_written'])}"),
        ("kappa", f"{remote['kappa']:.2f}" + ("" if remote["in_use"] else " (not in use)")),
    ):
        table.add_row(name, value)
    for path, fit in remote["bandwidth"].items():
        table.add_row(path, f"{fit['bytes_per_s'] / 1e9:,.2f} GB/s, {fit['samples']:,} samples")
    console.print(table)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.1%}"


@tier.command("metrics")
@click.argument("path", type=click.Path(path_type=Path))
def tier_metrics(path: Path) -> None:
    """Print the Prometheus exposition of the persisted tier statistics.

    What the file does not keep (in-flight bytes, latency histograms, the page
    table's size) reads as zero; `kvstore metrics STORE --port N` serves the same
    families beside the store's metrics, re-reading the file at each scrape.
    """
    from prometheus_client import generate_latest

    from kvstore.tiering.metrics import registry_for_data
    from kvstore.tiering.statsfile import read_stats_file

    with _errors():
        data = read_stats_file(path)
    click.echo(generate_latest(registry_for_data(data)).decode(), nl=False)


# -- demo --------------------------------------------------------------------

_DEMO_SHAPE = (2, 8, 64, 128)  # K/V x heads x block tokens x head dim, fp16 = 256 KiB


def _demo_page(layer: int, block: int, version: int = 0) -> np.ndarray:
    rng = np.random.default_rng(layer * 1_000_003 + block * 7919 + version * 104_729)
    return rng.standard_normal(_DEMO_SHAPE, dtype=np.float32).astype(np.float16)


def _demo_key(layer: int, block: int, prefix: str = "req0") -> str:
    return f"{prefix}/layer{layer:02d}/block{block:04d}"


def _progress(on: Console = console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        console=on,
    )


@main.command()
@click.option(
    "--path",
    type=click.Path(path_type=Path),
    default=Path("./kvstore-demo"),
    show_default=True,
    help="Store directory (the demo's own store is recreated on every run).",
)
@click.option("--layers", default=16, show_default=True)
@click.option("--blocks", default=32, show_default=True, help="KV blocks per layer.")
@click.option(
    "--force",
    is_flag=True,
    help="Delete a store at --path that the demo did not create (it is refused otherwise).",
)
def demo(path: Path, layers: int, blocks: int, force: bool) -> None:
    """Write a small model's KV pages, read them back, survive a SIGKILL.

    The demo deletes and recreates its own store at --path; a store it did not
    create there is refused (exit 2) unless --force.
    """
    with _errors():
        _run_demo(path, layers, blocks, force=force)


_DEMO_KEY = re.compile(rb"req[01]/layer\d{2}/block\d{4}")


def _made_by_demo(path: Path) -> bool:
    """Whether the store at ``path`` is the demo's: its marker, or (a store an older
    demo made, before the marker) a store holding nothing but the demo's pages."""
    if (path / DEMO_MARKER_NAME).exists():
        return True
    try:
        with KVStore.open(path, readonly=True) as store:
            seen = False
            for key in store.keys():  # noqa: SIM118 - KVStore is no dict
                if _DEMO_KEY.fullmatch(key) is None:
                    return False
                seen = True
            return seen
    except (KVStoreError, OSError):
        return False  # cannot tell: not the demo's


def _run_demo(path: Path, layers: int, blocks: int, *, force: bool = False) -> None:
    if path.exists():
        if not (path / SUPERBLOCK_NAME).exists():
            if path.is_dir() and any(path.iterdir()):
                raise click.UsageError(f"{path} exists and is not a kvstore; pick another --path")
            if not path.is_dir():
                raise click.UsageError(f"{path} is a file, not a directory; pick another --path")
        elif not force and not _made_by_demo(path):
            raise click.UsageError(
                f"{path} holds a kvstore the demo did not create, and the demo would delete "
                "it; pick another --path, or add --force to delete that store"
            )
        shutil.rmtree(path)
    page_bytes = int(np.prod(_DEMO_SHAPE)) * 2
    total = layers * blocks
    console.print(
        f"[bold]kvstore demo[/bold]: {layers} layers x {blocks} blocks, pages of "
        f"K/V x {_DEMO_SHAPE[1]} heads x {_DEMO_SHAPE[2]} tokens x {_DEMO_SHAPE[3]} dim fp16 "
        f"= {page_bytes >> 10} KiB, {total * page_bytes >> 20} MiB in all"
    )
    pages = {
        _demo_key(layer, block): _demo_page(layer, block)
        for layer in range(layers)
        for block in range(blocks)
    }
    with KVStore.open(path, create=True, segment_bytes=64 << 20) as store:
        (path / DEMO_MARKER_NAME).write_text(
            "created by `kvstore demo`, which deletes and recreates this store on its next run\n",
            encoding="utf-8",
        )
        stats = store.stats()
        console.print(
            f"store at {store.root}: engine {stats.io_engine} ({stats.io_engine_reason}), "
            f"O_DIRECT {stats.direct_io}"
        )
        items = list(pages.items())
        started = time.perf_counter()
        with _progress() as progress:
            task = progress.add_task("write (durable)", total=total * page_bytes)
            for start in range(0, total, 32):
                batch = items[start : start + 32]
                store.put_many(batch)
                store.flush()
                progress.advance(task, len(batch) * page_bytes)
        write_seconds = time.perf_counter() - started
        started = time.perf_counter()
        keys = list(pages)
        mismatches = 0
        with _progress() as progress:
            task = progress.add_task("read + verify", total=total * page_bytes)
            for start in range(0, total, 64):
                chunk = keys[start : start + 64]
                for key, data in zip(chunk, store.get_many(chunk), strict=True):
                    if data is None or data != pages[key].tobytes():
                        mismatches += 1
                progress.advance(task, len(chunk) * page_bytes)
        read_seconds = time.perf_counter() - started
    megabytes = total * page_bytes / 1e6
    console.print(
        f"wrote {total} pages durably at {megabytes / write_seconds:,.0f} MB/s; "
        f"read back and verified at {megabytes / read_seconds:,.0f} MB/s; mismatches: {mismatches}"
    )

    console.print("[bold]crash test[/bold]: a writer process puts pages; we SIGKILL it mid-stream")
    acked = _kill_a_writer(path, layers, blocks)
    started = time.perf_counter()
    with KVStore.open(path) as store:
        reopen_seconds = time.perf_counter() - started
        lost = 0
        for layer, block in acked:
            data = store.get(_demo_key(layer, block, "req1"))
            if data is None or data != _demo_page(layer, block, 1).tobytes():
                lost += 1
        intact = sum(
            1
            for key, data in zip(keys, store.get_many(keys), strict=True)
            if data is not None and data == pages[key].tobytes()
        )
        survivors = len(store)
    console.print(
        f"recovered in {reopen_seconds * 1000:.0f} ms: {len(acked)} acknowledged pages from the "
        f"killed writer, {lost} lost; first request intact: {intact}/{total}; "
        f"{survivors} pages in the store"
    )
    if mismatches or lost or intact != total:
        err_console.print("[red]corruption:[/red] the demo found lost or wrong pages")
        sys.exit(EXIT_CORRUPT)
    console.print("[green]ok[/green]: every acknowledged page survived, verified byte for byte")


def _kill_a_writer(path: Path, layers: int, blocks: int) -> list[tuple[int, int]]:
    child = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "demo-writer", str(path), str(layers), str(blocks)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    acked: list[tuple[int, int]] = []
    deadline = time.monotonic() + 0.8
    for line in child.stdout:
        if line.startswith("ack "):
            layer, block = map(int, line.split()[1:3])
            acked.append((layer, block))
        if time.monotonic() >= deadline or len(acked) >= layers * blocks // 2:
            break
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    return acked


@main.command("demo-writer", hidden=True)
@click.argument("path", type=click.Path(path_type=Path))
@click.argument("layers", type=int)
@click.argument("blocks", type=int)
def demo_writer(path: Path, layers: int, blocks: int) -> None:
    """Child of ``demo``: sync-puts a second request's pages, printing each ack."""
    with KVStore.open(path) as store:
        for layer in range(layers):
            for block in range(blocks):
                store.put(_demo_key(layer, block, "req1"), _demo_page(layer, block, 1), sync=True)
                print(f"ack {layer} {block}", flush=True)
        time.sleep(60)  # wait to be killed


# `kvstore bench` lives with the benchmark code (kvstore/bench/); imported here so
# `kvstore --help` lists it. Its heavy imports (matplotlib) happen only when it runs.
main.add_command(bench_command)
# `kvstore sim` lives with the simulator (kvstore/tiering/); torch and matplotlib load
# only when it replays kvstore or plots.
main.add_command(sim_command)


if __name__ == "__main__":
    main()
