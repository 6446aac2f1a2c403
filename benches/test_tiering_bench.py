"""Micro-benchmarks of the tier manager's hot paths: lookup, offer, the load plan, a
DRAM load. Each also asserts what it computed, so a broken path fails here rather
than reporting a fast wrong answer. The managers are kvstore/bench/tiering.py's, whose
measurements ``tools/bench_tiering.py`` sets beside their references and targets
(docs/benchmarks.md).

    .venv/bin/pytest benches/test_tiering_bench.py --benchmark-only
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pytest_benchmark.fixture import BenchmarkFixture

from kvstore.bench.common import MIB
from kvstore.bench.tiering import FILL_CHAINS, fake_config, fill_dram, load_config
from kvstore.bench.tiering import PREFIX_PAGES as PREFIX
from kvstore.bench.tiering import chain as chain_of
from kvstore.tiering import LookupState, TierManager


def fake_manager(dram_pages: int) -> TierManager:
    """The fake mover: no bytes move, what is timed is the manager's bookkeeping."""
    return TierManager.open(fake_config(dram_pages))


def chain(prefix: str) -> list[bytes]:
    return chain_of(prefix, PREFIX)


@pytest.fixture
def resident() -> Iterator[tuple[TierManager, list[bytes]]]:
    """A 128-page prefix resident in DRAM."""
    tm = fake_manager(4 * PREFIX)
    keys = chain("resident")
    assert tm.offer(keys, None).admitted == PREFIX
    tm.drain()
    yield tm, keys
    tm.close()


def test_lookup_128_page_prefix(
    benchmark: BenchmarkFixture, resident: tuple[TierManager, list[bytes]]
) -> None:
    tm, keys = resident
    result = benchmark(tm.lookup, keys)
    assert result.state is LookupState.READY
    assert result.pages_by_tier == (0, PREFIX, 0)
    assert result.plan.load_pages == PREFIX


def test_plan_128_pages(
    benchmark: BenchmarkFixture, resident: tuple[TierManager, list[bytes]]
) -> None:
    tm, _ = resident
    cost = benchmark(tm.cost.plan, [1] * PREFIX, [MIB] * PREFIX, PREFIX * 8)
    assert cost.load_pages == PREFIX
    assert cost.ttft_s == cost.ttft_load_all_s < cost.ttft_recompute_s


@pytest.mark.parametrize("full", [False, True], ids=["free-slots", "full-dram"])
def test_offer_128_page_chain(benchmark: BenchmarkFixture, full: bool) -> None:
    """A fresh chain per round; the previous round's copies land outside the timing.
    ``full-dram``: DRAM holds 8 chains and is full, so every offer evicts."""
    rounds = 40
    tm = fake_manager(8 * PREFIX if full else (rounds + 2) * PREFIX)
    names = itertools.count()
    if full:
        fill_dram(tm, FILL_CHAINS)
    admitted: list[int] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        tm.drain()
        tm.step()
        return (chain(f"offer{next(names)}"), None), {}

    def offer(keys: list[bytes], srcs: None) -> None:
        admitted.append(tm.offer(keys, srcs).admitted)

    try:
        benchmark.pedantic(offer, setup=setup, rounds=rounds, iterations=1)  # type: ignore[no-untyped-call]
    finally:
        tm.close()
    assert admitted == [PREFIX] * rounds


def test_dram_load_16_pages_cpu_mover(benchmark: BenchmarkFixture) -> None:
    """lookup -> prepare_load -> wait -> complete_load of 16 MiB resident in DRAM."""
    pages = 16
    config = load_config(pages, MIB)  # recomputing is made slow: the plan loads
    generator = torch.Generator().manual_seed(3)
    sources = [torch.randint(0, 256, (MIB,), dtype=torch.uint8, generator=generator)]
    sources *= pages  # one random page, offered under 16 keys
    keys = [f"load/{i}".encode() for i in range(pages)]
    destinations = [torch.zeros(MIB, dtype=torch.uint8) for _ in range(pages)]
    with TierManager.open(config) as tm:
        assert tm.offer(keys, sources).hbm_release.wait(30)
        tm.drain()

        def load() -> int:
            result = tm.lookup(keys)
            handle = tm.prepare_load(result.plan, destinations)
            assert handle.wait(30)
            return tm.complete_load(handle)

        assert benchmark(load) == pages
    assert all(torch.equal(d, sources[0]) for d in destinations)
