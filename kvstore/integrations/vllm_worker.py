"""The worker side of kvstore's vLLM ``OffloadingSpec`` (vLLM 0.33): a staging
region in shared memory and a CPU copy worker over it.

The scheduler-side manager (kvstore's tier manager) and vLLM's worker process
share exactly one thing: the ``StagingRegion``, a file in ``/dev/shm`` that both
map. The manager decides which chunk slot holds which offload key and moves
pages between the slots and its NVMe tier; the worker only copies KV blocks
between vLLM's KV caches and the slots the scheduler names in each job.

Byte layout of one chunk (``chunk_bytes``, a multiple of 4096): for every
canonical KV tensor ``t`` in ``CanonicalKVCaches.tensors`` order, a segment of
``blocks_per_chunk`` sub-blocks of ``page_t = tensors[t].page_size_bytes``
bytes each, the segments packed back to back from byte 0, then padding to
``chunk_bytes`` that is never written::

    | t0: sub 0 | t0: sub 1 | ... | t0: sub B-1 | t1: sub 0 | ... | t{T-1}: sub B-1 | pad |

Sub-block ``j`` of chunk ``c`` holds the request's logical GPU block
``c_first * B + j`` (``B = blocks_per_chunk``). Within a sub-block, the first
``ref.page_size_bytes`` bytes (the layer's unpadded page) are copied; the rest
of a padded page is left as it was. For a single worker this is the layout of
vLLM's own ``CPUOffloadingWorker`` over its ``SharedOffloadRegion`` (worker 0,
direct layout), so a chunk is byte-compatible with vLLM's CPU tier.

Invariants:
- A job is validated whole before its first byte moves: a bad spec (wrong type,
  group counts that do not add up, a block or chunk index out of range) moves no
  byte and is reported ``success=False``; a copy never writes outside the chunks
  and GPU blocks its job names.
- ``submit_store`` / ``submit_load`` never raise into vLLM and always accept the
  job; the outcome comes back from ``get_finished`` (vLLM 0.33's
  ``OffloadingConnectorWorker`` asserts ``success``, so a failure there stops
  the engine loudly instead of serving wrong KV).
- A region's mapping is released only when no chunk view is alive (numpy holds
  a buffer export on the ``mmap``), so a stale view can never touch unmapped
  memory.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvstore.errors import ClosedError

__all__ = ["PAGE_ALIGNMENT", "KVStoreCPUWorker", "StagingRegion", "staging_path"]

logger = logging.getLogger(__name__)

#: Chunk sizes are multiples of this (the host page size vLLM aligns its own
#: CPU chunks to), so every chunk starts on a page boundary of the mapping.
PAGE_ALIGNMENT = 4096


def staging_path(engine_id: str) -> Path:
    """The staging file of an engine: ``/dev/shm/kvstore_vllm_{engine_id}.staging``,
    or the same name in ``tempfile.gettempdir()`` where ``/dev/shm`` is absent."""
    if not engine_id or "/" in engine_id or "\0" in engine_id or engine_id in (".", ".."):
        raise ValueError(f"engine_id {engine_id!r} cannot name a file (no '/' or NUL)")
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return Path(directory) / f"kvstore_vllm_{engine_id}.staging"


class StagingRegion:
    """``num_chunks`` chunk slots of ``chunk_bytes`` bytes in a shared file.

    Opening creates the file if needed and grows it (never shrinks it) to
    ``num_chunks * chunk_bytes``, so the manager and the worker may open it in
    either order, in one process or two. ``chunk(i)`` views are thread-safe and
    copy-free. The file outlives ``close()``; whoever owns the engine removes it
    with ``unlink()``.
    """

    def __init__(self, engine_id: str, num_chunks: int, chunk_bytes: int) -> None:
        if chunk_bytes <= 0 or chunk_bytes % PAGE_ALIGNMENT:
            raise ValueError(
                f"chunk_bytes={chunk_bytes} must be a positive multiple of {PAGE_ALIGNMENT}"
            )
        if num_chunks <= 0:
            raise ValueError(f"num_chunks={num_chunks} must be positive")
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes
        self.path = staging_path(engine_id)
        total_bytes = num_chunks * chunk_bytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < total_bytes:
                os.ftruncate(fd, total_bytes)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, total_bytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        # torch.frombuffer takes no buffer export, so mmap.close() would unmap
        # under live views; numpy's export makes close() refuse instead.
        self._base: torch.Tensor | None = torch.from_numpy(
            np.frombuffer(self._mmap, dtype=np.uint8)
        )
        self._lock = threading.Lock()

    def chunk(self, i: int) -> torch.Tensor:
        """A uint8 view of chunk ``i``, shape ``(chunk_bytes,)``, on the mapping itself."""
        if not 0 <= i < self.num_chunks:
            raise IndexError(f"chunk {i} out of range [0, {self.num_chunks})")
        base = self._base_tensor()
        return base[i * self.chunk_bytes : (i + 1) * self.chunk_bytes]

    def _base_tensor(self) -> torch.Tensor:
        """The whole mapping as one flat uint8 tensor (for the copy worker)."""
        with self._lock:
            if self._base is None:
                raise ClosedError(f"staging region {self.path} is closed")
            return self._base

    def close(self) -> None:
        """Drop this object's mapping. Views still alive keep it mapped until
        they are freed; chunk() raises ClosedError from now on."""
        with self._lock:
            if self._base is None:
                return
            self._base = None
            mapping, self._mmap = self._mmap, None
        if mapping is not None:
            # BufferError: views are still alive; the mmap is unmapped when the
            # last one is garbage-collected.
            with contextlib.suppress(BufferError):
                mapping.close()

    def unlink(self) -> None:
        """Remove the file (mappings stay valid). Safe if it is already gone."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __repr__(self) -> str:
        return (
            f"StagingRegion({str(self.path)!r}, num_chunks={self.num_chunks}, "
            f"chunk_bytes={self.chunk_bytes})"
        )


