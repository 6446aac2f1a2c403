"""The staged backend: NVMe -> host staging ring -> device, and back.

Load, per page ``i``, on the transfer's pipeline thread::

    acquire a staging slot (waits for the slot's previous copy event)
    submit  store.get_into(key, slot)  to the reader pool   # O_DIRECT read + xxh3
    when ``slots`` pages are outstanding, finish the oldest:
        wait for its read, copy slot -> destination with copy_(non_blocking=True)
        on the copy stream, record the slot's event, give the slot back

so while page ``i`` is copied, the reads of pages ``i+1 .. i+slots-1`` run
(up to ``read_threads`` at once). Save is the reverse: copy device -> slot on
the copy stream and record an event; a writer thread waits for that event and
only then issues ``put_many`` for the slot's bytes.

Invariants:
- The ring is allocated, and on CUDA pinned (``cudaHostAlloc``), once, at the
  first transfer; nothing is pinned or registered on the hot path.
- A slot is handed to a reader or a copy only after the event of its previous
  copy completed, so a read never overwrites bytes a copy is still reading.
- Checksums: ``get_into`` verifies the record header and the payload's xxh3-64
  before a single byte reaches the slot, so the staged bytes are verified ones.
- On CPU (no CUDA) the same pipeline runs with unpinned slots and synchronous
  copies; that is what CI tests.

CUDA code paths here (streams, events, pinned memory) are written against the
torch API but have not yet been run on a GPU; ``tools/gpu_check.py`` checks them.
"""

from __future__ import annotations

import queue
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvstore.gpu._pages import Page, PageStore, PipelineCounters
from kvstore.gpu._tensors import (
    META_DEVICE_CHECKSUM,
    byte_view,
    cuda_event,
    cuda_stream,
    device_checksum_tensor,
    finish_device_checksum,
)
from kvstore.gpu.errors import PageMissingError, TransferError
from kvstore.gpu.transfer import Transfer

__all__ = ["StagedBackend", "StagingRing"]


_PAGE = 4096


