"""The Nth-I/O error loop (SQLite style) over the store's operations.

For each operation (``put``, ``put_pipelined`` (``put_many_async`` from aligned memory,
``sync=True``), ``flush``, ``checkpoint``, ``gc``, ``close``,
``open`` = crash recovery on open, ``recover`` = ``kvstore recover``), each
errno (EIO, ENOSPC) and each mode (a single failure, or every call from the
Nth on), fail the Nth I/O for N = 1, 2, ... until the operation completes
without reaching N. Every time:

- the operation either succeeds or raises a ``KVStoreError`` subclass;
- after a ``WriterFailedError`` the writer stays stopped (a put raises it);
- after the failure is lifted, reopening (and for ``recover`` rerunning it)
  shows every acknowledged page with its bytes, every unacknowledged one
  whole or absent, and ``check(deep=True)`` finds nothing.
"""

from __future__ import annotations

import errno as errno_module
import mmap
import os
import random
import shutil
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import KVStoreError, WriterFailedError
from kvstore.store import KVStore
from kvstore.testing.faults import FaultInjector, copy_store
from kvstore.testing.powerloss import RECORD_OPTIONS

__all__ = ["ERRNOS", "OPERATIONS", "LoopResult", "raised_at", "run_loop"]

OPERATIONS = ("put", "put_pipelined", "flush", "checkpoint", "gc", "close", "open", "recover")
ERRNOS = {"EIO": errno_module.EIO, "ENOSPC": errno_module.ENOSPC}

_OPTIONS: dict[str, Any] = {**RECORD_OPTIONS, "lsn_lease_step": 1 << 20}


@dataclass(slots=True)
class LoopResult:
    """One (operation, errno, mode) loop: how many N were tried and what was seen."""

    operation: str
    error: str
    persistent: bool
    iterations: int = 0
    completed_at: int = 0  # the N at which the operation no longer reached the fault
    raised: dict[str, int] = field(default_factory=dict)  # exception class -> count
    swallowed: int = 0  # the fault fired but the operation returned normally
    swallowed_calls: dict[str, int] = field(default_factory=dict)  # "call path" -> count
    violations: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Template:
    path: Path
    acked: dict[bytes, bytes | None]  # None: acknowledged delete
    crashed: bool  # copied while open: reopening replays the WAL


def _value(rng: random.Random, size: int) -> bytes:
    return rng.randbytes(size)


def _aligned(value: bytes) -> memoryview:
    """``value`` in 4 KiB-aligned memory: the store writes it without a copy."""
    region = mmap.mmap(-1, len(value) + (-len(value) % 4096))
    region[: len(value)] = value
    return memoryview(region)[: len(value)]


def _build_template(work: Path, operation: str, seed: int) -> _Template:
    """A store in the state the operation starts from; everything in it acknowledged."""
    rng = random.Random(seed)
    path = work / f"template-{operation}"
    acked: dict[bytes, bytes | None] = {}
    store = KVStore.open(path, create=True, **_OPTIONS)
    crashed = operation in ("open", "recover")
    try:
        # ~0.9 MiB in segment 1: the next puts roll to a new segment.
        for index in range(12):
            key, value = f"base{index:02d}".encode(), _value(rng, 70_000)
            store.put(key, value)
            acked[key] = value
        store.retain(b"base01")
        store.delete(b"base02")
        acked[b"base02"] = None
        store.flush()
        if operation == "gc":  # sealed segments mostly dead: GC compacts and frees
            for index in range(12, 40):
                key, value = f"base{index:02d}".encode(), _value(rng, 70_000)
                store.put(key, value)
                acked[key] = value
            for index in range(12, 38):
                store.delete(f"base{index:02d}".encode())
                acked[f"base{index:02d}".encode()] = None
            store.flush()
        if crashed:
            store.checkpoint()
            for index in range(40, 46):  # only in the WAL: replayed on open
                key, value = f"base{index:02d}".encode(), _value(rng, 20_000)
                store.put(key, value)
                acked[key] = value
            store.delete(b"base03")
            acked[b"base03"] = None
            store.flush()
            copy_store(path, work / f"template-{operation}-crashed")
    finally:
        store.close()
    if crashed:
        shutil.rmtree(path)
        path = work / f"template-{operation}-crashed"
        (path / "LOCK").unlink(missing_ok=True)
    return _Template(path, acked, crashed)