class _BadJobError(Exception):
    """A job's specs cannot be executed; the message says why (never leaves this module)."""


@dataclass(frozen=True, slots=True)
class _Copy:
    """One (group, layer ref) slice of a job: ``num_bytes`` of each listed GPU
    block <-> the same bytes of (chunk, sub-block) slots in tensor ``tensor_idx``'s
    segment."""

    tensor_idx: int
    num_bytes: int
    gpu_blocks: torch.Tensor
    chunks: torch.Tensor
    sub_blocks: torch.Tensor


def _block_rows(tensor: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """A ``(num_blocks, page_bytes)`` uint8 view of a canonical KV tensor whose
    dim 0 is the block and whose block pages are contiguous byte runs."""
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        raise ValueError(f"a canonical KV tensor needs a block dimension, got {tensor.shape}")
    if tensor.dim() > 1 and not tensor[0].is_contiguous():
        raise ValueError("a block's page must be one contiguous byte run")
    element_bytes = tensor.element_size()
    num_blocks = tensor.shape[0]
    block_stride_bytes = tensor.stride(0) * element_bytes
    offset_bytes = tensor.storage_offset() * element_bytes
    storage = tensor.untyped_storage()
    end_bytes = offset_bytes + (num_blocks - 1) * block_stride_bytes + page_bytes
    if page_bytes <= 0 or end_bytes > storage.nbytes():
        raise ValueError(
            f"page_size_bytes={page_bytes} x {num_blocks} blocks (stride "
            f"{block_stride_bytes}) overruns the tensor's {storage.nbytes()} bytes"
        )
    rows = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    rows.set_(storage, offset_bytes, (num_blocks, page_bytes), (block_stride_bytes, 1))
    return rows


class KVStoreCPUWorker(OffloadingWorker):  # type: ignore[misc]
    """Copies KV blocks between vLLM's canonical KV caches and ``StagingRegion``
    chunks, synchronously, on the calling thread (CPU tensors; a CUDA cache works
    too, through blocking copies).

    ``submit_store(job_id, GPULoadStoreSpec, CPULoadStoreSpec)`` copies GPU blocks
    into chunks, ``submit_load(job_id, CPULoadStoreSpec, GPULoadStoreSpec)`` the
    reverse; the CPU spec's ``block_ids`` are chunk indices. As in vLLM's
    ``CPUOffloadingWorker``, the GPU spec's blocks are ordered by KV group,
    ``group_sizes[g]`` of them for group ``g``, and ``block_indices[g]`` is the
    request-logical index of group ``g``'s first block: it starts at sub-block
    ``block_indices[g] % blocks_per_chunk`` of the group's first chunk, and the
    group uses ``ceil((skip + group_sizes[g]) / blocks_per_chunk)`` chunks. Only the
    direct (per-worker) layout is supported, not vLLM's ``canonical_layout``.
    """

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: StagingRegion
    ) -> None:
        if blocks_per_chunk <= 0:
            raise ValueError(f"blocks_per_chunk={blocks_per_chunk} must be positive")
        if not kv_caches.tensors:
            raise ValueError("CanonicalKVCaches has no tensors")
        self._blocks_per_chunk = blocks_per_chunk
        self._region = region
        self._group_refs = [list(refs) for refs in kv_caches.group_data_refs]
        self._gpu_rows = [
            _block_rows(entry.tensor, entry.page_size_bytes) for entry in kv_caches.tensors
        ]
        self._page_bytes = [entry.page_size_bytes for entry in kv_caches.tensors]
        offsets: list[int] = []
        used_bytes = 0
        for page_bytes in self._page_bytes:
            offsets.append(used_bytes)
            used_bytes += page_bytes * blocks_per_chunk
        if used_bytes > region.chunk_bytes:
            raise ValueError(
                f"a chunk of {blocks_per_chunk} blocks needs {used_bytes} bytes, "
                f"the region's chunks have {region.chunk_bytes}"
            )
        for refs in self._group_refs:
            for ref in refs:
                if not 0 <= ref.tensor_idx < len(self._page_bytes):
                    raise ValueError(f"layer ref names tensor {ref.tensor_idx}, out of range")
                if not 0 < ref.page_size_bytes <= self._page_bytes[ref.tensor_idx]:
                    raise ValueError(
                        f"layer page of {ref.page_size_bytes} bytes does not fit tensor "
                        f"{ref.tensor_idx}'s {self._page_bytes[ref.tensor_idx]}-byte page"
                    )
        base = region._base_tensor()
        # Per tensor: its segment of every chunk, as (chunk, sub-block, byte).
        self._chunk_views = [
            torch.as_strided(
                base,
                (region.num_chunks, blocks_per_chunk, page_bytes),
                (region.chunk_bytes, page_bytes, 1),
                offset,
            )
            for page_bytes, offset in zip(self._page_bytes, offsets, strict=True)
        ]
        self._finished: list[TransferResult] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """GPU blocks -> chunks; the result is reported by get_finished()."""
        self._run(job_id, src_spec, dst_spec, to_chunks=True)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Chunks -> GPU blocks. Copies are synchronous, so ``expedited`` changes nothing."""
        self._run(job_id, dst_spec, src_spec, to_chunks=False)
        return True

    def get_finished(self) -> list[TransferResult]:
        """The jobs done since the last call, in submission order."""
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: every job is done when its submit returns."""
        return

    def shutdown(self) -> None:
        """Release this worker's views and close its mapping of the region."""
        with self._lock:
            self._closed = True
            self._chunk_views = []
        self._region.close()

    def _run(self, job_id: int, gpu_spec: object, chunk_spec: object, *, to_chunks: bool) -> None:
        start = time.perf_counter()
        try:
            copies = self._plan(gpu_spec, chunk_spec)
            num_bytes = self._execute(copies, to_chunks=to_chunks)
        except (_BadJobError, RuntimeError, ValueError, IndexError, ClosedError) as e:
            logger.warning(
                "kvstore vLLM worker: %s job %d failed: %s",
                "store" if to_chunks else "load",
                job_id,
                e,
            )
            result = TransferResult(job_id=job_id, success=False)
        else:
            elapsed_s = time.perf_counter() - start
            result = TransferResult(
                job_id=job_id, success=True, transfer_size=num_bytes, transfer_time=elapsed_s
            )
        with self._lock:
            self._finished.append(result)

    def _plan(self, gpu_spec: object, chunk_spec: object) -> list[_Copy]:
        """Check a job whole and resolve it to copies; raises _BadJobError."""
        if not isinstance(gpu_spec, GPULoadStoreSpec):
            raise _BadJobError(f"GPU side is {type(gpu_spec).__name__}, not GPULoadStoreSpec")
        if not isinstance(chunk_spec, BlockIDsLoadStoreSpec) or isinstance(
            chunk_spec, GPULoadStoreSpec
        ):
            raise _BadJobError(f"chunk side is {type(chunk_spec).__name__}, not a CPU spec")
        group_sizes = [int(size) for size in gpu_spec.group_sizes]
        block_indices = [int(index) for index in gpu_spec.block_indices]
        if len(group_sizes) != len(self._group_refs) or len(block_indices) != len(group_sizes):
            raise _BadJobError(
                f"{len(group_sizes)} group sizes / {len(block_indices)} block indices "
                f"for {len(self._group_refs)} KV groups"
            )
        gpu_blocks = np.asarray(gpu_spec.block_ids, dtype=np.int64).reshape(-1)
        chunk_ids = np.asarray(chunk_spec.block_ids, dtype=np.int64).reshape(-1)
        if sum(group_sizes) != len(gpu_blocks):
            raise _BadJobError(f"group sizes add to {sum(group_sizes)}, {len(gpu_blocks)} blocks")
        if len(chunk_ids) and not (
            chunk_ids.min() >= 0 and chunk_ids.max() < self._region.num_chunks
        ):
            raise _BadJobError(f"chunk index out of range [0, {self._region.num_chunks})")
        copies: list[_Copy] = []
        gpu_offset = chunk_offset = 0
        for group, (size, first_index) in enumerate(zip(group_sizes, block_indices, strict=True)):
            if size < 0 or first_index < 0:
                raise _BadJobError(f"group {group}: size {size}, first block {first_index}")
            if size == 0:
                continue
            skip = first_index % self._blocks_per_chunk
            num_chunks = -(-(skip + size) // self._blocks_per_chunk)
            group_chunks = chunk_ids[chunk_offset : chunk_offset + num_chunks]
            if len(group_chunks) != num_chunks:
                raise _BadJobError(
                    f"group {group} needs {num_chunks} chunks, got {len(group_chunks)}"
                )
            group_blocks = gpu_blocks[gpu_offset : gpu_offset + size]
            positions = skip + np.arange(size, dtype=np.int64)
            chunks = torch.from_numpy(group_chunks[positions // self._blocks_per_chunk])
            sub_blocks = torch.from_numpy(positions % self._blocks_per_chunk)
            blocks = torch.from_numpy(group_blocks.copy())
            for ref in self._group_refs[group]:
                num_blocks = self._gpu_rows[ref.tensor_idx].shape[0]
                if group_blocks.min() < 0 or group_blocks.max() >= num_blocks:
                    raise _BadJobError(f"GPU block out of range [0, {num_blocks})")
                copies.append(
                    _Copy(ref.tensor_idx, ref.page_size_bytes, blocks, chunks, sub_blocks)
                )
            gpu_offset += size
            chunk_offset += num_chunks
        if chunk_offset != len(chunk_ids):
            raise _BadJobError(f"{len(chunk_ids)} chunks given, the groups use {chunk_offset}")
        return copies

    def _execute(self, copies: Sequence[_Copy], *, to_chunks: bool) -> int:
        if self._closed:
            raise ClosedError("the kvstore vLLM worker is shut down")
        num_bytes = 0
        for copy in copies:
            width = copy.num_bytes
            chunk_view = self._chunk_views[copy.tensor_idx]
            gpu_rows = self._gpu_rows[copy.tensor_idx]
            if to_chunks:
                rows = gpu_rows[copy.gpu_blocks.to(gpu_rows.device), :width].cpu()
                chunk_view[copy.chunks, copy.sub_blocks, :width] = rows
            else:
                slots = chunk_view[copy.chunks, copy.sub_blocks, :width]
                gpu_rows[copy.gpu_blocks.to(gpu_rows.device), :width] = slots.to(gpu_rows.device)
            num_bytes += width * len(copy.gpu_blocks)
        return num_bytes
