"""torch helpers shared by the backends: dtype names, byte views, page meta, the device checksum.

torch is imported here, and only modules of ``kvstore.gpu`` import this one.

The device checksum ("wsum64") exists so that a page loaded by GPUDirect
Storage, whose bytes never pass through host memory, can be verified where it
landed. It is computed with plain tensor ops, so CPU and CUDA give the same
value: the payload as little-endian 32-bit words ``w_i`` (zero-padded),
``sum_i w_i * m_i  mod 2**64`` with ``m_i = ((i * 0x9E3779B1 + 0x7F4A7C15) mod 2**32) | 1``,
plus ``nbytes * 0x100000001B3``. Every multiplier is odd, so any change of a
single word changes the sum, and words moved to another position are caught
because their multipliers differ. It is not a cryptographic hash and it is
weaker than the store's xxh3-64, which stays the checksum of record; see
docs/hbm.md.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "DTYPE_NAMES",
    "byte_view",
    "check_destination",
    "check_source",
    "cuda_event",
    "cuda_stream",
    "device_checksum",
    "device_checksum_tensor",
    "finish_device_checksum",
    "page_meta",
]

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_LENGTH_PRIME = 0x100000001B3

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPE_NAMES[getattr(torch, _name)] = _name

META_DTYPE = "dtype"
META_SHAPE = "shape"
META_NBYTES = "nbytes"
META_DEVICE_CHECKSUM = "wsum64"


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D uint8 tensor sharing its memory (contiguous tensors only)."""
    return tensor.reshape(-1).view(torch.uint8)


def check_source(tensor: object, device: torch.device, what: str) -> torch.Tensor:
    """A tensor to save or load into: contiguous, on ``device``, of a known dtype."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(tensor).__name__}")
    if tensor.device != device:
        raise ValueError(f"{what} is on {tensor.device}; this TensorIO moves pages to {device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} is not contiguous; pass tensor.contiguous() (a copy)")
    if tensor.dtype not in DTYPE_NAMES:
        raise TypeError(f"{what} has dtype {tensor.dtype}, which kvstore.gpu does not store")
    if tensor.numel() == 0:
        raise ValueError(f"{what} is empty; pages must be at least 1 byte")
    return tensor


def page_meta(tensor: torch.Tensor) -> dict[str, Any]:
    """The meta a saved page carries: dtype, shape and byte size."""
    return {
        META_DTYPE: DTYPE_NAMES[tensor.dtype],
        META_SHAPE: list(tensor.shape),
        META_NBYTES: tensor.numel() * tensor.element_size(),
    }


def check_destination(key: object, tensor: torch.Tensor, meta: Mapping[str, Any]) -> int:
    """Check that ``tensor`` matches the saved page's dtype, shape and size; the page's bytes."""
    dtype = meta.get(META_DTYPE)
    shape = meta.get(META_SHAPE)
    nbytes = meta.get(META_NBYTES)
    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(nbytes, int):
        raise ValueError(
            f"page {key!r} was not saved by kvstore.gpu (its meta has no dtype/shape/nbytes); "
            "read it with KVStore.get_into"
        )
    name = DTYPE_NAMES[tensor.dtype]
    if name != dtype:
        raise TypeError(f"page {key!r} holds {dtype}; the destination tensor is {name}")
    if list(tensor.shape) != shape:
        raise ValueError(
            f"page {key!r} has shape {tuple(shape)}; the destination tensor has "
            f"shape {tuple(tensor.shape)}"
        )
    size = tensor.numel() * tensor.element_size()
    if size != nbytes:
        raise ValueError(f"page {key!r} is {nbytes} bytes; the destination tensor is {size}")
    return nbytes


_multipliers: dict[torch.device, torch.Tensor] = {}
_multipliers_lock = threading.Lock()


def _multiplier_table(words: int, device: torch.device) -> torch.Tensor:
    """``m_i`` for ``i < words`` on ``device``; grown (never on a steady state) and cached."""
    with _multipliers_lock:
        table = _multipliers.get(device)
        if table is None or table.numel() < words:
            size = max(words, 1 << 18)
            index = torch.arange(size, dtype=torch.int64, device=device)
            table = ((index * 0x9E3779B1 + 0x7F4A7C15) & _MASK32) | 1
            _multipliers[device] = table
        return table[:words]


def device_checksum_tensor(data: torch.Tensor) -> torch.Tensor:
    """The wsum64 of a uint8 tensor as a 0-dim int64 tensor on its device (no sync)."""
    nbytes = data.numel()
    if nbytes % 4:
        padded = torch.zeros(nbytes + 4 - nbytes % 4, dtype=torch.uint8, device=data.device)
        padded[:nbytes] = data
        data = padded
    words = data.view(torch.int32).to(torch.int64) & _MASK32
    # int64 products and sums wrap modulo 2**64 on CPU and CUDA alike.
    return (words * _multiplier_table(words.numel(), data.device)).sum()


def finish_device_checksum(partial: int, nbytes: int) -> str:
    """The stored form (16 hex digits) of a wsum64 from its partial sum."""
    return f"{(partial + nbytes * _LENGTH_PRIME) & _MASK64:016x}"


def device_checksum(data: torch.Tensor) -> str:
    """The wsum64 of a uint8 tensor, computed on its device (synchronises)."""
    return finish_device_checksum(int(device_checksum_tensor(data).item()), data.numel())


def cuda_event() -> Any:
    """A new ``torch.cuda.Event`` (torch leaves its constructor untyped)."""
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


def cuda_stream(device: torch.device) -> Any:
    """A new ``torch.cuda.Stream`` on ``device``, for the copies of one backend."""
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
