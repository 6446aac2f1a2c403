"""The GPUDirect Storage backend (loads only): NVMe -> HBM through kvikio/cuFile.

Per batch, inside ``KVStore.held_extents(keys)``:

1. The store looks each page up, holds its segment (GC neither frees nor reuses
   the file until the block ends, so a page overwritten meanwhile still reads as
   its old, whole bytes) and checks the record's header against the index entry;
   it hands out the payload's extent (path, offset, length, checksum, meta).
2. ``CuFile.pread`` reads ``length`` bytes at the extent's offset (4 KiB
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

import time
from typing import Any

import torch

from kvstore.errors import CorruptionError
from kvstore.gpu._pages import Page, PageStore, PipelineCounters
from kvstore.gpu._tensors import META_DEVICE_CHECKSUM, byte_view, cuda_event, device_checksum
from kvstore.gpu.errors import (
    GDSUnavailableError,
    PageMissingError,
    TransferError,
    TransferTimeoutError,
)
from kvstore.gpu.transfer import Transfer
from kvstore.types import HeldExtent

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

    def load(self, pages: list[Page], transfer: Transfer, caller_event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(caller_event)
        torch.cuda.current_stream(self.device).synchronize()  # cuFile writes outside streams
        keys = [page.key for page in pages]
        with self.store.held_extents(keys) as held:
            extents: list[HeldExtent] = []
            for page, extent in zip(pages, held, strict=True):
                if extent is None:
                    raise PageMissingError(f"page {page.key!r} is not in the store")
                if extent.length != page.nbytes:
                    raise TransferError(f"page {page.key!r} changed before the load")
                extents.append(extent)
            self._read_all(pages, extents)
        self._verify_all(pages, extents)
        done = cuda_event()
        done.record(torch.cuda.current_stream(self.device))
        transfer._set_issued(done)

    def _read_all(self, pages: list[Page], extents: list[HeldExtent]) -> None:
        files: dict[int, Any] = {}
        futures: list[tuple[Page, Any]] = []
        try:
            for page, extent in zip(pages, extents, strict=True):
                if extent.segment_id not in files:
                    try:
                        files[extent.segment_id] = self.kvikio.CuFile(extent.path, "r")
                    except Exception as e:
                        raise GDSUnavailableError(
                            f"cuFile could not open {extent.path}: {e}"
                        ) from e
                try:
                    future = files[extent.segment_id].pread(
                        byte_view(page.tensor), page.nbytes, extent.offset
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

    def _verify_all(self, pages: list[Page], extents: list[HeldExtent]) -> None:
        for page, extent in zip(pages, extents, strict=True):
            expected = extent.meta.get(META_DEVICE_CHECKSUM)
            data = byte_view(page.tensor)
            if isinstance(expected, str):
                ok = device_checksum(data) == expected
            else:
                ok = extent.matches(data.cpu().numpy().tobytes())
            if not ok:
                raise CorruptionError(
                    f"page {page.key!r} at {extent.path}:{extent.offset}: "
                    "checksum mismatch after the GDS read (the destination holds bad bytes)"
                )
            with self.counters.lock:
                self.counters.pages_loaded += 1
                self.counters.bytes_loaded += page.nbytes
