"""A trace across N serving nodes, with and without a shared cluster tier
(docs/tiering.md, "Beyond one machine, by simulation").

Each node runs the **real** ``TierManager`` on the fake mover and its own virtual
clock, configured like the single-node replay (``replay.kvstore_config``); a router
sends each request to one node. The shared tier is a model kept here, not the tier
manager's remote tier: a pool of blocks with LRU replacement behind a network path
(α + bytes/B, then PCIe into HBM: the NVMe path's shape, docs/tiering.md, "Load versus
recompute"). Nodes publish every block they offer; a request's blocks past its node's
local hit run that the pool holds are its remote hit, loaded over the network.

One replay yields both answers, with and without the pool: a node's manager sees the
same lookups and offers either way (every block is offered as computed, whether its
bytes came from the pool or from the prefill), so the pool changes only what a miss
costs. The numbers without the pool are the manager's own (at one node, exactly the
single-node replay's); with it, a request whose local run is followed by pool blocks
is planned again over both (``plan_with_remote``), the rest keep the manager's plan.

Capacities: ``--capacity`` fractions are of the trace's unique blocks for the whole
cluster, each node holding 1/N of each tier (floored to blocks), so every node count
has the same hardware in all; ``--capacity-bytes`` is per node. The pool's size is its
own (a fraction of the unique blocks, or bytes) and does not change with N.

Routing (``ROUTINGS``):

- ``random``: a uniform node per request (``random.Random(seed)``).
- ``session``: a session sticks to the node its first request went to; a new session
  goes to the least loaded node. Traces carry no session ids, so sessions are
  derived from the prefix structure (``derive_sessions``).
- ``prefix``: the node holding the longest prefix of the request, by the router's own
  index of the blocks it sent to each node (an LRU of the node's capacity in blocks,
  as a cache-aware router keeps); ties go to the least loaded of them. A match shorter
  than ``PREFIX_MIN_MATCH`` of the request's blocks is no match: the least loaded
  node takes the request.

"Least loaded": the fewest requests routed in the last ``LOAD_WINDOW_S`` seconds of
the trace's clock, then the fewest in all, then the lowest index.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.tiering.config import MODEL_PRESETS, ModelCost, TierConfig
from kvstore.tiering.cost import CostModel
from kvstore.tiering.sim.replay import (
    Machine,
    _batch_gc,
    _quantile,
    kvstore_config,
    parse_overrides,
)
from kvstore.tiering.sim.trace import Request, capacity_blocks, trace_facts

__all__ = [
    "ANY_ROUTING",
    "DEFAULT_NETWORK",
    "DEFAULT_SHARED_FRACTION",
    "LOAD_WINDOW_S",
    "MAX_NODES",
    "PREFIX_MIN_MATCH",
    "ROUTINGS",
    "ClusterResult",
    "Network",
    "cluster_replays",
    "derive_sessions",
    "node_capacity",
    "plan_with_remote",
    "run_cluster",
    "simulate_cluster",
]

ROUTINGS = ("random", "session", "prefix")
ANY_ROUTING = "any"  # a one-node configuration's routing: all of them are the same
LOAD_WINDOW_S = 60.0
# A prefix match routes only when it covers this share of the request's blocks, as a
# cache-aware router's threshold does: a prefix every request shares (a one-block
# system prompt) would otherwise send the whole trace to the first node that saw it.
PREFIX_MIN_MATCH = 0.5
MAX_NODES = 1024  # one manager each; 64 replay the conversation trace in seconds
DEFAULT_SHARED_FRACTION = 0.1  # the pool: a tenth of the trace's unique blocks
REMOTE = 3  # the pool, as a tier index beside HBM 0, DRAM 1, NVMe 2

# How a page reaches HBM from each tier: CostModel's paths, and the pool's network
# read into a DRAM slot, then PCIe (as an NVMe page does).
_PATHS: dict[int, tuple[str, ...]] = {
    0: ("d2d",),
    1: ("h2d",),
    2: ("nvme_read", "h2d"),
    REMOTE: ("net", "h2d"),
}


@dataclass(frozen=True, slots=True)
class Network:
    """A node's path to the shared pool: one batch of reads costs α + bytes/B."""

    gbps: float = 25.0  # a 200 Gb/s RDMA NIC per node
    latency_s: float = 100e-6  # the master's metadata round trip and the read's first byte

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gbps) and self.gbps > 0):
            raise ValueError(f"network bandwidth must be a finite number > 0 GB/s, got {self.gbps}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"network latency must be finite and >= 0, got {self.latency_s}")


DEFAULT_NETWORK = Network()


# -- sessions ----------------------------------------------------------------------


def derive_sessions(requests: Sequence[Request]) -> list[int]:
    """A session id per request, from the trace's prefix structure alone.

    A request continues session s when the deepest of its leading blocks already
    seen was first seen in s, and it repeats all of s's latest request but at most
    that request's last block (a turn's last block is partial: the next turn re-hashes
    it with more tokens). Anything else opens a new session: a request that shares
    only a common prefix (a system prompt) with earlier ones, or none. Ids count up
    from 0 in order of first appearance.
    """
    creator: dict[int, int] = {}  # block -> the session it was first seen in
    latest_len: list[int] = []  # session -> blocks of its latest request
    out: list[int] = []
    for request in requests:
        blocks = request.blocks
        seen = 0
        for block in blocks:
            if block not in creator:
                break
            seen += 1
        session = -1
        if seen:
            owner = creator[blocks[seen - 1]]
            if latest_len[owner] - seen <= 1:
                session = owner
        if session < 0:
            session = len(latest_len)
            latest_len.append(0)
        for block in blocks[seen:]:
            creator.setdefault(block, session)
        latest_len[session] = len(blocks)
        out.append(session)
    return out


# -- the pool ----------------------------------------------------------------------


class _Pool:
    """The shared tier's contents: block ids in LRU order (reads and writes refresh)."""

    __slots__ = ("capacity", "lru")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()

    def run(self, blocks: Sequence[int], start: int) -> int:
        """How many of ``blocks[start:]`` in a row the pool holds; each is refreshed."""
        lru = self.lru
        count = 0
        for block in blocks[start:]:
            if block not in lru:
                break
            lru.move_to_end(block)
            count += 1
        return count

    def publish(self, blocks: Sequence[int]) -> int:
        """Put ``blocks`` (refreshing those held); how many were new (sent over the network)."""
        if self.capacity <= 0:
            return 0
        lru = self.lru
        new = 0
        for block in blocks:
            if block in lru:
                lru.move_to_end(block)
            else:
                lru[block] = None
                new += 1
        while len(lru) > self.capacity:
            lru.popitem(last=False)
        return new


# -- routing -----------------------------------------------------------------------


class _Router:
    """One of ``ROUTINGS`` over ``nodes`` nodes (module docstring)."""

    def __init__(
        self,
        routing: str,
        nodes: int,
        *,
        index_blocks: int,
        seed: int,
        sessions: Sequence[int] | None,
    ) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing {routing!r}: known: {', '.join(ROUTINGS)}")
        if routing == "session" and sessions is None:
            raise ValueError("session routing needs the sessions (derive_sessions)")
        self.routing = routing
        self.nodes = nodes
        self.rng = random.Random(seed)
        self.sessions = sessions
        self.session_node: dict[int, int] = {}
        self.recent: list[deque[float]] = [deque() for _ in range(nodes)]
        self.total = [0] * nodes
        self.index_blocks = index_blocks
        self.index: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(nodes)]
        self.holders: dict[int, int] = {}  # block -> bit mask of the nodes indexing it

    def route(self, position: int, request: Request) -> int:
        now = request.timestamp_s
        if self.nodes == 1:
            node = 0
        elif self.routing == "random":
            node = self.rng.randrange(self.nodes)
        elif self.routing == "session":
            assert self.sessions is not None
            session = self.sessions[position]
            found = self.session_node.get(session)
            if found is None:
                found = self.session_node[session] = self._least_loaded(range(self.nodes), now)
            node = found
        else:
            node = self._longest_prefix(request.blocks, now)
        self._count(node, now)
        if self.routing == "prefix":
            self._remember(node, request.blocks)
        return node

    def _count(self, node: int, now: float) -> None:
        self.recent[node].append(now)
        self.total[node] += 1

    def _least_loaded(self, candidates: Any, now: float) -> int:
        horizon = now - LOAD_WINDOW_S
        best = -1
        best_key: tuple[int, int] = (0, 0)
        for node in candidates:
            recent = self.recent[node]
            while recent and recent[0] <= horizon:
                recent.popleft()
            key = (len(recent), self.total[node])
            if best < 0 or key < best_key:
                best, best_key = node, key
        return best

    def _longest_prefix(self, blocks: Sequence[int], now: float) -> int:
        holders = self.holders
        mask = (1 << self.nodes) - 1
        depth = 0
        for block in blocks:
            held = holders.get(block, 0) & mask
            if not held:
                break
            mask = held
            depth += 1
        if not depth or depth < PREFIX_MIN_MATCH * len(blocks):
            return self._least_loaded(range(self.nodes), now)
        return self._least_loaded((n for n in range(self.nodes) if mask >> n & 1), now)

    def _remember(self, node: int, blocks: Sequence[int]) -> None:
        if self.index_blocks <= 0:
            return
        index = self.index[node]
        holders = self.holders
        bit = 1 << node
        for block in blocks:
            if block in index:
                index.move_to_end(block)
            else:
                index[block] = None
                holders[block] = holders.get(block, 0) | bit
        while len(index) > self.index_blocks:
            old, _ = index.popitem(last=False)
            left = holders[old] & ~bit
            if left:
                holders[old] = left
            else:
                del holders[old]


