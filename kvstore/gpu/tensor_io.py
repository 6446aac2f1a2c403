"""``TensorIO``: save torch tensors as store pages and load pages into tensors.

Owns a pipeline thread (transfers run one at a time, in call order), the
staged backend (pinned host ring on CUDA, plain host buffers on CPU) and, on
CUDA with kvikio, the GDS backend. Calls validate everything on the caller's
thread before anything moves; a returned ``Transfer`` then runs
asynchronously.

A saved page's meta is ``{"dtype", "shape", "nbytes"}`` (and ``"wsum64"``, the
device checksum, when enabled); a load checks the destination against it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from kvstore.gpu import probe
from kvstore.gpu._pages import Page, PageStore, PipelineCounters
from kvstore.gpu._tensors import check_destination, check_source, cuda_event, page_meta
from kvstore.gpu.errors import GDSUnavailableError, PageMissingError
from kvstore.gpu.gds import GDSBackend
from kvstore.gpu.pinned import StagedBackend
from kvstore.gpu.transfer import Transfer

__all__ = ["BACKENDS", "TensorIO", "TensorIOStats"]

BACKENDS = ("auto", "pinned", "gds", "cpu")
_DEFAULT_MAX_SLOT_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class TensorIOStats:
    """A snapshot of a ``TensorIO``: which backend moves pages, and its counters.

    ``load_backend`` is None until the first load resolves ``auto``; saves
    always use the staged backend (``save_backend``).
    """

    device: str
    backend: str
    load_backend: str | None
    save_backend: str
    reason: str
    probe_gbps: Mapping[str, float] = field(default_factory=dict)
    staging_slots: int = 0
    staging_slot_bytes: int = 0
    staging_pinned: bool = False
    counters: Mapping[str, int] = field(default_factory=dict)


def _keys(keys: Sequence[object]) -> list[bytes]:
    out = []
    for key in keys:
        if isinstance(key, str):
            out.append(key.encode("utf-8"))
        elif isinstance(key, bytes):
            out.append(key)
        else:
            raise TypeError(f"key must be bytes or str, not {type(key).__name__}")
    return out


class TensorIO:
    """Move pages between a ``KVStore`` and tensors on ``device``.

    ``backend``: ``"auto"`` (measure pinned and GDS at the first load, use the
    faster; ``cpu`` without CUDA), ``"pinned"``, ``"gds"`` (loads through
    cuFile; raises ``GDSUnavailableError`` at construction if it cannot), or
    ``"cpu"``. ``staging_slots`` host buffers of ``staging_slot_bytes`` each
    (default: the store's ``max_page_bytes``, at most 16 MiB) are allocated
    once, at the first transfer; a page larger than a slot is refused.

    Thread-safe; close it (or use ``with``) to stop its threads. The store must
    stay open while transfers run.
    """

    def __init__(
        self,
        store: PageStore,
        device: str | torch.device,
        *,
        backend: str = "auto",
        staging_slots: int = 4,
        staging_slot_bytes: int | None = None,
        read_threads: int = 3,
        write_threads: int = 2,
        gds_threads: int = 8,
        transfer_timeout_s: float = 60.0,
        device_checksums: bool | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device} requested but CUDA is not available")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            if backend == "cpu":
                raise ValueError('backend="cpu" is for CPU tensors; use "pinned" on CUDA')
        elif self.device.type == "cpu":
            if backend == "gds":
                raise ValueError('backend="gds" needs a CUDA device')
        else:
            raise ValueError(f"device must be cpu or cuda, not {self.device}")
        if staging_slot_bytes is None:
            staging_slot_bytes = min(store.config.max_page_bytes, _DEFAULT_MAX_SLOT_BYTES)
        if staging_slot_bytes < 1:
            raise ValueError("staging_slot_bytes must be positive")
        if transfer_timeout_s <= 0:
            raise ValueError("transfer_timeout_s must be positive")
        self.store = store
        self.backend = backend
        cuda = self.device.type == "cuda"
        self._device_checksums = cuda if device_checksums is None else device_checksums
        self._counters = PipelineCounters()
        self._staged = StagedBackend(
            store,
            self.device,
            slots=staging_slots,
            slot_bytes=staging_slot_bytes,
            read_threads=read_threads,
            write_threads=write_threads,
            counters=self._counters,
        )
        self._gds: GDSBackend | None = None
        self._gds_unavailable = ""
        self._gds_threads = gds_threads
        self._timeout_s = transfer_timeout_s
        self._load_backend: StagedBackend | GDSBackend | None = None
        self._reason = ""
        self._probe_gbps: Mapping[str, float] = {}
        if not cuda:
            self._load_backend = self._staged
            self._reason = "no CUDA device: CPU tensors through host buffers"
        elif backend == "pinned":
            self._load_backend = self._staged
            self._reason = "requested"
        elif backend == "gds":
            self._gds = self._make_gds()  # raises GDSUnavailableError: loud, at once
            self._load_backend = self._gds
            self._reason = "requested"
        self._pipeline = ThreadPoolExecutor(1, thread_name_prefix="kvstore-gpu-pipeline")
        self._closed = False

    def _make_gds(self) -> GDSBackend:
        return GDSBackend(
            self.store,
            self.device,
            threads=self._gds_threads,
            timeout_s=self._timeout_s,
            counters=self._counters,
        )

    # -- lifecycle -------------------------------------------------------

    def close(self) -> None:
        """Wait for running transfers, then stop the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pipeline.shutdown(wait=True)
        self._staged.close()
        if self._gds is not None:
            self._gds.close()

    def __enter__(self) -> TensorIO:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- transfers -------------------------------------------------------

    def _pages(self, keys: Sequence[object], tensors: Sequence[object], what: str) -> list[Page]:
        if self._closed:
            raise ValueError("this TensorIO is closed")
        if isinstance(keys, (bytes, str)):
            raise TypeError("keys must be a sequence of keys, not a single key")
        raw_keys = _keys(keys)
        if len(raw_keys) != len(tensors):
            raise ValueError(f"{len(raw_keys)} keys but {len(tensors)} tensors")
        pages = []
        for index, (key, tensor) in enumerate(zip(raw_keys, tensors, strict=True)):
            checked = check_source(tensor, self.device, f"{what} tensor {index} ({key!r})")
            nbytes = checked.numel() * checked.element_size()
            pages.append(Page(key, checked, nbytes, page_meta(checked)))
        return pages

    def _caller_event(self) -> Any:
        if self.device.type != "cuda":
            return None
        event = cuda_event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _submit(self, transfer: Transfer, work: Any) -> Transfer:
        def run() -> None:
            try:
                work()
            except BaseException as e:
                transfer._finish(e)
            else:
                transfer._finish(None)

        self._pipeline.submit(run)
        return transfer

    def save(
        self, keys: Sequence[object], tensors: Sequence[object], *, sync: bool = False
    ) -> Transfer:
        """Store each tensor's bytes under its key, with dtype and shape in the page's meta.

        The tensors must not be modified until the transfer is done (on CUDA:
        until ``transfer.event`` completes). ``sync=True`` makes the pages
        durable before the transfer completes.
        """
        if self.store.readonly:
            raise ValueError("the store was opened read-only; saves need a writable store")
        pages = self._pages(keys, tensors, "source")
        self._check_fits(pages)
        transfer = Transfer("save", len(pages), sum(page.nbytes for page in pages))
        caller_event = self._caller_event()
        checksums = self._device_checksums
        return self._submit(
            transfer,
            lambda: self._staged.save(
                pages, transfer, caller_event, sync=sync, with_checksum=checksums
            ),
        )

    def load(self, keys: Sequence[object], tensors: Sequence[object]) -> Transfer:
        """Fill each tensor with its page; dtype, shape and byte size must match the saved ones.

        Raises at once (nothing moves) on a mismatch, a non-contiguous tensor
        or a missing page; failures while data moves are raised by ``wait()``.
        """
        pages = self._pages(keys, tensors, "destination")
        for page in pages:
            info = self.store.info(page.key)
            if info is None:
                raise PageMissingError(f"page {page.key!r} is not in the store")
            check_destination(page.key, page.tensor, info.meta)
            if info.payload_bytes != page.nbytes:
                raise ValueError(
                    f"page {page.key!r} is {info.payload_bytes} bytes on disk; "
                    f"its meta says {page.nbytes}"
                )
        transfer = Transfer("load", len(pages), sum(page.nbytes for page in pages))
        caller_event = self._caller_event()
        return self._submit(transfer, lambda: self._run_load(pages, transfer, caller_event))

    def _check_fits(self, pages: list[Page]) -> None:
        for page in pages:
            if page.nbytes > self._staged.slot_bytes:
                raise ValueError(
                    f"page {page.key!r} of {page.nbytes} bytes exceeds staging_slot_bytes "
                    f"({self._staged.slot_bytes}); open TensorIO with a larger one"
                )

    def _run_load(self, pages: list[Page], transfer: Transfer, caller_event: Any) -> None:
        backend = self._resolve_load_backend(pages)
        if backend is self._staged:
            self._check_fits(pages)
        backend.load(pages, transfer, caller_event)

    def _resolve_load_backend(self, pages: list[Page]) -> StagedBackend | GDSBackend:
        """``auto`` on CUDA: measure both at the first load (pipeline thread only)."""
        if self._load_backend is not None:
            return self._load_backend
        device = str(self.device)
        root = str(self.store.root)
        try:
            self._gds = self._make_gds()
        except GDSUnavailableError as e:
            self._gds_unavailable = f"gds unavailable: {e}"
        sample = [
            Page(page.key, torch.empty_like(page.tensor), page.nbytes, page.meta)
            for page in pages[: probe.PROBE_PAGES]
            if page.nbytes <= self._staged.slot_bytes
        ]

        def run_with(backend: StagedBackend | GDSBackend) -> int:
            scratch = Transfer("probe", len(sample), 0)
            backend.load(sample, scratch, self._caller_event())
            return sum(page.nbytes for page in sample)

        gds = self._gds
        result = probe.choose(
            root,
            device,
            lambda: run_with(self._staged),
            (lambda: run_with(gds)) if gds is not None and sample else None,
            self._gds_unavailable,
        )
        chosen: StagedBackend | GDSBackend | None = self._staged
        if result.backend == "gds":
            chosen = self._gds or self._staged
        self._load_backend = chosen
        self._reason = result.reason
        self._probe_gbps = dict(result.gbps)
        assert chosen is not None
        return chosen

    # -- introspection ---------------------------------------------------

    def stats(self) -> TensorIOStats:
        """Which backend moves pages (and why), and the pipeline's counters."""
        load = self._load_backend.name if self._load_backend is not None else None
        ring = self._staged._ring
        return TensorIOStats(
            device=str(self.device),
            backend=self.backend,
            load_backend=load,
            save_backend=self._staged.name,
            reason=self._reason,
            probe_gbps=dict(self._probe_gbps),
            staging_slots=ring.slots if ring is not None else 0,
            staging_slot_bytes=self._staged.slot_bytes,
            staging_pinned=ring.pinned if ring is not None else False,
            counters=self._counters.snapshot(),
        )

    def __repr__(self) -> str:
        load = self._load_backend.name if self._load_backend is not None else "undecided"
        return f"TensorIO(device={self.device}, backend={self.backend}, load={load})"