def _aligned_empty(nbytes: int, pin: bool) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` starting on a 4 KiB boundary."""
    backing = torch.empty(nbytes + _PAGE, dtype=torch.uint8, pin_memory=pin)
    start = -backing.data_ptr() % _PAGE
    return backing[start : start + nbytes]


class StagingRing:
    """A fixed ring of ``slots`` host buffers of ``slot_bytes`` each, pinned when ``pin``."""

    def __init__(self, slots: int, slot_bytes: int, *, pin: bool) -> None:
        if slots < 2:
            raise ValueError("staging_slots must be at least 2 (double buffering)")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.pinned = pin
        # Page-aligned slots: the store then reads pages straight into them (its
        # zero-copy get_into) whether or not they are pinned.
        self.buffers = [_aligned_empty(slot_bytes, pin) for _ in range(slots)]
        # numpy views share the memory: the store reads and writes through the buffer protocol.
        self.arrays = [buffer.numpy() for buffer in self.buffers]
        # A pinned int64 per slot receives the device checksum of a save.
        self.checksums = [torch.zeros((), dtype=torch.int64, pin_memory=pin) for _ in range(slots)]
        self._events: list[Any] = [None] * slots
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(slots):
            self._free.put(slot)

    def acquire(self) -> int:
        """A free slot whose previous copy has completed."""
        slot = self._free.get()
        event = self._events[slot]
        if event is not None:
            event.synchronize()
            self._events[slot] = None
        return slot

    def release(self, slot: int, event: Any = None) -> None:
        """Give ``slot`` back; ``event`` (CUDA) completes when the slot may be reused."""
        self._events[slot] = event
        self._free.put(slot)


class StagedBackend:
    """Pinned staging on CUDA, plain host buffers on CPU; one per ``TensorIO``.

    Transfers are run one at a time by the ``TensorIO``'s pipeline thread.
    """

    def __init__(
        self,
        store: PageStore,
        device: torch.device,
        *,
        slots: int,
        slot_bytes: int,
        read_threads: int,
        write_threads: int,
        counters: PipelineCounters,
    ) -> None:
        if read_threads < 1 or write_threads < 1:
            raise ValueError("read_threads and write_threads must be at least 1")
        self.store = store
        self.device = device
        self.cuda = device.type == "cuda"
        self.name = "pinned" if self.cuda else "cpu"
        self.counters = counters
        self._slots = slots
        self._slot_bytes = slot_bytes
        self._ring: StagingRing | None = None
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="kvstore-gpu-read")
        self._writers = ThreadPoolExecutor(write_threads, thread_name_prefix="kvstore-gpu-write")
        self._stream: Any = cuda_stream(device) if self.cuda else None

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    def ring(self) -> StagingRing:
        """The staging ring, allocated (and pinned) at the first transfer only."""
        if self._ring is None:
            self._ring = StagingRing(self._slots, self._slot_bytes, pin=self.cuda)
        return self._ring

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)

    # -- load ----------------------------------------------------------------

    def _read(self, page: Page, ring: StagingRing, slot: int) -> None:
        self.counters.read_started()
        try:
            got = self.store.get_into(page.key, ring.arrays[slot])
        finally:
            self.counters.read_finished()
        if got is None:
            raise PageMissingError(f"page {page.key!r} is not in the store")
        if got != page.nbytes:
            raise TransferError(
                f"page {page.key!r} changed during the load: {got} bytes, expected {page.nbytes}"
            )

    def _copy_in(self, page: Page, ring: StagingRing, slot: int) -> Any:
        """Issue the slot -> destination copy; the event that completes with it (CUDA)."""
        self.counters.sample_during_copy()
        destination = byte_view(page.tensor)
        source = ring.buffers[slot][: page.nbytes]
        event = None
        if self.cuda:
            with torch.cuda.stream(self._stream):
                destination.copy_(source, non_blocking=True)
                event = cuda_event()
                event.record(self._stream)
        else:
            destination.copy_(source)
        self.counters.sample_during_copy()
        with self.counters.lock:
            self.counters.copies += 1
            self.counters.pages_loaded += 1
            self.counters.bytes_loaded += page.nbytes
        return event

    def load(self, pages: list[Page], transfer: Transfer, caller_event: Any) -> None:
        """Run a load on the pipeline thread (see the module docstring)."""
        ring = self.ring()
        if self.cuda:
            # The copies must not start before the caller's prior work on the destinations.
            self._stream.wait_event(caller_event)
            for page in pages:
                page.tensor.record_stream(self._stream)
        pending: deque[tuple[Page, int, Future[None]]] = deque()
        last_event: Any = None
        try:
            for page in pages:
                if len(pending) == ring.slots:
                    last_event = self._finish_read(pending.popleft(), ring)
                slot = ring.acquire()
                try:
                    future = self._readers.submit(self._read, page, ring, slot)
                except BaseException:
                    ring.release(slot)
                    raise
                pending.append((page, slot, future))
            while pending:
                last_event = self._finish_read(pending.popleft(), ring)
        finally:
            # On failure: let every submitted read end before its slot is reused.
            for _, slot, future in pending:
                future.exception()
                ring.release(slot)
        if self.cuda:
            done = cuda_event()
            done.record(self._stream)
            transfer._set_issued(done)
            done.synchronize()
        elif last_event is not None:  # pragma: no cover - CPU copies have no events
            last_event.synchronize()

    def _finish_read(self, item: tuple[Page, int, Future[None]], ring: StagingRing) -> Any:
        page, slot, future = item
        event = None
        try:
            future.result()
            event = self._copy_in(page, ring, slot)
        finally:
            ring.release(slot, event)
        return event

    # -- save ----------------------------------------------------------------

    def _write(
        self, page: Page, ring: StagingRing, slot: int, event: Any, with_checksum: bool
    ) -> None:
        try:
            if event is not None:
                event.synchronize()  # the device -> slot copy has landed
            meta = dict(page.meta)
            if with_checksum:
                partial = int(ring.checksums[slot].item())
                meta[META_DEVICE_CHECKSUM] = finish_device_checksum(partial, page.nbytes)
            self.store.put_many([(page.key, ring.arrays[slot][: page.nbytes], meta)])
        finally:
            ring.release(slot)
        with self.counters.lock:
            self.counters.pages_saved += 1
            self.counters.bytes_saved += page.nbytes

    def _copy_out(self, page: Page, ring: StagingRing, slot: int, with_checksum: bool) -> Any:
        source = byte_view(page.tensor)
        staging = ring.buffers[slot][: page.nbytes]
        if not self.cuda:
            staging.copy_(source)
            if with_checksum:
                ring.checksums[slot].copy_(device_checksum_tensor(source))
            return None
        with torch.cuda.stream(self._stream):
            staging.copy_(source, non_blocking=True)
            if with_checksum:
                ring.checksums[slot].copy_(device_checksum_tensor(source), non_blocking=True)
            event = cuda_event()
            event.record(self._stream)
        return event

    def save(
        self,
        pages: list[Page],
        transfer: Transfer,
        caller_event: Any,
        *,
        sync: bool,
        with_checksum: bool,
    ) -> None:
        """Run a save on the pipeline thread: device -> slot, then a write per landed copy."""
        ring = self.ring()
        if self.cuda:
            self._stream.wait_event(caller_event)  # the caller's kernels wrote the sources
            for page in pages:
                page.tensor.record_stream(self._stream)
        writes: deque[Future[None]] = deque()
        try:
            for page in pages:
                # Keep at most ``slots`` writes outstanding, so acquire() cannot wait forever.
                if len(writes) == ring.slots:
                    writes.popleft().result()
                slot = ring.acquire()
                try:
                    event = self._copy_out(page, ring, slot, with_checksum)
                    future = self._writers.submit(
                        self._write, page, ring, slot, event, with_checksum
                    )
                except BaseException:
                    ring.release(slot)
                    raise
                writes.append(future)
            if self.cuda:
                done = cuda_event()
                done.record(self._stream)
                transfer._set_issued(done)
            while writes:
                writes.popleft().result()
        finally:
            for future in writes:
                future.exception()
        if sync:
            self.store.flush()
