"""kvstore: a persistent, crash-safe store of LLM KV-cache pages on local NVMe.

from kvstore import KVStore
with KVStore.open("/nvme/kv", create=True) as store:
    store.put(b"layer0/block17", page_bytes, sync=True)
    assert store.get(b"layer0/block17") == page_bytes
"""

from kvstore.config import StoreConfig
from kvstore.errors import (
    AlreadyOpenError,
    ClosedError,
    CorruptionError,
    FormatVersionError,
    IOFailure,
    KVStoreError,
    LockedError,
    PinError,
    ReadOnlyError,
    StoreFullError,
    StoreNotFoundError,
    WriterFailedError,
)
from kvstore.format.constants import FORMAT_VERSION
from kvstore.store import KVStore
from kvstore.types import PageInfo, StoreStats

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "AlreadyOpenError",
    "ClosedError",
    "CorruptionError",
    "FormatVersionError",
    "IOFailure",
    "KVStore",
    "KVStoreError",
    "LockedError",
    "PageInfo",
    "PinError",
    "ReadOnlyError",
    "StoreConfig",
    "StoreFullError",
    "StoreNotFoundError",
    "StoreStats",
    "WriterFailedError",
    "__version__",
]
