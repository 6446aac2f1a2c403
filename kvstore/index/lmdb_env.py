"""The LMDB environment: ``pages``, ``segments``, ``meta`` and ``retains`` databases.

One Environment per process and never across fork (LMDB's rule). The map is
grown on MapFullError and the transaction retried. LMDB syncs its own files
on commit, but never fsyncs a directory: the store does that once at creation.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from kvstore.errors import AlreadyOpenError, CorruptionError, FormatVersionError, IOFailure
from kvstore.format.checksum import checksum
from kvstore.format.constants import MAX_INDEX_KEY_BYTES
from kvstore.index.lmdb_verify import verify_lmdb_file
from kvstore.log.regular import require_regular

__all__ = [
    "IndexDamagedError",
    "IndexEnv",
    "decode_meta_u64",
    "encode_meta_u64",
    "lmdb_read_errors",
    "open_environment",
]

T = TypeVar("T")
INITIAL_MAP_BYTES = 1 << 30
_WALK_ATTEMPTS = 5  # walks redone while a live writer's commits overlap them
_ITER_CHUNK = 1024  # entries read per transaction by IndexEnv.iter_items
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


def require_index_files_regular(path: Path) -> None:
    """LMDB opens ``data.mdb`` and ``lock.mdb`` itself: check them first, because
    open(2) of a FIFO in their place would block forever."""
    for name in ("data.mdb", "lock.mdb"):
        require_regular(path / name)


def check_key_limit(lmdb_max_key_bytes: int) -> None:
    """Refuse an LMDB build that cannot hold every key the store accepts.

    The ``pages`` and ``retains`` databases are keyed by the page key itself (no
    prefix), so a key fits the index iff it fits LMDB. py-lmdb's bundled LMDB
    holds 511 bytes (MDB_MAXKEYSIZE), which is ``MAX_INDEX_KEY_BYTES``; a key the
    store accepted must stay readable under every build that opens it.
    """
    if lmdb_max_key_bytes < MAX_INDEX_KEY_BYTES:
        raise FormatVersionError(
            f"this LMDB build holds keys of at most {lmdb_max_key_bytes} bytes, but kvstore "
            f"keys may be {MAX_INDEX_KEY_BYTES}: install py-lmdb with its bundled LMDB"
        )


_LMDB_OPEN_DAMAGE = (*_LMDB_DAMAGE, lmdb.MemoryError, lmdb.InvalidParameterError)
"""What ``lmdb.open`` raises for a damaged meta page (a bad magic or version, a
last page or map size so large the map cannot be made)."""


def open_environment(
    path: Path,
    *,
    readonly: bool,
    create: bool = False,
    lock: bool = True,
    map_size: int | None = None,
) -> Any:
    """The store's LMDB environment (``index/``), configured in this one place: the
    writer's and the views' ``IndexEnv``, ``kvstore recover`` (read-only, ``lock=False``:
    no writer may run) and ``kvstore stat`` (read-only beside a writer). Raises
    ``lmdb.Error``; the callers say what it means for them."""
    return lmdb.open(
        str(path),
        map_size=INITIAL_MAP_BYTES if map_size is None else map_size,
        max_dbs=8,
        subdir=True,
        readonly=readonly,
        create=create,
        sync=True,
        metasync=True,
        readahead=False,
        max_readers=256,
        lock=lock,
        mode=0o600,
    )


class IndexDamagedError(CorruptionError):
    """The LMDB file's structure is damaged: LMDB itself must not read it.

    ``problems`` lists what the structural walk found. A store open salvages what
    still verifies (kvstore/index/salvage.py) instead of refusing.
    """

    def __init__(self, message: str, problems: list[str]) -> None:
        super().__init__(message)
        self.problems = problems


class IndexEnv:
    """Thin owner of the LMDB environment and its three named databases."""

    check_seconds = 0.0
    """How long this open's structural check of ``data.mdb`` took."""

    def __init__(self, path: Path, *, readonly: bool, create: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        # A read-only view's one read transaction (``pin``): every ``read`` reuses
        # it, so all of the view's lookups see one point in time. LMDB lets a read
        # transaction serve several threads only if they take turns: ``_pin_lock``.
        self._pinned: Any = None
        self._pin_lock = threading.RLock()
        require_index_files_regular(path)
        try:
            self.env = open_environment(path, readonly=readonly, create=create)
        except lmdb.Error as e:
            if "already open in this process" in str(e):
                raise AlreadyOpenError(f"the store's index {path} is already open here") from e
            message = f"cannot open the LMDB index at {path}: {e}"
            # LMDB refuses a damaged meta page (bad magic or version, a last page or
            # map size it cannot map): if the file's own walk agrees, it is damage.
            problems = verify_lmdb_file(path / "data.mdb") if (path / "data.mdb").exists() else []
            if problems or isinstance(e, _LMDB_OPEN_DAMAGE):
                raise IndexDamagedError(message, problems or [str(e)]) from e
            raise CorruptionError(message) from e
        try:
            check_key_limit(self.env.max_key_size())
        except FormatVersionError:
            self.env.close()
            raise
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
            self.env.close()
            raise IndexDamagedError(
                f"LMDB index at {path} lacks its databases: {e}", [f"no databases: {e}"]
            ) from e

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
            raise IndexDamagedError(
                f"the LMDB index at {self.path} is truncated ({file_bytes} bytes, its meta "
                f"page names page {last_page}: {problems[0]}); run `kvstore recover PATH`",
                problems,
            )

    def _check_structure(self) -> None:
        """Refuse an index whose B-tree would send LMDB outside its file, or whose
        free lists would make LMDB overwrite a live page (``IndexDamagedError``).

        Walked at every open (numpy, a level of the tree at a time: ~25 ms for
        100,000 pages; ``check_seconds`` says how long it took), inside a read
        transaction, so a live writer cannot reuse the pages being checked.
        """
        started = time.perf_counter()
        try:
            for _ in range(_WALK_ATTEMPTS):
                try:
                    before = self.last_txnid()
                    with self.env.begin(write=False):
                        problems = verify_lmdb_file(self.path / "data.mdb")
                    # A live writer committing during the walk can make the file look
                    # torn (it grew past the mapped length, a meta page was half
                    # written): only a walk no commit overlapped is believed.
                    moved = bool(problems) and self.last_txnid() != before
                except (lmdb.Error, OSError, CorruptionError, IOFailure) as e:
                    problems, moved = [str(e)], False
                if not moved:
                    break
        finally:
            self.check_seconds = time.perf_counter() - started
        if problems:
            self.env.close()
            raise IndexDamagedError(
                f"the LMDB index at {self.path} is damaged ({problems[0]}); "
                "run `kvstore recover PATH`",
                problems,
            )

    @contextlib.contextmanager
    def read(self) -> Iterator[Any]:
        """A read transaction: the pinned one (``pin``) if any, else a fresh one."""
        if self._pinned is not None:
            with self._pin_lock:
                pinned = self._pinned
                if pinned is not None:
                    yield pinned
                    return
        with lmdb_read_errors(self.path):
            txn = self.env.begin(write=False, buffers=False)
        try:
            yield txn
        finally:
            txn.abort()

    def pin(self) -> None:
        """Fix every later ``read`` at the current point in time (a read-only view).

        Holds one LMDB read transaction until ``unpin`` or ``close``: the writer
        cannot reuse the pages it sees, so the view stays whole however far the
        writer moves on (and its index file may grow while the view is held).
        """
        with self._pin_lock:
            self.unpin()
            with lmdb_read_errors(self.path):
                self._pinned = self.env.begin(write=False, buffers=False)

    def unpin(self) -> None:
        with self._pin_lock:
            pinned, self._pinned = self._pinned, None
            if pinned is not None:
                pinned.abort()

    @property
    def pinned(self) -> bool:
        return self._pinned is not None

    def get_pinned(self, key: bytes, db: Any) -> bytes | None:
        """``key`` in ``db`` as the pinned transaction sees it (the lookup fast path)."""
        with self._pin_lock:
            pinned = self._pinned
            if pinned is None:
                with self.read() as txn:
                    raw: bytes | None = txn.get(key, db=db)
                return raw
            return pinned.get(key, db=db)  # type: ignore[no-any-return]

    def iter_items(self, db: Any, *, values: bool = True) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) of ``db`` in key order, read ``_ITER_CHUNK`` at a time.

        No transaction (nor the pin's lock) stays held while the caller works on
        a chunk. Pinned, the chunks all come from the one view; unpinned, each
        chunk is read at its own point in time (keys changed meanwhile may or
        may not show). ``values=False`` yields empty values.
        """
        after: bytes | None = None
        while True:
            chunk: list[tuple[bytes, bytes]] = []
            with self.read() as txn, lmdb_read_errors(self.path):
                cursor = txn.cursor(db=db)
                found = cursor.first() if after is None else cursor.set_range(after)
                while found and len(chunk) < _ITER_CHUNK:
                    key = bytes(cursor.key())
                    if key != after:
                        chunk.append((key, bytes(cursor.value()) if values else b""))
                    found = cursor.next()
            if not chunk:
                return
            yield from chunk
            after = chunk[-1][0]

    def last_txnid(self) -> int:
        """The id of the newest committed write transaction (what a fresh read sees)."""
        with lmdb_read_errors(self.path):
            return int(self.env.info()["last_txnid"])

    def fresh_meta(self, key: bytes, default: int) -> int:
        """A meta value as of now, bypassing the pin (has a live writer moved on?)."""
        with lmdb_read_errors(self.path):
            txn = self.env.begin(write=False, buffers=False)
        try:
            return self.get_meta(txn, key, default)
        finally:
            txn.abort()

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

    def sync(self) -> None:
        """Force LMDB's data to disk now (after writes made with ``write`` by a tool
        that builds an index and swaps it in: ``kvstore recover``, salvage)."""
        try:
            self.env.sync(True)
        except lmdb.Error as e:
            raise IOFailure(f"LMDB sync of {self.path} failed: {e}") from e

    def get_meta(self, txn: Any, key: bytes, default: int) -> int:
        with lmdb_read_errors(self.path):
            raw = txn.get(key, db=self.meta)
        return default if raw is None else decode_meta_u64(key, raw)

    def close(self) -> None:
        with contextlib.suppress(lmdb.Error):
            self.unpin()
        self.env.close()
