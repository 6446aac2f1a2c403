"""``kvstore sim --nodes``: a trace across nodes, with and without the shared tier
(docs/tiering.md, "Beyond one machine, by simulation"). Tiny traces only."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from kvstore.cli import main
from kvstore.tiering.config import MODEL_PRESETS
from kvstore.tiering.cost import CostModel
from kvstore.tiering.sim.cluster import (
    DEFAULT_NETWORK as MACHINE_NETWORK,
)
from kvstore.tiering.sim.cluster import (
    REMOTE,
    _Pool,
    derive_sessions,
    plan_with_remote,
    simulate_cluster,
)
from kvstore.tiering.sim.replay import Machine, kvstore_config, simulate_kvstore
from kvstore.tiering.sim.trace import Request, capacity_blocks, generate, trace_facts

MODEL = MODEL_PRESETS["llama-3.1-8b"]
MACHINE = Machine()


def _cost() -> CostModel:
    return MACHINE.cost_model(MODEL, 512)


def sim(*args: str) -> Result:
    return CliRunner().invoke(main, ["sim", *args], env={"COLUMNS": "260"})


@pytest.fixture(scope="module")
def requests() -> list[Request]:
    return generate("multi-turn", seed=1, requests=200)


def test_one_node_without_the_pool_is_the_single_node_replay(requests: list[Request]) -> None:
    facts = trace_facts(requests)
    config = kvstore_config(
        capacity_blocks((0.02, 0.10, 0.5), facts.unique_blocks), MODEL, 512, MACHINE
    )
    single = simulate_kvstore(requests, config)
    cluster = simulate_cluster(
        requests, config, nodes=1, routing="random", shared_blocks=0, cost=_cost()
    )
    assert cluster.local_hits == single.hit_blocks_by_tier
    assert cluster.remote_hits == 0
    assert cluster.ttft_local_s == single.ttft_s
    assert cluster.ttft_shared_s == single.ttft_s
    assert cluster.nvme_blocks_written == single.nvme_blocks_written
    assert cluster.nvme_bytes_written == single.nvme_bytes_written


def test_cli_one_node_matches_kvstore_sim(tmp_path: Path) -> None:
    common = ["--generate", "multi-turn", "--seed", "1", "--requests", "150", "--json"]
    single = sim(*common, "--policy", "kvstore")
    assert single.exit_code == 0, single.output
    plot = tmp_path / "cluster.png"
    cluster = sim(*common, "--nodes", "1,2", "--plot", str(plot))
    assert cluster.exit_code == 0, cluster.output
    assert plot.stat().st_size > 0
    mine = json.loads(single.stdout)["results"][0]
    document = json.loads(cluster.stdout)
    one = document["configurations"][0]
    assert (one["nodes"], one["routing"]) == (1, "any")
    without = one["without_shared"]
    for key in ("hit_ratio", "ttft_p50_s", "ttft_p99_s", "nvme_blocks_written"):
        assert without[key] == mine[key], key
    assert [(c["nodes"], c["routing"]) for c in document["configurations"][1:]] == [
        (2, "random"),
        (2, "session"),
        (2, "prefix"),
    ]
    for entry in document["configurations"]:
        assert entry["with_shared"]["hit_ratio"] >= entry["without_shared"]["hit_ratio"]
        assert set(entry["with_shared"]["hit_ratio_by_tier"]) == {"hbm", "dram", "nvme", "remote"}


def test_derive_sessions_follows_turns_not_a_shared_system_prompt() -> None:
    def r(t: float, *blocks: int) -> Request:
        return Request(t, 512 * len(blocks), 1, blocks)

    trace = [
        r(0, 0, 1, 2, 3),  # session A: system prompt 0, its own 1, 2, partial 3
        r(1, 0, 10, 11),  # session B: shares only the system prompt
        r(2, 0, 1, 2, 4, 5),  # A's next turn: 3 (partial) re-hashed as 4
        r(3, 0, 10, 11, 12),  # B's next turn: extends exactly
        r(4, 0, 1, 20),  # shares A's first turn but much less than all of it: new
    ]
    assert derive_sessions(trace) == [0, 1, 0, 1, 2]


def test_session_routing_keeps_a_session_on_one_node(requests: list[Request]) -> None:
    sessions = derive_sessions(requests)
    assert len(set(sessions)) < len(requests)  # multi-turn: sessions of several turns
    facts = trace_facts(requests)
    capacity = tuple(c // 4 for c in capacity_blocks((0.02, 0.1, 0.5), facts.unique_blocks))
    config = kvstore_config(capacity, MODEL, 512, MACHINE)  # type: ignore[arg-type]
    result = simulate_cluster(
        requests, config, nodes=4, routing="session", shared_blocks=0, cost=_cost()
    )
    nodes_of: dict[int, set[int]] = {}
    for session, node in zip(sessions, result.node_of_request, strict=True):
        nodes_of.setdefault(session, set()).add(node)
    assert all(len(nodes) == 1 for nodes in nodes_of.values())
    assert len(set(result.node_of_request)) == 4  # and the sessions spread over the nodes


def test_the_pool_helps_two_nodes_sharing_one_prefix() -> None:
    shared = tuple(range(8))
    trace = [
        Request(float(i), 512 * 10, 1, (*shared, 1000 + 2 * i, 1001 + 2 * i)) for i in range(20)
    ]
    config = kvstore_config((4, 20, 40), MODEL, 512, MACHINE)
    run = {
        blocks: simulate_cluster(
            trace, config, nodes=2, routing="session", shared_blocks=blocks, cost=_cost()
        )
        for blocks in (0, 100)
    }
    # every request opens a session: the least loaded node takes it, so they alternate
    assert run[100].node_of_request == [i % 2 for i in range(20)]
    off = run[0].to_json()["without_shared"]
    on = run[100].to_json()["with_shared"]
    assert run[100].remote_hits == len(shared)  # node 1's first request finds node 0's prefix
    assert on["hit_ratio"] > off["hit_ratio"]
    assert on["ttft_p99_s"] <= off["ttft_p99_s"]
    assert run[100].network_bytes_read > 0
    for with_pool, alone in zip(run[100].ttft_shared_s, run[0].ttft_local_s, strict=True):
        assert with_pool <= alone * (1 + 1e-12)


def test_plan_with_remote_is_the_cost_models_plan_on_local_pages() -> None:
    cost = _cost()
    page = 512 * MODEL.kv_bytes_per_token
    rng = random.Random(3)
    for _ in range(200):
        hit = rng.randint(0, 12)
        tiers = sorted(rng.choice((0, 1, 2)) for _ in range(hit))
        tokens = rng.randint(1, 20) * 512
        plan = cost.plan(tiers, [page] * hit, tokens)
        assert plan_with_remote(cost, MACHINE_NETWORK, tiers, page, tokens) == (
            plan.ttft_s,
            plan.load_pages,
        )
    # a remote page is cheaper than recomputing it on the default network
    _, load = plan_with_remote(cost, MACHINE_NETWORK, [REMOTE] * 4, page, 4 * 512)
    assert load == 4


def test_pool_is_lru_and_counts_new_blocks() -> None:
    pool = _Pool(3)
    assert pool.publish([1, 2, 3]) == 3
    assert pool.run([1, 2, 3], 1) == 2  # 2, 3 refreshed
    assert pool.publish([4]) == 1  # evicts 1, the least recently used
    assert pool.run([1, 2], 0) == 0
    assert pool.run([9, 2, 3, 4], 1) == 3
    assert _Pool(0).publish([1]) == 0


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--nodes", "0"], "--nodes"),
        (["--nodes", "two"], "--nodes"),
        (["--nodes", "2,,8"], "--nodes"),
        (["--nodes", "100000"], "--nodes"),
        (["--nodes", "2", "--routing", "nearest"], "--routing"),
        (["--nodes", "2", "--shared-capacity", "-1"], "--shared-capacity"),
        (["--nodes", "2", "--shared-capacity", "nan"], "--shared-capacity"),
        (["--nodes", "2", "--shared-capacity-bytes", "12XB"], "--shared-capacity-bytes"),
        (
            ["--nodes", "2", "--shared-capacity", "0.1", "--shared-capacity-bytes", "1GiB"],
            "--shared-capacity",
        ),
        (["--nodes", "2", "--net-gbps", "0"], "--net-gbps"),
        (["--nodes", "2", "--net-latency-us", "-5"], "--net-latency-us"),
        (["--nodes", "2", "--policy", "lmcache"], "--policy"),
        (["--nodes", "2", "--capacity", "0.1,0.1"], "--capacity"),
        (["--routing", "random"], "--routing"),
        (["--net-gbps", "10"], "--net-gbps"),
        (["--nodes", "2", "--suite"], "--suite"),
    ],
)
def test_bad_input_is_a_usage_error_naming_it(args: list[str], named: str) -> None:
    result = sim("--generate", "multi-turn", "--requests", "20", *args)
    assert result.exit_code == 2, result.output
    assert named in result.stderr
    assert "Traceback" not in result.output


def test_bad_input_with_json_prints_the_error_object() -> None:
    result = sim("--generate", "multi-turn", "--requests", "20", "--nodes", "0", "--json")
    assert result.exit_code == 2
    error = json.loads(result.stdout)
    assert error["exit_code"] == 2 and "--nodes" in error["error"]["message"]
