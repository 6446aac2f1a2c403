#!/usr/bin/env python3
"""Reopen-after-crash benchmark: a big checkpointed table plus a long WAL tail.

1. A builder child process creates a store with ``--pages`` small pages
   (``--min-bytes``..``--max-bytes``) written with ``put_many`` batches and
   checkpointed into LMDB, then runs ``--tail`` puts and deletes AFTER the last
   checkpoint (automatic checkpoints are off: checkpoint_wal_bytes=1<<40,
   checkpoint_interval_s=1e9), flushes, and reports "done". The parent SIGKILLs it.
2. A fresh process times ``KVStore.open`` (recovery: LMDB + WAL replay) and the
   first gets, and checks a sample of keys against the expected state. This runs
   ``--repeats`` times; each measuring process exits without closing, so every
   run replays the same WAL tail (optionally after dropping the page cache).

    .venv/bin/python tools/reopen_bench.py --dir /tmp/reopen --pages 1000000 --tail 100000
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstore import KVStore
from kvstore.bench.common import MIB
from kvstore.clikit import progress_line

POOL_BYTES = 4 * MIB
TARGET_REOPEN_S = 3.0
Ints = npt.NDArray[np.int64]


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """Everything the builder writes, derived from the seed (so the checker agrees)."""

    pages: int
    tail: int
    min_bytes: int
    max_bytes: int
    seed: int
    delete_frac: float

    def pool(self) -> bytes:
        return np.random.default_rng(self.seed).bytes(POOL_BYTES)

    def _sizes(self, rng: np.random.Generator, count: int) -> tuple[Ints, Ints]:
        sizes = rng.integers(self.min_bytes, self.max_bytes + 1, count)
        offsets = rng.integers(0, POOL_BYTES - self.max_bytes, count)
        return sizes, offsets

    def base(self) -> tuple[Ints, Ints]:
        """(sizes, offsets) of the checkpointed pages p00000000..."""
        return self._sizes(np.random.default_rng(self.seed + 1), self.pages)

    def tail_ops(self) -> tuple[npt.NDArray[np.int8], Ints, Ints, Ints]:
        """(kind, key index, size, offset) of each tail op; kind 0 put, 1 delete.

        Puts go half to existing keys (overwrites) and half to new keys past
        ``pages``; deletes go to existing keys.
        """
        rng = np.random.default_rng(self.seed + 2)
        kinds = (rng.random(self.tail) < self.delete_frac).astype(np.int8)
        fresh = rng.random(self.tail) < 0.5
        existing = rng.integers(0, max(self.pages, 1), self.tail)
        new_keys = self.pages + np.arange(self.tail)
        keys: Ints = np.where((kinds == 0) & fresh, new_keys, existing)
        sizes, offsets = self._sizes(rng, self.tail)
        return kinds, keys, sizes, offsets

    def expected(self) -> dict[int, tuple[int, int] | None]:
        """Final (size, offset) per key touched by the tail; None when deleted."""
        out: dict[int, tuple[int, int] | None] = {}
        kinds, keys, sizes, offsets = self.tail_ops()
        for kind, key, size, offset in zip(
            kinds.tolist(), keys.tolist(), sizes.tolist(), offsets.tolist(), strict=True
        ):
            if kind == 1:
                if key < self.pages or out.get(key) is not None:
                    out[key] = None
            else:
                out[key] = (size, offset)
        return out


def key_bytes(index: int) -> bytes:
    return b"p%09d" % index


def open_store(path: Path, segment_mib: int, *, create: bool = False, **options: Any) -> KVStore:
    return KVStore.open(
        path,
        create=create,
        segment_bytes=segment_mib * MIB,
        max_page_bytes=1 * MIB,
        checkpoint_wal_bytes=1 << 40,
        checkpoint_interval_s=1e9,
        **options,
    )


def _report(line: str) -> None:
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def _batches(total: int, size: int) -> Iterator[range]:
    for start in range(0, total, size):
        yield range(start, min(total, start + size))


def build_child(args: argparse.Namespace, plan: Plan) -> int:
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    pool = memoryview(plan.pool())
    started = time.perf_counter()
    options = {"lsn_lease_step": args.lsn_lease_step} if args.lsn_lease_step else {}
    store = open_store(Path(args.dir), args.segment_mib, create=True, **options)
    sizes, offsets = plan.base()
    sizes_l, offsets_l = sizes.tolist(), offsets.tolist()
    since_checkpoint = 0
    for batch in _batches(plan.pages, args.batch):
        store.put_many(
            [(key_bytes(i), pool[offsets_l[i] : offsets_l[i] + sizes_l[i]]) for i in batch]
        )
        since_checkpoint += len(batch)
        if since_checkpoint >= args.checkpoint_every:
            store.checkpoint()
            since_checkpoint = 0
            _report(f"progress {batch.stop} {time.perf_counter() - started:.1f}")
    store.checkpoint()
    base_s = time.perf_counter() - started
    _report(f"checkpointed {plan.pages} {base_s:.1f}")
    kinds, keys, tsizes, toffsets = plan.tail_ops()
    ops = list(zip(kinds.tolist(), keys.tolist(), tsizes.tolist(), toffsets.tolist(), strict=True))
    tail_started = time.perf_counter()
    puts: list[tuple[bytes, memoryview]] = []
    for done, (kind, key, size, offset) in enumerate(ops):
        if done and done % 10_000 == 0:
            _report(f"tail {done} {time.perf_counter() - tail_started:.1f}")
        if kind == 1:
            if puts:  # keep op order: a delete must follow the puts queued before it
                store.put_many(puts)
                puts = []
            store.delete(key_bytes(key))
        else:
            puts.append((key_bytes(key), pool[offset : offset + size]))
            if len(puts) >= args.batch:
                store.put_many(puts)
                puts = []
    if puts:
        store.put_many(puts)
    store.flush()
    stats = store.stats()
    _report(
        "done "
        + json.dumps(
            {
                "build_base_s": base_s,
                "build_tail_s": time.perf_counter() - tail_started,
                "pages": stats.pages,
                "wal_bytes": stats.wal_bytes,
                "segments": stats.segments,
                "overlay_entries": stats.overlay_entries,
            }
        )
    )
    time.sleep(3600)  # the parent kills us: nothing after the flush is ever checkpointed
    return 0


def measure_child(args: argparse.Namespace, plan: Plan) -> int:
    """Open after the crash, time it, verify a sample, then exit WITHOUT closing."""
    started = time.perf_counter()
    store = open_store(Path(args.dir), args.segment_mib)
    open_s = time.perf_counter() - started
    expected = plan.expected()
    touched = sorted(expected)
    first_key = touched[len(touched) // 2] if touched else 0
    t0 = time.perf_counter()
    store.get(key_bytes(first_key))
    first_get_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    store.get(key_bytes(plan.pages - 1))
    second_get_s = time.perf_counter() - t0
    pool = plan.pool()
    sizes, offsets = plan.base()
    rng = np.random.default_rng(args.repeat_index)
    sample = rng.choice(
        plan.pages + plan.tail, size=min(args.verify_sample, plan.pages), replace=False
    )
    checked = mismatches = 0
    for index in [*sample.tolist(), *touched[: args.verify_sample]]:
        if index in expected:
            want = expected[index]
            want_bytes = None if want is None else pool[want[1] : want[1] + want[0]]
        elif index < plan.pages:
            want_bytes = pool[int(offsets[index]) : int(offsets[index]) + int(sizes[index])]
        else:
            want_bytes = None
        checked += 1
        if store.get(key_bytes(index)) != want_bytes:
            mismatches += 1
    deleted = sum(1 for k, v in expected.items() if k < plan.pages and v is None)
    added = sum(1 for k, v in expected.items() if k >= plan.pages and v is not None)
    live = plan.pages - deleted + added
    result = {
        "open_s": open_s,
        "first_get_s": first_get_s,
        "second_get_s": second_get_s,
        "replayed_records": store.replayed_records,
        "recovery_notes": store.recovery_notes,
        "pages_reported": len(store),
        "pages_expected": live,
        "verified_keys": checked,
        "mismatches": mismatches,
    }
    _report("result " + json.dumps(result))
    os._exit(0)  # no close: a close would checkpoint the tail away


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def _child_args(args: argparse.Namespace, mode: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvstore.bench.reopen",  # the children run this module (its __main__ below)
        mode,
        "--dir",
        str(args.dir),
        "--pages",
        str(args.pages),
        "--tail",
        str(args.tail),
        "--min-bytes",
        str(args.min_bytes),
        "--max-bytes",
        str(args.max_bytes),
        "--seed",
        str(args.seed),
        "--delete-frac",
        str(args.delete_frac),
        "--segment-mib",
        str(args.segment_mib),
        "--batch",
        str(args.batch),
        "--checkpoint-every",
        str(args.checkpoint_every),
        "--verify-sample",
        str(args.verify_sample),
        "--lsn-lease-step",
        str(args.lsn_lease_step),
    ]


def _lines(proc: subprocess.Popen[bytes], stall_s: float) -> Iterator[str]:
    """The builder's lines; on ``stall_s`` seconds of silence dump its stacks and stop."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    pending = b""
    while True:
        ready, _, _ = select.select([fd], [], [], stall_s)
        if not ready:
            proc.send_signal(signal.SIGUSR1)  # faulthandler: stacks to its stderr
            time.sleep(1.0)
            raise SystemExit(f"builder made no progress for {stall_s} s (stacks above)")
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.decode().strip()


