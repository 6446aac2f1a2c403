"""TensorIO on CPU tensors: the staged pipeline that CUDA uses, minus pinning and streams.

Runs in CI (no GPU). Round-trips are compared element for element, with the
destinations poisoned first so a page that was never copied cannot pass.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvstore import KVStore  # noqa: E402
from kvstore.gpu import PageMissingError, TensorIO  # noqa: E402
from kvstore.gpu._tensors import byte_view, device_checksum  # noqa: E402
from kvstore.types import Key, Meta, PageInfo  # noqa: E402

KIB = 1 << 10
MIB = 1 << 20
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8]
SIZES = [64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB]


@pytest.fixture
def kv(tmp_path: Path) -> Iterator[KVStore]:
    store = KVStore.open(
        tmp_path / "store", create=True, segment_bytes=32 * MIB, max_page_bytes=4 * MIB
    )
    yield store
    store.close()


@pytest.fixture
def tio(kv: KVStore) -> Iterator[TensorIO]:
    with TensorIO(kv, "cpu") as tensor_io:
        yield tensor_io


def random_tensor(dtype: Any, nbytes: int, seed: int, shape_cols: int = 128) -> Any:
    generator = torch.Generator().manual_seed(seed)
    count = nbytes // torch.empty((), dtype=dtype).element_size()
    if dtype.is_floating_point:
        flat = torch.randn(count, generator=generator, dtype=torch.float32).to(dtype)
    else:
        flat = torch.randint(-128, 128, (count,), generator=generator, dtype=torch.int64).to(dtype)
    return flat.reshape(-1, shape_cols)


def poisoned_like(tensor: Any) -> Any:
    out = torch.empty_like(tensor)
    if tensor.dtype.is_floating_point:
        out.fill_(float("nan"))
    else:
        out.fill_(-1)
    return out


def same_bits(a: Any, b: Any) -> bool:
    return bool(torch.equal(byte_view(a), byte_view(b)))


@pytest.mark.parametrize("nbytes", SIZES, ids=lambda n: f"{n // KIB}KiB")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_exact(tio: TensorIO, kv: KVStore, dtype: Any, nbytes: int) -> None:
    sources = [random_tensor(dtype, nbytes, seed) for seed in range(3)]
    keys = [f"{dtype}/{nbytes}/{i}" for i in range(3)]
    tio.save(keys, sources).wait()
    destinations = [poisoned_like(t) for t in sources]
    transfer = tio.load(keys, destinations)
    transfer.wait()
    assert transfer.done() and transfer.event is None
    for source, destination in zip(sources, destinations, strict=True):
        assert same_bits(source, destination)
    meta = kv.info(keys[0]).meta  # type: ignore[union-attr]
    assert meta["dtype"] == str(dtype).removeprefix("torch.")
    assert meta["shape"] == list(sources[0].shape)
    assert meta["nbytes"] == nbytes == kv.info(keys[0]).payload_bytes  # type: ignore[union-attr]


def test_pages_are_plain_store_pages(tio: TensorIO, kv: KVStore) -> None:
    source = random_tensor(torch.bfloat16, 64 * KIB, 7)
    tio.save(["p"], [source], sync=True).wait()
    raw = kv.get("p")
    assert raw == bytes(byte_view(source).numpy())


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda t: torch.empty_like(t, dtype=torch.float16), TypeError, "holds float32"),
        (lambda t: torch.empty(t.numel(), dtype=t.dtype), ValueError, "shape"),
        (lambda t: torch.empty(8, 64, dtype=t.dtype), ValueError, "shape"),
        (lambda t: torch.empty(t.shape[1], t.shape[0], dtype=t.dtype).t(), ValueError, "contig"),
    ],
    ids=["dtype", "shape", "size", "non-contiguous"],
)
def test_mismatched_destinations_are_refused(
    tio: TensorIO, make: Any, error: type[Exception], match: str
) -> None:
    source = random_tensor(torch.float32, 64 * KIB, 1)
    tio.save(["k"], [source]).wait()
    with pytest.raises(error, match=match):
        tio.load(["k"], [make(source)])


def test_same_bytes_other_shape_is_refused(tio: TensorIO) -> None:
    source = random_tensor(torch.float16, 64 * KIB, 2)
    tio.save(["k"], [source]).wait()
    with pytest.raises(ValueError, match="shape"):
        tio.load(["k"], [torch.empty(source.shape[1], source.shape[0], dtype=torch.float16)])


def test_non_contiguous_source_is_refused(tio: TensorIO) -> None:
    source = random_tensor(torch.float32, 64 * KIB, 3).t()
    with pytest.raises(ValueError, match="not contiguous"):
        tio.save(["k"], [source])


def test_misuse(tio: TensorIO) -> None:
    tensor = random_tensor(torch.float32, 64 * KIB, 4)
    with pytest.raises(ValueError, match="keys but"):
        tio.save(["a", "b"], [tensor])
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        tio.save(["a"], [b"bytes"])
    with pytest.raises(TypeError, match="single key"):
        tio.save("a", [tensor])
    with pytest.raises(PageMissingError):
        tio.load(["never-saved"], [tensor])
    with pytest.raises(ValueError, match="backend"):
        TensorIO(tio.store, "cpu", backend="fast")
    with pytest.raises(ValueError, match="CUDA"):
        TensorIO(tio.store, "cpu", backend="gds")


def test_page_larger_than_a_slot_is_refused(kv: KVStore) -> None:
    with (
        TensorIO(kv, "cpu", staging_slot_bytes=64 * KIB) as small,
        pytest.raises(ValueError, match="staging_slot_bytes"),
    ):
        small.save(["big"], [random_tensor(torch.int8, 128 * KIB, 5)])


def test_page_not_saved_by_tensor_io_is_refused(tio: TensorIO, kv: KVStore) -> None:
    kv.put("raw", b"x" * 4096)
    with pytest.raises(ValueError, match=r"not saved by kvstore\.gpu"):
        tio.load(["raw"], [torch.empty(4096, dtype=torch.uint8)])


def test_page_deleted_before_the_read_fails_the_transfer(kv: KVStore) -> None:
    slow = SlowStore(kv, read_delay_s=0.05)
    with TensorIO(slow, "cpu", read_threads=1, staging_slots=2) as tensor_io:
        tensors = [random_tensor(torch.float32, 64 * KIB, s) for s in range(4)]
        keys = [f"d{i}" for i in range(4)]
        tensor_io.save(keys, tensors).wait()
        transfer = tensor_io.load(keys, [poisoned_like(t) for t in tensors])
        kv.delete("d3")
        with pytest.raises(PageMissingError, match="d3"):
            transfer.wait()
        # The pipeline is still usable after a failed transfer.
        again = [poisoned_like(t) for t in tensors[:3]]
        tensor_io.load(keys[:3], again).wait()
        assert all(same_bits(a, b) for a, b in zip(tensors, again, strict=False))


class SlowStore:
    """A KVStore whose get_into takes at least ``read_delay_s``: makes reads overlap visibly."""

    def __init__(self, store: KVStore, read_delay_s: float) -> None:
        self._store = store
        self._delay = read_delay_s
        self.root = store.root
        self.config = store.config
        self.readonly = store.readonly
        self.reads_started: list[float] = []
        self.lock = threading.Lock()

    def get_into(self, key: Key, buffer: object) -> int | None:
        with self.lock:
            self.reads_started.append(time.monotonic())
        time.sleep(self._delay)
        return self._store.get_into(key, buffer)

    def put_many(self, items: Iterable[Any], *, sync: bool = False) -> list[bool]:
        return self._store.put_many(items, sync=sync)

    def info(self, key: Key) -> PageInfo | None:
        return self._store.info(key)

    def flush(self) -> None:
        self._store.flush()

    def pinned(self, keys: Iterable[Key]) -> contextlib.AbstractContextManager[list[bool]]:
        return self._store.pinned(keys)

    def put(self, key: Key, value: object, meta: Meta | None = None) -> None:
        self._store.put(key, value, meta=meta)


def test_reads_stay_in_flight_while_pages_are_copied(kv: KVStore) -> None:
    slow = SlowStore(kv, read_delay_s=0.02)
    with TensorIO(slow, "cpu", staging_slots=4, read_threads=3) as tensor_io:
        tensors = [random_tensor(torch.float16, 256 * KIB, s) for s in range(12)]
        keys = [f"pipe{i}" for i in range(12)]
        tensor_io.save(keys, tensors).wait()
        destinations = [poisoned_like(t) for t in tensors]
        started = time.monotonic()
        tensor_io.load(keys, destinations).wait()
        elapsed = time.monotonic() - started
        counters = tensor_io.stats().counters
    assert all(same_bits(a, b) for a, b in zip(tensors, destinations, strict=True))
    assert counters["max_reads_during_copy"] > 1
    assert counters["max_reads_running"] == 3
    # 12 reads of 20 ms one after another would take 240 ms; three at a time, ~80 ms.
    assert elapsed < 12 * 0.02 * 0.75


def test_stats_say_which_backend(tio: TensorIO) -> None:
    before = tio.stats()
    assert (before.backend, before.load_backend, before.save_backend) == ("auto", "cpu", "cpu")
    assert before.staging_slots == 0  # nothing allocated before the first transfer
    tensor = random_tensor(torch.int8, 64 * KIB, 9)
    tio.save(["s"], [tensor]).wait()
    tio.load(["s"], [torch.empty_like(tensor)]).wait()
    after = tio.stats()
    assert after.staging_slots == 4 and not after.staging_pinned
    assert after.counters["pages_saved"] == 1 and after.counters["pages_loaded"] == 1
    assert after.counters["bytes_loaded"] == 64 * KIB


def test_device_checksum_is_position_sensitive_and_stored(kv: KVStore) -> None:
    with TensorIO(kv, "cpu", device_checksums=True) as tensor_io:
        tensor = random_tensor(torch.float32, 64 * KIB, 11)
        tensor_io.save(["c"], [tensor]).wait()
        stored = kv.info("c").meta["wsum64"]  # type: ignore[union-attr]
    data = byte_view(tensor).clone()
    assert stored == device_checksum(data)
    swapped = data.clone()
    swapped[:4], swapped[4:8] = data[4:8].clone(), data[:4].clone()
    flipped = data.clone()
    flipped[1000] ^= 1
    odd = torch.cat([data, torch.zeros(3, dtype=torch.uint8)])
    digests = {device_checksum(x) for x in (data, swapped, flipped, odd)}
    assert len(digests) == 4


def test_import_kvstore_does_not_import_torch() -> None:
    code = "import kvstore, sys; assert 'torch' not in sys.modules and 'kvikio' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_staging_slots_are_page_aligned_for_zero_copy_loads() -> None:
    """The store reads a page straight into a slot only when the slot starts on a
    4 KiB boundary; torch's own CPU allocations need not."""
    from kvstore.gpu.pinned import StagingRing

    ring = StagingRing(4, 64 * KIB + 3, pin=False)
    for buffer, array in zip(ring.buffers, ring.arrays, strict=True):
        assert buffer.data_ptr() % 4096 == 0
        assert array.ctypes.data == buffer.data_ptr()
        assert buffer.numel() == array.nbytes == 64 * KIB + 3
