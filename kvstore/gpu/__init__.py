"""The HBM path: save torch tensors as store pages and load pages into tensors.

    from kvstore import KVStore
    from kvstore.gpu import TensorIO

    with KVStore.open(path, create=True) as store, TensorIO(store, "cuda") as tio:
        tio.save(keys, tensors).wait()
        transfer = tio.load(keys, destinations)
        torch.cuda.current_stream().wait_event(transfer.event)

torch (and kvikio, for GDS) are imported here and nowhere else in kvstore;
``import kvstore`` never imports them. See docs/hbm.md.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401  (fail here, with a hint, not deep inside)
except ImportError as e:  # pragma: no cover - the dev environment has torch
    raise ImportError(
        "kvstore.gpu needs torch; install it with: pip install 'kvstore[torch]'"
    ) from e

from kvstore.gpu.errors import (
    GDSUnavailableError,
    PageMissingError,
    TransferError,
    TransferTimeoutError,
)
from kvstore.gpu.tensor_io import TensorIO, TensorIOStats
from kvstore.gpu.transfer import Transfer

__all__ = [
    "GDSUnavailableError",
    "PageMissingError",
    "TensorIO",
    "TensorIOStats",
    "Transfer",
    "TransferError",
    "TransferTimeoutError",
]
