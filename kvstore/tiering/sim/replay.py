"""Trace replay: the real ``TierManager`` (fake mover, virtual clock) beside the
peers' policy models, on the same requests, capacities and machine.

Semantics, fixed so results compare across tools: per request, the prefix hit is
the run of leading blocks resident in any tier, counted per tier it is served
from; then every block of the request is offered as computed (parent = the
previous block). Time to first token is modelled with one ``CostModel`` for
everyone: transfers cost α + bytes/B per path, prefill costs the ``ModelCost``
formula at ``tflops``. Peers always load what hit; ``kvstore`` loads what its plan
says (and recomputes the rest); ``recompute`` loads nothing.

``python -m kvstore.tiering.sim`` is ``kvstore sim``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvstore.tiering.config import MODEL_PRESETS, ModelCost, TierConfig
from kvstore.tiering.cost import Compute, CostModel, make_bandwidths
from kvstore.tiering.pages import DRAM, HBM, NVME, TIER_NAMES, PageRec
from kvstore.tiering.sim.peers import POLICIES, make_peer, replay_peer
from kvstore.tiering.sim.trace import Request, capacity_blocks, trace_facts

__all__ = ["Machine", "SimResult", "kvstore_config", "run", "simulate_kvstore"]


@dataclass(frozen=True, slots=True)
class Machine:
    """The modelled node: disk and PCIe bandwidth, effective prefill FLOP/s."""

    nvme_gbps: float = 6.0
    nvme_write_gbps: float = 12.0
    pcie_gbps: float = 25.0
    tflops: float = 400.0
    nvme_latency_s: float = 1e-4
    pcie_latency_s: float = 1e-5

    def rates(self) -> dict[str, float]:
        return {
            "nvme_read": self.nvme_gbps * 1e9,
            "nvme_write": self.nvme_write_gbps * 1e9,
            "h2d": self.pcie_gbps * 1e9,
            "d2h": self.pcie_gbps * 1e9,
        }

    def latencies(self) -> dict[str, float]:
        return {
            "nvme_read": self.nvme_latency_s,
            "nvme_write": 2 * self.nvme_latency_s,
            "h2d": self.pcie_latency_s,
            "d2h": self.pcie_latency_s,
        }

    def cost_model(self, model: ModelCost, block_tokens: int) -> CostModel:
        return CostModel(
            model,
            block_tokens,
            Compute(self.tflops * 1e12),
            make_bandwidths(self.rates(), self.latencies()),
        )


@dataclass(slots=True)
class SimResult:
    policy: str
    hit_blocks_by_tier: tuple[int, int, int]
    block_accesses: int
    nvme_blocks_written: int
    nvme_bytes_written: int
    ttft_s: list[float] = field(repr=False)
    recompute_tokens: int
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return sum(self.hit_blocks_by_tier) / self.block_accesses if self.block_accesses else 0.0

    def to_json(self) -> dict[str, Any]:
        n = self.block_accesses or 1
        h, d, v = self.hit_blocks_by_tier
        return {
            "policy": self.policy,
            "hit_ratio": self.hit_ratio,
            "hit_ratio_by_tier": {"hbm": h / n, "dram": d / n, "nvme": v / n},
            "nvme_blocks_written": self.nvme_blocks_written,
            "nvme_bytes_written": self.nvme_bytes_written,
            "ttft_p50_s": _quantile(self.ttft_s, 0.5),
            "ttft_p99_s": _quantile(self.ttft_s, 0.99),
            "recompute_tokens": self.recompute_tokens,
            "wall_s": self.wall_s,
            **({"details": self.extra} if self.extra else {}),
        }


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


def kvstore_config(
    capacity: tuple[int, int, int],
    model: ModelCost,
    block_tokens: int,
    machine: Machine,
    overrides: Mapping[str, Any] | None = None,
) -> TierConfig:
    """The manager's configuration for a simulation: its defaults, the trace's
    capacities in blocks, the machine's bandwidths, then ``overrides``."""
    page = block_tokens * model.kv_bytes_per_token
    page = (page + 4095) // 4096 * 4096
    config = TierConfig(
        device="cpu",
        hbm="owned",
        hbm_bytes=capacity[0] * page,
        dram_bytes=capacity[1] * page,
        nvme_bytes=capacity[2] * page,
        page_bytes=page,
        tokens_per_page=block_tokens,
        model=model,
        compute_flops=machine.tflops * 1e12,
        mover="fake",
        control_interval_s=0,
        probe_at_open=False,
        bandwidth_bytes_per_s=machine.rates(),
        latency_s=machine.latencies(),
    )
    if overrides:
        config = replace(config, **overrides)
    return config


