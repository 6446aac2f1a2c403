"""Arena: one allocation of host (or device) memory cut into equal, 4 KiB-aligned slots.

The DRAM tier (L1) is one arena of ``dram_bytes``, allocated once at open and, on
a machine with CUDA, pinned once (``pin_memory``), so that H2D/D2H copies are
true DMA and nothing is allocated or registered on the hot path. The owned HBM
pool is the same structure on the GPU.

Invariants:
- ``buffer()`` starts on a 4096-byte boundary and every slot is ``slot_bytes``
  long, a multiple of 4096, so every slot starts 4 KiB-aligned too: the store's
  ``get_many_into`` then reads NVMe pages straight into a slot (O_DIRECT,
  zero-copy).
- A slot is either on the free list or allocated, never both; ``free`` of a
  slot that is not allocated is a ValueError (a double free would hand one slot
  to two pages: the wrong-bytes bug this package exists to prevent).
- ``alloc``/``free`` are O(1) and thread-safe (one lock held for a few list
  operations); ``view`` takes no lock and allocates at most the view object
  (whole-slot views of slots >= 64 KiB are made once and reused).

The arena does not know what a slot holds or whether it may be read: that is
the page state machine's job (rule R4 of docs/tiering.md, "The mover and the ordering rules").
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

from kvstore.tiering._torch import require_torch

if TYPE_CHECKING:
    import torch

__all__ = ["SLOT_ALIGN_BYTES", "Arena", "SlotPool", "VirtualSlots"]

SLOT_ALIGN_BYTES = 4096
_CACHED_VIEW_MIN_SLOT_BYTES = 64 * 1024


class SlotPool(Protocol):
    """What the tier manager needs of a tier's page slots: an ``Arena`` (real memory)
    or the simulator's slot counter (``VirtualSlots``)."""

    slots: int
    slot_bytes: int
    capacity_bytes: int

    def alloc(self) -> int | None: ...
    def free(self, slot: int) -> None: ...
    def used_slots(self) -> int: ...
    def free_slots(self) -> int: ...
    def view(self, slot: int, nbytes: int | None = None) -> Any: ...


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class Arena:
    """One allocation of ``capacity_bytes`` cut into slots of ``slot_bytes`` (rounded up to 4096).

    ``capacity_bytes`` is rounded down to whole slots (an arena smaller than one
    slot has no slots: every ``alloc`` answers None). ``pin`` asks for pinned
    host memory; it is honoured only for a CPU arena on a machine where CUDA is
    available (pinned memory needs the driver) and ``pinned`` says whether it was.
    """

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        device: str | torch.device,
        *,
        pin: bool = False,
        name: str = "dram",
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise TypeError(f"capacity_bytes must be an int, not {type(capacity_bytes).__name__}")
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int):
            raise TypeError(f"slot_bytes must be an int, not {type(slot_bytes).__name__}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be > 0, got {slot_bytes}")
        require_torch()
        import torch

        self.name = name
        self.device = torch.device(device)
        self.slot_bytes = _round_up(slot_bytes, SLOT_ALIGN_BYTES)
        self.slots = capacity_bytes // self.slot_bytes
        self.capacity_bytes = self.slots * self.slot_bytes
        self.pinned = bool(pin) and self.device.type == "cpu" and torch.cuda.is_available()
        self._buffer = self._allocate(self.capacity_bytes)
        self._lock = threading.Lock()
        # A stack: the most recently freed slot is reused first (warm in cache and TLB).
        # Reversed so that a fresh arena hands out 0, 1, 2, ...
        self._free: list[int] = list(range(self.slots - 1, -1, -1))
        self._allocated = bytearray(self.slots)  # 1 where the slot is allocated
        # Whole-slot views, made on first use and kept: a torch slice costs 2-5 us and
        # every page of every load and offer asks for one. A view is ~600 bytes, so
        # only arenas whose slots are large enough for that to stay under 1% keep them.
        self._views: list[torch.Tensor | None] | None = (
            [None] * self.slots if self.slot_bytes >= _CACHED_VIEW_MIN_SLOT_BYTES else None
        )

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """The uninitialised backing memory, starting on a 4 KiB boundary.

        Over-allocates by one alignment unit and slices at the aligned offset; the
        slice keeps the whole allocation alive.
        """
        import torch

        backing = torch.empty(
            nbytes + SLOT_ALIGN_BYTES, dtype=torch.uint8, device=self.device, pin_memory=self.pinned
        )
        start = -backing.data_ptr() % SLOT_ALIGN_BYTES
        return backing[start : start + nbytes]

    # -- allocation ---------------------------------------------------------

    def alloc(self) -> int | None:
        """A free slot, or None when the arena is full (shortage is an answer, not an error)."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self._allocated[slot] = 1
            return slot

    def alloc_many(self, n: int) -> list[int] | None:
        """``n`` free slots, or None (and nothing allocated) when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with self._lock:
            if len(self._free) < n:
                return None
            if n == 0:
                return []
            taken = self._free[-n:]
            del self._free[-n:]
            taken.reverse()  # the order single allocs would have given
            for slot in taken:
                self._allocated[slot] = 1
            return taken

    def free(self, slot: int) -> None:
        """Return ``slot`` to the free list; ValueError if it is out of range or not allocated."""
        self._check_slot(slot)
        with self._lock:
            if not self._allocated[slot]:
                raise ValueError(
                    f"slot {slot} of arena {self.name!r} is not allocated (double free?)"
                )
            self._allocated[slot] = 0
            self._free.append(slot)

    def is_allocated(self, slot: int) -> bool:
        """Whether ``slot`` is allocated now (a snapshot; for checks and tests)."""
        self._check_slot(slot)
        return bool(self._allocated[slot])

    # -- views --------------------------------------------------------------

    def view(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """A 1-D uint8 view of ``slot`` (its first ``nbytes``, default the whole slot).

        The view shares the arena's memory; it does not check that the slot is
        allocated (the caller owns the slot while it holds the view).
        """
        # Called per page on every load and offer: the checks are inline (a call to
        # _check_slot costs as much as they do), and a whole slot's view is reused.
        slot_bytes = self.slot_bytes
        if not 0 <= slot < self.slots:
            self._check_slot(slot)
        if nbytes is None:
            nbytes = slot_bytes
        elif not 0 <= nbytes <= slot_bytes:
            raise ValueError(
                f"nbytes {nbytes} does not fit a slot of arena {self.name!r} ({slot_bytes} bytes)"
            )
        views = self._views
        if nbytes == slot_bytes and views is not None:
            view = views[slot]
            if view is None:  # two threads racing here make two equal views: harmless
                view = views[slot] = self._buffer[slot * slot_bytes : (slot + 1) * slot_bytes]
            return view
        start = slot * slot_bytes
        return self._buffer[start : start + nbytes]

    def buffer(self) -> torch.Tensor:
        """The whole allocation (``capacity_bytes``, 4 KiB-aligned), slot 0 first."""
        return self._buffer

    # -- accounting ---------------------------------------------------------

    def used_slots(self) -> int:
        """Slots allocated now."""
        return self.slots - len(self._free)

    def free_slots(self) -> int:
        """Slots free now."""
        return len(self._free)

    def used_bytes(self) -> int:
        """Bytes of the slots allocated now (whole slots, not the pages' sizes)."""
        return self.used_slots() * self.slot_bytes

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(
                f"slot {slot} is out of range for arena {self.name!r} ({self.slots} slots)"
            )

    def __repr__(self) -> str:
        return (
            f"Arena(name={self.name!r}, device={self.device}, slots={self.slots}, "
            f"slot_bytes={self.slot_bytes}, used={self.used_slots()}, pinned={self.pinned})"
        )


class VirtualSlots:
    """Slot accounting without memory: the simulator's ``SlotPool`` (the fake mover's)."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.capacity_bytes = slots * slot_bytes
        # Slots never handed out are a count, not a list: a huge simulated tier costs
        # nothing until it is used. Freed slots go back on the list, lowest reused first
        # (the order a full list would have given).
        self._fresh = 0
        self._free: list[int] = []

    def alloc(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._fresh < self.slots:
            self._fresh += 1
            return self._fresh - 1
        return None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def used_slots(self) -> int:
        return self._fresh - len(self._free)

    def free_slots(self) -> int:
        return self.slots - self.used_slots()

    def view(self, slot: int, nbytes: int | None = None) -> Any:
        return None
