"""The write and read paths of kvstore's peers, run on the same directory and pages.

Each peer writes the same pages (same sizes, same payload pool) as kvstore and
then reads a random sample back cold:

- ``file_per_page``: one file per page, ``open / write / close`` (LMCache's local
  disk backend), buffered with no fsync (not durable), and with ``fsync`` per file.
  Reads: ``open / read / close`` one page at a time (serial).
- ``tmp_rename``: HiCache-style ``write tmp; rename``; made durable with an fsync
  of the file before the rename and of the directory after it.
- ``lmdb``: pages as LMDB values (``sync=True``: each commit is durable), 1 page
  and 64 pages per write transaction. Reads: one page at a time.
- ``safetensors``: one ``.safetensors`` file per page (``save_file``, then fsync).
- ``odirect_pool``: one preallocated file, O_DIRECT ``pwritev``/``preadv`` of aligned
  buffers from a thread pool of ``io_depth`` workers, ``fdatasync`` per batch;
  the simplest thing that could keep the device busy from Python.

Writes are "durable" when each batch (or page) is on stable storage before the
next starts. Buffered peers are made cold with ``CacheDropper`` before reading;
``extra["resident_after_drop"]`` is the fraction of probed pages still cached
(0.0 means the reads were really cold).
"""

from __future__ import annotations

import mmap
import os
import queue
import random
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvstore.bench.common import (
    CacheDropper,
    Measurement,
    Reporter,
    payload_pool,
    percentile,
    remove_tree,
    resident_fraction,
)

__all__ = ["PEERS", "PeerConfig", "run_peers"]


@dataclass(frozen=True, slots=True)
class PeerConfig:
    page_bytes: int = 256 << 10
    total_bytes: int = 1 << 30
    batch: int = 64
    io_depth: int = 32
    reads: int = 2000  # cold reads per peer (a random sample of the pages)
    runtime_s: float = 30.0  # cap per phase
    cold_method: str = "fadvise"
    seed: int = 2


class _Phase:
    """Collects one timed phase: per-op latency and elapsed seconds, with a time cap."""

    def __init__(self, runtime_s: float) -> None:
        self.runtime_s = runtime_s
        self.seconds = 0.0
        self.latencies: list[float] = []
        self._start = 0.0

    @contextmanager
    def op(self) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.latencies.append((time.perf_counter() - t0) * 1e6)

    def begin(self) -> None:
        self._start = time.perf_counter()

    def over(self) -> bool:
        return time.perf_counter() - self._start > self.runtime_s

    def end(self) -> None:
        self.seconds = time.perf_counter() - self._start


def _measurement(
    name: str,
    label: str,
    phase: _Phase,
    pages: int,
    config: PeerConfig,
    *,
    durable: bool | None = None,
    cold: str = "",
    notes: str = "",
    **extra: float,
) -> Measurement:
    return Measurement(
        name=name,
        label=label,
        group="peer",
        page_bytes=config.page_bytes,
        ops=pages,
        bytes_moved=pages * config.page_bytes,
        seconds=phase.seconds,
        p50_us=percentile(phase.latencies, 50),
        p99_us=percentile(phase.latencies, 99),
        durable=durable,
        cold=cold,
        extra=extra,
        notes=notes,
    )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes, *, fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _cold_read_files(
    name: str,
    label: str,
    paths: Sequence[Path],
    read: Callable[[Path], object],
    config: PeerConfig,
    reporter: Reporter,
) -> Measurement:
    rng = random.Random(config.seed)
    sample = rng.sample(list(paths), min(config.reads, len(paths)))
    CacheDropper(config.cold_method).drop(paths)
    resident = resident_fraction(sample[:32])
    phase = _Phase(config.runtime_s)
    reporter.start(label, len(sample))
    phase.begin()
    done = 0
    for path in sample:
        with phase.op():
            read(path)
        done += 1
        reporter.advance()
        if phase.over():
            break
    phase.end()
    reporter.finish()
    return _measurement(
        name,
        label,
        phase,
        done,
        config,
        cold=config.cold_method,
        resident_after_drop=resident,
    )


