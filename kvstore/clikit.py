"""What the command lines share: exit codes, the ``--json`` error object, the
consoles, the progress bar and the drivers' progress lines.

``kvstore`` (kvstore/cli.py), ``kvstore bench`` (kvstore/bench/cli.py) and
``kvstore sim`` (kvstore/tiering/sim/cli.py) import it; none of them imports
another for these (kvstore/cli.py registers the other two commands, nothing
more). The benchmark and fault drivers behind tools/ (kvstore/bench,
kvstore/testing) print their progress with ``progress_line``. It imports only
kvstore.errors, click and rich.

Exit codes (documented in README.md and docs/operations.md):
    0  success
    1  a key was not found (``get``)
    2  usage error
    3  the store is locked by another writer
    4  corruption was found
    8  operational error (I/O failure, missing store, bad format version)
"""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvstore.errors import KVStoreError, LockedError, StoreNotFoundError

__all__ = [
    "EXIT_CORRUPT",
    "EXIT_LOCKED",
    "EXIT_NOT_FOUND",
    "EXIT_OPERATIONAL",
    "EXIT_USAGE",
    "console",
    "echo_error_json",
    "err_console",
    "error_json",
    "message_of",
    "os_reason",
    "progress_bar",
    "progress_line",
]

EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_LOCKED = 3
EXIT_CORRUPT = 4
EXIT_OPERATIONAL = 8

console = Console()
# Errors are not wrapped: a path or key in a message stays on one line, to copy.
err_console = Console(stderr=True, soft_wrap=True)

# The library's hints name Python calls (create=True, readonly=True); on the command
# line the same advice names commands.
_CLI_HINTS: tuple[tuple[type[KVStoreError], str], ...] = (
    (StoreNotFoundError, "create one with `kvstore init PATH`"),
    (
        LockedError,
        "stop the writer first; stat, wear, metrics and fsck without --repair run beside it",
    ),
)


def os_reason(error: OSError) -> str:
    """An OSError as its reason alone ("No such file or directory"), no repr."""
    return error.strerror or str(error) or type(error).__name__


def message_of(error: BaseException) -> str:
    """An error as one line for the command line."""
    if isinstance(error, OSError) and not isinstance(error, KVStoreError):
        where = f"{error.filename}: " if error.filename is not None else ""
        return f"{where}{os_reason(error)}"
    message = str(error)
    if isinstance(error, KVStoreError) and error.hint:
        for kind, hint in _CLI_HINTS:
            if isinstance(error, kind):
                return message.replace(error.hint, hint)
    return message


def error_json(error: BaseException, exit_code: int) -> dict[str, object]:
    """What ``--json`` prints when a command fails (docs/operations.md)."""
    return {
        "error": {"type": type(error).__name__, "message": message_of(error)},
        "exit_code": exit_code,
    }


def echo_error_json(error: BaseException, exit_code: int) -> None:
    """Print ``error_json`` on stdout, indented, one document."""
    click.echo(json.dumps(error_json(error, exit_code), indent=2))


def progress_bar(*, transient: bool) -> Progress:
    """The commands' progress bar: on stderr, a label, a bar, done of total and the
    time elapsed; shown only on a terminal."""
    on = Console(stderr=True)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=on,
        transient=transient,
        disable=not on.is_terminal,
    )


def progress_line(message: str, *, quiet: bool = False) -> None:
    """One line of progress on stderr, flushed at once (none with ``quiet``): what a
    long driver says while stdout keeps its report or JSON."""
    if not quiet:
        print(message, file=sys.stderr, flush=True)
