"""TensorIO on a CUDA device: pinned staging, streams, events and (when kvikio works) GDS.

Skipped without CUDA. NOT YET RUN: no GPU was available when these were written;
``tools/gpu_check.py`` covers the same ground with bandwidth numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvstore import KVStore  # noqa: E402
from kvstore.gpu import GDSUnavailableError, TensorIO  # noqa: E402
from kvstore.gpu._tensors import byte_view, device_checksum  # noqa: E402

pytestmark = pytest.mark.gpu
MIB = 1 << 20
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8]


@pytest.fixture
def kv(tmp_path: Path) -> Iterator[KVStore]:
    store = KVStore.open(
        tmp_path / "store", create=True, segment_bytes=64 * MIB, max_page_bytes=4 * MIB
    )
    yield store
    store.close()


def random_cuda(dtype: Any, nbytes: int, seed: int) -> Any:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    count = nbytes // torch.empty((), dtype=dtype).element_size()
    if dtype.is_floating_point:
        flat = torch.randn(count, generator=generator, device="cuda").to(dtype)
    else:
        flat = torch.randint(-128, 128, (count,), generator=generator, device="cuda").to(dtype)
    return flat.reshape(-1, 256)


def poisoned(tensor: Any) -> Any:
    out = torch.empty_like(tensor)
    return out.fill_(float("nan") if tensor.dtype.is_floating_point else -1)


@pytest.mark.parametrize("backend", ["pinned", "auto", "gds"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_on_cuda(kv: KVStore, backend: str, dtype: Any) -> None:
    try:
        tensor_io = TensorIO(kv, "cuda", backend=backend)
    except GDSUnavailableError as e:
        pytest.skip(f"GDS unavailable here: {e}")
    with tensor_io:
        sources = [
            random_cuda(dtype, nbytes, i) for i, nbytes in enumerate([MIB // 4, MIB, 4 * MIB])
        ]
        keys = [f"{dtype}/{i}" for i in range(len(sources))]
        tensor_io.save(keys, sources, sync=True).wait()
        destinations = [poisoned(s) for s in sources]
        transfer = tensor_io.load(keys, destinations)
        torch.cuda.current_stream().wait_event(transfer.event)
        transfer.wait()
        for source, destination in zip(sources, destinations, strict=True):
            assert torch.equal(byte_view(source), byte_view(destination))
        stats = tensor_io.stats()
        assert stats.staging_pinned
        assert stats.load_backend in ("pinned", "gds")


def test_device_checksum_matches_cpu() -> None:
    data = torch.randint(0, 256, (MIB + 3,), dtype=torch.uint8)
    assert device_checksum(data) == device_checksum(data.cuda())
