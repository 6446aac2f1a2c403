"""The two PyPI ``liburing`` bindings behind one small interface.

Both publish the module ``liburing``, with different APIs:

- **liburing-2024** (``liburing`` 2024.x, Cython with the C liburing bundled,
  built from its sdist): ``io_uring()`` rings, ``iovec``, ``io_uring_cqe`` and
  ``io_uring_peek_cqe``; negative results come back as ints. It runs on any
  x86-64 CPU and any kernel with io_uring (5.1+). The project's pinned default.
- **liburing-2026** (``liburing`` 2026.x, Zig wheels): ``Ring()``, ``Iovec``,
  ``Cqe`` and ``CqeIter``; a negative ``res`` raises ``OSError``. The wheels are
  tuned to their build machine's CPU (AVX-512) and want Linux 6.14+.

Whichever is importable is used; ``UringQueue`` only talks to a ``Binding``.
Nothing here proves that a binding *runs*: a binding built for another CPU
dies with SIGILL at its first call, so ``kvstore.io.probe`` runs one in a
child process before this process touches it.
"""

from __future__ import annotations

import ctypes
import importlib
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from kvstore.errors import IOFailure
from kvstore.io.files import system_iov_max

__all__ = ["BINDING_NAMES", "Binding", "binding_flavour", "load_binding"]

BINDING_NAMES = ("liburing-2024", "liburing-2026")


def binding_flavour(module: ModuleType) -> str | None:
    """Which of ``BINDING_NAMES`` a ``liburing`` module is, or None for neither."""
    if hasattr(module, "Ring") and hasattr(module, "CqeIter"):
        return "liburing-2026"
    if hasattr(module, "io_uring") and hasattr(module, "io_uring_peek_cqe"):
        return "liburing-2024"
    return None


class Binding:
    """What ``UringQueue`` needs from a binding; one subclass per API."""

    name = "?"

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.version: str = str(getattr(module, "__version__", "") or _dist_version())
        self.file: str = str(getattr(module, "__file__", "") or "")
        # The most buffers one ``iovec`` may gather (a writer's gather list stays within).
        self.max_iovecs: int = system_iov_max()

    def _checked(self, what: str, *args: Any) -> Any:
        """The binding's ``what(*args)``; an ``OSError`` (2026) or a negative
        result (2024 returns some errors as ints) becomes ``IOFailure``."""
        try:
            result = getattr(self.module, what)(*args)
        except OSError as e:
            raise IOFailure(f"{what} refused", e.errno) from e
        if isinstance(result, int) and result < 0:
            raise IOFailure(f"{what} refused", -result)
        return result

    def new_ring(self, entries: int) -> Any:
        raise NotImplementedError

    def exit_ring(self, ring: Any) -> None:
        self.module.io_uring_queue_exit(ring)

    def register_eventfd(self, ring: Any, fd: int) -> None:
        self._checked("io_uring_register_eventfd", ring, fd)

    def get_sqe(self, ring: Any) -> Any | None:
        raise NotImplementedError

    def iovec(self, buffers: list[memoryview]) -> Any:
        raise NotImplementedError

    def prep_readv(self, sqe: Any, fd: int, iovec: Any, count: int, offset: int) -> None:
        raise NotImplementedError

    def prep_writev(self, sqe: Any, fd: int, iovec: Any, count: int, offset: int) -> None:
        raise NotImplementedError

    def prep_nop(self, sqe: Any) -> None:
        self.module.io_uring_prep_nop(sqe)

    def set_token(self, sqe: Any, token: int) -> None:
        self.module.io_uring_sqe_set_data64(sqe, token)

    def submit(self, ring: Any) -> None:
        self._checked("io_uring_submit", ring)

    def new_cqe(self) -> Any:
        raise NotImplementedError

    def reap(self, ring: Any, cqe: Any, out: list[tuple[int, int]]) -> None:
        """Append every ready ``(token, result)`` to ``out`` without blocking."""
        raise NotImplementedError


