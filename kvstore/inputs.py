"""Checks and encodings of what callers hand the store: keys, values, meta, buffers.

Each function either returns the canonical form (bytes of a key, a flat byte view of
a value, meta's JSON bytes) or raises TypeError/ValueError naming the problem; none
of them touches the store's state. ``decode_meta`` is the reverse of ``meta_bytes``
for what the store read back (CorruptionError when it is not a JSON object).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from kvstore.errors import CorruptionError
from kvstore.format.constants import MAX_INDEX_KEY_BYTES, MAX_META_BYTES, MAX_META_DEPTH
from kvstore.types import Meta

__all__ = [
    "check_fits",
    "decode_meta",
    "json_depth",
    "key_bytes",
    "meta_bytes",
    "value_view",
    "writable_view",
]


def key_bytes(key: object) -> bytes:
    if isinstance(key, str):
        try:
            raw = key.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate, e.g. from os.fsdecode
            shown = key if len(key) <= 64 else key[:64] + "..."
            raise ValueError(
                f"key {shown!r} is not encodable as UTF-8 ({e.reason} at index {e.start}); "
                "pass bytes, or a str without lone surrogates"
            ) from None
    elif isinstance(key, bytes):
        raw = key
    else:
        raise TypeError(f"key must be bytes or str, not {type(key).__name__}")
    if not 0 < len(raw) <= MAX_INDEX_KEY_BYTES:
        raise ValueError(
            f"key must be 1..{MAX_INDEX_KEY_BYTES} bytes (the LMDB index's key limit), "
            f"got {len(raw)}"
        )
    return raw


def value_view(value: object, max_page_bytes: int) -> memoryview:
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            "value must support the buffer protocol (bytes, bytearray, memoryview, "
            f"numpy array), not {type(value).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError("value must be C-contiguous; copy it first (e.g. numpy.ascontiguousarray)")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    size = view.nbytes
    if size == 0:
        raise ValueError("value is empty; pages must be at least 1 byte")
    if size > max_page_bytes:
        raise ValueError(f"value of {size} bytes exceeds max_page_bytes ({max_page_bytes})")
    return view


def meta_bytes(meta: Meta | None) -> bytes:
    if meta is None:
        return b""
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a mapping of str to JSON values, not {type(meta).__name__}")
    try:
        raw = json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except RecursionError:
        raise ValueError(f"meta nests deeper than {MAX_META_DEPTH} levels") from None
    except (TypeError, ValueError) as e:
        raise TypeError(f"meta must hold only JSON values: {e}") from None
    if len(raw) > MAX_META_BYTES:
        raise ValueError(f"meta encodes to {len(raw)} bytes; the limit is {MAX_META_BYTES}")
    # Nesting is capped so that every reader can decode what was stored: the JSON
    # decoder recurses per level. Counting brackets is cheap and bounds the depth.
    if raw.count(b"[") + raw.count(b"{") > MAX_META_DEPTH and json_depth(meta) > MAX_META_DEPTH:
        raise ValueError(f"meta nests deeper than {MAX_META_DEPTH} levels")
    return raw


def json_depth(value: object) -> int:
    """How deeply ``value`` nests dicts and lists (a scalar is 0), without recursion."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[object] = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def writable_view(buffer: object) -> memoryview:
    """A flat, writable byte view of ``buffer``, or a TypeError/ValueError saying why not."""
    try:
        target = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"buffer must support the buffer protocol, not {type(buffer).__name__}"
        ) from None
    if target.readonly:
        raise TypeError("buffer must be writable")
    if not target.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    return target.cast("B") if target.format != "B" or target.ndim != 1 else target


def check_fits(target: memoryview, key: bytes, payload_bytes: int) -> None:
    if payload_bytes > target.nbytes:
        raise ValueError(
            f"buffer of {target.nbytes} bytes is too small for page {key!r} "
            f"of {payload_bytes} bytes"
        )


def decode_meta(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        decoded = json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        raise CorruptionError("page meta is not JSON") from None
    if not isinstance(decoded, dict):
        raise CorruptionError("page meta is not a JSON object")
    return decoded