def build(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    proc = subprocess.Popen(_child_args(args, "--build-child"), stdout=subprocess.PIPE)
    assert proc.stdout is not None
    info: dict[str, Any] = {}
    try:
        info = _read_build(proc, args.stall_s, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        status = proc.wait()
        proc.stdout.close()
    if not info:
        raise SystemExit(f"builder exited with status {status} before it was done")
    info["builder_status"] = status
    return info


def _read_build(
    proc: subprocess.Popen[bytes], stall_s: float, log: Callable[[str], None]
) -> dict[str, Any]:
    info: dict[str, Any] = {}
    for line in _lines(proc, stall_s):
        if line.startswith("done "):
            info = json.loads(line[5:])
            break
        log(f"build: {line}")
    return info


def measure(args: argparse.Namespace, index: int) -> dict[str, Any]:
    command = [*_child_args(args, "--measure-child"), "--repeat-index", str(index)]
    started = time.perf_counter()
    out = subprocess.run(command, stdout=subprocess.PIPE, check=False)
    wall = time.perf_counter() - started
    for raw in out.stdout.splitlines():
        line = raw.decode()
        if line.startswith("result "):
            result: dict[str, Any] = json.loads(line[7:])
            result["process_wall_s"] = wall
            return result
    raise SystemExit(f"measuring process failed with status {out.returncode}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--pages", type=int, default=1_000_000, help="checkpointed pages")
    parser.add_argument("--tail", type=int, default=100_000, help="puts/deletes after it")
    parser.add_argument("--min-bytes", type=int, default=1)
    parser.add_argument("--max-bytes", type=int, default=4096)
    parser.add_argument("--delete-frac", type=float, default=0.3, help="share of tail deletes")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--segment-mib", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1000, help="put_many batch size")
    parser.add_argument("--checkpoint-every", type=int, default=250_000)
    parser.add_argument(
        "--repeats", type=int, default=3, help="reopen measurements (0: build only)"
    )
    parser.add_argument("--verify-sample", type=int, default=2000)
    parser.add_argument(
        "--lsn-lease-step", type=int, default=0, help="builder's lsn_lease_step (0: default)"
    )
    parser.add_argument(
        "--stall-s", type=float, default=300.0, help="fail when the builder is silent this long"
    )
    parser.add_argument("--drop-caches", action="store_true", help="drop the page cache first")
    parser.add_argument("--skip-build", action="store_true", help="measure an existing build")
    parser.add_argument("--fresh", action="store_true", help="remove --dir if it is a kvstore")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--build-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--measure-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeat-index", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.dir = args.dir.absolute()
    plan = Plan(args.pages, args.tail, args.min_bytes, args.max_bytes, args.seed, args.delete_frac)
    if args.build_child:
        return build_child(args, plan)
    if args.measure_child:
        return measure_child(args, plan)

    def log(message: str) -> None:
        progress_line(message, quiet=args.json)

    report: dict[str, Any] = {"pages": args.pages, "tail": args.tail}
    if not args.skip_build:
        if args.fresh and (args.dir / "KVSTORE").exists():
            shutil.rmtree(args.dir)
        if args.dir.exists() and any(args.dir.iterdir()):
            raise SystemExit(f"{args.dir} is not empty (use --fresh or --skip-build)")
        started = time.perf_counter()
        report["build"] = build(args, log)
        report["build"]["wall_s"] = time.perf_counter() - started
        log(f"build: {json.dumps(report['build'])}")
    if args.repeats <= 0:  # build only; measure later with --skip-build
        print(json.dumps(report, indent=2))
        return 0
    runs = []
    for index in range(args.repeats):
        dropped = _drop_caches() if args.drop_caches else False
        result = measure(args, index)
        result["page_cache_dropped"] = dropped
        runs.append(result)
        log(
            f"reopen {index + 1}: open {result['open_s']:.3f} s, first get "
            f"{result['first_get_s'] * 1e3:.2f} ms, replayed {result['replayed_records']} "
            f"records, pages {result['pages_reported']} (expected {result['pages_expected']}), "
            f"{result['mismatches']} mismatches in {result['verified_keys']} keys"
            + (" [cold cache]" if dropped else "")
        )
    report["reopens"] = runs
    worst = max(r["open_s"] for r in runs)
    bad = any(r["mismatches"] or r["pages_reported"] != r["pages_expected"] for r in runs)
    report["open_s_max"] = worst
    report["target_s"] = TARGET_REOPEN_S
    report["ok"] = worst < TARGET_REOPEN_S and not bad
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"reopen after kill -9 with {args.pages} checkpointed pages and {args.tail} "
            f"WAL-tail ops: open max {worst:.3f} s (target < {TARGET_REOPEN_S} s), "
            f"{'OK' if report['ok'] else 'FAIL'}"
        )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