def _dist_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("liburing")
    except metadata.PackageNotFoundError:
        return "unknown"


def _iovec_limit(make_iovec: Callable[[list[bytes]], Any], wanted: int) -> int:
    """The longest gather list ``make_iovec`` takes, up to ``wanted``: ``wanted`` if it
    takes that many, else the longest it takes found by halving, at least 1."""
    one = [b"\0"]
    low, high = 0, wanted
    while low < high:  # the largest n in [1, wanted] that it takes
        n = (low + high + 1) // 2
        try:
            make_iovec(one * n)
        except (OverflowError, ValueError, MemoryError):
            high = n - 1
        else:
            low = n
    return max(low, 1)


class Liburing2024(Binding):
    """``liburing`` 2024.x (Cython).

    Its ``iovec`` refuses more than ``SC_IOV_MAX`` buffers, a constant that 2024.5.3
    sets to the ``sysconf`` name ``_SC_IOV_MAX`` (60 on Linux), not to the limit that
    name looks up (1024): a longer gather list raises ``OverflowError``. The limit in
    force is found once, by asking it (``_iovec_limit``).
    """

    name = "liburing-2024"

    def __init__(self, module: ModuleType) -> None:
        super().__init__(module)
        self.max_iovecs = _iovec_limit(module.iovec, self.max_iovecs)

    def new_ring(self, entries: int) -> Any:
        ring = self.module.io_uring()
        self._checked("io_uring_queue_init", entries, ring, 0)
        return ring

    def get_sqe(self, ring: Any) -> Any | None:
        sqe = self.module.io_uring_get_sqe(ring)
        return sqe if sqe else None  # a full queue gives an sqe over NULL

    def iovec(self, buffers: list[memoryview]) -> Any:
        # The iovec keeps a reference to each buffer until it is dropped, which
        # UringQueue does when the completion is reaped: nothing stays pinned.
        return self.module.iovec(buffers)

    def prep_readv(self, sqe: Any, fd: int, iovec: Any, count: int, offset: int) -> None:
        self.module.io_uring_prep_readv(sqe, fd, iovec, offset)

    def prep_writev(self, sqe: Any, fd: int, iovec: Any, count: int, offset: int) -> None:
        self.module.io_uring_prep_writev(sqe, fd, iovec, count, offset)

    def new_cqe(self) -> Any:
        return self.module.io_uring_cqe()

    def reap(self, ring: Any, cqe: Any, out: list[tuple[int, int]]) -> None:
        module = self.module
        peek, seen = module.io_uring_peek_cqe, module.io_uring_cqe_seen
        while peek(ring, cqe) == 0:
            out.append((cqe.user_data, cqe.res))
            seen(ring, cqe)


_IOVEC_CACHE_MAX = 4096


