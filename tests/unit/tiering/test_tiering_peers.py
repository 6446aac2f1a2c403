"""Reference models of the peers: exact hits and NVMe writes on hand-made traces.

Each small trace is traced by hand in the comments (tiers: HBM, DRAM, NVMe; an
LRU lists oldest first). Then properties on generated traces: no peer beats
the infinite cache, recompute never hits, the per-request hits add up.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvstore.tiering.sim.peers import POLICIES, PeerPolicy, make_peer, replay_peer
from kvstore.tiering.sim.trace import Request, capacity_blocks, generate, load_trace, trace_facts

MOONCAKE_TRACE = "mooncake-conversation"  # shipped as package data, read by name

ALL_NAMES = {
    "vllm",
    "vllm-threshold2",
    "lmcache",
    "sglang-write-through",
    "sglang-selective",
    "sglang-write-back",
    "dynamo",
    "mooncake",
    "exclusive-lru",
    "infinite",
    "recompute",
}


def run(
    peer: PeerPolicy, *requests: Sequence[int], times: Sequence[float] | None = None
) -> list[tuple[int, int, int]]:
    at = times if times is not None else [float(i) for i in range(len(requests))]
    return [peer.request(blocks, now) for blocks, now in zip(requests, at, strict=True)]


def test_policies_and_make_peer() -> None:
    assert set(POLICIES) == ALL_NAMES
    for name in ALL_NAMES:
        peer = make_peer(name, (1, 2, 3))
        assert peer.name == name
        assert peer.nvme_blocks_written == 0
    with pytest.raises(ValueError, match=r"unknown peer policy 'arc'; known: vllm, "):
        make_peer("arc", (1, 1, 1))
    for bad in [(1, 1), (1, -1, 1), (1, 1.5, 1), (True, 1, 1)]:
        with pytest.raises(ValueError, match="capacity_blocks"):
            make_peer("vllm", bad)  # type: ignore[arg-type]


def test_infinite_hits_every_block_seen_before_and_recompute_nothing() -> None:
    infinite = make_peer("infinite", (0, 0, 0))
    assert run(infinite, [1, 2, 3], [1, 2, 4], [5, 1], [1, 2, 4, 5]) == [
        (0, 0, 0),
        (2, 0, 0),
        (0, 0, 0),
        (4, 0, 0),
    ]
    assert infinite.resident(4) == 0 and infinite.resident(9) is None
    recompute = make_peer("recompute", (10, 10, 10))
    assert run(recompute, [1, 2], [1, 2]) == [(0, 0, 0), (0, 0, 0)]
    assert recompute.nvme_blocks_written == 0 and recompute.resident(1) is None


def test_vllm_cascades_every_stored_block_to_nvme() -> None:
    peer = make_peer("vllm", (2, 100, 100))
    # [1,2,3]: HBM keeps 2,3; DRAM and NVMe get all three.  [4,5]: HBM 4,5.
    hits = run(peer, [1, 2, 3], [4, 5], [1, 2, 3, 6])
    assert hits == [(0, 0, 0), (0, 0, 0), (0, 3, 0)]
    assert peer.nvme_blocks_written == 6  # every unique block offered


def test_vllm_promotes_an_nvme_hit_to_dram_without_writing_it_again() -> None:
    peer = make_peer("vllm", (1, 2, 100))
    # [1,2,3]: HBM [3]; DRAM [3,2] (1 evicted, 2 most recent after the
    # request); NVMe 1,2,3 (3 writes).
    assert run(peer, [1, 2, 3]) == [(0, 0, 0)]
    assert peer.nvme_blocks_written == 3
    # Again: 1 from NVMe (promoted into DRAM, evicting 3), 2 from DRAM, 3 from
    # HBM. Placing 3: not in DRAM any more, so stored again and cascaded: the
    # FS tier rewrites it. The promotion of 1 is not cascaded.
    assert run(peer, [1, 2, 3]) == [(1, 1, 1)]
    assert peer.nvme_blocks_written == 4
    assert [peer.resident(b) for b in (1, 2, 3)] == [1, 2, 0]


def test_vllm_without_a_cpu_tier_writes_nothing_to_nvme() -> None:
    peer = make_peer("vllm", (1, 0, 100))
    run(peer, [1, 2], [3], [1, 2])
    assert peer.nvme_blocks_written == 0


def test_vllm_threshold2_stores_on_the_second_lookup() -> None:
    peer = make_peer("vllm-threshold2", (1, 100, 100))
    # First: looked up once each, not stored. Second: nothing resident but
    # HBM's 2, which is not at the front, so a miss; now seen twice: stored.
    # Third: 1 from DRAM, 2 from HBM.
    assert run(peer, [1, 2], [1, 2], [1, 2]) == [(0, 0, 0), (0, 0, 0), (1, 1, 0)]
    assert peer.nvme_blocks_written == 2


def test_vllm_threshold2_does_not_count_gpu_hits() -> None:
    # The lookup (and its counter) only sees blocks past the GPU prefix hit.
    peer = make_peer("vllm-threshold2", (10, 100, 100))
    assert run(peer, [1], [1], [1]) == [(0, 0, 0), (1, 0, 0), (1, 0, 0)]
    assert peer.nvme_blocks_written == 0
    plain = make_peer("vllm", (10, 100, 100))
    run(plain, [1], [1], [1])
    assert plain.nvme_blocks_written == 1


def test_lmcache_writes_each_backend_once_and_writes_nvme_hits_back_to_dram() -> None:
    peer = make_peer("lmcache", (1, 1, 10))
    # [1,2]: HBM [2], DRAM [2], NVMe 1,2.
    assert run(peer, [1, 2]) == [(0, 0, 0)]
    assert peer.nvme_blocks_written == 2
    # 1 from NVMe (written back into DRAM), 2 from HBM; nothing rewritten.
    assert run(peer, [1, 2]) == [(1, 0, 1)]
    assert peer.nvme_blocks_written == 2


def test_sglang_write_through_backs_up_host_then_storage() -> None:
    peer = make_peer("sglang-write-through", (1, 2, 10))
    # Place 1: host + L3. Place 2: evicts 1 from HBM (kept on host), host + L3.
    assert run(peer, [1, 2]) == [(0, 0, 0)]
    assert peer.nvme_blocks_written == 2
    assert run(peer, [1, 2]) == [(1, 1, 0)]
    assert peer.nvme_blocks_written == 2


def test_sglang_host_pool_evicts_only_device_evicted_nodes() -> None:
    peer = make_peer("sglang-write-through", (1, 1, 10))
    # Place 1: host [1], L3. Place 2: HBM evicts 1 (host-only now); backing 2
    # up needs room, so host drops 1 (it leaves the tree); L3 gets 2.
    assert run(peer, [1, 2]) == [(0, 0, 0)]
    assert peer.nvme_blocks_written == 2
    assert peer.resident(1) == 2
    # 1 from L3: its prefetch finds host full of 2, which is on the device and
    # so not evictable. Placing 1 evicts 2 from HBM (host-only now), and
    # backing 1 up drops 2 from host; the same again for 2. L3 has both
    # already, so nothing is written.
    assert run(peer, [1, 2]) == [(1, 0, 1)]
    assert peer.nvme_blocks_written == 2


def test_sglang_selective_backs_up_on_the_second_hit_while_in_the_tree() -> None:
    peer = make_peer("sglang-selective", (2, 10, 10))
    assert run(peer, [1], [1]) == [(0, 0, 0), (1, 0, 0)]
    assert peer.nvme_blocks_written == 1
    # With a 1-block device, 1 is evicted (not backed up: dropped with its
    # count) before it is seen again, so it never reaches host or L3.
    small = make_peer("sglang-selective", (1, 10, 10))
    assert run(small, [1], [2], [1]) == [(0, 0, 0)] * 3
    assert small.nvme_blocks_written == 0


def test_sglang_write_back_writes_only_on_device_eviction() -> None:
    peer = make_peer("sglang-write-back", (1, 10, 10))
    assert run(peer, [1]) == [(0, 0, 0)]
    assert peer.nvme_blocks_written == 0
    # 2 evicts 1 from HBM: written to host, then L3.
    assert run(peer, [2]) == [(0, 0, 0)]
    assert peer.nvme_blocks_written == 1
    # 1 loads back from host and evicts 2, which is written back.
    assert run(peer, [1]) == [(0, 1, 0)]
    assert peer.nvme_blocks_written == 2
    roomy = make_peer("sglang-write-back", (1000, 10, 10))
    replay_peer(roomy, generate("multi-turn", seed=2, requests=50))
    assert roomy.nvme_blocks_written == 0


def test_dynamo_writes_to_disk_only_blocks_registered_twice_within_the_decay() -> None:
    peer = make_peer("dynamo", (1, 1, 10))
    # t=0 [1]: host registration, count 1. t=1 [2]: evicts 1 from HBM and host.
    # t=2 [1]: registered again, count 2: written.
    assert run(peer, [1], [2], [1], times=[0.0, 1.0, 2.0]) == [(0, 0, 0)] * 3
    assert peer.nvme_blocks_written == 1
    # t=700: one decay tick (at 600 s): 1's count 2 -> 1, 2's 1 -> pruned. So
    # 2's second registration counts 1 again: not written.
    assert run(peer, [2], times=[700.0]) == [(0, 0, 0)]
    assert peer.nvme_blocks_written == 1
    # 1 is on disk: served from there, onboarded, not written again.
    assert run(peer, [1], times=[701.0]) == [(0, 0, 1)]
    assert peer.nvme_blocks_written == 1


def test_dynamo_never_writes_a_block_that_stays_on_host() -> None:
    peer = make_peer("dynamo", (10, 10, 10))
    assert run(peer, [1], [1], [1]) == [(0, 0, 0), (1, 0, 0), (1, 0, 0)]
    assert peer.nvme_blocks_written == 0
    no_host = make_peer("dynamo", (1, 0, 10))
    run(no_host, [1], [2], [1], [2], [1])
    assert no_host.nvme_blocks_written == 0


def test_mooncake_evicts_a_five_percent_batch_past_ninety_percent() -> None:
    peer = make_peer("mooncake", (1, 100, 1000))
    # 90 puts fill DRAM to 0.90: no eviction. The 91st crosses it: evict
    # ceil(91 * (0.91 - 0.90 + 0.05)) = 6, least recent first, each offloaded.
    run(peer, list(range(90)))
    assert peer.nvme_blocks_written == 0
    run(peer, [1000])
    assert peer.nvme_blocks_written == 6
    # The request's blocks were refreshed tail first, so 89..84 were oldest.
    assert {b for b in range(90) if peer.resident(b) == 2} == set(range(84, 90))
    # 85 left; 6 more puts reach 91 again and evict the next oldest, 83..78.
    run(peer, [1001, 1002, 1003, 1004, 1005, 1006])
    assert peer.nvme_blocks_written == 12
    assert {b for b in range(90) if peer.resident(b) == 2} == set(range(78, 90))


def test_mooncake_promotes_an_ssd_hit_and_keeps_its_ssd_copy() -> None:
    peer = make_peer("mooncake", (1, 10, 100))
    # 10 puts: the 10th takes DRAM to 1.0 > 0.9: evict ceil(10 * 0.15) = 2.
    run(peer, list(range(10)))
    assert peer.nvme_blocks_written == 2
    assert [peer.resident(b) for b in (0, 1)] == [2, 2]
    # 0 and 1 from SSD, promoted; the puts cross the watermark again and
    # evict 2 more (9 and 8, the oldest), which have no SSD copy yet.
    assert run(peer, [0, 1]) == [(0, 0, 2)]
    assert peer.nvme_blocks_written == 4
    assert [peer.resident(b) for b in (0, 1, 8, 9)] == [1, 0, 2, 2]
    assert 0 in peer.nvme and 1 in peer.nvme


def test_exclusive_lru_demotes_on_eviction_down_the_chain() -> None:
    peer = make_peer("exclusive-lru", (1, 1, 10))
    assert run(peer, [1], [2]) == [(0, 0, 0)] * 2
    assert (peer.resident(1), peer.nvme_blocks_written) == (1, 0)
    run(peer, [3])  # 2 down to DRAM, 1 down to NVMe
    assert [peer.resident(b) for b in (1, 2, 3)] == [2, 1, 0]
    assert peer.nvme_blocks_written == 1
    # 1 moves up from NVMe to HBM; 3 goes down to DRAM, 2 down to NVMe.
    assert run(peer, [1]) == [(0, 0, 1)]
    assert [peer.resident(b) for b in (1, 2, 3)] == [0, 2, 1]
    assert peer.nvme_blocks_written == 2
    # Exclusive: each block in one tier only.
    assert len(peer.hbm) + len(peer.dram) + len(peer.nvme) == 3


@pytest.mark.parametrize("name", ["vllm", "lmcache", "sglang-write-through"])
def test_write_through_peers_write_each_unique_block_once_with_room(name: str) -> None:
    requests = generate("mixed", seed=4, requests=400)
    unique = trace_facts(requests).unique_blocks
    peer = make_peer(name, (50, unique, unique))
    replay_peer(peer, requests)
    assert peer.nvme_blocks_written == unique


def check_replays(requests: list[Request], fractions: tuple[float, float, float]) -> None:
    facts = trace_facts(requests)
    capacities = capacity_blocks(fractions, facts.unique_blocks)
    results = {name: replay_peer(make_peer(name, capacities), requests) for name in POLICIES}
    best = results["infinite"]
    assert best.hit_ratio == pytest.approx(facts.max_hit_ratio)
    assert results["recompute"].hit_ratio == 0.0
    assert results["recompute"].nvme_blocks_written == 0
    for name, result in results.items():
        assert result.policy == name
        assert result.block_accesses == facts.block_accesses
        assert result.hit_ratio <= best.hit_ratio, name
        assert len(result.per_request_hits) == len(requests)
        totals = tuple(sum(hits[tier] for hits in result.per_request_hits) for tier in range(3))
        assert totals == result.hit_blocks_by_tier, name
        for request, hits in zip(requests, result.per_request_hits, strict=True):
            assert sum(hits) <= len(request.blocks)
    # Inclusive peers serve at least as many hits from HBM+DRAM+NVMe as HBM alone.
    assert results["vllm"].hit_ratio > results["recompute"].hit_ratio


@pytest.mark.parametrize("fractions", [(0.02, 0.10, 0.5), (0.01, 0.05, 0.25)])
def test_no_peer_beats_the_infinite_cache_on_a_generated_trace(
    fractions: tuple[float, float, float],
) -> None:
    check_replays(generate("mixed", seed=9, requests=1500), fractions)


def test_no_peer_beats_the_infinite_cache_on_the_mooncake_trace() -> None:
    check_replays(load_trace(MOONCAKE_TRACE, limit=2000), (0.02, 0.10, 0.5))
