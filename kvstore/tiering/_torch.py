"""torch, imported when the real tier manager first needs it.

The simulator, the trace tools, ``kvstore sim`` and ``kvstore tier stat`` never
import torch: the fake mover and the virtual slots move no tensors. The real
manager's arenas and movers do, and :func:`require_torch` is where a missing
torch becomes one line that says what to install.
"""

from __future__ import annotations

from types import ModuleType

from kvstore.errors import KVStoreError

__all__ = ["INSTALL_HINT", "TorchMissingError", "require_torch"]

INSTALL_HINT = "pip install 'kvstore[torch]'"


class TorchMissingError(KVStoreError, ImportError):
    """torch is not installed and the real tier manager (arenas, movers) needs it."""


def require_torch(what: str = "the tier manager") -> ModuleType:
    """The torch module, or TorchMissingError naming what needs it and what to install."""
    try:
        import torch
    except ImportError as e:
        raise TorchMissingError(
            f"{what} needs torch, which is not installed; install it with: {INSTALL_HINT} "
            "(the simulator, `kvstore sim` and `kvstore tier stat` do not need it)"
        ) from e
    return torch
