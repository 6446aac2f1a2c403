"""The LMDB environment: ``pages``, ``segments``, ``meta`` and ``retains`` databases.

One Environment per process and never across fork (LMDB's rule). The map is
grown on MapFullError and the transaction retried. LMDB syncs its own files
on commit, but never fsyncs a directory: the store does that once at creation.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from kvstore.errors import AlreadyOpenError, CorruptionError, IOFailure
from kvstore.format.checksum import checksum

__all__ = ["IndexEnv", "decode_meta_u64", "encode_meta_u64"]

T = TypeVar("T")
INITIAL_MAP_BYTES = 1 << 30
_META = struct.Struct("<QQ")  # value, xxh3(key + value)


def encode_meta_u64(key: bytes, value: int) -> bytes:
    packed = struct.pack("<Q", value)
    return packed + struct.pack("<Q", checksum(key + packed))


def decode_meta_u64(key: bytes, raw: bytes) -> int:
    if len(raw) != _META.size:
        raise CorruptionError(f"index meta {key!r}: bad length {len(raw)}")
    value, stored = _META.unpack(raw)
    if stored != checksum(key + raw[:8]):
        raise CorruptionError(f"index meta {key!r}: checksum mismatch")
    return int(value)


class IndexEnv:
    """Thin owner of the LMDB environment and its three named databases."""

    def __init__(self, path: Path, *, readonly: bool, create: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        try:
            self.env = lmdb.open(
                str(path),
                map_size=INITIAL_MAP_BYTES,
                max_dbs=8,
                subdir=True,
                readonly=readonly,
                create=create,
                sync=True,
                metasync=True,
                readahead=False,
                max_readers=256,
                lock=True,
                mode=0o600,
            )
        except lmdb.Error as e:
            if "already open in this process" in str(e):
                raise AlreadyOpenError(f"the store's index {path} is already open here") from e
            raise CorruptionError(f"cannot open the LMDB index at {path}: {e}") from e
        if not readonly:
            self.env.reader_check()  # clear reader slots of killed processes
        try:
            self.pages = self.env.open_db(b"pages", create=not readonly)
            self.segments = self.env.open_db(b"segments", create=not readonly)
            self.meta = self.env.open_db(b"meta", create=not readonly)
            self.retains = self.env.open_db(b"retains", create=not readonly)
        except lmdb.Error as e:
            raise CorruptionError(f"LMDB index at {path} lacks its databases: {e}") from e

    def read(self) -> Any:
        return self.env.begin(write=False, buffers=False)

    def write(self, body: Callable[[Any], T]) -> T:
        """Run ``body(txn)`` in one write transaction, growing the map when full."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    return body(txn)
            except lmdb.MapFullError:
                self.env.set_mapsize(self.env.info()["map_size"] * 2)
            except lmdb.Error as e:
                raise IOFailure(f"LMDB write to {self.path} failed: {e}") from e

    def get_meta(self, txn: Any, key: bytes, default: int) -> int:
        raw = txn.get(key, db=self.meta)
        return default if raw is None else decode_meta_u64(key, raw)

    def close(self) -> None:
        self.env.close()
