"""``kvstore sim`` (also ``python -m kvstore.tiering.sim``) on small generated traces.

The ``--json`` object is exactly the issue's schema (plus ``max_hit_ratio`` and
``machine`` at the top and ``details`` per result); the table marks the Pareto
frontier of hit ratio against NVMe bytes written; ``--plot`` writes a PNG. Exit
codes are the house's: 2 for an option the command refuses, 8 for a trace file
that is missing or invalid; with ``--json`` a failure prints the error object.
"""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kvstore.cli import main
from kvstore.tiering.config import MODEL_PRESETS
from kvstore.tiering.sim.cli import (
    kvstore_verdict,
    occupancy_line,
    parse_capacity,
    parse_capacity_bytes,
)
from kvstore.tiering.sim.peers import POLICIES
from kvstore.tiering.sim.plots import FrontierNote, frontier_notes, pareto_frontier
from kvstore.tiering.sim.trace import generate, load_trace, trace_facts, write_trace

REPO_ROOT = Path(__file__).resolve().parents[3]
MOONCAKE_TRACE = "mooncake-conversation"  # shipped as package data, read by name
REQUESTS = 300
SEED = 1
PAGE_8B = 512 * MODEL_PRESETS["llama-3.1-8b"].kv_bytes_per_token  # 64 MiB, 4 KiB aligned

TOP_KEYS = {"trace", "requests", "block_accesses", "unique_blocks", "capacity_blocks", "results"}
TOP_EXTRA = {"max_hit_ratio", "machine"}
RESULT_KEYS = {
    "policy",
    "hit_ratio",
    "hit_ratio_by_tier",
    "nvme_blocks_written",
    "nvme_bytes_written",
    "ttft_p50_s",
    "ttft_p99_s",
    "recompute_tokens",
    "wall_s",
}


def sim(*args: str) -> Result:
    return CliRunner().invoke(main, ["sim", *args], env={"COLUMNS": "260"})


def json_of(result: Result) -> Any:
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sim") / "mixed.jsonl"
    write_trace(generate("mixed", seed=SEED, requests=REQUESTS), path)
    return path


@pytest.fixture(scope="module")
def full_run() -> Result:
    """Every policy (the default) on the generated trace, with --json."""
    result = sim("--generate", "mixed", "--requests", str(REQUESTS), "--seed", str(SEED), "--json")
    assert result.exit_code == 0, result.output
    return result