# -- the plan with remote pages ------------------------------------------------------


def plan_with_remote(
    cost: CostModel,
    network: Network,
    tiers: Sequence[int],
    page_bytes: int,
    total_tokens: int,
    *,
    layer_overlap: bool = False,
) -> tuple[float, int]:
    """(TTFT, pages to load) for a hit whose page i is served from ``tiers[i]`` (0 HBM,
    1 DRAM, 2 NVMe, ``REMOTE`` the pool): ``CostModel.plan``'s arithmetic, step for
    step, with the pool's path beside the local ones (no in-flight waits)."""
    rates: dict[str, tuple[float, float]] = {
        path: (fit.rate, fit.latency_s) for path, fit in cost.bandwidth.items()
    }
    rates["net"] = (network.gbps * 1e9, network.latency_s)
    hit = len(tiers)
    tpp = cost.tokens_per_page
    total_tokens = max(total_tokens, hit * tpp)
    rate = cost.compute.flops_per_s
    two_n = 2.0 * cost.model.n_params
    half_a = 0.5 * cost.model.attention_flops_per_token_context
    total_sq = total_tokens * total_tokens
    rec0 = (two_n * total_tokens + half_a * total_sq) / rate
    best_pages, best_ttft = 0, rec0
    paths_seen: set[str] = set()
    load = 0.0
    last_tier = -1
    per_byte = 0.0
    for i in range(hit):
        tier = tiers[i]
        if tier != last_tier:
            last_tier = tier
            per_byte = 0.0
            for path in _PATHS[tier]:
                path_rate, latency = rates[path]
                per_byte += 1.0 / path_rate
                if path not in paths_seen:
                    paths_seen.add(path)
                    load += latency
        load += page_bytes * per_byte
        loaded = (i + 1) * tpp
        rec = (two_n * (total_tokens - loaded) + half_a * (total_sq - loaded * loaded)) / rate
        moving = load if load > 0.0 else 0.0
        ttft = (moving if moving > rec else rec) if layer_overlap else moving + rec
        if ttft < best_ttft:
            best_pages, best_ttft = i + 1, ttft
    return best_ttft, best_pages


