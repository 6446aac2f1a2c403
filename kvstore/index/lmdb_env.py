"""The LMDB environment: ``pages``, ``segments``, ``meta`` and ``retains`` databases.

One Environment per process and never across fork (LMDB's rule). The map is
grown on MapFullError and the transaction retried. LMDB syncs its own files
on commit, but never fsyncs a directory: the store does that once at creation.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from kvstore.errors import AlreadyOpenError, CorruptionError, IOFailure
from kvstore.format.checksum import checksum
from kvstore.index.lmdb_verify import verify_lmdb_file

__all__ = ["IndexEnv", "decode_meta_u64", "encode_meta_u64", "lmdb_read_errors"]

T = TypeVar("T")
INITIAL_MAP_BYTES = 1 << 30
VERIFY_ON_OPEN_MAX_BYTES = 4 << 20  # walk the B-tree at open up to this data.mdb size
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


@contextlib.contextmanager
def lmdb_read_errors(path: Path) -> Iterator[None]:
    """Turn an ``lmdb.Error`` raised while reading into a ``KVStoreError``.

    LMDB has no checksums: a damaged B-tree page surfaces as MDB_CORRUPTED,
    MDB_PAGE_NOTFOUND, a bad value size, and so on. Those name the index as
    corrupt (``kvstore recover`` rebuilds it); anything else LMDB refuses on a
    read (reader slots full, ...) is an ``IOFailure``.
    """
    try:
        yield
    except _LMDB_DAMAGE as e:
        raise CorruptionError(
            f"the LMDB index at {path} is damaged ({e}); run `kvstore recover PATH`"
        ) from e
    except lmdb.Error as e:
        raise IOFailure(f"LMDB read of {path} failed: {e}") from e


_LMDB_DAMAGE = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.BadValsizeError,
    lmdb.BadTxnError,
    lmdb.PanicError,
    lmdb.VersionMismatchError,
    lmdb.IncompatibleError,
    lmdb.NotFoundError,
)


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
        self._check_file_size()
        self._check_structure()
        if not readonly:
            with lmdb_read_errors(path):
                self.env.reader_check()  # clear reader slots of killed processes
        try:
            self.pages = self.env.open_db(b"pages", create=not readonly)
            self.segments = self.env.open_db(b"segments", create=not readonly)
            self.meta = self.env.open_db(b"meta", create=not readonly)
            self.retains = self.env.open_db(b"retains", create=not readonly)
        except lmdb.Error as e:
            raise CorruptionError(f"LMDB index at {path} lacks its databases: {e}") from e

    def _check_file_size(self) -> None:
        """Refuse a ``data.mdb`` shorter than the pages its meta page claims.

        LMDB maps the file and trusts its meta page: touching a page past the end
        of a truncated file is SIGBUS, which kills the process instead of raising.
        """
        try:
            last_page = self.env.info()["last_pgno"]
            page_bytes = self.env.stat()["psize"]
            file_bytes = os.stat(self.path / "data.mdb").st_size
        except (lmdb.Error, OSError) as e:
            self.env.close()
            raise CorruptionError(f"cannot read the LMDB index at {self.path}: {e}") from e
        if (last_page + 1) * page_bytes <= file_bytes:
            return
        # The meta page's last page can be one LMDB never wrote (allocated and
        # freed again within a transaction), so a sound file may end before it
        # (the kill -9 loop met it every few dozen cycles). Refuse only if a page
        # reachable from the roots lies past the end.
        try:
            with self.env.begin(write=False):  # no writer reuses pages meanwhile
                problems = verify_lmdb_file(self.path / "data.mdb", page_bytes)
        except lmdb.Error as e:
            problems = [str(e)]
        if problems:
            self.env.close()
            raise CorruptionError(
                f"the LMDB index at {self.path} is truncated ({file_bytes} bytes, its meta "
                f"page names page {last_page}: {problems[0]}); run `kvstore recover PATH`"
            )

    def _check_structure(self) -> None:
        """Refuse a small index whose B-tree would send LMDB outside its file.

        Walked inside a read transaction, so a live writer cannot reuse the
        pages being checked. Larger indexes are walked by fsck only (the walk
        is Python, O(index size)).
        """
        try:
            if os.stat(self.path / "data.mdb").st_size > VERIFY_ON_OPEN_MAX_BYTES:
                return
            with self.env.begin(write=False):
                problems = verify_lmdb_file(self.path / "data.mdb")
        except (lmdb.Error, OSError) as e:
            problems = [str(e)]
        if problems:
            self.env.close()
            raise CorruptionError(
                f"the LMDB index at {self.path} is damaged ({problems[0]}); "
                "run `kvstore recover PATH`"
            )

    def read(self) -> Any:
        with lmdb_read_errors(self.path):
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
        with lmdb_read_errors(self.path):
            raw = txn.get(key, db=self.meta)
        return default if raw is None else decode_meta_u64(key, raw)

    def close(self) -> None:
        self.env.close()
