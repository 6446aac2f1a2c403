#!/usr/bin/env python3
"""The kill -9 loop (kvstore.testing.crashloop), plus fsck after every recovery.

Runs the kill -9 loop of kvstore.testing.crashloop unchanged (same options, same
oracle), and after the parent has reopened the store and checked it against
the oracle in each cycle, runs ``store.check()`` (``--fsck-deep``: with
payload checksums) on that recovered store. Any finding is a violation: it
is printed, counted in ``fsck_findings`` and makes the exit status 1.

``--parent-engine threadpool`` makes the parent (which reopens, checks and
fscks the store every cycle) use the thread-pool engine; the children, which
are the ones killed, keep the default. With io_uring the parent leaks every
I/O buffer it ever used (the liburing binding's ``Iovec`` never releases its
buffer export; tests/reliability/test_resource_leaks.py), which after a few
hundred cycles exhausts vm.max_map_count or memory.

``--stall-s S`` raises the no-progress limit after which a live child counts
as stalled (crashloop's default is 5 s, which a heavily loaded machine can
exceed: a child importing numpy under load average 11 was flagged).

    .venv/bin/python tools/crashloop_fsck.py --dir /tmp/cl --cycles 500 --seed 1 \\
        --capacity-mib 64 --retain --json
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import sys
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


def _load_crashloop() -> Any:
    from kvstore.testing import crashloop

    return crashloop


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    deep = "--fsck-deep" in argv
    if deep:
        argv.remove("--fsck-deep")
    parent_engine = None
    if "--parent-engine" in argv:
        at = argv.index("--parent-engine")
        parent_engine = argv[at + 1]
        del argv[at : at + 2]
    stall_s = None
    if "--stall-s" in argv:
        at = argv.index("--stall-s")
        stall_s = float(argv[at + 1])
        del argv[at : at + 2]
    crashloop = _load_crashloop()
    if "--child" in argv:
        return int(crashloop.main(argv))
    if stall_s is not None:
        original_stalled = crashloop._stalled

        def stalled(config: Any, watch: Any, proc: Any) -> bool:
            return bool(original_stalled(dataclasses.replace(config, stall_s=stall_s), watch, proc))

        crashloop._stalled = stalled
    if parent_engine is not None:
        original_open = crashloop.open_store

        def open_store(path: Path, segment_bytes: int, **options: Any) -> Any:
            options["io_engine"] = parent_engine  # over crashloop's --engine, if given
            return original_open(path, segment_bytes, **options)

        crashloop.open_store = open_store
    tally = {"fsck_runs": 0, "fsck_findings": 0, "fsck_examples": []}
    original = crashloop._check_index

    def check_index_then_fsck(store: Any, present: Any, summary: Any, cycle: int) -> None:
        original(store, present, summary, cycle)
        findings = store.check(deep=deep)
        tally["fsck_runs"] += 1
        if findings:
            tally["fsck_findings"] += len(findings)
            for finding in findings[:3]:
                line = f"cycle {cycle}: fsck {finding.kind}: {finding.message}"
                print(line, file=sys.stderr, flush=True)
                if len(tally["fsck_examples"]) < 20:
                    tally["fsck_examples"].append(line)

    crashloop._check_index = check_index_then_fsck
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        status = int(crashloop.main(argv))
    text = buffer.getvalue()
    if "--json" in argv:
        summary = {
            **json.loads(text),
            **tally,
            "fsck_deep": deep,
            "parent_engine": parent_engine,
            "stall_s": stall_s,
        }
        summary["violations"] = summary.get("violations", 0) + tally["fsck_findings"]
        print(json.dumps(summary, indent=2))
    else:
        print(text, end="")
        print(f"fsck runs {tally['fsck_runs']}, findings {tally['fsck_findings']}")
    return 1 if status or tally["fsck_findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