class Liburing2026(Binding):
    """``liburing`` 2026.x (Zig).

    Its ``Iovec`` takes a buffer export of each item and never releases it: an
    item handed to it stays alive (and its mmap mapped) for the life of the
    process. So ``iovec`` hands it a ctypes array over the same memory instead,
    one per (address, length), and caches the ``Iovec``: buffers can be
    unmapped, and only those small arrays stay pinned (pool buffers reuse their
    addresses). Read-only buffers (writes from ``bytes``) are handed over as
    they are.
    """

    name = "liburing-2026"

    def __init__(self, module: ModuleType) -> None:
        super().__init__(module)
        self._iovecs: dict[tuple[tuple[int, int], ...], Any] = {}
        self._iovecs_lock = threading.Lock()

    def new_ring(self, entries: int) -> Any:
        ring = self.module.Ring()
        self._checked("io_uring_queue_init", entries, ring)
        return ring

    def get_sqe(self, ring: Any) -> Any | None:
        return self.module.io_uring_get_sqe(ring)

    def iovec(self, buffers: list[memoryview]) -> Any:
        if any(buffer.readonly for buffer in buffers):
            return self.module.Iovec(buffers)
        windows = [
            (ctypes.addressof(ctypes.c_char.from_buffer(buffer)), buffer.nbytes)
            for buffer in buffers
        ]
        key = tuple(windows)
        iovec = self._iovecs.get(key)
        if iovec is None:
            iovec = self.module.Iovec(
                [
                    memoryview((ctypes.c_char * length).from_address(address)).cast("B")
                    for address, length in windows
                ]
            )
            with self._iovecs_lock:
                if len(self._iovecs) >= _IOVEC_CACHE_MAX:
                    self._iovecs.clear()
                self._iovecs[key] = iovec
        return iovec

    def prep_readv(self, sqe: Any, fd: int, iovec: Any, count: int, offset: int) -> None:
        self.module.io_uring_prep_readv(sqe, fd, iovec, offset)

    def prep_writev(self, sqe: Any, fd: int, iovec: Any, count: int, offset: int) -> None:
        self.module.io_uring_prep_writev(sqe, fd, iovec, offset)

    def new_cqe(self) -> Any:
        return self.module.Cqe()

    def reap(self, ring: Any, cqe: Any, out: list[tuple[int, int]]) -> None:
        module = self.module
        count = 0
        for _ in module.CqeIter(ring, cqe):
            entry = cqe[0]
            try:
                result = entry.res
            except OSError as e:  # the binding raises for a negative res
                result = -(e.errno or 5)
            out.append((entry.user_data, result))
            count += 1
        if count:
            module.io_uring_cq_advance(ring, count)


_FLAVOURS: dict[str, type[Binding]] = {
    "liburing-2024": Liburing2024,
    "liburing-2026": Liburing2026,
}
_loaded: dict[str, Binding] = {}
_loaded_lock = threading.Lock()


def _import_liburing() -> ModuleType:
    """``import liburing``, once more if the first attempt failed on a file: the 2024
    wheel's loader (``dynamic_import``) deletes its own bytecode cache while it imports,
    so two processes importing it for the first time can race on that file
    (FileNotFoundError in the one that lost: CI's fresh virtual environment, a store
    opened in two processes at once). The second attempt finds the cache rebuilt."""
    try:
        return importlib.import_module("liburing")
    except ImportError as e:
        raise IOFailure(f"no io_uring binding: cannot import liburing ({e})") from e
    except OSError:
        pass  # lost the race on the loader's cache file: once more
    try:
        return importlib.import_module("liburing")
    except (ImportError, OSError) as e:
        raise IOFailure(f"no io_uring binding: importing liburing failed ({e!r})") from e


def load_binding(wanted: str = "auto") -> Binding:
    """The importable ``liburing`` as a ``Binding``, checked against ``wanted``.

    Importing is safe (no ring is made); call ``kvstore.io.probe`` before using
    the result in this process. Raises ``IOFailure`` naming the problem when no
    binding is importable or the importable one is not ``wanted``.
    """
    if wanted != "auto" and wanted not in _FLAVOURS:
        raise ValueError(f"uring_binding must be 'auto' or one of {BINDING_NAMES}, got {wanted!r}")
    with _loaded_lock:
        cached = _loaded.get(wanted)
        if cached is not None:
            return cached
        module = _import_liburing()
        flavour = binding_flavour(module)
        if flavour is None:
            raise IOFailure(
                f"the installed liburing ({getattr(module, '__file__', '?')}) has neither "
                "API kvstore knows (2024.x: io_uring(); 2026.x: Ring())"
            )
        if wanted not in ("auto", flavour):
            raise IOFailure(
                f"uring_binding={wanted!r} was asked for, but the importable liburing is "
                f"{flavour} ({getattr(module, '__file__', '?')})"
            )
        binding = _FLAVOURS[flavour](module)
        _loaded[wanted] = binding
        return binding
