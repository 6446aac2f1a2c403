"""The HBM and DRAM copies: the engine's buffers in and out of the slot pools.

``Copies`` turns the tier manager's copy decisions into mover tickets over byte
views of real memory: offers into a slot, demotions HBM -> DRAM, loads from a slot
into the engine's destinations. ``SimulatedCopies`` is the simulator's twin: the same
calls, sized tickets on the fake mover (which takes no tensors), and no
destinations or sources to check. The manager holds one and never asks which.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.tiering.arena import SlotPool
from kvstore.tiering.completions import Demotion, Load, OfferCopy
from kvstore.tiering.mover_api import Mover, Path, Priority, Ticket
from kvstore.tiering.pages import HBM, PageRec
from kvstore.tiering.results import LoadHandle

__all__ = ["Copies", "SimulatedCopies", "byte_view"]

_DEMAND, _WRITEBACK = Priority.DEMAND, Priority.WRITEBACK
_D2H = Path.D2H


class Copies:
    """Copies between the engine's tensors and the slot pools (real memory)."""

    # Copies to one load's destinations are gathered per read and sent as one ticket
    # (fewer tickets and wake-ups); the simulator keeps one per page, its timing.
    batches_loads = True

    def __init__(self, mover: Mover, hbm: SlotPool, dram: SlotPool) -> None:
        self._mover = mover
        self._hbm = hbm
        self._dram = dram

    def sources(
        self, srcs: Sequence[Any] | None, sizes: Sequence[int] | None, count: int, page_bytes: int
    ) -> tuple[list[Any], list[int]]:
        """An offer's byte views and their sizes."""
        if srcs is None:
            raise ValueError("srcs is required (only the fake mover takes sizes alone)")
        if len(srcs) != count:
            raise ValueError(f"{count} keys but {len(srcs)} sources")
        views = [byte_view(s, f"srcs[{i}]") for i, s in enumerate(srcs)]
        return views, [int(v.numel()) for v in views]

    def destinations(self, dst: Sequence[Any] | None, count: int) -> list[Any]:
        """A load's byte views, one per page it loads."""
        if dst is None or len(dst) < count:
            got = 0 if dst is None else len(dst)
            raise ValueError(f"the plan loads {count} pages but {got} destinations were given")
        return [byte_view(t, f"dst[{i}]") for i, t in enumerate(dst[:count])]

    def source(self, rec: PageRec, tier: int) -> Any:
        """A view of the page's slot in ``tier`` (HBM or DRAM)."""
        if tier == HBM:
            return self._hbm.view(rec.hbm_slot, rec.nbytes)
        return self._dram.view(rec.dram_slot, rec.nbytes)

    def offer(
        self, path: Path, tier: int, recs: list[PageRec], srcs: list[Any], event: Any
    ) -> Ticket:
        """Copy offered pages from the engine's ``srcs`` into their slots in ``tier``."""
        pairs = [(src, self.source(rec, tier)) for rec, src in zip(recs, srcs, strict=True)]
        return self._mover.copy(
            path, pairs, priority=_WRITEBACK, tag=OfferCopy(recs, tier), wait_event=event
        )

    def demote(self, recs: list[PageRec], keep: bool) -> None:
        """One D2H copy of the pages' HBM slots into their (taken) DRAM slots."""
        pairs = [
            (self._hbm.view(r.hbm_slot, r.nbytes), self._dram.view(r.dram_slot, r.nbytes))
            for r in recs
        ]
        self._mover.copy(_D2H, pairs, priority=_WRITEBACK, tag=Demotion(recs, keep))

    def load(
        self, handle: LoadHandle, path: Path, items: list[tuple[int, Any, Any]], wait_event: Any
    ) -> None:
        """Copy ``(position, source view, destination)`` items of a load: one ticket."""
        pairs = [
            (src, dst if dst.numel() == src.numel() else dst[: src.numel()])
            for _, src, dst in items
        ]
        ticket = self._mover.copy(
            path, pairs, priority=_DEMAND, tag=Load(handle, items), wait_event=wait_event
        )
        if ticket.event is not None:
            handle.event = ticket.event


class SimulatedCopies(Copies):
    """The simulator's copies: sized tickets; no tensors anywhere."""

    batches_loads = False

    def sources(
        self, srcs: Sequence[Any] | None, sizes: Sequence[int] | None, count: int, page_bytes: int
    ) -> tuple[list[Any], list[int]]:
        if srcs is not None:
            return super().sources(srcs, sizes, count, page_bytes)
        nbytes = list(sizes) if sizes is not None else [page_bytes] * count
        if len(nbytes) != count:
            raise ValueError(f"{count} keys but {len(nbytes)} sizes")
        return [None] * count, nbytes

    def destinations(self, dst: Sequence[Any] | None, count: int) -> list[Any]:
        return [None] * count

    def offer(
        self, path: Path, tier: int, recs: list[PageRec], srcs: list[Any], event: Any
    ) -> Ticket:
        nbytes = sum(rec.nbytes for rec in recs)
        return self._mover.copy(
            path, [], priority=_WRITEBACK, tag=OfferCopy(recs, tier), nbytes=nbytes
        )

    def demote(self, recs: list[PageRec], keep: bool) -> None:
        nbytes = sum(r.nbytes for r in recs)
        self._mover.copy(_D2H, [], priority=_WRITEBACK, tag=Demotion(recs, keep), nbytes=nbytes)

    def load(
        self, handle: LoadHandle, path: Path, items: list[tuple[int, Any, Any]], wait_event: Any
    ) -> None:
        nbytes = sum(handle.records[i].nbytes for i, _, _ in items)
        self._mover.copy(path, [], priority=_DEMAND, tag=Load(handle, items), nbytes=nbytes)


def byte_view(tensor: Any, what: str) -> Any:
    """``tensor`` as a flat contiguous uint8 view (TypeError/ValueError naming ``what``)."""
    import torch

    if (
        type(tensor) is torch.Tensor
        and tensor.dtype is torch.uint8
        and tensor.dim() == 1
        and tensor.is_contiguous()
    ):
        return tensor  # already a byte view: a new view object costs ~5 us
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} is not contiguous; pass tensor.contiguous()")
    return tensor.reshape(-1).view(torch.uint8)