@contextlib.contextmanager
def _batch_gc() -> Iterator[None]:
    """A replay allocates hundreds of thousands of page records and tickets that
    live on: the default thresholds walk them in ~600 collections (4-5% of a
    replay). Collect a tenth as often while it runs; restore the settings after."""
    thresholds = gc.get_threshold()
    gc.set_threshold(50_000, 20, thresholds[2])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


# details.misses: why a request's first missing block was missing; the blocks counted
# are that one and every block after it in the request (a prefix ends at its first miss).
_MISS_REASONS: dict[int, str] = {
    HBM: "left HBM without a copy below",
    DRAM: "dropped from DRAM unwritten",
    NVME: "deleted from NVMe",
}


def simulate_kvstore(
    requests: Sequence[Request],
    config: TierConfig,
    *,
    name: str = "kvstore",
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Replay ``requests`` through a real ``TierManager`` on the fake mover."""
    from kvstore.tiering.manager import TierManager

    started = time.perf_counter()
    tm = TierManager.open(config)
    clock = tm.clock
    assert clock is not None
    hits = [0, 0, 0]
    accesses = 0
    ttft: list[float] = []
    recompute_tokens = 0
    tpp = config.tokens_per_page
    keys_of: dict[int, bytes] = {}
    # How full each tier runs, sampled before each lookup (free slots are capacity no
    # policy uses: `details.occupancy`).
    state = tm._state
    hbm_pool, dram_pool = tm._hbm, tm._dram
    nvme_pages = state.capacity[2] // state.slot_bytes if state.slot_bytes else 0
    held = [0, 0, 0]
    # Why a request's first missing block was missing (details.misses): the tier each
    # page last left when it lost its last copy.
    left: dict[bytes, int] = {}
    misses: dict[str, list[int]] = {}

    def gone(rec: PageRec, tier: int) -> None:
        left[rec.key] = tier

    state.on_gone = gone
    try:
        with _batch_gc():
            for index, request in enumerate(requests):
                if request.timestamp_s > clock.now():
                    clock.set(request.timestamp_s)
                tm.step()
                held[0] += hbm_pool.used_slots()
                held[1] += dram_pool.used_slots()
                held[2] += state.count[2]
                keys: list[bytes] = []
                first_new = -1  # the first block no earlier request had
                for block in request.blocks:
                    key = keys_of.get(block)
                    if key is None:
                        key = keys_of[block] = b"%d" % block
                        if first_new < 0:
                            first_new = len(keys)
                    keys.append(key)
                tokens = max(request.input_tokens, 1)
                result = tm.lookup(keys, tokens=tokens)
                by_tier = result.pages_by_tier
                hits[0] += by_tier[0]
                hits[1] += by_tier[1]
                hits[2] += by_tier[2]
                accesses += len(keys)
                found = by_tier[0] + by_tier[1] + by_tier[2]
                if found < len(keys):
                    first = keys[found]
                    if 0 <= first_new <= found:
                        reason = "never seen"
                    else:
                        reason = _MISS_REASONS[left[first]] if first in left else "declined"
                    counts = misses.setdefault(reason, [0, 0])
                    counts[0] += 1
                    counts[1] += len(keys) - found
                ttft.append(result.plan.cost.ttft_s)
                recompute_tokens += max(tokens - result.plan.load_pages * tpp, 0)
                tm.offer(keys, None)
                if progress is not None and index % 256 == 0:
                    progress(index)
        stats = tm.stats()
    finally:
        state.on_gone = None
        tm.close()
    return SimResult(
        name,
        (hits[0], hits[1], hits[2]),
        accesses,
        stats.nvme_pages_written,
        stats.nvme_bytes_written,
        ttft,
        recompute_tokens,
        time.perf_counter() - started,
        extra={
            "evictions": dict(stats.evictions),
            "admissions": dict(stats.admissions),
            "recompute_decisions": dict(stats.recompute_decisions),
            "tau": list(stats.tau),
            "nvme_displacement": stats.nvme_displacement,
            "kappa": list(stats.kappa),
            "thrash": stats.thrash,
            "occupancy": _occupancy(
                held, len(requests), (hbm_pool.slots, dram_pool.slots, nvme_pages)
            ),
            "misses": {
                reason: {"requests": n, "blocks": blocks}
                for reason, (n, blocks) in sorted(misses.items())
            },
        },
    )


def _occupancy(
    held: Sequence[int], samples: int, capacity: Sequence[int]
) -> dict[str, float | None]:
    """Mean share of each tier's slots holding a page, before a request's lookup (None
    for a tier with no capacity)."""
    return {
        name: (held[t] / samples / capacity[t]) if samples and capacity[t] else None
        for t, name in enumerate(TIER_NAMES)
    }


def simulate_peer(
    requests: Sequence[Request],
    name: str,
    capacity: tuple[int, int, int],
    cost: CostModel,
    page_bytes: int,
) -> SimResult:
    """A peer's model, then its TTFT: it loads every hit block."""
    started = time.perf_counter()
    result = replay_peer(make_peer(name, capacity), requests)
    tpp = cost.tokens_per_page
    ttft = []
    recompute_tokens = 0
    for request, (h, d, n) in zip(requests, result.per_request_hits, strict=True):
        tokens = max(request.input_tokens, 1)
        tiers = [0] * h + [1] * d + [2] * n
        if name == "infinite":
            tiers = [0] * len(tiers)
        ttft.append(cost.plan(tiers, [page_bytes] * len(tiers), tokens).ttft_load_all_s)
        recompute_tokens += max(tokens - len(tiers) * tpp, 0)
    return SimResult(
        name,
        result.hit_blocks_by_tier,
        result.block_accesses,
        result.nvme_blocks_written,
        result.nvme_blocks_written * page_bytes,
        ttft,
        recompute_tokens,
        time.perf_counter() - started,
    )


def run(
    requests: Sequence[Request],
    *,
    capacity_fractions: tuple[float, float, float] | None = (0.02, 0.10, 0.5),
    capacity_bytes: tuple[int, int, int] | None = None,
    model: ModelCost | str = "llama-3.1-8b",
    block_tokens: int = 512,
    machine: Machine | None = None,
    policies: Sequence[str] | None = None,
    trace_name: str = "",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every policy on one trace; the ``--json`` object of ``kvstore sim``."""
    machine = machine or Machine()
    cost_model = model if isinstance(model, ModelCost) else MODEL_PRESETS[model]
    facts = trace_facts(requests)
    page = block_tokens * cost_model.kv_bytes_per_token
    page = (page + 4095) // 4096 * 4096
    if capacity_bytes is not None:
        capacity = (
            capacity_bytes[0] // page,
            capacity_bytes[1] // page,
            capacity_bytes[2] // page,
        )
    else:
        assert capacity_fractions is not None
        capacity = capacity_blocks(capacity_fractions, facts.unique_blocks)
    cost = machine.cost_model(cost_model, block_tokens)
    names = list(policies) if policies else [*POLICIES, "kvstore"]
    results = []
    for name in names:
        if progress is not None:
            progress(name)
        if name == "kvstore" or name.startswith("kvstore:"):
            overrides = parse_overrides(name)
            config = kvstore_config(capacity, cost_model, block_tokens, machine, overrides)
            results.append(simulate_kvstore(requests, config, name=name))
        else:
            results.append(simulate_peer(requests, name, capacity, cost, page))
    return {
        "trace": trace_name,
        "requests": facts.requests,
        "block_accesses": facts.block_accesses,
        "unique_blocks": facts.unique_blocks,
        "max_hit_ratio": facts.max_hit_ratio,
        "capacity_blocks": list(capacity),
        "machine": {
            "nvme_gbps": machine.nvme_gbps,
            "pcie_gbps": machine.pcie_gbps,
            "tflops": machine.tflops,
            "kappa_nvme": cost.kappa(2, page),
            "kappa_dram": cost.kappa(1, page),
        },
        "results": [r.to_json() for r in results],
    }


_FIELD_TYPES: dict[str, Callable[[str], Any]] = {}


def _optional(key: str) -> bool:
    """Whether TierConfig's field ``key`` takes None (its annotation says ``| None``)."""
    annotation = TierConfig.__annotations__.get(key, "")
    return "None" in str(annotation)


def parse_overrides(name: str) -> dict[str, Any]:
    """``kvstore:admission=freq2,hysteresis_s=0`` -> TierConfig overrides."""
    if ":" not in name:
        return {}
    _, _, spec = name.partition(":")
    overrides: dict[str, Any] = {}
    defaults = TierConfig()
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not hasattr(defaults, key):
            raise ValueError(f"--policy {name!r}: {item!r} is not FIELD=VALUE of TierConfig")
        current = getattr(defaults, key)
        overrides[key] = _coerce(key, value, current)
    return overrides


def _coerce(key: str, value: str, current: object) -> Any:
    if value.lower() == "none" and _optional(key):
        return None
    if isinstance(current, bool):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{key} takes true/false, got {value!r}")
        return value.lower() in ("true", "1")
    if isinstance(current, int):
        return int(value)
    if isinstance(current, float):
        return float(value)
    if isinstance(current, tuple):
        return tuple(float(v) for v in value.split("/"))
    if current is None:
        if str(TierConfig.__annotations__.get(key, "")) == "int | None":
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{key} takes a whole number or None, got {value!r}") from None
        try:
            return float(value)
        except ValueError:
            return value
    return value