# -- the replay ----------------------------------------------------------------------


@dataclass(slots=True)
class ClusterResult:
    """One (nodes, routing) replay: the numbers without the pool and with it."""

    nodes: int
    routing: str
    block_accesses: int
    local_hits: tuple[int, int, int]  # HBM, DRAM, NVMe of the nodes' own tiers
    remote_hits: int  # blocks past a local run that the pool held
    ttft_local_s: list[float]  # per request, without the pool
    ttft_shared_s: list[float]  # per request, with it
    nvme_blocks_written: int
    nvme_bytes_written: int
    remote_blocks_loaded: int
    network_bytes_read: int
    network_bytes_written: int
    requests_per_node: list[int]
    wall_s: float
    node_of_request: list[int] = field(default_factory=list, repr=False)  # not in the JSON

    def to_json(self) -> dict[str, Any]:
        n = self.block_accesses or 1
        h, d, v = self.local_hits
        local = h + d + v
        nvme = {
            "nvme_blocks_written": self.nvme_blocks_written,
            "nvme_bytes_written": self.nvme_bytes_written,
        }
        requests = sum(self.requests_per_node) or 1
        return {
            "nodes": self.nodes,
            "routing": self.routing,
            "busiest_node_share": max(self.requests_per_node, default=0) / requests,
            "without_shared": {
                "hit_ratio": local / n,
                "hit_ratio_by_tier": {"hbm": h / n, "dram": d / n, "nvme": v / n},
                "ttft_p50_s": _quantile(self.ttft_local_s, 0.5),
                "ttft_p99_s": _quantile(self.ttft_local_s, 0.99),
                **nvme,
                "network_bytes_read": 0,
                "network_bytes_written": 0,
            },
            "with_shared": {
                "hit_ratio": (local + self.remote_hits) / n,
                "hit_ratio_by_tier": {
                    "hbm": h / n,
                    "dram": d / n,
                    "nvme": v / n,
                    "remote": self.remote_hits / n,
                },
                "ttft_p50_s": _quantile(self.ttft_shared_s, 0.5),
                "ttft_p99_s": _quantile(self.ttft_shared_s, 0.99),
                **nvme,
                "remote_blocks_loaded": self.remote_blocks_loaded,
                "network_bytes_read": self.network_bytes_read,
                "network_bytes_written": self.network_bytes_written,
            },
            "wall_s": self.wall_s,
        }


