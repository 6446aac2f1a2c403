"""NVMe admission against the displaced page: the sketch, the rule, the models that
switch it, and the rule in the manager (docs/tiering.md, "Admission against the
displaced page")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvstore.tiering import TierConfig
from kvstore.tiering.displace import Displacement, FrequencySketch


def k(name: str, i: int) -> bytes:
    return f"{name}{i}".encode()


def _nothing_above(_key: bytes) -> bool:
    return False


# -- the frequency sketch --------------------------------------------------------------


def test_the_sketch_counts_each_key_and_saturates_at_fifteen() -> None:
    sketch = FrequencySketch(pages=1000)
    for _ in range(5):
        sketch.add(b"five")
    for _ in range(40):
        sketch.add(b"many")
    assert sketch.estimate(b"five") == 5
    assert sketch.estimate(b"many") == 15
    assert sketch.estimate(b"never") == 0


def test_the_sketch_halves_every_counter_after_ten_additions_per_page() -> None:
    sketch = FrequencySketch(pages=100)  # period: 1,000 additions
    for _ in range(8):
        sketch.add(b"hot")
    for i in range(991):
        sketch.add(k("cold", i))
    assert sketch.estimate(b"hot") == 8  # 999 additions: not yet
    sketch.add(b"other")  # the 1,000th
    assert sketch.estimate(b"hot") == 4
    assert sketch.estimate(b"other") == 0  # 1 halved


def test_the_sketch_is_the_same_in_every_process() -> None:
    """xxh3 of the key, not Python's per-process hash: a replay's decisions repeat."""
    import subprocess
    import sys

    probe = (
        "from kvstore.tiering.displace import FrequencySketch as F\n"
        "s = F(pages=1)\n"  # 1 Ki counters a row, period 10: collisions and aging
        "for i in range(200): s.add(b'k%d' % (i % 37))\n"
        "print([s.estimate(b'k%d' % i) for i in range(37)])\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", probe],
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1, outputs


# -- the rule and its models -------------------------------------------------------


def _popular_then_torrent(rule: Displacement, popular: int, rounds: int) -> None:
    """Pages read by many requests (documents) among a torrent of pages seen once."""
    hot = [k("doc", i) for i in range(popular)]
    for _ in range(3):
        rule.looked_up(hot, _nothing_above)
    for key in hot:
        rule.candidate(key)
    for r in range(rounds):
        for j in range(4):
            once = k("once", 4 * r + j)
            rule.counted(once)
            rule.candidate(once)  # leaves DRAM for NVMe
        rule.looked_up([hot[r % popular]], _nothing_above)


def test_the_rule_admits_everything_while_off() -> None:
    rule = Displacement(nvme_pages=10, cache_pages=40)
    rule.counted(b"victim")
    rule.counted(b"victim")
    assert not rule.on
    assert rule.admits(b"new", b"victim")


def test_the_filtered_model_keeps_what_is_read_again_and_turns_the_rule_on() -> None:
    rule = Displacement(nvme_pages=10, cache_pages=40)
    _popular_then_torrent(rule, popular=8, rounds=200)
    plain, filtered = rule.model_hits()
    # The unfiltered model lost the documents to the torrent; the filtered one kept them.
    assert filtered > 5 * plain
    assert rule.on and rule.moves == 1
    assert rule.summary()["on"] is True
    # On: a page asked for once may not displace a document, a document may displace it.
    rule.counted(b"fresh")
    assert not rule.admits(b"fresh", k("doc", 0))
    assert rule.admits(k("doc", 0), b"fresh")


def test_on_a_page_asked_for_once_displaces_not_even_a_page_no_one_asked_for() -> None:
    """A page seen once is the torrent's; a stale page may be a document read again
    after a while. A page asked for twice replaces it."""
    rule = Displacement(nvme_pages=10, cache_pages=40)
    _popular_then_torrent(rule, popular=8, rounds=200)
    assert rule.on
    assert rule.sketch.estimate(b"stale") == 0
    rule.counted(b"once")
    assert not rule.admits(b"once", b"stale")
    rule.counted(b"twice")
    rule.counted(b"twice")
    assert rule.admits(b"twice", b"stale")
    assert not rule.admits(b"twice", k("doc", 0))  # asked for less often than a document


def test_the_filtered_model_applies_the_same_two_asks() -> None:
    rule = Displacement(nvme_pages=2, cache_pages=40)
    for stale in (b"stale-1", b"stale-2"):
        rule.candidate(stale)  # never asked for: counted 0
    rule.counted(b"once")
    rule.candidate(b"once")
    assert b"once" in rule._plain.keys and b"once" not in rule._filtered.keys
    rule.counted(b"twice")
    rule.counted(b"twice")
    rule.candidate(b"twice")
    assert b"twice" in rule._filtered.keys and b"stale-1" not in rule._filtered.keys


def test_new_pages_read_again_turn_the_rule_off() -> None:
    """A session's newest pages have one arrival; the pages of sessions that ended have
    many. Where the next requests want the new ones, the filtered model loses them to
    the old and the rule goes off again."""
    rule = Displacement(nvme_pages=10, cache_pages=40)
    _popular_then_torrent(rule, popular=8, rounds=200)
    assert rule.on
    for i in range(300):
        new = k("turn", i)
        rule.counted(new)
        rule.candidate(new)
        rule.looked_up([new], _nothing_above)  # the session's next turn reads it
    plain, filtered = rule.model_hits()
    assert plain > filtered
    assert not rule.on and rule.moves == 2


def test_a_page_held_above_nvme_is_no_model_hit() -> None:
    rule = Displacement(nvme_pages=10, cache_pages=40)
    rule.candidate(b"page")
    rule.looked_up([b"page"], lambda key: True)  # DRAM serves it
    assert rule.model_hits() == (0.0, 0.0)
    rule.looked_up([b"page"], _nothing_above)
    assert rule.model_hits() == (1.0, 1.0)


def test_a_large_nvme_is_modelled_on_a_hash_sample_of_its_keys() -> None:
    rule = Displacement(nvme_pages=1 << 20, cache_pages=1 << 21)
    for i in range(4096):
        rule.candidate(k("p", i))
    plain, _ = rule.model_hits()
    held = sum(1 for i in range(4096) if rule._plain.keys.get(k("p", i), 0) is None)
    # 2^20 pages over 2^15 a model: one key in 32, and a model of 32 Ki keys.
    assert rule._plain.capacity == 1 << 15
    assert 64 <= held <= 200, held
    assert plain == 0.0


# -- in the manager, replayed -------------------------------------------------------


def _replay(kind: str, capacity: tuple[float, float, float]) -> dict[str, Any]:
    from kvstore.tiering.sim import replay
    from kvstore.tiering.sim.trace import generate

    requests = generate(kind, seed=7, requests=1500, block_tokens=512)
    document = replay.run(
        requests,
        capacity_fractions=capacity,
        policies=["kvstore", "kvstore:nvme_displacement=false"],
    )
    on, off = document["results"]
    return {"on": on, "off": off}


def test_rag_documents_keep_their_nvme_pages_against_pages_seen_once() -> None:
    """`kvstore sim --generate rag` at the smallest capacity: NVMe wrote nearly every
    page leaving DRAM and served fewer hits than Dynamo's second-arrival rule."""
    runs = _replay("rag", (0.005, 0.02, 0.1))
    on, off = runs["on"], runs["off"]
    rule = on["details"]["nvme_displacement"]
    assert rule["on"], rule
    assert off["details"]["nvme_displacement"] is None
    assert on["nvme_blocks_written"] < 0.5 * off["nvme_blocks_written"]
    assert on["hit_ratio"] >= off["hit_ratio"]
    assert on["ttft_p50_s"] <= off["ttft_p50_s"]
    assert on["details"]["admissions"].get("nvme:displaced", 0) > 0