def _run_operation(
    operation: str, target: Path, injector: FaultInjector, rng: random.Random
) -> tuple[KVStore | None, dict[bytes, bytes], BaseException | None, bool]:
    """Run ``operation`` with the injector armed.

    Returns (the open store or None, unacknowledged puts the op made, the
    exception it raised, whether the op acknowledges its puts on success).
    """
    pending: dict[bytes, bytes] = {}
    store: KVStore | None = None
    if operation in ("open", "recover"):
        injector.armed = True
        try:
            if operation == "open":
                store = KVStore.open(target, **_OPTIONS)
            else:
                from kvstore.recover import recover_store

                recover_store(target)
        except BaseException as e:
            injector.armed = False
            if operation == "recover":  # the operator reruns an interrupted recover
                from kvstore.recover import recover_store

                try:
                    recover_store(target)
                except KVStoreError:
                    pass  # _check_reopened reruns it once more before giving up
            return store, pending, e, False
        finally:
            injector.armed = False
        return store, pending, None, True
    injector.armed = False
    store = KVStore.open(target, **_OPTIONS)
    acknowledges = operation in ("flush", "checkpoint", "close", "put_pipelined")
    if operation in ("flush", "checkpoint", "close"):
        for index in range(3):
            key, value = f"new{index}".encode(), _value(rng, 70_000 + index)
            store.put(key, value)
            pending[key] = value
    injector.count = 0
    injector.armed = True
    try:
        if operation == "put":
            for index in range(3):
                key, value = f"new{index}".encode(), _value(rng, 100_000)
                pending[key] = value  # whole or absent, whether or not the put returned
                store.put(key, value)
        elif operation == "put_pipelined":
            # Pages in aligned memory (zero copy), on a pipeline thread, durable when done.
            futures = []
            for index in range(3):
                key, value = f"new{index}".encode(), _value(rng, 100_000 + 4096 * index)
                pending[key] = value
                futures.append(store.put_many_async([(key, _aligned(value))], sync=True))
            for future in futures:
                future.result()
        elif operation == "flush":
            store.flush()
        elif operation == "checkpoint":
            store.checkpoint()
        elif operation == "gc":
            store.gc()
        elif operation == "close":
            store.close()
    except BaseException as e:
        return store, pending, e, False
    finally:
        injector.armed = False
    return store, pending, None, acknowledges


def raised_at(error: BaseException) -> str:
    """``module:function`` of the innermost kvstore frame (outside kvstore/testing)."""
    where = "?"
    for frame in traceback.extract_tb(error.__traceback__):
        name = frame.filename.replace(os.sep, "/")
        if "/kvstore/" in name and "/kvstore/testing/" not in name:
            where = f"{name.rsplit('/', 1)[-1]}:{frame.name}"
    return where


def _check_reopened(
    target: Path,
    acked: dict[bytes, bytes | None],
    pending: dict[bytes, bytes],
    operation: str,
) -> list[str]:
    problems: list[str] = []
    try:
        store = KVStore.open(target, **_OPTIONS)
    except KVStoreError as e:
        if operation != "recover":
            return [f"reopen failed: {type(e).__name__}: {e}"]
        # An interrupted `kvstore recover` is rerun, then the store opens.
        try:
            from kvstore.recover import recover_store

            recover_store(target)
            store = KVStore.open(target, **_OPTIONS)
        except KVStoreError as again:
            return [f"rerun of recover, then open, failed: {type(again).__name__}: {again}"]
    try:
        for key, value in acked.items():
            got = store.get(key)
            if value is None and got is not None and key not in pending:
                problems.append(f"resurrected delete {key!r}")
            elif value is not None and got != value:
                problems.append(f"{'lost' if got is None else 'wrong bytes'} {key!r}")
        for key, value in pending.items():
            got = store.get(key)
            if got is not None and got != value:
                problems.append(f"unacknowledged {key!r} is not whole")
        if (
            operation not in ("recover",)
            and b"base01" in acked
            and not store.is_retained(b"base01")
        ):
            problems.append("lost retain of base01")
        problems += [f"fsck {f.kind}: {f.message}" for f in store.check(deep=True)]
    finally:
        store.close()
    return problems