def simulate_cluster(
    requests: Sequence[Request],
    config: TierConfig,
    *,
    nodes: int,
    routing: str,
    shared_blocks: int,
    network: Network = DEFAULT_NETWORK,
    cost: CostModel,
    seed: int = 0,
    sessions: Sequence[int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ClusterResult:
    """Replay ``requests`` over ``nodes`` managers of ``config`` (each node's), routed
    by ``routing``, beside a pool of ``shared_blocks`` blocks; ``cost`` prices the
    plans that take pool pages. ``progress(done)`` is called every 256 requests."""
    from kvstore.tiering.manager import TierManager

    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"nodes must be 1..{MAX_NODES}, got {nodes}")
    if routing == "session" and sessions is None:
        sessions = derive_sessions(requests)
    started = time.perf_counter()
    router = _Router(
        routing,
        nodes,
        index_blocks=_blocks_held(config),
        seed=seed,
        sessions=sessions,
    )
    pool = _Pool(shared_blocks)
    page = config.page_bytes
    overlap = config.layer_overlap
    managers: list[Any] = []
    hits = [0, 0, 0]
    remote_hits = 0
    remote_loaded = 0
    published = 0
    accesses = 0
    ttft_local: list[float] = []
    ttft_shared: list[float] = []
    routed: list[int] = []
    keys_of: dict[int, bytes] = {}
    try:
        for _ in range(nodes):
            managers.append(TierManager.open(config))
        clocks = [tm.clock for tm in managers]
        with _batch_gc():
            for position, request in enumerate(requests):
                node = router.route(position, request)
                routed.append(node)
                tm = managers[node]
                clock = clocks[node]
                if request.timestamp_s > clock.now():
                    clock.set(request.timestamp_s)
                tm.step()
                blocks = request.blocks
                keys = []
                for block in blocks:
                    key = keys_of.get(block)
                    if key is None:
                        key = keys_of[block] = b"%d" % block
                    keys.append(key)
                tokens = max(request.input_tokens, 1)
                result = tm.lookup(keys, tokens=tokens)
                by_tier = result.pages_by_tier
                hits[0] += by_tier[0]
                hits[1] += by_tier[1]
                hits[2] += by_tier[2]
                accesses += len(keys)
                local_ttft = result.plan.cost.ttft_s
                ttft_local.append(local_ttft)
                remote = pool.run(blocks, result.hit_pages) if shared_blocks > 0 else 0
                if remote:
                    remote_hits += remote
                    tiers = [*result.plan.tiers, *([REMOTE] * remote)]
                    ttft, load = plan_with_remote(
                        cost, network, tiers, page, tokens, layer_overlap=overlap
                    )
                    ttft_shared.append(ttft)
                    remote_loaded += max(load - result.hit_pages, 0)
                else:
                    ttft_shared.append(local_ttft)
                tm.offer(keys, None)
                if shared_blocks > 0:
                    published += pool.publish(blocks)
                if progress is not None and position % 256 == 0:
                    progress(position)
        nvme_blocks = 0
        nvme_bytes = 0
        for tm in managers:
            stats = tm.stats()
            nvme_blocks += stats.nvme_pages_written
            nvme_bytes += stats.nvme_bytes_written
    finally:
        for tm in managers:
            tm.close()
    return ClusterResult(
        nodes=nodes,
        routing=routing,
        block_accesses=accesses,
        local_hits=(hits[0], hits[1], hits[2]),
        remote_hits=remote_hits,
        ttft_local_s=ttft_local,
        ttft_shared_s=ttft_shared,
        nvme_blocks_written=nvme_blocks,
        nvme_bytes_written=nvme_bytes,
        remote_blocks_loaded=remote_loaded,
        network_bytes_read=remote_loaded * page,
        network_bytes_written=published * page,
        requests_per_node=list(router.total),
        wall_s=time.perf_counter() - started,
        node_of_request=routed,
    )


def _blocks_held(config: TierConfig) -> int:
    """The most distinct blocks a node can hold: its tiers' capacities in pages (an
    NVMe tier of no set size: as many as there are blocks, unbounded)."""
    page = config.page_bytes
    if config.nvme_bytes is None:
        return 1 << 62
    return (config.hbm_bytes + config.dram_bytes + config.nvme_bytes) // page


def node_capacity(
    nodes: int,
    unique_blocks: int,
    page_bytes: int,
    *,
    capacity_fractions: tuple[float, float, float] | None = None,
    capacity_bytes: tuple[int, int, int] | None = None,
) -> tuple[int, int, int]:
    """Each node's HBM, DRAM, NVMe in blocks: ``capacity_bytes`` per node, or the
    cluster's ``capacity_fractions`` of the unique blocks shared out over ``nodes``."""
    if capacity_bytes is not None:
        return (
            capacity_bytes[0] // page_bytes,
            capacity_bytes[1] // page_bytes,
            capacity_bytes[2] // page_bytes,
        )
    assert capacity_fractions is not None
    total = capacity_blocks(capacity_fractions, unique_blocks)
    return total[0] // nodes, total[1] // nodes, total[2] // nodes


def cluster_replays(nodes: Sequence[int], routings: Sequence[str]) -> int:
    """How many replays ``run_cluster`` makes: one per (nodes, routing), one for 1 node."""
    return sum(1 if count == 1 else len(routings) for count in nodes)


def run_cluster(
    requests: Sequence[Request],
    *,
    nodes: Sequence[int],
    routings: Sequence[str] = ROUTINGS,
    capacity_fractions: tuple[float, float, float] | None = (0.02, 0.10, 0.5),
    capacity_bytes: tuple[int, int, int] | None = None,
    shared_fraction: float | None = DEFAULT_SHARED_FRACTION,
    shared_bytes: int | None = None,
    network: Network = DEFAULT_NETWORK,
    model: ModelCost | str = "llama-3.1-8b",
    block_tokens: int = 512,
    machine: Machine | None = None,
    policy: str = "kvstore",
    seed: int = 0,
    trace_name: str = "",
    progress: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """Every (nodes, routing) on one trace; the ``--json`` object of ``kvstore sim
    --nodes``. ``progress(label, requests done in all)``."""
    machine = machine or Machine()
    cost_model = model if isinstance(model, ModelCost) else MODEL_PRESETS[model]
    facts = trace_facts(requests)
    page = block_tokens * cost_model.kv_bytes_per_token
    page = (page + 4095) // 4096 * 4096
    if shared_bytes is not None:
        pool_blocks = shared_bytes // page
    else:
        assert shared_fraction is not None
        pool_blocks = capacity_blocks((shared_fraction, 0.0, 0.0), facts.unique_blocks)[0]
    cost = machine.cost_model(cost_model, block_tokens)
    overrides = parse_overrides(policy)
    sessions = derive_sessions(requests) if "session" in routings else None
    configurations = []
    done = 0
    for count in nodes:
        capacity = node_capacity(
            count,
            facts.unique_blocks,
            page,
            capacity_fractions=capacity_fractions,
            capacity_bytes=capacity_bytes,
        )
        config = kvstore_config(capacity, cost_model, block_tokens, machine, overrides)
        # One node: every routing sends everything to it, so it is replayed once.
        for routing in routings if count > 1 else [ANY_ROUTING]:
            label = f"{count} node{'s' if count != 1 else ''}, {routing}"
            base = done

            def on_progress(position: int, label: str = label, base: int = base) -> None:
                if progress is not None:
                    progress(label, base + position)

            result = simulate_cluster(
                requests,
                config,
                nodes=count,
                routing=routing if count > 1 else ROUTINGS[0],
                shared_blocks=pool_blocks,
                network=network,
                cost=cost,
                seed=seed,
                sessions=sessions,
                progress=on_progress,
            )
            done += len(requests)
            entry = result.to_json()
            entry["routing"] = routing
            entry["capacity_blocks_per_node"] = list(capacity)
            configurations.append(entry)
            if progress is not None:
                progress(label, done)
    return {
        "trace": trace_name,
        "requests": facts.requests,
        "block_accesses": facts.block_accesses,
        "unique_blocks": facts.unique_blocks,
        "max_hit_ratio": facts.max_hit_ratio,
        "sessions": None if sessions is None else len(set(sessions)),
        "policy": policy,
        "page_bytes": page,
        "capacity": {
            "per_node": "bytes" if capacity_bytes is not None else "cluster fractions / nodes",
            "fractions": list(capacity_fractions)
            if capacity_bytes is None and capacity_fractions is not None
            else None,
            "bytes_per_node": list(capacity_bytes) if capacity_bytes is not None else None,
        },
        "shared": {
            "capacity_blocks": pool_blocks,
            "capacity_bytes": pool_blocks * page,
            "network_gbps": network.gbps,
            "network_latency_s": network.latency_s,
            "kappa_remote": _kappa_remote(cost, network, page),
        },
        "machine": {
            "nvme_gbps": machine.nvme_gbps,
            "pcie_gbps": machine.pcie_gbps,
            "tflops": machine.tflops,
            "kappa_nvme": cost.kappa(2, page),
            "kappa_dram": cost.kappa(1, page),
        },
        "seed": seed,
        "configurations": configurations,
    }


def _kappa_remote(cost: CostModel, network: Network, page_bytes: int) -> float:
    """κ of the pool: one page's recompute over its load over the network and PCIe."""
    h2d = cost.bandwidth["h2d"]
    load = network.latency_s + page_bytes / (network.gbps * 1e9) + h2d.seconds(page_bytes)
    return cost.recompute_s(cost.tokens_per_page) / load if load > 0 else math.inf
