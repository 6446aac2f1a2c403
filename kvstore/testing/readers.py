"""Read-only readers and read-only fsck beside a live, churning writer.

Each role runs as its own process (LMDB allows one open of an index per
process, and a reader must see the writer the way another process does):
``python -m kvstore.testing.readers ROLE`` with a JSON spec on stdin.

- ``serve``: a writer driven by one JSON command per stdin line, one JSON reply
  line each (``WriterProcess``); the deterministic tests use it to make a
  checkpoint, a segment free or a segment reuse happen exactly between a
  reader's open and its lookups.
- ``churn``: a writer that, until its deadline, puts pages (``put_many`` of 1-6
  keys), deletes, flushes, runs ``gc()`` and ``checkpoint()``, with the GC
  thread and the flusher on short intervals and a capacity small enough that
  puts evict, so segments are freed and their files reused all the time.
- ``reader``: opens the store ``readonly=True`` again and again and reads
  random keys (``get``, ``get_many``, ``get_into``), checking every page it
  gets against what the writer could have written for that key.
- ``fsck``: opens the store read-only and runs ``check_store`` again and again
  (some ``deep=True``), and now and then the ``kvstore fsck --json`` CLI.

Every page the writer puts is ``payload(key, version, size)``: a magic, the
version, then bytes derived from (key, version). A reader recomputes them from
the version the page names, so any byte that is not exactly a page the writer
put under that key is counted as wrong, without the oracle keeping pages.
The writer never damages the store, so every finding of a check beside it is a
false one, and so is every ``CorruptionError`` of a read-only open or read.

``soak(root, seconds=..., readers=..., fsckers=...)`` runs one churning writer
with the readers and fsck loops beside it and returns a ``SoakResult``;
``tools/reader_soak.py`` runs it for minutes and prints the numbers.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import xxhash

from kvstore.check import check_store
from kvstore.errors import KVStoreError, StoreFullError
from kvstore.store import KVStore

__all__ = [
    "CHURN_OPTIONS",
    "SoakResult",
    "WriterProcess",
    "payload",
    "soak",
    "verify_payload",
]

_MAGIC = b"KVRDSOAK"
_SIZES = (4096, 10_000, 16_384, 40_000, 65_536)
CHURN_OPTIONS: dict[str, Any] = {
    "segment_bytes": 1 << 20,
    "max_page_bytes": 256 << 10,
    "capacity_bytes": 16 << 20,  # 16 segments: puts evict, GC frees and reuses files
    "flush_interval_ms": 2.0,
    "checkpoint_interval_s": 0.3,
    "checkpoint_wal_bytes": 256 << 10,
    "gc_interval_s": 0.05,
}
"""Options of the churning writer (small segments and capacity: constant churn)."""
_MAX_SAMPLES = 10  # error messages kept per kind


def payload(key: str, version: int, size: int) -> bytes:
    """The bytes the writer puts under ``key`` at ``version`` (``size`` >= 16)."""
    seed = xxhash.xxh3_128_digest(f"{key}#{version}".encode())
    body = (seed * ((size - 16) // len(seed) + 1))[: size - 16]
    return _MAGIC + version.to_bytes(8, "little") + body


def verify_payload(key: str, data: bytes) -> str | None:
    """None if ``data`` is exactly a page the writer put under ``key``; else what is wrong."""
    if len(data) < 16 or data[:8] != _MAGIC:
        return f"{key}: {len(data)} bytes that are no page of the writer's"
    version = int.from_bytes(data[8:16], "little")
    if data != payload(key, version, len(data)):
        return f"{key}: bytes differ from version {version} of the key"
    return None


def _keys(count: int) -> list[str]:
    return [f"key{index:05d}" for index in range(count)]


# -- the command-driven writer (deterministic tests) ---------------------------------


class WriterProcess:
    """A writer in a child process, driven by ``call(op, **args)``.

    Ops: ``put`` (``items``: [key, version, size] lists; put_many, then flush),
    ``delete`` (``keys``; then flush), ``gc`` (``full``), ``checkpoint``,
    ``segments`` (``keys``: the segment id of each, or None), ``spare`` (waits for
    the prepared spare segment; its id), ``no_spare`` (drops the spare and stops
    the prepare thread from making another, so the next segment GC frees is
    reused as the spare: ``recycle_segment``), ``stats``, ``close``.
    """

    def __init__(self, root: Path, options: dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvstore.testing.readers", "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._send({"path": str(root), "options": options})
        self._receive()

    def _send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def _receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the writer process died (exit {self.process.wait()})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the writer failed: {reply['error']}")
        return reply

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        self._send({"op": op, **args})
        return self._receive()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.call("close")
            finally:
                self.process.wait(timeout=60)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> WriterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            self.kill()


def _serve(spec: dict[str, Any], commands: IO[str]) -> None:
    store = KVStore.open(spec["path"], create=True, **spec["options"])
    print(json.dumps({"ok": True}), flush=True)
    for line in commands:
        command = json.loads(line)
        op = command.pop("op")
        try:
            reply = _serve_one(store, op, command)
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
        if op == "close":
            return


def _serve_one(store: KVStore, op: str, args: dict[str, Any]) -> dict[str, Any]:
    if op == "put":
        store.put_many([(key, payload(key, version, size)) for key, version, size in args["items"]])
        store.flush()
    elif op == "delete":
        for key in args["keys"]:
            store.delete(key)
        store.flush()
    elif op == "gc":
        return {"freed": store.gc(full=args.get("full", False)).segments_freed}
    elif op == "checkpoint":
        store.checkpoint()
    elif op == "segments":
        infos = [store.info(key) for key in args["keys"]]
        return {"segments": [None if info is None else info.segment_id for info in infos]}
    elif op == "spare":
        spare = store.internals.wait_for_spare(10)
        return {"spare": None if spare is None else spare[0]}
    elif op == "no_spare":
        _stop_spares(store)
    elif op == "stats":
        stats = store.stats()
        return {"segments": stats.segments, "checkpoint_lsn": stats.checkpoint_lsn}
    elif op == "close":
        store.close()
    else:
        raise ValueError(f"unknown op {op!r}")
    return {"ok": True}


def _stop_spares(store: KVStore) -> None:
    """Drop the prepared spare and keep the prepare thread from making another:
    the next segment GC frees then becomes the spare (its file reused)."""
    segment_set = store.internals.segment_set
    claim = segment_set.claim_spare_locked

    def claim_unless_preparing() -> tuple[int, int] | None:
        if threading.current_thread().name == "kvstore-prepare":
            return None
        return claim()

    segment_set.claim_spare_locked = claim_unless_preparing  # type: ignore[method-assign]
    with store.internals.state.cond:
        while store.internals.state.preparing:
            store.internals.state.cond.wait()
        spare, store.internals.state.spare = store.internals.state.spare, None
    if spare is not None:
        spare.close()
        spare.path.unlink()


# -- the soak: a churning writer with readers and fsck beside it --------------------


@dataclass
class SoakResult:
    """What one ``soak`` saw. ``ok``: no false finding, no wrong byte, no false error."""

    seconds: float
    writer_ops: dict[str, int] = field(default_factory=dict)
    opens: int = 0
    failed_opens: int = 0
    reads: int = 0  # pages asked for
    hits: int = 0
    misses: int = 0
    stale_reads: int = 0  # misses of pages the writer freed after the reader's open
    failed_reads: int = 0
    wrong_bytes: int = 0
    fsck_runs: int = 0
    fsck_cli_runs: int = 0
    fsck_failed: int = 0  # check runs that raised (or a CLI run that printed no JSON)
    false_findings: int = 0
    changed_while_checking: int = 0
    final_findings: int = 0  # fsck after the writer closed
    final_wrong_bytes: int = 0
    samples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (
            self.failed_opens
            or self.failed_reads
            or self.wrong_bytes
            or self.fsck_failed
            or self.false_findings
            or self.final_findings
            or self.final_wrong_bytes
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


class _Tally:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.samples: dict[str, list[str]] = {}

    def note(self, kind: str, message: str) -> None:
        self.counts[kind] += 1
        kept = self.samples.setdefault(kind, [])
        if len(kept) < _MAX_SAMPLES:
            kept.append(message)

    def out(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "samples": self.samples}


def _churn(spec: dict[str, Any]) -> dict[str, Any]:
    rng = random.Random(spec["seed"])
    keys = _keys(spec["keys"])
    tally = _Tally()
    version = 0
    deadline = time.monotonic() + spec["seconds"]
    with KVStore.open(spec["path"], create=True, **spec["options"]) as store:
        for start in range(0, len(keys), 8):  # everything once, then churn
            version += 1
            batch = keys[start : start + 8]
            store.put_many([(key, payload(key, version, rng.choice(_SIZES))) for key in batch])
        store.checkpoint()
        print(json.dumps({"ready": True}), flush=True)
        while time.monotonic() < deadline:
            roll = rng.random()
            try:
                if roll < 0.70:
                    batch = rng.sample(keys, rng.randint(1, 6))
                    items = []
                    for key in batch:
                        version += 1
                        items.append((key, payload(key, version, rng.choice(_SIZES))))
                    store.put_many(items)
                    tally.counts["puts"] += len(items)
                elif roll < 0.85:
                    store.delete(rng.choice(keys))
                    tally.counts["deletes"] += 1
                elif roll < 0.93:
                    store.flush()
                    tally.counts["flushes"] += 1
                elif roll < 0.97:
                    store.gc()
                    tally.counts["gc"] += 1
                else:
                    store.checkpoint()
                    tally.counts["checkpoints"] += 1
            except StoreFullError as e:
                tally.note("store_full", str(e))
        stats = store.stats()
        tally.counts["segments_freed"] = stats.counters["segments_freed"]
        tally.counts["evictions"] = sum(stats.evictions.values())
        tally.counts["checkpoints_total"] = stats.counters["checkpoints"]
    return tally.out()


def _read_loop(spec: dict[str, Any]) -> dict[str, Any]:
    rng = random.Random(spec["seed"])
    keys = _keys(spec["keys"])
    tally = _Tally()
    options = spec.get("reader_options", {})
    deadline = time.monotonic() + spec["seconds"]
    target = mmap.mmap(-1, 256 << 10)  # page-aligned: get_into reads straight into it
    while time.monotonic() < deadline:
        try:
            store = KVStore.open(spec["path"], readonly=True, **options)
        except KVStoreError as e:
            tally.note("failed_opens", f"{type(e).__name__}: {e}")
            time.sleep(0.01)
            continue
        tally.counts["opens"] += 1
        with store:
            for _ in range(rng.randint(10, 120)):
                if time.monotonic() >= deadline:
                    break
                _read_some(store, rng, keys, target, tally)
                if rng.random() < 0.1:  # hold the view while the writer moves on
                    time.sleep(rng.random() * 0.05)
            tally.counts["stale_reads"] += store.stats().counters.get("stale_reads", 0)
    return tally.out()


def _read_some(
    store: KVStore, rng: random.Random, keys: list[str], target: mmap.mmap, tally: _Tally
) -> None:
    roll = rng.random()
    try:
        if roll < 0.4:
            batch = rng.sample(keys, rng.randint(2, 12))
            got: list[bytes | None] = list(store.get_many(batch))
        elif roll < 0.7:
            batch = [rng.choice(keys)]
            size = store.get_into(batch[0], target)
            got = [None if size is None else bytes(target[:size])]
        else:
            batch = [rng.choice(keys)]
            got = [store.get(batch[0])]
    except KVStoreError as e:
        tally.note("failed_reads", f"{type(e).__name__}: {e}")
        return
    tally.counts["reads"] += len(batch)
    for key, data in zip(batch, got, strict=True):
        if data is None:
            tally.counts["misses"] += 1
            continue
        tally.counts["hits"] += 1
        wrong = verify_payload(key, data)
        if wrong is not None:
            tally.note("wrong_bytes", wrong)


def _fsck_loop(spec: dict[str, Any]) -> dict[str, Any]:
    rng = random.Random(spec["seed"])
    tally = _Tally()
    deadline = time.monotonic() + spec["seconds"]
    cli_every = spec.get("cli_every", 0)
    runs = 0
    while time.monotonic() < deadline:
        runs += 1
        if cli_every and runs % cli_every == 0:
            _fsck_cli(spec["path"], tally)
            continue
        try:
            with KVStore.open(spec["path"], readonly=True) as store:
                findings = check_store(store, deep=rng.random() < 0.3)
        except KVStoreError as e:
            tally.note("fsck_failed", f"{type(e).__name__}: {e}")
            continue
        tally.counts["fsck_runs"] += 1
        tally.counts["changed_while_checking"] += getattr(findings, "changed_while_checking", 0)
        for finding in findings:
            tally.note("false_findings", f"{finding.kind}: {finding.message}")
    return tally.out()


def _fsck_cli(path: str, tally: _Tally) -> None:
    """``kvstore fsck PATH --json`` in its own process: exit 0 and ``[]`` expected."""
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "fsck", path, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    tally.counts["fsck_cli_runs"] += 1
    try:
        findings = json.loads(result.stdout)
    except ValueError:
        tally.note("fsck_failed", f"exit {result.returncode}, no JSON: {result.stderr[-300:]}")
        return
    for finding in findings:
        tally.note("false_findings", f"cli: {finding['kind']}: {finding['message']}")
    if result.returncode != 0 and not findings:
        tally.note("fsck_failed", f"exit {result.returncode} with no finding")


def _final_check(path: str, key_count: int) -> dict[str, Any]:
    tally = _Tally()
    with KVStore.open(path, readonly=True) as store:
        for finding in check_store(store, deep=True):
            tally.note("final_findings", f"{finding.kind}: {finding.message}")
        keys = _keys(key_count)
        for key, data in zip(keys, store.get_many(keys), strict=True):
            if data is not None and (wrong := verify_payload(key, data)) is not None:
                tally.note("final_wrong_bytes", wrong)
    return tally.out()


def _spawn(role: str, spec: dict[str, Any]) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "kvstore.testing.readers", role],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdin is not None
    process.stdin.write(json.dumps(spec))
    process.stdin.close()
    process.stdin = None  # written and closed: communicate() must not flush it
    return process


def _collect(process: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    assert process.stdout is not None
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if process.returncode != 0 or not lines:
        return {"counts": {"crashed": 1}, "samples": {"crashed": [f"exit {process.returncode}"]}}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def soak(
    root: str | os.PathLike[str],
    *,
    seconds: float = 12.0,
    readers: int = 1,
    fsckers: int = 1,
    keys: int = 160,
    seed: int = 1,
    cli_every: int = 0,
    options: dict[str, Any] | None = None,
) -> SoakResult:
    """One churning writer on a fresh store at ``root``, ``readers`` read loops and
    ``fsckers`` fsck loops beside it for ``seconds``; then a deep fsck and a read
    of every key once the writer has closed. ``cli_every``: every Nth fsck run is
    the ``kvstore fsck --json`` CLI (0: never)."""
    path = str(root)
    writer_spec = {
        "path": path,
        "seconds": seconds + 1.0,  # churn until every reader has stopped
        "keys": keys,
        "seed": seed,
        "options": {**CHURN_OPTIONS, **(options or {})},
    }
    writer = subprocess.Popen(
        [sys.executable, "-m", "kvstore.testing.readers", "churn"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdin is not None and writer.stdout is not None
    writer.stdin.write(json.dumps(writer_spec))
    writer.stdin.close()
    writer.stdin = None
    ready = writer.stdout.readline()
    if not ready.startswith("{"):
        writer.wait()
        raise RuntimeError(f"the churning writer did not start (exit {writer.returncode})")
    started = time.monotonic()
    spec = {"path": path, "seconds": seconds, "keys": keys}
    children = [_spawn("reader", {**spec, "seed": seed * 1000 + index}) for index in range(readers)]
    children += [
        _spawn("fsck", {**spec, "seed": seed * 2000 + index, "cli_every": cli_every})
        for index in range(fsckers)
    ]
    outs = [_collect(child, seconds + 300) for child in children]
    writer_out = _collect(writer, seconds + 300)
    elapsed = time.monotonic() - started
    final = _final_check(path, keys)
    result = SoakResult(seconds=round(elapsed, 1))
    samples: dict[str, list[str]] = {}
    totals: Counter[str] = Counter()
    for out in [*outs, writer_out, final]:
        totals.update(out["counts"])
        for kind, messages in out["samples"].items():
            samples.setdefault(kind, []).extend(
                messages[: _MAX_SAMPLES - len(samples.get(kind, []))]
            )
    result.writer_ops = {
        name: writer_out["counts"].get(name, 0)
        for name in (
            "puts",
            "deletes",
            "flushes",
            "gc",
            "checkpoints",
            "checkpoints_total",
            "segments_freed",
            "evictions",
            "store_full",
        )
    }
    for name in (
        "opens",
        "failed_opens",
        "reads",
        "hits",
        "misses",
        "stale_reads",
        "failed_reads",
        "wrong_bytes",
        "fsck_runs",
        "fsck_cli_runs",
        "fsck_failed",
        "false_findings",
        "changed_while_checking",
        "final_findings",
        "final_wrong_bytes",
    ):
        setattr(result, name, totals.get(name, 0))
    result.fsck_failed += totals.get("crashed", 0)  # a child that died counts against ok
    result.samples = samples
    return result


def _main(role: str) -> None:
    if role == "serve":
        _serve(json.loads(sys.stdin.readline()), sys.stdin)
        return
    spec = json.load(sys.stdin)
    runner = {"churn": _churn, "reader": _read_loop, "fsck": _fsck_loop}[role]
    print(json.dumps(runner(spec)), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1])