def _read_file(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def file_per_page(root: Path, config: PeerConfig, reporter: Reporter) -> list[Measurement]:
    payloads = payload_pool(config.page_bytes)
    pages = config.total_bytes // config.page_bytes
    found = []
    for fsync in (False, True):
        directory = root / ("files-fsync" if fsync else "files")
        remove_tree(directory)
        directory.mkdir(parents=True)
        phase = _Phase(config.runtime_s)
        paths: list[Path] = []
        label = "file per page, write" + (" + fsync (LMCache-style durable)" if fsync else "")
        reporter.start(label, pages)
        phase.begin()
        for index in range(pages):
            path = directory / f"{index:010d}.bin"
            with phase.op():
                _write_file(path, payloads[index % len(payloads)], fsync=fsync)
            paths.append(path)
            reporter.advance()
            if phase.over():
                break
        phase.end()
        reporter.finish()
        found.append(
            _measurement(
                "peer.file_per_page_fsync" if fsync else "peer.file_per_page_buffered",
                label if fsync else label + " (not durable)",
                phase,
                len(paths),
                config,
                durable=fsync,
                notes="" if fsync else "dirty pages left for writeback; synced untimed after",
            )
        )
        if fsync:
            found.append(
                _cold_read_files(
                    "peer.file_per_page_read_cold",
                    "file per page, open/read/close one at a time, cold",
                    paths,
                    _read_file,
                    config,
                    reporter,
                )
            )
        os.sync()
        remove_tree(directory)
    return found


def _fresh(root: Path, name: str, config: PeerConfig) -> tuple[list[bytes], int, Path]:
    """(payloads, page count, an empty directory ``root/name``) for one peer's run."""
    directory = root / name
    remove_tree(directory)
    directory.mkdir(parents=True)
    return payload_pool(config.page_bytes), config.total_bytes // config.page_bytes, directory


def tmp_rename(root: Path, config: PeerConfig, reporter: Reporter) -> list[Measurement]:
    payloads, pages, directory = _fresh(root, "tmp-rename", config)
    phase = _Phase(config.runtime_s)
    label = "temp file + fsync + rename + dir fsync (HiCache-style, durable)"
    reporter.start(label, pages)
    done = 0
    phase.begin()
    for index in range(pages):
        final = directory / f"{index:010d}.bin"
        temp = directory / f".{index:010d}.tmp"
        with phase.op():
            _write_file(temp, payloads[index % len(payloads)], fsync=True)
            os.rename(temp, final)
            _fsync_dir(directory)
        done += 1
        reporter.advance()
        if phase.over():
            break
    phase.end()
    reporter.finish()
    remove_tree(directory)
    return [_measurement("peer.tmp_rename_fsync", label, phase, done, config, durable=True)]


def lmdb_blobs(root: Path, config: PeerConfig, reporter: Reporter) -> list[Measurement]:
    import lmdb

    payloads = payload_pool(config.page_bytes)
    pages = config.total_bytes // config.page_bytes
    map_bytes = max(64 << 20, 2 * pages * (config.page_bytes + 4096))
    found = []
    for per_txn in (1, config.batch):
        directory = root / f"lmdb-{per_txn}"
        remove_tree(directory)
        env = lmdb.open(
            str(directory), map_size=map_bytes, sync=True, metasync=True, readahead=False
        )
        keys = [b"page/%010d" % i for i in range(pages)]
        phase = _Phase(config.runtime_s)
        label = f"LMDB blobs, {per_txn} page{'s' if per_txn > 1 else ''} per txn (durable)"
        reporter.start(label, pages)
        done = 0
        phase.begin()
        for first in range(0, pages, per_txn):
            chunk = range(first, min(first + per_txn, pages))
            with phase.op(), env.begin(write=True) as txn:
                for index in chunk:
                    txn.put(keys[index], payloads[index % len(payloads)])
            done += len(chunk)
            reporter.advance(len(chunk))
            if phase.over():
                break
        phase.end()
        reporter.finish()
        env.close()
        found.append(
            _measurement(
                f"peer.lmdb_{per_txn}_per_txn",
                label,
                phase,
                done,
                config,
                durable=True,
                notes="latency is per transaction",
            )
        )
        if per_txn == config.batch:
            found.append(_lmdb_cold_reads(directory, keys[:done], config, reporter))
        remove_tree(directory)
    return found


def _lmdb_cold_reads(
    directory: Path, keys: Sequence[bytes], config: PeerConfig, reporter: Reporter
) -> Measurement:
    import lmdb

    data_file = directory / "data.mdb"
    CacheDropper(config.cold_method).drop([data_file])
    resident = resident_fraction([data_file], range(0, 32 * config.page_bytes, config.page_bytes))
    env = lmdb.open(str(directory), readonly=True, lock=False, readahead=False)
    sample = random.Random(config.seed).sample(list(keys), min(config.reads, len(keys)))
    phase = _Phase(config.runtime_s)
    label = "LMDB blobs, get one page at a time, cold"
    reporter.start(label, len(sample))
    done = 0
    try:
        with env.begin() as txn:
            phase.begin()
            for key in sample:
                with phase.op():
                    if txn.get(key) is None:
                        raise RuntimeError(f"LMDB lost {key!r}")
                done += 1
                reporter.advance()
                if phase.over():
                    break
            phase.end()
    finally:
        env.close()
        reporter.finish()
    return _measurement(
        "peer.lmdb_read_cold",
        label,
        phase,
        done,
        config,
        cold=config.cold_method,
        resident_after_drop=resident,
    )


def safetensors_files(root: Path, config: PeerConfig, reporter: Reporter) -> list[Measurement]:
    import numpy as np
    from safetensors.numpy import load_file, save_file

    payloads = [np.frombuffer(p, dtype=np.uint8) for p in payload_pool(config.page_bytes)]
    pages = config.total_bytes // config.page_bytes
    directory = root / "safetensors"
    remove_tree(directory)
    directory.mkdir(parents=True)
    phase = _Phase(config.runtime_s)
    label = "safetensors file per page, save_file + fsync (durable)"
    reporter.start(label, pages)
    paths: list[Path] = []
    phase.begin()
    for index in range(pages):
        path = directory / f"{index:010d}.safetensors"
        with phase.op():
            save_file({"kv": payloads[index % len(payloads)]}, str(path))
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        paths.append(path)
        reporter.advance()
        if phase.over():
            break
    phase.end()
    reporter.finish()
    found = [
        _measurement("peer.safetensors_fsync", label, phase, len(paths), config, durable=True),
        _cold_read_files(
            "peer.safetensors_read_cold",
            "safetensors load_file one page at a time, cold",
            paths,
            lambda path: load_file(str(path))["kv"],
            config,
            reporter,
        ),
    ]
    remove_tree(directory)
    return found


def odirect_pool(root: Path, config: PeerConfig, reporter: Reporter) -> list[Measurement]:
    payloads, pages, directory = _fresh(root, "odirect", config)
    path = directory / "pages.dat"
    buffers: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
    for _ in range(config.io_depth):
        buffers.put(mmap.mmap(-1, config.page_bytes))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o644)
    except OSError:  # tmpfs: no O_DIRECT
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        cold = "page cache (O_DIRECT refused)"
    else:
        cold = "O_DIRECT"
    found = []
    try:
        os.posix_fallocate(fd, 0, pages * config.page_bytes)
        os.fsync(fd)

        def write(index: int) -> None:
            buffer = buffers.get()
            try:
                buffer[:] = payloads[index % len(payloads)]
                if os.pwritev(fd, [buffer], index * config.page_bytes) != config.page_bytes:
                    raise OSError(f"short write at page {index}")
            finally:
                buffers.put(buffer)

        def read(index: int) -> bytes:
            buffer = buffers.get()
            try:
                if os.preadv(fd, [buffer], index * config.page_bytes) != config.page_bytes:
                    raise OSError(f"short read at page {index}")
                return bytes(buffer)
            finally:
                buffers.put(buffer)

        with ThreadPoolExecutor(max_workers=config.io_depth) as pool:
            phase = _Phase(config.runtime_s)
            label = f"O_DIRECT pwritev, {config.io_depth} threads, fdatasync per {config.batch}"
            reporter.start(label, pages)
            done = 0
            phase.begin()
            for first in range(0, pages, config.batch):
                chunk = range(first, min(first + config.batch, pages))
                with phase.op():
                    list(pool.map(write, chunk))
                    os.fdatasync(fd)
                done += len(chunk)
                reporter.advance(len(chunk))
                if phase.over():
                    break
            phase.end()
            reporter.finish()
            found.append(
                _measurement(
                    "peer.odirect_pool_write",
                    label + " (durable)",
                    phase,
                    done,
                    config,
                    durable=True,
                    notes="latency is per batch",
                )
            )
            rng = random.Random(config.seed)
            order = list(range(done))
            rng.shuffle(order)
            phase = _Phase(config.runtime_s)
            label = f"O_DIRECT preadv, {config.io_depth} threads, batches of {config.batch}"
            reporter.start(label, len(order))
            read_pages = 0
            phase.begin()
            for first in range(0, len(order), config.batch):
                read_chunk = order[first : first + config.batch]
                with phase.op():
                    list(pool.map(read, read_chunk))
                read_pages += len(read_chunk)
                reporter.advance(len(read_chunk))
                if phase.over():
                    break
            phase.end()
            reporter.finish()
            found.append(
                _measurement(
                    "peer.odirect_pool_read",
                    label + ", cold",
                    phase,
                    read_pages,
                    config,
                    cold=cold,
                    notes="latency is per batch",
                )
            )
    finally:
        os.close(fd)
        remove_tree(directory)
    return found


PEERS: dict[str, Callable[[Path, PeerConfig, Reporter], list[Measurement]]] = {
    "file_per_page": file_per_page,
    "tmp_rename": tmp_rename,
    "lmdb": lmdb_blobs,
    "safetensors": safetensors_files,
    "odirect_pool": odirect_pool,
}


def run_peers(
    root: Path, config: PeerConfig, reporter: Reporter, only: Sequence[str] = tuple(PEERS)
) -> list[Measurement]:
    found: list[Measurement] = []
    try:
        for name in only:
            found.extend(PEERS[name](root / "peers", config, reporter))
            os.sync()
    finally:
        remove_tree(root / "peers")
    return found
