"""Fixtures for the micro-benchmarks (pytest-benchmark), run by ``make bench``.

Not collected by ``make test``: pytest's ``testpaths`` is ``tests/``. Run with
``pytest benches --benchmark-only`` (add ``--benchmark-json=FILE`` to save).
Stores live on the file system of the checkout (``bench-data/micro``), not
tmpfs, so O_DIRECT and fdatasync cost what they cost in production.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore import KVStore

MICRO_DIR = Path(__file__).resolve().parent.parent / "bench-data" / "micro"
PAGES = 10_000
PAGE_BYTES = 4096


def page_key(index: int) -> bytes:
    return b"micro/%08d" % index


@pytest.fixture
def scratch(request: pytest.FixtureRequest) -> Iterator[Path]:
    path = MICRO_DIR / request.node.name.replace("[", "-").replace("]", "")
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["overlay", "lmdb"])
def filled_store(request: pytest.FixtureRequest, scratch: Path) -> Iterator[KVStore]:
    """10,000 pages of 4 KiB; with ``lmdb`` checkpointed, so lookups go to LMDB."""
    store = KVStore.open(scratch / "store", create=True, segment_bytes=64 << 20)
    payload = bytes(PAGE_BYTES)
    for first in range(0, PAGES, 1000):
        store.put_many([(page_key(i), payload) for i in range(first, first + 1000)])
    store.flush()
    if request.param == "lmdb":
        store.checkpoint()
    yield store
    store.close()
