"""Every StoreConfig field is validated, and a refused open creates nothing on disk.

A bad value is a TypeError (wrong type: a float or bool where an int is wanted, a
str where a number is) or a ValueError (out of range, NaN, an infinity, an unknown
name), and the message names the field and the value.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from kvstore import KVStore
from kvstore.config import StoreConfig
from kvstore.errors import IOFailure
from kvstore.io.probe import ProbeVerdict

MIB = 1 << 20
NAN = float("nan")
INF = float("inf")

# Field -> values KVStore.open must refuse. Small stores: 1 MiB segments.
BAD_VALUES: dict[str, list[Any]] = {
    "segment_bytes": [8.0 * MIB, "1048576", True, 0, 3 * 4096, MIB + 1, 1 << 41, None],
    "max_page_bytes": [2.5, 0, -1, True, "65536", MIB],  # MIB: no room for the header
    "capacity_bytes": [0, -1, 1.5, "big", True, MIB],  # MIB: fewer than 5 segments
    "flush_interval_ms": [0, -1, NAN, INF, -INF, "20", True, None],
    "checkpoint_wal_bytes": [0, -1, 1.5, NAN, "64", None],
    "checkpoint_interval_s": [0, -1, NAN, INF, "60", None],
    "io_engine": ["fast", "", 1, None],
    "uring_binding": ["liburing-1999", 3, None],
    "direct_io": ["yes", 1, 0.0],
    "io_depth": [2.5, 0, -1, True, "64", 1 << 20, None],
    "read_poll_us": [-1, 1.5, NAN, "10"],
    "pipeline_depth": [0, -1, 2.5, True, "2", 65, None],
    "lsn_lease_step": [0, -1, 1.5, 1 << 40],
    "eviction_policy": ["random", "", None, 7],
    "low_watermark_segments": [0, -1, 1.5, "2"],
    "gc_reserve_segments": [0, 2.0, "1"],
    "gc_live_ratio": [-0.1, 1.5, NAN, INF, "0.5"],
    "gc_interval_s": [-1, -0.5, NAN, INF, "1", None],
    "telemetry_flush_interval_s": [0, -1, NAN, INF],
    "telemetry_retention_hours": [100, 719, 720.5, NAN],
    "telemetry_clock": [5, "time.time"],
    "drive_capacity_bytes": [0, -1, 1.5, NAN],
    "rated_dwpd": [0, -1, NAN, INF, "1"],
    "warranty_years": [0, -5, NAN, INF],
    "max_dwpd": [0, -1, NAN, INF, True],
    "max_dwpd_burst_s": [0, -1, NAN, INF, None],
}

CASES = [(field, value) for field, values in BAD_VALUES.items() for value in values]


def test_every_field_has_bad_values() -> None:
    """A new StoreConfig field needs its validation, and its rows here."""
    assert set(BAD_VALUES) == {field.name for field in dataclasses.fields(StoreConfig)}


def _shown(value: Any) -> str:
    return "nan" if isinstance(value, float) and math.isnan(value) else repr(value)


@pytest.mark.parametrize(("field", "value"), CASES, ids=[f"{f}={v!r}" for f, v in CASES])
def test_a_bad_value_is_refused_naming_field_and_value_and_creates_nothing(
    store_path: Path, field: str, value: Any
) -> None:
    options: dict[str, Any] = {"segment_bytes": MIB, "max_page_bytes": 256 << 10}
    options[field] = value
    with pytest.raises((TypeError, ValueError)) as caught:
        KVStore.open(store_path, create=True, **options)
    message = str(caught.value)
    assert field in message, message
    assert _shown(value) in message, message
    assert not store_path.exists(), "a refused open created the store"


@pytest.mark.parametrize("field", ["io_depth", "segment_bytes", "checkpoint_wal_bytes"])
def test_an_int_field_refuses_floats_and_bools_as_type_error(store_path: Path, field: str) -> None:
    for value in (2.5, 8.0 * MIB, True):
        with pytest.raises(TypeError, match=f"{field} must be an int"):
            KVStore.open(store_path, create=True, **{field: value})
    assert not store_path.exists()


def test_good_values_are_accepted(open_store: Any) -> None:
    store = open_store(
        flush_interval_ms=1,  # an int where a float is declared
        checkpoint_interval_s=0.5,
        checkpoint_wal_bytes=1,
        gc_interval_s=0,  # 0 disables the GC thread
        gc_live_ratio=1,
        io_depth=1,
        read_poll_us=0,
        eviction_policy="lru",
        io_engine="threadpool",
        direct_io=False,
        rated_dwpd=1,
        max_dwpd=0.5,
        capacity_bytes=5 * MIB,
    )
    store.put("k", b"v", sync=True)
    assert store.get("k") == b"v"


def test_an_unknown_option_is_type_error(store_path: Path) -> None:
    with pytest.raises(TypeError, match="unknown store option"):
        KVStore.open(store_path, create=True, no_such_option=1)
    assert not store_path.exists()


def test_io_uring_asked_for_but_refused_here_creates_nothing(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused = ProbeVerdict(False, None, None, "the probe child died of SIGILL")
    monkeypatch.setattr("kvstore.io.probe.probe_uring", lambda *args, **kwargs: refused)
    with pytest.raises(IOFailure, match="SIGILL"):
        KVStore.open(store_path, create=True, segment_bytes=MIB, io_engine="io_uring")
    assert not store_path.exists()


def test_a_refused_reopen_leaves_the_store_as_it_was(open_store: Any, store_path: Path) -> None:
    open_store(io_engine="threadpool").close()
    before = sorted(p.relative_to(store_path) for p in store_path.rglob("*"))
    with pytest.raises(ValueError, match="eviction_policy"):
        KVStore.open(store_path, eviction_policy="nope")
    with pytest.raises(ValueError, match="checkpoint_interval_s"):
        KVStore.open(store_path, checkpoint_interval_s=NAN)
    assert sorted(p.relative_to(store_path) for p in store_path.rglob("*")) == before