def _one(
    template: _Template,
    operation: str,
    fail_at: int,
    error: int,
    persistent: bool,
    work: Path,
    result: LoopResult,
) -> bool:
    """One N; True when the operation no longer reached the fault (loop ends)."""
    target = work / f"case-{operation}-{fail_at}"
    if target.exists():
        shutil.rmtree(target)
    copy_store(template.path, target)
    rng = random.Random(fail_at)
    injector = FaultInjector(target, fail_at, error, persistent=persistent)
    injector.armed = False
    acked = dict(template.acked)
    try:
        with injector.installed():
            store, pending, raised, acknowledges = _run_operation(operation, target, injector, rng)
            fired = bool(injector.failed)
            if raised is not None:
                name = type(raised).__name__
                result.raised[name] = result.raised.get(name, 0) + 1
                if not isinstance(raised, KVStoreError):
                    result.violations.append(
                        f"N={fail_at}: unclear error {name} from {raised_at(raised)}: {raised}"
                    )
            elif fired:
                result.swallowed += 1
                for call, rel in injector.failed[:1]:
                    where = f"{call} {rel.split('/')[0]}"
                    result.swallowed_calls[where] = result.swallowed_calls.get(where, 0) + 1
            inside = store.internals if store is not None else None
            if inside is not None and inside.closed and inside.writer_lock_held:
                result.violations.append(f"N={fail_at}: close left the writer lock held")
                inside.abandon()
            if (
                isinstance(raised, WriterFailedError)
                and store is not None
                and not store.internals.closed
            ):
                try:
                    store.put(b"after-failure", b"x", sync=True)
                    result.violations.append(f"N={fail_at}: writer kept writing after {raised}")
                except WriterFailedError:
                    pass
                except KVStoreError as e:
                    result.violations.append(
                        f"N={fail_at}: after WriterFailedError, put raised {e!r}"
                    )
            if store is not None:
                injector.armed = persistent and fired  # a persistent fault outlives the op
                try:
                    store.close()
                except KVStoreError:
                    pass
                except BaseException as e:
                    result.violations.append(
                        f"N={fail_at}: close raised {type(e).__name__} from {raised_at(e)}: {e}"
                    )
                    # Let the loop go on: finish releasing what close left held.
                    injector.armed = False
                    store.internals.abandon()
                injector.armed = False
        if raised is None and acknowledges:
            acked.update(pending)
            pending = {}
        problems = _check_reopened(target, acked, pending, operation)
        result.violations += [f"N={fail_at}: {p}" for p in problems]
        return not fired
    finally:
        shutil.rmtree(target, ignore_errors=True)


def run_loop(
    work: Path,
    operation: str,
    error: str = "EIO",
    *,
    persistent: bool = False,
    seed: int = 1,
    max_n: int = 10_000,
    stride: int = 1,
    on_iteration: Callable[[int, LoopResult], None] | None = None,
) -> LoopResult:
    """Run the loop for one (operation, errno, mode); ``stride`` > 1 samples N."""
    if operation not in OPERATIONS:
        raise ValueError(f"operation must be one of {OPERATIONS}")
    work.mkdir(parents=True, exist_ok=True)
    template = _build_template(work, operation, seed)
    result = LoopResult(operation, error, persistent)
    try:
        fail_at = 1
        while fail_at <= max_n:
            result.iterations += 1
            done = _one(template, operation, fail_at, ERRNOS[error], persistent, work, result)
            if on_iteration is not None:
                on_iteration(fail_at, result)
            if done:
                result.completed_at = fail_at
                break
            fail_at += stride
    finally:
        shutil.rmtree(template.path, ignore_errors=True)
    return result
