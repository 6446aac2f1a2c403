"""Errors of the HBM path; all are ``KVStoreError`` subclasses.

Misuse (a tensor of the wrong dtype, shape or size, a non-contiguous tensor, a
device that does not match) raises the built-in ``TypeError`` / ``ValueError``
as the rest of the library does. These classes are for failures of the
transfer itself.
"""

from __future__ import annotations

from kvstore.errors import KVStoreError

__all__ = ["GDSUnavailableError", "PageMissingError", "TransferError", "TransferTimeoutError"]


class TransferError(KVStoreError):
    """A transfer between the store and a tensor failed; no tensor named in it is trustworthy.

    The message names the page. Destinations of a failed load hold unspecified
    bytes: load them again (or recompute them) before use.
    """

    hint = "load the pages again; if it repeats, run `kvstore fsck PATH --deep`"


class PageMissingError(TransferError):
    """A page to load is not in the store (never saved, deleted, or evicted)."""

    hint = "save the page first, or recompute it; check `kvstore stat` for evictions"


class GDSUnavailableError(TransferError):
    """GPUDirect Storage cannot be used: kvikio is missing, runs in POSIX
    compatibility mode, or cuFile refused a file or buffer registration.

    Nothing was loaded through GDS. Use ``backend="pinned"`` (or ``"auto"``,
    which falls back to it), or fix the GDS setup (``gdscheck -p``).
    """

    hint = 'use backend="pinned", or check the GDS setup with `gdscheck -p`'


class TransferTimeoutError(TransferError):
    """An I/O of a transfer did not complete within ``transfer_timeout_s``.

    Raised instead of hanging (a wedged cuFile or NVMe queue). The device or
    driver needs attention; the destinations hold unspecified bytes.
    """

    hint = "check dmesg and the GDS/NVMe driver; raise transfer_timeout_s for slow disks"
