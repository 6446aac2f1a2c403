"""kill -9 while pipelined batches are in flight (docs/design.md, "Pipelined batches").

A child keeps three ``put_many_async(..., sync=True)`` batches in flight and reports
``ack`` for a batch only when its future is done. Its group commits are slowed
(every ``fdatasync`` sleeps first), so most of the time some batches are written
and readable but not yet durable: the window in which an early acknowledgement
would show. The test SIGKILLs the child while batches are in flight, reopens the
store and requires every acknowledged page with its exact bytes (pages of
batches still in flight may be there or not, never torn), then fsck is clean.
Pages are in 4 KiB-aligned memory (written straight from it) or in bytes (copied),
on both I/O engines. The kvstore/testing/crashloop.py soak runs the same calls
under concurrency (``--pipelined``; test_pipelined_threads_crashloop below).
"""

from __future__ import annotations

import hashlib
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore import KVStore
from kvstore.testing import crashloop

_CHILD = r"""
import hashlib, mmap, os, sys, time, collections
from kvstore import KVStore

root, engine, aligned, page = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
real_sync = os.fdatasync

def slow_sync(fd):
    time.sleep(0.01)  # widen the gap between written and durable
    real_sync(fd)

os.fdatasync = slow_sync

def value(key):
    data = hashlib.shake_128(key.encode()).digest(page)
    if not aligned:
        return data
    region = mmap.mmap(-1, page + (-page % 4096))
    region[:page] = data
    return memoryview(region)[:page]

store = KVStore.open(root, create=True, segment_bytes=8 << 20, io_engine=engine,
                     flush_interval_ms=1000.0, pipeline_depth=2)
out = sys.stdout
print("ready", flush=True)
pending = collections.deque()
batch = 0
while True:
    keys = [f"b{batch}/{i}" for i in range(6)]
    print("begin", batch, flush=True)
    pending.append((batch, store.put_many_async([(k, value(k)) for k in keys], sync=True)))
    batch += 1
    while len(pending) >= 3 or (pending and pending[0][1].done()):
        done_batch, future = pending.popleft()
        future.result()
        print("ack", done_batch, flush=True)
"""


def _value(key: str, page: int) -> bytes:
    return hashlib.shake_128(key.encode()).digest(page)


def _run_and_kill(root: Path, engine: str, aligned: bool, page: int, seed: int) -> tuple[set, set]:
    """Run the child until it has acknowledged a few batches and has some in flight,
    then SIGKILL it; (acknowledged batches, batches begun but not acknowledged)."""
    rng = random.Random(seed)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(root), engine, "1" if aligned else "0", str(page)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    acked: set[int] = set()
    begun: set[int] = set()
    wanted_acks = rng.randint(3, 12)
    deadline = time.monotonic() + 60
    buffer = b""
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                word, _, rest = line.decode().partition(" ")
                if word == "begin":
                    begun.add(int(rest))
                elif word == "ack":
                    acked.add(int(rest))
            if len(acked) >= wanted_acks and begun - acked:
                break
        else:
            pytest.fail("the child made no progress")
        if proc.poll() is not None:
            pytest.fail(f"the child died: {proc.stderr.read().decode() if proc.stderr else ''}")
        # Kill while batches are in flight: a random few ms later, so the kill lands
        # in writes, in publishing, or in a group commit.
        time.sleep(rng.uniform(0.0, 0.02))
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    # Lines written before the kill that the loop above did not read yet.
    rest = buffer + (proc.stdout.read() or b"")
    for line in rest.split(b"\n"):
        word, _, tail = line.decode().partition(" ")
        if word == "begin":
            begun.add(int(tail))
        elif word == "ack":
            acked.add(int(tail))
    return acked, begun - acked


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "bytes"])
def test_a_pipelined_batch_is_acknowledged_only_once_durable(
    tmp_path: Path, engine_kind: str, aligned: bool
) -> None:
    page = 64 << 10
    cycles = int(os.environ.get("KVSTORE_PIPELINE_KILLS", "6"))
    in_flight_at_kill = 0
    for cycle in range(cycles):
        root = tmp_path / f"store{cycle}"
        acked, unacked = _run_and_kill(root, engine_kind, aligned, page, seed=cycle)
        assert acked, "no batch was acknowledged before the kill"
        in_flight_at_kill += len(unacked)
        with KVStore.open(root, io_engine=engine_kind) as store:
            for batch in sorted(acked):
                for i in range(6):
                    key = f"b{batch}/{i}"
                    got = store.get(key)
                    assert got is not None, f"acknowledged page {key} lost (cycle {cycle})"
                    assert got == _value(key, page), f"acknowledged page {key} has wrong bytes"
            for batch in unacked:  # in flight at the kill: whole or absent
                for i in range(6):
                    key = f"b{batch}/{i}"
                    got = store.get(key)
                    assert got is None or got == _value(key, page)
            assert store.check(deep=True) == []
    assert in_flight_at_kill >= cycles, "the kills did not land while batches were in flight"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipelined_threads_crashloop(tmp_path: Path, engine_kind: str) -> None:
    """The concurrent kill -9 loop with writer threads that pipeline their batches
    from aligned memory (and thread 0's plain mix beside them)."""
    cycles = int(os.environ.get("KVSTORE_CRASH_THREAD_CYCLES", "8"))
    config = crashloop.LoopConfig(
        dir=tmp_path / "store",
        cycles=cycles,
        seed=int(os.environ.get("KVSTORE_CRASH_SEED", "3030")),
        segment_mib=2,
        min_delay_s=0.05,
        max_delay_s=0.4,
        threads=3,
        pipelined=True,
        aligned=True,
        flush_interval_ms=1.0,
        max_page_kib=256,
        engine=engine_kind,
        stall_s=20.0,
        verify_timeout_s=None,
    )
    summary = crashloop.run_crashloop(config)
    report = crashloop.format_summary(summary)
    assert summary.violations == 0, report
    assert summary.cycles == cycles, report
    assert summary.checked_acked_puts > 0, report
