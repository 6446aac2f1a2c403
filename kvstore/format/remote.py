"""The remote tier's wire value: a page as it is published to a cluster store.

docs/format.md, "Remote tier value, version 1": the value is a 4096-byte header block
followed by the payload. The header block is the store's page record header
(``records.encode_record_fields_into``: magic, format version, key, meta, payload
length, payload checksum, sealed by the xxh3-64 of its first 4088 bytes) with lsn,
segment, offset and generation all 0 — offset 0 is never a record's on disk (block 0
of a segment is its header), so a remote header can never pass for a record and the
other way round. Its key is the remote key (the namespace and the page key, below),
its meta a JSON object ``{"kvr": 1, "ns": NAMESPACE, "parent": hex | null, "depth":
int, "tokens": int}``; ``kvr`` is the wire version. Bytes <-> values, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.errors import CorruptionError, KVStoreError
from kvstore.format.checksum import BytesLike, checksum
from kvstore.format.constants import BLOCK_BYTES, MAX_KEY_BYTES, RECORD_PAGE
from kvstore.format.records import decode_record_header, encode_record_fields_into

__all__ = [
    "REMOTE_HEADER_BYTES",
    "REMOTE_KEY_PREFIX",
    "REMOTE_WIRE_VERSION",
    "RemotePage",
    "encode_remote_header_into",
    "remote_key",
    "verify_remote_value",
    "verify_remote_values",
]

REMOTE_WIRE_VERSION = 1
REMOTE_HEADER_BYTES = BLOCK_BYTES
REMOTE_KEY_PREFIX = "kvstore/r1/"  # r1: the wire version in every remote key


def remote_key(namespace: str, key: bytes) -> str:
    """The cluster store's key of page ``key`` in ``namespace``: text, as cluster
    stores key by strings; two namespaces never share a key."""
    name = f"{REMOTE_KEY_PREFIX}{namespace}/{key.hex()}"
    if len(name.encode()) > MAX_KEY_BYTES:
        raise ValueError(
            f"remote key of {len(name.encode())} bytes: namespace and page key must fit "
            f"{MAX_KEY_BYTES} bytes"
        )
    return name


@dataclass(frozen=True, slots=True)
class RemotePage:
    """What a verified remote value says about its page."""

    payload_bytes: int
    parent: bytes | None
    depth: int
    tokens: int


def _meta(namespace: str, parent: bytes | None, depth: int, tokens: int) -> bytes:
    return json.dumps(
        {
            "kvr": REMOTE_WIRE_VERSION,
            "ns": namespace,
            "parent": parent.hex() if parent is not None else None,
            "depth": depth,
            "tokens": tokens,
        },
        separators=(",", ":"),
        sort_keys=True,
    ).encode()


def encode_remote_header_into(
    block: memoryview,
    *,
    namespace: str,
    key: bytes,
    payload: BytesLike,
    parent: bytes | None,
    depth: int,
    tokens: int,
) -> None:
    """Seal the header block of ``key``'s value (its payload checksum) into ``block``."""
    encode_record_fields_into(
        block,
        RECORD_PAGE,
        remote_key(namespace, key).encode(),
        _meta(namespace, parent, depth, tokens),
        len(payload),
        0,
        0,
        0,
        0,
        checksum(payload),
    )


def verify_remote_values(
    headers: Sequence[BytesLike],
    payloads: Sequence[BytesLike],
    *,
    namespace: str,
    names: Sequence[bytes],
    max_payload_bytes: int,
) -> list[RemotePage | str]:
    """``verify_remote_value`` for a read's values in one pass: the same checks, in
    the same order, per value (``names``: each one's ``remote_key`` encoded, as the
    reader asked for it); for each a ``RemotePage`` or the reason word a caller
    counts (``unverifiable``, ``mismatched``, ``short``, ``checksum``). No exception
    per value, no key rebuilt, no header record kept: the reads of a lookup's 64
    values check in about half the Python calls of one call per value."""
    out: list[RemotePage | str] = []
    append = out.append
    loads, fromhex, version = json.loads, bytes.fromhex, REMOTE_WIRE_VERSION
    for header, payload, name in zip(headers, payloads, names, strict=True):
        try:
            head = decode_record_header(header, max_page_bytes=max_payload_bytes)
        except KVStoreError:
            append("unverifiable")
            continue
        if head.lsn or head.segment_id or head.offset or head.generation:
            append("unverifiable")
            continue
        if head.key != name:
            append("mismatched")
            continue
        try:
            meta: Any = loads(head.meta)
        except ValueError:
            append("unverifiable")
            continue
        if type(meta) is not dict or meta.get("kvr") != version or meta.get("ns") != namespace:
            append("mismatched")
            continue
        if head.payload_bytes != len(payload):
            append("short")
            continue
        if checksum(payload) != head.payload_checksum:
            append("checksum")
            continue
        parent_hex, depth, tokens = meta.get("parent"), meta.get("depth"), meta.get("tokens")
        try:
            parent = fromhex(parent_hex) if type(parent_hex) is str else None
        except ValueError:
            append("unverifiable")
            continue
        if type(depth) is not int or type(tokens) is not int or depth < 0 or tokens < 1:
            append("unverifiable")
            continue
        append(RemotePage(head.payload_bytes, parent, depth, tokens))
    return out


def verify_remote_value(
    header: BytesLike,
    payload: BytesLike,
    *,
    namespace: str,
    key: bytes,
    max_payload_bytes: int,
) -> RemotePage:
    """Check a value read from the cluster against the page it should be.

    ``payload`` is exactly the bytes that arrived after the header. Raises
    ``CorruptionError`` whose first word is the reason a caller counts: ``short``,
    ``unverifiable`` (no sealed header of this version), ``mismatched`` (another
    key, namespace or wire version), ``checksum`` (the payload is not what was
    published)."""
    try:
        head = decode_record_header(header, max_page_bytes=max_payload_bytes)
    except KVStoreError as e:
        raise CorruptionError(f"unverifiable: {e}") from None
    if head.lsn or head.segment_id or head.offset or head.generation:
        raise CorruptionError("unverifiable: a store record header, not a remote value's")
    if head.key != remote_key(namespace, key).encode():
        raise CorruptionError("mismatched: the value names another key or namespace")
    try:
        meta: Any = json.loads(head.meta)
    except ValueError:
        raise CorruptionError("unverifiable: its meta is not JSON") from None
    if not isinstance(meta, dict) or meta.get("kvr") != REMOTE_WIRE_VERSION:
        raise CorruptionError("mismatched: not wire version 1")
    if meta.get("ns") != namespace:
        raise CorruptionError("mismatched: another namespace")
    if head.payload_bytes != len(payload):
        raise CorruptionError(
            f"short: {len(payload)} payload bytes arrived, the header says {head.payload_bytes}"
        )
    if checksum(payload) != head.payload_checksum:
        raise CorruptionError("checksum: the payload does not match its checksum")
    parent_hex, depth, tokens = meta.get("parent"), meta.get("depth"), meta.get("tokens")
    try:
        parent = bytes.fromhex(parent_hex) if isinstance(parent_hex, str) else None
    except ValueError:
        raise CorruptionError("unverifiable: a parent that is not hex") from None
    if not isinstance(depth, int) or not isinstance(tokens, int) or depth < 0 or tokens < 1:
        raise CorruptionError("unverifiable: depth or tokens out of range")
    return RemotePage(head.payload_bytes, parent, depth, tokens)
