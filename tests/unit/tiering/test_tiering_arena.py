"""tiering/arena.py: slot geometry, alignment, the free list, views, thread safety."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstore.tiering.arena import SLOT_ALIGN_BYTES, Arena


def test_geometry_rounds_slots_up_and_capacity_down() -> None:
    arena = Arena(10 * 4096 + 5, 5000, "cpu")
    assert arena.slot_bytes == 8192
    assert arena.slots == 5
    assert arena.capacity_bytes == 5 * 8192
    assert arena.buffer().numel() == arena.capacity_bytes
    assert arena.buffer().dtype == torch.uint8
    assert arena.device == torch.device("cpu")
    assert arena.name == "dram"


def test_exact_multiple_keeps_its_size() -> None:
    arena = Arena(4 * 8192, 8192, "cpu", name="hbm")
    assert (arena.slots, arena.slot_bytes, arena.capacity_bytes) == (4, 8192, 4 * 8192)
    assert arena.name == "hbm"


def test_arena_smaller_than_a_slot_has_no_slots() -> None:
    arena = Arena(100, 4096, "cpu")
    assert arena.slots == 0
    assert arena.capacity_bytes == 0
    assert arena.alloc() is None
    assert arena.alloc_many(1) is None
    assert arena.alloc_many(0) == []


@pytest.mark.parametrize(
    ("capacity", "slot"), [(-1, 4096), (4096, 0), (4096, -4096)], ids=["capacity", "zero", "neg"]
)
def test_bad_sizes_are_value_errors(capacity: int, slot: int) -> None:
    with pytest.raises(ValueError):
        Arena(capacity, slot, "cpu")


def test_non_int_sizes_are_type_errors() -> None:
    with pytest.raises(TypeError):
        Arena(4096.0, 4096, "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Arena(4096, True, "cpu")


def test_alloc_until_full_then_free_and_reuse() -> None:
    arena = Arena(3 * 4096, 4096, "cpu")
    assert [arena.alloc(), arena.alloc(), arena.alloc()] == [0, 1, 2]
    assert arena.alloc() is None
    assert arena.used_slots() == 3
    assert arena.free_slots() == 0
    assert arena.used_bytes() == 3 * 4096
    arena.free(1)
    assert arena.is_allocated(0) and not arena.is_allocated(1)
    assert arena.free_slots() == 1
    assert arena.alloc() == 1
    assert arena.alloc() is None


def test_double_free_and_out_of_range_are_value_errors() -> None:
    arena = Arena(2 * 4096, 4096, "cpu")
    slot = arena.alloc()
    assert slot is not None
    arena.free(slot)
    with pytest.raises(ValueError, match="double free"):
        arena.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        arena.free(1)  # never allocated
    for bad in (-1, 2):
        with pytest.raises(ValueError, match="out of range"):
            arena.free(bad)
        with pytest.raises(ValueError, match="out of range"):
            arena.view(bad)
    assert arena.free_slots() == 2


def test_alloc_many_is_all_or_nothing() -> None:
    arena = Arena(4 * 4096, 4096, "cpu")
    assert arena.alloc_many(3) == [0, 1, 2]
    assert arena.alloc_many(2) is None
    assert arena.free_slots() == 1  # the refused request took nothing
    assert arena.alloc_many(1) == [3]
    with pytest.raises(ValueError):
        arena.alloc_many(-1)


def test_buffer_and_every_slot_are_4k_aligned() -> None:
    for slot_bytes in (1, 4096, 4097, 12288):
        arena = Arena(5 * 16384, slot_bytes, "cpu")
        assert arena.buffer().data_ptr() % SLOT_ALIGN_BYTES == 0
        for slot in range(arena.slots):
            assert arena.view(slot).data_ptr() % SLOT_ALIGN_BYTES == 0


def test_views_do_not_overlap_and_share_the_buffer() -> None:
    arena = Arena(6 * 4096, 4096, "cpu")
    for slot in range(arena.slots):
        arena.view(slot).fill_(slot + 1)
    buffer = arena.buffer()
    for slot in range(arena.slots):
        expected = torch.full((4096,), slot + 1, dtype=torch.uint8)
        assert torch.equal(arena.view(slot), expected)
        assert torch.equal(buffer[slot * 4096 : (slot + 1) * 4096], expected)


def test_view_with_nbytes_is_a_prefix() -> None:
    arena = Arena(2 * 4096, 4096, "cpu")
    full = arena.view(1)
    part = arena.view(1, 100)
    assert part.numel() == 100 and part.dim() == 1 and part.dtype == torch.uint8
    assert part.data_ptr() == full.data_ptr()
    assert arena.view(1, 0).numel() == 0
    assert arena.view(1, 4096).numel() == 4096
    with pytest.raises(ValueError, match="does not fit"):
        arena.view(1, 4097)
    with pytest.raises(ValueError):
        arena.view(1, -1)


def test_pin_without_cuda_is_ignored() -> None:
    arena = Arena(2 * 4096, 4096, "cpu", pin=True)
    assert arena.pinned is torch.cuda.is_available()
    assert arena.buffer().is_pinned() is arena.pinned


def test_unpinned_by_default() -> None:
    assert Arena(4096, 4096, "cpu").pinned is False


def test_concurrent_alloc_and_free_never_hand_out_a_slot_twice() -> None:
    arena = Arena(64 * 4096, 4096, "cpu")
    errors: list[str] = []
    owned: list[set[int]] = [set(), set()]
    barrier = threading.Barrier(2)

    def worker(index: int) -> None:
        mine = owned[index]
        barrier.wait()
        for round_ in range(3000):
            slot = arena.alloc()
            if slot is not None:
                if slot in owned[1 - index]:
                    errors.append(f"slot {slot} given to both threads")
                mine.add(slot)
            if mine and round_ % 3 == 2:
                arena.free(mine.pop())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert owned[0].isdisjoint(owned[1])
    assert arena.used_slots() == len(owned[0]) + len(owned[1])
    for slot in owned[0] | owned[1]:
        assert arena.is_allocated(slot)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_host_arena_and_device_arena() -> None:
    host = Arena(4 * 4096, 4096, "cpu", pin=True)
    assert host.pinned and host.buffer().is_pinned()
    device = Arena(4 * 4096, 4096, "cuda")
    assert device.buffer().is_cuda and not device.pinned
    assert device.buffer().data_ptr() % SLOT_ALIGN_BYTES == 0


def test_whole_slot_views_are_reused_and_partial_ones_are_not() -> None:
    arena = Arena(4 << 20, 1 << 20, "cpu")
    whole = arena.view(2)
    assert arena.view(2) is whole
    assert arena.view(2, 1 << 20) is whole
    assert whole.data_ptr() == arena.buffer().data_ptr() + 2 * (1 << 20)
    part = arena.view(2, 4096)
    assert part is not arena.view(2, 4096)
    assert part.data_ptr() == whole.data_ptr() and part.numel() == 4096
    arena.buffer().fill_(0)
    whole.fill_(7)  # the reused view still writes the arena's memory, and only its slot
    assert int(arena.buffer()[2 << 20]) == 7 and int(arena.buffer()[(3 << 20) - 1]) == 7
    assert int(arena.buffer()[(2 << 20) - 1]) == 0 and int(arena.buffer()[3 << 20]) == 0
    with pytest.raises(ValueError):
        arena.view(4)
    with pytest.raises(ValueError):
        arena.view(0, (1 << 20) + 1)


def test_small_slot_views_are_made_each_time() -> None:
    arena = Arena(16 * 4096, 4096, "cpu")
    first = arena.view(3)
    assert first is not arena.view(3)
    assert first.data_ptr() == arena.view(3).data_ptr() == arena.buffer().data_ptr() + 3 * 4096
