"""A structural check of ``data.mdb`` that reads the file, never maps it.

LMDB keeps no checksums and trusts its pages: a flipped node offset or value
size makes it read past the end of the file (SIGBUS) or the map (SIGSEGV),
which kills the process instead of raising. fsck and ``kvstore recover`` must
survive exactly that damage, so before they let LMDB walk the tree they walk
it here with ``pread``: every page reachable from the current meta page must
sit inside the file and hold nodes that fit inside it.

Layout (LMDB 0.9, 64-bit): a page starts with ``pgno u64, pad u16, flags u16,
lower u16, upper u16`` (overflow pages: ``pages u32`` in place of lower/upper);
node offsets (u16) follow at [16, lower); nodes sit at [upper, page end), each
``lo u16, hi u16, flags u16, ksize u16, key, value``. Pages 0 and 1 are the
two meta pages; the newer (higher txnid) one is current.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from kvstore.errors import NotRegularFileError
from kvstore.log.regular import open_regular

__all__ = ["verify_lmdb_file"]

_MAGIC = 0xBEEFC0DE
_HEADER = 16
_META = struct.Struct("<IIQQ")  # magic, version, address, mapsize
_DB = struct.Struct("<IHHQQQQQ")  # pad (page size in the free db), flags, depth, ..., root
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META, _P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_P_INVALID = (1 << 64) - 1
_MAX_PROBLEMS = 20


def verify_lmdb_file(path: Path, page_bytes: int = 4096) -> list[str]:
    """Problems that would make LMDB read outside ``path``; empty when sound.

    Checks bounds and shapes only (it cannot know whether a key or value is
    the right one: the entries' own checksums do that).
    """
    try:
        with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 2 * page_bytes:
                return [f"{path.name}: {size} bytes, shorter than its two meta pages"]
            # A read-only map: Python bounds-checks every access against the
            # length mapped here, and a large index is not copied into memory.
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _verify(data, size, page_bytes)
    except NotRegularFileError as e:  # a FIFO would have blocked the open forever
        return [str(e.args[0])]
    except (OSError, ValueError) as e:
        return [f"cannot read {path}: {e}"]


def _verify(data: mmap.mmap, size: int, page_bytes: int) -> list[str]:
    pages = size // page_bytes
    metas = []
    problems: list[str] = []
    for pgno in (0, 1):
        base = pgno * page_bytes
        magic, version, _, _ = _META.unpack_from(data, base + _HEADER)
        flags = struct.unpack_from("<H", data, base + 10)[0]
        if magic != _MAGIC or version != 1 or not flags & _P_META:
            problems.append(f"meta page {pgno}: bad magic, version or flags")
            continue
        at = base + _HEADER + _META.size
        dbs = [_DB.unpack_from(data, at + index * _DB.size) for index in (0, 1)]
        last_page, txnid = struct.unpack_from("<QQ", data, at + 2 * _DB.size)
        metas.append((txnid, pgno, dbs, last_page))
    if problems:
        return problems
    _, meta_pgno, dbs, last_page = max(metas)
    # The meta page's last page may lie past the end of the file: LMDB counts a
    # page it allocated and freed again in the same transaction (a "loose" page,
    # never written) as used. Only the pages reachable from the roots must be
    # inside the file.
    walker = _Walker(data, page_bytes, min(last_page, pages - 1))
    for db in dbs:
        walker.visit(db[7], f"meta {meta_pgno}")
    return walker.problems


class _Walker:
    def __init__(self, data: mmap.mmap, page_bytes: int, last_page: int) -> None:
        self.data = data
        self.page_bytes = page_bytes
        self.last_page = last_page
        self.seen: set[int] = set()
        self.problems: list[str] = []

    def bad(self, message: str) -> None:
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(message)

    def visit(self, root: int, parent: str) -> None:
        if root == _P_INVALID:
            return
        todo = [(root, parent)]
        while todo and len(self.problems) < _MAX_PROBLEMS:
            pgno, parent = todo.pop()
            if not 2 <= pgno <= self.last_page:
                self.bad(f"{parent} points at page {pgno}, outside 2..{self.last_page}")
                continue
            if pgno in self.seen:
                self.bad(f"{parent} points at page {pgno} again (a cycle or a shared page)")
                continue
            self.seen.add(pgno)
            todo.extend(self.page(pgno))

    def page(self, pgno: int) -> list[tuple[int, str]]:
        data, page_bytes = self.data, self.page_bytes
        base = pgno * page_bytes
        stored, _, flags, lower, upper = struct.unpack_from("<QHHHH", data, base)
        where = f"page {pgno}"
        if stored != pgno:
            self.bad(f"{where}: header says page {stored}")
            return []
        if flags & _P_OVERFLOW or not flags & (_P_BRANCH | _P_LEAF) or flags & _P_LEAF2:
            self.bad(f"{where}: flags {flags:#x} are not a branch or leaf page")
            return []
        if not _HEADER <= lower <= upper <= page_bytes or lower % 2:
            self.bad(f"{where}: free-space bounds {lower}/{upper} are impossible")
            return []
        count = (lower - _HEADER) // 2
        if count == 0 and flags & _P_BRANCH:
            self.bad(f"{where}: an empty branch page")
            return []
        children: list[tuple[int, str]] = []
        for slot in range(count):
            (node_at,) = struct.unpack_from("<H", data, base + _HEADER + 2 * slot)
            if node_at < upper or node_at % 2 or node_at + 8 > page_bytes:
                self.bad(f"{where}: node {slot} at {node_at} lies outside the node area")
                return []
            lo, hi, node_flags, key_bytes = struct.unpack_from("<HHHH", data, base + node_at)
            value_at = node_at + 8 + key_bytes
            if value_at > page_bytes:
                self.bad(f"{where}: node {slot} key runs past the page")
                return []
            if flags & _P_BRANCH:
                children.append((lo | hi << 16 | node_flags << 32, where))
                continue
            value_bytes = lo | hi << 16
            if node_flags & _F_DUPDATA:
                self.bad(f"{where}: node {slot} has duplicate data (kvstore never writes it)")
                return []
            if node_flags & _F_BIGDATA:
                if value_at + 8 > page_bytes:
                    self.bad(f"{where}: node {slot} overflow pointer runs past the page")
                    return []
                (first,) = struct.unpack_from("<Q", data, base + value_at)
                self.overflow(first, value_bytes, f"{where} node {slot}")
                continue
            if value_at + value_bytes > page_bytes:
                self.bad(f"{where}: node {slot} value of {value_bytes} bytes runs past the page")
                return []
            if node_flags & _F_SUBDATA:
                if value_bytes != _DB.size:
                    self.bad(f"{where}: node {slot} names a database with a bad record")
                    return []
                root = _DB.unpack_from(data, base + value_at)[7]
                if root != _P_INVALID:
                    children.append((root, f"{where} node {slot} (a named database)"))
        return children

    def overflow(self, first: int, value_bytes: int, where: str) -> None:
        if not 2 <= first <= self.last_page:
            self.bad(f"{where}: overflow page {first} outside 2..{self.last_page}")
            return
        base = first * self.page_bytes
        stored, _, flags, count = struct.unpack_from("<QHHI", self.data, base)
        if stored != first or not flags & _P_OVERFLOW:
            self.bad(f"{where}: overflow page {first} is not one")
            return
        if first + count - 1 > self.last_page or value_bytes > count * self.page_bytes - _HEADER:
            self.bad(f"{where}: overflow run of {count} pages does not hold {value_bytes} bytes")
            return
        self.seen.update(range(first, first + count))
