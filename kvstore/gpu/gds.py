"""The GPUDirect Storage backend (loads only): NVMe -> HBM through kvikio/cuFile.

Per page, with the batch's pages pinned in the store (so GC cannot move or
free them while the device reads them):

1. ``info(key)`` gives the segment and the record's offset. The 4 KiB record
   header is read on the host and checked against the index entry (key,
   segment, offset, generation, LSN, length, payload checksum): the location
   really holds this page.
2. ``CuFile.pread`` reads ``payload_bytes`` from ``offset + 4096`` (4 KiB
   aligned, as O_DIRECT and cuFile want) straight into the destination tensor.
   All pages of a batch are issued before any is awaited; kvikio splits them
   over its thread pool.
3. Verification on the device: the page's ``wsum64`` (written into its meta at
   save, see ``_tensors``) is recomputed on the destination and compared. A
   page saved without one is copied back to the host and checked against its
   xxh3-64 (slow, but never unverified).

Saves are not done through GDS: a page must go through the store's write path
(WAL, group commit), which takes host memory, so saves always use the staged
backend.

Failures are loud: kvikio missing or in POSIX compatibility mode raises
``GDSUnavailableError`` at construction; a cuFile error is wrapped in it; an
I/O that does not complete within ``timeout_s`` raises
``TransferTimeoutError`` rather than hang.

NOT YET RUN ON A GPU: this module is written against kvikio's documented
Python API (``CuFile``, ``IOFuture``, ``kvikio.defaults``) and has never run;
``tools/gpu_check.py`` is the first check.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from kvstore.errors import CorruptionError
from kvstore.format.checksum import checksum
from kvstore.format.constants import BLOCK_BYTES
from kvstore.format.names import segment_path
from kvstore.format.records import decode_record_header, record_mismatches
from kvstore.gpu._pages import Page, PageStore, PipelineCounters
from kvstore.gpu._tensors import META_DEVICE_CHECKSUM, byte_view, cuda_event, device_checksum
from kvstore.gpu.errors import (
    GDSUnavailableError,
    PageMissingError,
    TransferError,
    TransferTimeoutError,
)
from kvstore.gpu.transfer import Transfer
from kvstore.types import PageInfo

__all__ = ["GDSBackend", "import_kvikio"]

# Pages of 256 KiB - 1 MiB must take the GDS path: kvikio sends reads below
# gds_threshold through POSIX, and splits reads above task_size over threads.
GDS_THRESHOLD_BYTES = 64 << 10
GDS_TASK_BYTES = 1 << 20


def import_kvikio() -> Any:
    """kvikio, or ``GDSUnavailableError`` naming the reason it cannot do GDS."""
    try:
        import kvikio
        import kvikio.defaults
    except ImportError as e:
        raise GDSUnavailableError(
            f"kvikio is not installed ({e}); install the extra: pip install 'kvstore[gds]'"
        ) from e
    if _compat_mode(kvikio):
        raise GDSUnavailableError(
            "kvikio runs in POSIX compatibility mode (no libcufile, /run/udev not "
            "readable, or KVIKIO_COMPAT_MODE=ON): reads would not be GPUDirect"
        )
    return kvikio


def _compat_mode(kvikio: Any) -> bool:
    defaults = kvikio.defaults
    try:
        mode = defaults.get("compat_mode")  # kvikio >= 25.04
    except (AttributeError, TypeError, KeyError):
        mode = defaults.compat_mode()
    # A bool in older releases, a CompatMode enum (ON/OFF/AUTO) in newer ones.
    if isinstance(mode, bool):
        return mode
    return str(getattr(mode, "name", mode)).upper() in ("ON", "TRUE", "1")


def _configure(kvikio: Any, threads: int) -> None:
    settings = {
        "num_threads": threads,
        "task_size": GDS_TASK_BYTES,
        "gds_threshold": GDS_THRESHOLD_BYTES,
    }
    defaults = kvikio.defaults
    if hasattr(defaults, "set"):
        defaults.set(settings)
        return
    defaults.num_threads_reset(threads)  # releases before 25.04
    defaults.task_size_reset(GDS_TASK_BYTES)
    defaults.gds_threshold_reset(GDS_THRESHOLD_BYTES)


class GDSBackend:
    """Loads through cuFile into CUDA tensors; one per ``TensorIO``."""

    name = "gds"

    def __init__(
        self,
        store: PageStore,
        device: torch.device,
        *,
        threads: int,
        timeout_s: float,
        counters: PipelineCounters,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"the gds backend needs a CUDA device, not {device}")
        self.kvikio = import_kvikio()
        try:
            _configure(self.kvikio, threads)
        except Exception as e:
            raise GDSUnavailableError(f"could not configure kvikio: {e}") from e
        self.store = store
        self.device = device
        self.timeout_s = timeout_s
        self.counters = counters

    def close(self) -> None:
        pass

    def _check_header(self, fd: int, page: Page, info: PageInfo) -> None:
        block = os.pread(fd, BLOCK_BYTES, info.offset)
        where = f"page {page.key!r} in segment {info.segment_id} at offset {info.offset}"
        try:
            header = decode_record_header(block, max_page_bytes=self.store.config.max_page_bytes)
        except Exception as e:
            raise TransferError(f"{where}: {e}") from e
        mismatched = record_mismatches(
            header,
            page.key,
            segment_id=info.segment_id,
            offset=info.offset,
            generation=info.generation,
            lsn=info.lsn,
            payload_bytes=info.payload_bytes,
            payload_checksum=info.checksum,
            meta=None,  # PageInfo holds the decoded meta; the checksum covers the rest
        )
        if mismatched:
            raise TransferError(
                f"{where}: the record there is not this page ({', '.join(mismatched)})"
            )

    def load(self, pages: list[Page], transfer: Transfer, caller_event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(caller_event)
        torch.cuda.current_stream(self.device).synchronize()  # cuFile writes outside streams
        keys = [page.key for page in pages]
        with self.store.pinned(keys) as present:
            for page, ok in zip(pages, present, strict=True):
                if not ok:
                    raise PageMissingError(f"page {page.key!r} is not in the store")
            infos: list[PageInfo] = []
            for page in pages:
                info = self.store.info(page.key)
                if info is None:
                    raise PageMissingError(f"page {page.key!r} is not in the store")
                if info.payload_bytes != page.nbytes:
                    raise TransferError(f"page {page.key!r} changed before the load")
                infos.append(info)
            self._read_all(pages, infos)
        self._verify_all(pages, infos)
        done = cuda_event()
        done.record(torch.cuda.current_stream(self.device))
        transfer._set_issued(done)

    def _read_all(self, pages: list[Page], infos: list[PageInfo]) -> None:
        files: dict[int, Any] = {}
        host_fds: dict[int, int] = {}
        futures: list[tuple[Page, Any]] = []
        try:
            for page, info in zip(pages, infos, strict=True):
                path = segment_path(self.store.root, info.segment_id)
                if info.segment_id not in files:
                    host_fds[info.segment_id] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        files[info.segment_id] = self.kvikio.CuFile(path, "r")
                    except Exception as e:
                        raise GDSUnavailableError(f"cuFile could not open {path}: {e}") from e
                self._check_header(host_fds[info.segment_id], page, info)
                try:
                    future = files[info.segment_id].pread(
                        byte_view(page.tensor), page.nbytes, info.offset + BLOCK_BYTES
                    )
                except Exception as e:
                    raise GDSUnavailableError(f"cuFile read of {page.key!r} failed: {e}") from e
                futures.append((page, future))
            deadline = time.monotonic() + self.timeout_s
            for page, future in futures:
                while not future.done():
                    if time.monotonic() > deadline:
                        raise TransferTimeoutError(
                            f"GDS read of {page.key!r} not done after {self.timeout_s} s"
                        )
                    time.sleep(50e-6)
                try:
                    got = future.get()
                except Exception as e:
                    raise GDSUnavailableError(f"cuFile read of {page.key!r} failed: {e}") from e
                if got != page.nbytes:
                    raise TransferError(
                        f"GDS read of {page.key!r}: {got} of {page.nbytes} bytes (short read)"
                    )
        finally:
            # A timed-out read may still write into its destination: the error says so.
            for handle in files.values():
                handle.close()
            for fd in host_fds.values():
                os.close(fd)

    def _verify_all(self, pages: list[Page], infos: list[PageInfo]) -> None:
        for page, info in zip(pages, infos, strict=True):
            expected = info.meta.get(META_DEVICE_CHECKSUM)
            data = byte_view(page.tensor)
            if isinstance(expected, str):
                ok = device_checksum(data) == expected
            else:
                ok = checksum(data.cpu().numpy().tobytes()) == info.checksum
            if not ok:
                raise CorruptionError(
                    f"page {page.key!r} in segment {info.segment_id} at offset {info.offset}: "
                    "checksum mismatch after the GDS read (the destination holds bad bytes)"
                )
            with self.counters.lock:
                self.counters.pages_loaded += 1
                self.counters.bytes_loaded += page.nbytes