# -- the JSON object -------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def test_json_is_the_issue_schema(full_run: Result) -> None:
    document = json_of(full_run)  # stdout is exactly one JSON document
    assert TOP_KEYS <= set(document) <= TOP_KEYS | TOP_EXTRA
    assert document["trace"] == f"generated:mixed:seed={SEED}:requests={REQUESTS}"
    facts = trace_facts(generate("mixed", seed=SEED, requests=REQUESTS))
    assert (document["requests"], document["block_accesses"], document["unique_blocks"]) == (
        facts.requests,
        facts.block_accesses,
        facts.unique_blocks,
    )
    unique = facts.unique_blocks
    assert document["capacity_blocks"] == [unique * 2 // 100, unique // 10, unique // 2]
    assert [r["policy"] for r in document["results"]] == [*POLICIES, "kvstore"]
    accesses = document["block_accesses"]
    for result in document["results"]:
        extra = set(result) - RESULT_KEYS
        assert set(result) >= RESULT_KEYS and extra <= {"details"}, result["policy"]
        by_tier = result["hit_ratio_by_tier"]
        assert set(by_tier) == {"hbm", "dram", "nvme"}
        for key in ("nvme_blocks_written", "nvme_bytes_written", "recompute_tokens"):
            assert _is_int(result[key]), (result["policy"], key)
        for key in ("hit_ratio", "ttft_p50_s", "ttft_p99_s", "wall_s"):
            assert isinstance(result[key], float) and math.isfinite(result[key])
        # Fractions of all block accesses: whole blocks per tier, summing to the total.
        for ratio in by_tier.values():
            assert ratio * accesses == pytest.approx(round(ratio * accesses), abs=1e-6)
        assert sum(by_tier.values()) == pytest.approx(result["hit_ratio"])
        assert result["hit_ratio"] <= document["max_hit_ratio"] + 1e-12
        assert result["nvme_bytes_written"] == result["nvme_blocks_written"] * PAGE_8B
        assert result["ttft_p50_s"] <= result["ttft_p99_s"]
    by_name = {r["policy"]: r for r in document["results"]}
    assert by_name["infinite"]["hit_ratio"] == pytest.approx(document["max_hit_ratio"])
    assert by_name["recompute"]["hit_ratio"] == 0.0
    assert by_name["recompute"]["nvme_blocks_written"] == 0
    assert "details" in by_name["kvstore"]
    assert document["machine"]["nvme_gbps"] == 6.0


def test_json_run_prints_the_table_on_stderr_with_the_frontier(full_run: Result) -> None:
    document = json_of(full_run)
    notes = frontier_notes(document["results"])
    table = full_run.stderr
    assert "Pareto" in table and "NVMe writes" in table
    for note in notes:
        row = next(line for line in table.splitlines() if line.startswith(f"│ {note.policy} "))
        if note.reference:
            assert "reference" in row
        elif note.on_frontier:
            assert "frontier" in row and "dominated" not in row
        else:
            assert f"dominated by: {note.dominated_by[0]}" in row
    [kvstore] = [n for n in notes if n.policy == "kvstore"]
    assert kvstore_verdict(kvstore) in table


def test_kvstore_reports_how_full_its_tiers_ran(full_run: Result) -> None:
    """Mean share of each tier's slots holding a page before each lookup: in [0, 1],
    HBM and DRAM filled by a trace with more unique blocks than they hold, printed
    under the table as it is in the JSON."""
    [kvstore] = [r for r in json_of(full_run)["results"] if r["policy"] == "kvstore"]
    occupancy = kvstore["details"]["occupancy"]
    assert set(occupancy) == {"hbm", "dram", "nvme"}
    assert all(0.0 <= share <= 1.0 for share in occupancy.values())
    assert occupancy["hbm"] > 0.5 and occupancy["dram"] > 0.5
    assert occupancy_line(kvstore) in full_run.stderr
    assert f"DRAM {occupancy['dram']:.0%}" in full_run.stderr
    peer = json_of(full_run)["results"][0]
    assert occupancy_line(peer) is None  # a peer model reports none


def test_generated_trace_saved_with_out_replays_the_same(tmp_path: Path) -> None:
    saved = tmp_path / "saved.jsonl"
    policies = ["--policy", "vllm", "--policy", "dynamo", "--json"]
    first = sim("--generate", "multi-turn", "--requests", "120", "--out", str(saved), *policies)
    assert first.exit_code == 0, first.output
    assert load_trace(saved) == generate("multi-turn", seed=0, requests=120)
    second = sim(str(saved), *policies)
    assert second.exit_code == 0, second.output
    a, b = json_of(first), json_of(second)
    assert b["trace"] == str(saved)
    for document in (a, b):
        for result in document["results"]:
            del result["wall_s"]
        del document["trace"]
    assert a == b


def test_limit_replays_the_first_requests(trace_file: Path) -> None:
    result = sim(str(trace_file), "--limit", "50", "--policy", "lmcache", "--json")
    assert result.exit_code == 0, result.output
    document = json_of(result)
    first = load_trace(trace_file)[:50]
    assert document["requests"] == 50
    assert document["block_accesses"] == sum(len(r.blocks) for r in first)
    assert [r["policy"] for r in document["results"]] == ["lmcache"]


def test_capacity_bytes_model_and_machine(trace_file: Path) -> None:
    page_70b = 512 * MODEL_PRESETS["llama-3.1-70b"].kv_bytes_per_token  # 160 MiB
    args = ["--model", "llama-3.1-70b", "--capacity-bytes", "320MiB,1600MiB,8GiB"]
    machine = ["--nvme-gbps", "3", "--pcie-gbps", "10", "--tflops", "100"]
    result = sim(str(trace_file), *args, *machine, "--policy", "lmcache", "--json")
    assert result.exit_code == 0, result.output
    document = json_of(result)
    assert document["capacity_blocks"] == [2, 10, (8 << 30) // page_70b]
    assert {k: document["machine"][k] for k in ("nvme_gbps", "pcie_gbps", "tflops")} == {
        "nvme_gbps": 3.0,
        "pcie_gbps": 10.0,
        "tflops": 100.0,
    }
    [lmcache] = document["results"]
    assert lmcache["nvme_blocks_written"] > 0
    assert lmcache["nvme_bytes_written"] == lmcache["nvme_blocks_written"] * page_70b


def test_capacity_fractions_and_kvstore_overrides(trace_file: Path) -> None:
    result = sim(
        str(trace_file),
        "--capacity",
        "0,0.29,1",
        "--policy",
        "kvstore",
        "--policy",
        "kvstore:eviction=lru,hysteresis_s=0",
        "--policy",
        "kvstore",  # a repeat runs once
        "--json",
    )
    assert result.exit_code == 0, result.output
    document = json_of(result)
    unique = document["unique_blocks"]
    assert document["capacity_blocks"] == [0, math.floor(unique * 29 / 100), unique]
    names = [r["policy"] for r in document["results"]]
    assert names == ["kvstore", "kvstore:eviction=lru,hysteresis_s=0"]
    for row in document["results"]:
        assert row["hit_ratio_by_tier"]["hbm"] == 0.0  # no HBM tier


def test_a_slice_of_the_mooncake_trace() -> None:
    result = sim(MOONCAKE_TRACE, "--limit", "200", "--policy", "vllm", "--json")
    assert result.exit_code == 0, result.output
    document = json_of(result)
    assert document["requests"] == 200
    assert document["block_accesses"] == sum(
        len(r.blocks) for r in load_trace(MOONCAKE_TRACE, limit=200)
    )


# -- --plot ----------------------------------------------------------------------------------


def test_plot_writes_a_png(trace_file: Path, tmp_path: Path) -> None:
    png = tmp_path / "sim.png"
    policies = ["vllm", "sglang-selective", "dynamo", "infinite", "recompute", "kvstore"]
    args = [arg for name in policies for arg in ("--policy", name)]
    result = sim(str(trace_file), "--limit", "120", *args, "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert f"wrote {png}" in result.stdout.replace("\n", "")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    failed = sim(str(trace_file), "--policy", "vllm", "--plot", str(tmp_path / "no" / "p.png"))
    assert failed.exit_code == 8, failed.output
    assert "cannot write plot" in failed.stderr


# -- the Pareto frontier ---------------------------------------------------------------------


def point(policy: str, hit_ratio: float, nvme_bytes: int) -> dict[str, Any]:
    return {"policy": policy, "hit_ratio": hit_ratio, "nvme_bytes_written": nvme_bytes}


def test_frontier_leaves_out_references_and_keeps_ties() -> None:
    results = [
        point("a", 0.5, 100),
        point("b", 0.4, 10),
        point("c", 0.4, 50),  # dominated by b (same hits, more writes)
        point("d", 0.5, 100),  # a tie with a: both stay
        point("infinite", 0.9, 0),  # would dominate everything
        point("recompute", 0.0, 0),
    ]
    assert [r["policy"] for r in pareto_frontier(results)] == ["b", "a", "d"]
    notes = {n.policy: n for n in frontier_notes(results)}
    assert notes["c"] == FrontierNote("c", False, False, ("b",))
    assert notes["infinite"].reference and not notes["infinite"].on_frontier
    assert notes["a"].on_frontier and notes["a"].dominated_by == ()


@pytest.mark.parametrize(
    ("kvstore", "standing", "dominating", "dominated"),
    [
        (point("kvstore", 0.45, 20), "on", (), ()),  # between b and a
        (point("kvstore", 0.5, 10), "above", (), ("b", "a")),  # fewest writes first
        (point("kvstore", 0.3, 60), "dominated", ("b",), ()),
        (point("kvstore", 0.3, 200), "dominated", ("a", "b"), ()),
        (point("kvstore", 0.4, 10), "on", (), ()),  # equal to b: neither dominates
    ],
)
def test_kvstore_against_the_peers_frontier(
    kvstore: dict[str, Any], standing: str, dominating: tuple[str, ...], dominated: tuple[str, ...]
) -> None:
    peers = [point("a", 0.5, 100), point("b", 0.4, 10), point("infinite", 0.9, 0)]
    note = frontier_notes([*peers, kvstore])[-1]
    assert (note.against_peers, note.peers_dominating, note.peers_dominated) == (
        standing,
        dominating,
        dominated,
    )
    verdict = kvstore_verdict(note)
    assert {"on": "on the peers' frontier", "above": "above", "dominated": "below"}[
        standing
    ] in verdict


# -- bad inputs ------------------------------------------------------------------------------


def test_missing_and_invalid_trace_files_exit_8(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    result = sim(str(missing), "--json")
    assert result.exit_code == 8
    error = json_of(result)
    assert error["exit_code"] == 8 and str(missing) in error["error"]["message"]
    assert "Traceback" not in result.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 4, "input_length": 10, "output_length": 1, "hash_ids": [2]}\n'
    )
    result = sim(str(bad), "--json")
    assert result.exit_code == 8
    error = json_of(result)["error"]
    assert error["type"] == "TraceError"
    assert f"{bad}:2" in error["message"] and "'timestamp'" in error["message"]
    result = sim(str(bad))  # without --json: one line on stderr, nothing on stdout
    assert result.exit_code == 8 and result.stdout == "" and f"{bad}:2" in result.stderr


GOOD_LINE = b'{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}\n'
DIGITS = sys.get_int_max_str_digits()


def bad_trace(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A file (or directory) that is no trace, and what its error must say."""
    path = tmp_path / f"{kind}.jsonl"
    if kind == "directory":
        path.mkdir()
        return path, f"cannot read trace {path}: "
    content, named = {
        "deep-json": (GOOD_LINE + b"[" * 100_000 + b"\n", f"{path}:2: not valid JSON"),
        "not-utf8": (GOOD_LINE * 2 + b'{"x": "\xff"}\n', f"{path}:3: not UTF-8 (byte 0xff"),
        "long-int": (
            GOOD_LINE + b'{"timestamp": ' + b"9" * 5000 + b"}\n",
            f"{path}:2: not valid JSON (a number has more than {DIGITS} digits)",
        ),
        "damaged-gzip": (gzip.compress(GOOD_LINE * 3)[:-8], f"{path}: a damaged gzip file"),
        "empty": (b"", f"{path}: no requests"),
    }[kind]
    path.write_bytes(content)
    return path, named


@pytest.mark.parametrize(
    "kind", ["deep-json", "not-utf8", "long-int", "damaged-gzip", "empty", "directory"]
)
def test_a_trace_that_is_no_trace_exits_8_with_one_line(tmp_path: Path, kind: str) -> None:
    """Not a traceback (RecursionError), nor a usage error (2) for bad bytes, a too
    long number or a directory: exit 8, one line naming the file and line."""
    path, named = bad_trace(tmp_path, kind)
    result = sim(str(path), "--policy", "vllm", "--json")
    assert result.exit_code == 8, result.output
    error = json_of(result)
    assert error["exit_code"] == 8 and named in error["error"]["message"]
    assert "Traceback" not in result.output
    result = sim(str(path), "--policy", "vllm")
    assert result.exit_code == 8 and result.stdout == ""
    [line] = result.stderr.splitlines()  # one line, however long the path and hint
    assert line.startswith("error: ") and named in line


def test_a_trace_that_is_no_trace_exits_8_from_the_command_line(tmp_path: Path) -> None:
    """The real process: no RecursionError traceback, exit 8, stderr one line."""
    path, named = bad_trace(tmp_path, "deep-json")
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.tiering.sim", str(path), "--policy", "vllm"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        check=False,
    )
    assert done.returncode == 8, done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1 and named in done.stderr


def test_a_huge_capacity_is_a_capacity_and_a_non_finite_one_a_usage_error(
    trace_file: Path,
) -> None:
    """Large finite capacities ask for an unbounded tier; inf, nan and negatives exit 2."""
    huge = "9" * 400  # beyond a float: once an OverflowError traceback
    assert parse_capacity_bytes(f"2.01KB,{huge},1") == (2010, int(huge), 1)  # exact
    result = sim(str(trace_file), "--capacity-bytes", f"1GiB,{huge},1GiB", "--policy", "vllm")
    assert result.exit_code == 0, result.output
    result = sim(str(trace_file), "--capacity", "0.02,1e300,0.5", "--policy", "lmcache", "--json")
    assert result.exit_code == 0, result.output
    document = json_of(result)
    assert document["capacity_blocks"][1] == 10**300 * document["unique_blocks"]
    for capacity in ("0.02,inf,0.5", "0.02,1e400,0.5", "0.02,-inf,0.5", "-0.5,1,1"):
        result = sim(str(trace_file), "--capacity", capacity, "--json")
        assert result.exit_code == 2, (capacity, result.output)
        assert "must be finite and >= 0" in json_of(result)["error"]["message"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--capacity", "0.1,0.2"], "--capacity"),
        (["--capacity", "a,0.1,0.2"], "'a' is not a number"),
        (["--capacity", "-1,0.1,0.2"], ">= 0"),
        (["--capacity", "nan,0.1,0.2"], "finite"),
        (["--capacity-bytes", "1XB,1GiB,1GiB"], "'1XB' is not a size"),
        (["--capacity", "0,0,1", "--capacity-bytes", "0,0,1"], "not both"),
        (["--policy", "nope"], "'nope': unknown policy"),
        (["--policy", "kvstore:nofield=1"], "'nofield=1' is not FIELD=VALUE"),
        (["--policy", "kvstore:eviction=bogus"], "eviction must be one of"),
        (["--policy", "kvstore:hysteresis_s=abc"], "--policy 'kvstore:hysteresis_s=abc'"),
        (["--model", "gpt-5"], "unknown model preset 'gpt-5'"),
        (["--nvme-gbps", "0"], "--nvme-gbps must be"),
        (["--tflops", "-3"], "--tflops must be"),
    ],
)
def test_bad_options_exit_2_naming_the_problem(
    trace_file: Path, args: list[str], named: str
) -> None:
    result = sim(str(trace_file), *args, "--json")
    assert result.exit_code == 2, result.output
    error = json_of(result)
    assert error["exit_code"] == 2 and named in error["error"]["message"]
    assert "Traceback" not in result.output


def test_trace_and_generate_are_one_or_the_other(trace_file: Path, tmp_path: Path) -> None:
    assert "TRACE file or --generate" in sim().stderr
    assert sim().exit_code == 2
    assert sim(str(trace_file), "--generate", "mixed").exit_code == 2
    result = sim(str(trace_file), "--out", str(tmp_path / "x.jsonl"))
    assert result.exit_code == 2 and "needs --generate" in result.stderr
    assert not (tmp_path / "x.jsonl").exists()
    assert sim("--generate", "nope").exit_code == 2  # click's choice


def test_capacity_parsers() -> None:
    assert parse_capacity(" 0.02, 0.1 ,0.5") == (0.02, 0.1, 0.5)
    assert parse_capacity_bytes("1GiB,2gb,4096") == (1 << 30, 2 * 10**9, 4096)
    assert parse_capacity_bytes("1.5K,0,.5MiB") == (1536, 0, 1 << 19)
    with pytest.raises(ValueError, match="three"):
        parse_capacity_bytes("1,2,3,4")


# -- entry points ----------------------------------------------------------------------------


def test_python_dash_m_help_and_kvstore_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.tiering.sim", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Usage: python -m kvstore.tiering.sim" in done.stdout and "--generate" in done.stdout
    listing = CliRunner().invoke(main, ["--help"])
    assert listing.exit_code == 0 and " sim " in listing.stdout


def test_a_replay_paces_the_collector_and_restores_it() -> None:
    """The replay collects less often while it runs (a batch job) and leaves the
    process's garbage-collector thresholds as it found them, even on an error."""
    import gc

    from kvstore.tiering import sim

    before = gc.get_threshold()
    seen: list[tuple[int, int, int]] = []
    requests = generate("multi-turn", seed=3, requests=40)
    cap = (8, 32, 128)
    config = sim.kvstore_config(cap, MODEL_PRESETS["llama-3.1-8b"], 512, sim.Machine())
    sim.simulate_kvstore(requests, config, progress=lambda _: seen.append(gc.get_threshold()))
    assert seen and all(t[0] >= 10 * before[0] for t in seen)
    assert gc.get_threshold() == before

    def boom(_: int) -> None:
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        sim.simulate_kvstore(requests, config, progress=boom)
    assert gc.get_threshold() == before


@pytest.mark.parametrize(
    ("nvme_pages", "reason"), [(8, "deleted from NVMe"), (0, "dropped from DRAM unwritten")]
)
def test_a_replay_says_why_each_requests_first_missing_block_was_missing(
    nvme_pages: int, reason: str
) -> None:
    """details.misses: a chain asked for again after 100 other pages went through a
    2 + 4 (+ 8) page cache was deleted from NVMe (written: no write gate here) or, with
    no NVMe, dropped from DRAM; every other request's first block was never seen."""
    from kvstore.tiering import sim
    from kvstore.tiering.sim.trace import Request

    requests = [Request(0.0, 1024, 10, (1, 2))]
    requests += [Request(1.0 + i, 512, 10, (1000 + i,)) for i in range(100)]
    requests.append(Request(101.0, 1024, 10, (1, 2)))
    overrides = {"nvme_write_payoff": None}
    config = sim.kvstore_config(
        (2, 4, nvme_pages), MODEL_PRESETS["llama-3.1-8b"], 512, sim.Machine(), overrides
    )
    result = sim.simulate_kvstore(requests, config)
    assert result.extra["misses"] == {
        reason: {"requests": 1, "blocks": 2},
        "never seen": {"requests": 101, "blocks": 102},
    }