@pytest.mark.parametrize("kind", ["multi-turn", "agent"])
def test_sessions_keep_the_rule_off_and_the_decisions_unchanged(kind: str) -> None:
    runs = _replay(kind, (0.01, 0.05, 0.25))
    on, off = runs["on"], runs["off"]
    rule = on["details"]["nvme_displacement"]
    assert not rule["on"] and rule["moves"] == 0, rule
    plain, filtered = rule["model_hits"]
    assert plain > filtered
    for field in ("hit_ratio", "nvme_blocks_written", "ttft_p50_s"):
        assert on[field] == off[field], field


def test_the_rule_is_a_config_switch() -> None:
    from kvstore.tiering.sim import parse_overrides

    assert parse_overrides("kvstore:nvme_displacement=false") == {"nvme_displacement": False}
    assert TierConfig().nvme_displacement is True


# -- in the manager, on a real store, the rule held on ----------------------------------


class _HeldOn(Displacement):
    """The rule, never switched off by its models."""

    __slots__ = ()

    def _judge(self) -> None:
        pass


def hold_on(tm: Any) -> Displacement:
    """Turn the manager's displacement rule on for good (its models never move it)."""
    rule = tm._value.displacement
    assert rule is not None
    rule.__class__ = _HeldOn
    rule.on = True
    return rule


def test_held_on_nvme_keeps_its_documents_stays_within_capacity_and_loads_exact_bytes(
    tmp_path: Path,
) -> None:
    import torch

    from kvstore.tiering import TierManager
    from tests.unit.tiering.test_tiering_manager import SLOT, keys, load_all, page
    from tests.unit.tiering.test_tiering_manager import config as manager_config

    cfg = manager_config(
        tmp_path,
        hbm_bytes=2 * SLOT,
        dram_bytes=4 * SLOT,
        nvme_bytes=6 * SLOT,
        watermark_warn=0.5,
        watermark_low=0.25,
        admission="value_density",
        nvme_write_payoff=None,  # every page value density admits: the rule alone filters
    )
    with TierManager.open(cfg) as tm:
        hold_on(tm)

        def settle() -> None:
            for _ in range(4):
                tm.drain()
                tm.step()
            assert tm.drain()

        documents = keys(6, "doc")
        for i in range(0, 6, 2):
            out = tm.offer(
                documents[i : i + 2], [page(i), page(i + 1)], parents=[None, documents[i]]
            )
            assert out.admitted == 2, out.reasons
            settle()
        for _ in range(4):  # read by many: counted often
            for i in range(0, 6, 2):
                tm.lookup(documents[i : i + 2])
        torrent = keys(40, "once")
        for i in range(0, 40, 2):
            tm.offer(torrent[i : i + 2], [page(100 + i), page(101 + i)], parents=[None, torrent[i]])
            settle()
            stats = tm.stats()
            assert stats.used_bytes[2] <= stats.capacity_bytes[2], stats.used_bytes
        stats = tm.stats()
        assert stats.admissions.get("nvme:displaced", 0) > 0, stats.admissions
        assert stats.nvme_displacement is not None and stats.nvme_displacement["on"]
        # The documents kept their NVMe pages against pages seen once, and load exactly.
        for i in range(0, 6, 2):
            got = load_all(tm, documents[i : i + 2])
            assert len(got) == 2, i
            assert torch.equal(got[0], page(i)) and torch.equal(got[1], page(i + 1)), i
        # Whatever of the torrent is still held loads its own bytes.
        for i in range(0, 40, 2):
            for j, tensor in enumerate(load_all(tm, torrent[i : i + 2])):
                assert torch.equal(tensor, page(100 + i + j)), (i, j)
