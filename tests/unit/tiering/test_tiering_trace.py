"""Traces: the Mooncake JSONL loader, the facts, capacities and the synthetic generator.

A bad line is a TraceError (a KVStoreError and a ValueError) whose message names
the file, the line number and the field. The facts use the fixed hit semantics
(leading blocks seen before). The generator is deterministic per seed and its
ids are chained: an id always has the same parent.
"""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import pytest

from kvstore.errors import KVStoreError
from kvstore.tiering.sim.trace import (
    GENERATOR_KINDS,
    Request,
    TraceError,
    capacity_blocks,
    generate,
    load_trace,
    trace_facts,
    write_trace,
)

# Shipped as package data (kvstore/tiering/sim/data/), read by name.
MOONCAKE_TRACE = "mooncake-conversation"

GOOD = '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}'


def write_lines(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------------
# Loader


def test_load_reads_records_skips_blank_lines_and_ignores_extra_fields(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path,
        GOOD,
        "",
        "   ",
        '{"timestamp": 1500, "input_length": 10, "output_length": 0, "hash_ids": [],'
        ' "session": "x"}',
    )
    assert load_trace(path) == [
        Request(0.0, 1000, 5, (0, 1)),
        Request(1.5, 10, 0, ()),
    ]
    assert load_trace(path, limit=1) == [Request(0.0, 1000, 5, (0, 1))]
    assert load_trace(path, limit=0) == []


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        ('{"timestamp": 0, "input_length": 1', "not valid JSON"),
        ("[1, 2, 3]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1}', "missing field 'hash_ids'"),
        ('{"input_length": 1, "output_length": 1, "hash_ids": []}', "missing field 'timestamp'"),
        (
            '{"timestamp": 0, "input_length": -3, "output_length": 1, "hash_ids": []}',
            "field 'input_length' must be >= 0, got -3",
        ),
        (
            '{"timestamp": 0, "input_length": 1, "output_length": 2.5, "hash_ids": []}',
            "field 'output_length' must be an integer, got 2.5",
        ),
        (
            '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [4, "5"]}',
            "field 'hash_ids'[1] must be an integer, got '5'",
        ),
        (
            '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [true]}',
            "field 'hash_ids'[0] must be an integer, got True",
        ),
        (
            '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": 7}',
            "field 'hash_ids' must be a list",
        ),
        (
            '{"timestamp": "0", "input_length": 1, "output_length": 1, "hash_ids": []}',
            "field 'timestamp' must be a number",
        ),
        (
            '{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": []}',
            "field 'timestamp' must be finite and >= 0",
        ),
    ],
)
def test_a_bad_line_names_file_line_and_field(tmp_path: Path, bad_line: str, expected: str) -> None:
    path = write_lines(tmp_path, GOOD, "", bad_line)
    with pytest.raises(TraceError) as raised:
        load_trace(path)
    message = str(raised.value)
    assert f"{path}:3:" in message
    assert expected in message
    assert isinstance(raised.value, KVStoreError)
    assert isinstance(raised.value, ValueError)
    assert "hint:" in message


def test_a_timestamp_going_back_is_refused(tmp_path: Path) -> None:
    later = GOOD.replace('"timestamp": 0', '"timestamp": 2000')
    path = write_lines(tmp_path, later, GOOD)
    with pytest.raises(TraceError, match=r"t\.jsonl:2: field 'timestamp' is 0 ms, before"):
        load_trace(path)
    # Equal timestamps are fine (Mooncake has many at the same millisecond).
    assert len(load_trace(write_lines(tmp_path, GOOD, GOOD))) == 2


def bad_files() -> list[tuple[str, bytes, str, str]]:
    """(id, file bytes, the line the error names, what it says) of files no trace is."""
    good = (GOOD + "\n").encode()
    digits = sys.get_int_max_str_digits()
    return [
        ("deep-array", good + b"[" * 100_000 + b"\n", ":2:", "nested too deeply"),
        ("deep-object", good + b'{"a": ' * 100_000 + b"\n", ":2:", "nested too deeply"),
        (
            "not-utf8",
            good * 3 + b'{"timestamp": 0, "note": "caf\xe9"}\n',
            ":4:",
            "not UTF-8 (byte 0xe9 at column 30)",
        ),
        ("damaged-gzip", gzip.compress(good * 3)[:-8], ":", "a damaged gzip file"),
        (
            "long-int",
            good + GOOD.replace('"timestamp": 0', f'"timestamp": {"9" * (digits + 700)}').encode(),
            ":2:",
            f"a number has more than {digits} digits",
        ),
        (
            "int-beyond-float",
            good + GOOD.replace('"timestamp": 0', f'"timestamp": {"9" * 400}').encode(),
            ":2:",
            "field 'timestamp' must be finite and >= 0",
        ),
        (
            "count-beyond-float",
            good + GOOD.replace('"input_length": 1000', f'"input_length": {2**53}').encode(),
            ":2:",
            "field 'input_length' must be < 2**53",
        ),
    ]


@pytest.mark.parametrize(
    ("content", "line", "expected"),
    [case[1:] for case in bad_files()],
    ids=[case[0] for case in bad_files()],
)
def test_a_file_that_is_no_trace_is_a_trace_error_naming_the_line(
    tmp_path: Path, content: bytes, line: str, expected: str
) -> None:
    """Not a RecursionError, UnicodeDecodeError, bare ValueError or OverflowError."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(content)
    with pytest.raises(TraceError) as raised:
        load_trace(path)
    message = str(raised.value)
    assert f"{path}{line}" in message and expected in message
    assert len(message) < 400  # no megabyte excerpt of the bad line


def test_a_gzipped_trace_reads_as_its_text_whatever_its_name(tmp_path: Path) -> None:
    text = "\n".join([GOOD, GOOD.replace('"timestamp": 0', '"timestamp": 5')]) + "\n"
    plain = write_lines(tmp_path, text.rstrip("\n"))
    for name in ("t.jsonl.gz", "t.jsonl"):
        path = tmp_path / "gz" / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(gzip.compress(text.encode()))
        assert load_trace(path) == load_trace(plain)


def test_the_packaged_trace_is_read_by_name_and_a_file_of_that_name_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_trace(MOONCAKE_TRACE, limit=3)[0].input_tokens > 0
    monkeypatch.chdir(tmp_path)
    Path(MOONCAKE_TRACE).write_text(GOOD + "\n", encoding="utf-8")
    assert len(load_trace(MOONCAKE_TRACE)) == 1
    with pytest.raises(FileNotFoundError):
        load_trace("mooncake-conversation.jsonl")  # only the exact name is packaged


def test_the_packaged_trace_ships_with_its_attribution() -> None:
    from importlib import resources

    data = resources.files("kvstore.tiering.sim").joinpath("data")
    notice = data.joinpath("NOTICE").read_text(encoding="utf-8")
    assert "kvcache-ai/Mooncake" in notice and "Apache License, Version 2.0" in notice
    assert data.joinpath("mooncake_conversation.jsonl.gz").read_bytes()[:2] == b"\x1f\x8b"


def test_an_error_quotes_a_short_excerpt_of_a_huge_value(tmp_path: Path) -> None:
    huge = '"' + "x" * 100_000 + '"'
    path = write_lines(tmp_path, GOOD.replace('"hash_ids": [0, 1]', f'"hash_ids": [{huge}]'))
    with pytest.raises(TraceError, match=r"'hash_ids'\[0\] must be an integer, got 'xx") as raised:
        load_trace(path)
    assert len(str(raised.value)) < 400
    path = write_lines(tmp_path, GOOD.replace('"input_length": 1000', f'"input_length": {huge}'))
    with pytest.raises(TraceError, match="'input_length' must be an integer") as raised:
        load_trace(path)
    assert len(str(raised.value)) < 400


def test_an_empty_file_has_no_requests(tmp_path: Path) -> None:
    for text in ("", "\n  \n\n"):
        path = tmp_path / "empty.jsonl"
        path.write_text(text, encoding="utf-8")
        with pytest.raises(TraceError, match=f"{path}: no requests"):
            load_trace(path)
        assert load_trace(path, limit=0) == []  # asked for none


def test_utf8_text_beyond_ascii_is_fine(tmp_path: Path) -> None:
    path = write_lines(tmp_path, GOOD.replace("}", ', "note": "café ✓"}'))
    assert load_trace(path) == [Request(0.0, 1000, 5, (0, 1))]


def test_write_then_load_round_trips(tmp_path: Path) -> None:
    requests = generate("mixed", seed=3, requests=300)
    path = tmp_path / "gen.jsonl"
    write_trace(requests, path)
    assert load_trace(path) == requests
    first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert isinstance(first["timestamp"], int)


# ---------------------------------------------------------------------------
# Facts and capacities


def test_facts_count_leading_hits_only() -> None:
    requests = [
        Request(0.0, 1, 1, (0, 1, 2)),
        Request(0.0, 1, 1, (0, 1, 3)),  # 2 hits
        Request(0.0, 1, 1, (4,)),  # 0
        Request(0.0, 1, 1, (5, 0)),  # 0: the run stops at 5, though 0 was seen
        Request(0.0, 1, 1, (0, 1, 2)),  # 3
    ]
    facts = trace_facts(requests)
    assert (facts.requests, facts.block_accesses, facts.unique_blocks) == (5, 12, 6)
    assert facts.max_hit_ratio == pytest.approx(5 / 12)
    assert trace_facts([]).max_hit_ratio == 0.0


def test_facts_of_the_mooncake_conversation_trace() -> None:
    facts = trace_facts(load_trace(MOONCAKE_TRACE))
    assert facts.requests == 12_031
    assert facts.block_accesses == 288_500
    assert facts.unique_blocks == 182_790
    assert facts.max_hit_ratio == pytest.approx(0.366, abs=0.001)


def test_capacity_blocks_floor_the_decimal_fraction() -> None:
    assert capacity_blocks((0.02, 0.10, 0.5), 182_790) == (3655, 18279, 91395)
    assert capacity_blocks((0.01, 0.05, 0.25), 182_790) == (1827, 9139, 45697)
    # 0.29 * 100 is 28.999999999999996 in binary floating point.
    assert capacity_blocks((0.29, 0.57, 1.0), 100) == (29, 57, 100)
    assert capacity_blocks((0.0, 0.015, 2.0), 100) == (0, 1, 200)


@pytest.mark.parametrize(
    "fractions", [(-0.1, 0.1, 0.1), (math.nan, 0.1, 0.1), (0.1, math.inf, 0.1), (0.1, 0.1)]
)
def test_capacity_blocks_refuse_bad_fractions(fractions: tuple[float, float, float]) -> None:
    with pytest.raises(ValueError, match="fraction"):
        capacity_blocks(fractions, 100)


# ---------------------------------------------------------------------------
# Generator


def reuse_ratio(requests: list[Request]) -> float:
    facts = trace_facts(requests)
    return 1 - facts.unique_blocks / facts.block_accesses


@pytest.mark.parametrize("kind", GENERATOR_KINDS)
def test_generate_is_deterministic_per_seed_and_well_formed(kind: str) -> None:
    requests = generate(kind, seed=11, requests=500)
    assert requests == generate(kind, seed=11, requests=500)
    assert requests != generate(kind, seed=12, requests=500)
    assert len(requests) == 500
    times = [r.timestamp_s for r in requests]
    assert times == sorted(times)
    parent_of: dict[int, int] = {}
    for request in requests:
        assert request.blocks
        assert math.ceil(request.input_tokens / 512) == len(request.blocks)
        assert request.output_tokens > 0
        # Chained ids: an id names its whole prefix, so it always has one parent.
        for parent, block in zip((-1, *request.blocks), request.blocks, strict=False):
            assert parent_of.setdefault(block, parent) == parent


def test_generate_block_tokens_sets_the_token_counts() -> None:
    for request in generate("system-prompts", seed=1, requests=200, block_tokens=64):
        assert math.ceil(request.input_tokens / 64) == len(request.blocks)


def test_each_kind_has_its_shape() -> None:
    prompts = generate("system-prompts", seed=5)
    turns = generate("multi-turn", seed=5)
    docs = generate("long-docs", seed=5)
    mixed = generate("mixed", seed=5)
    assert reuse_ratio(prompts) > 0.6
    assert reuse_ratio(turns) > 0.6
    assert reuse_ratio(docs) < 0.15
    assert reuse_ratio(docs) < reuse_ratio(mixed) < reuse_ratio(prompts)
    # Long documents are long; prompts are short.
    assert sum(len(r.blocks) for r in docs) > 3 * sum(len(r.blocks) for r in prompts)
    # A few system prompts are shared by everyone: few distinct first blocks.
    assert len({r.blocks[0] for r in prompts}) <= 8
    # Most turns extend an earlier turn's whole prefix.
    earlier: set[tuple[int, ...]] = set()
    extends = 0
    for request in turns:
        blocks = request.blocks
        if any(blocks[:cut] in earlier for cut in range(1, len(blocks))):
            extends += 1
        earlier.add(blocks)
    assert extends > len(turns) // 2


def test_generate_refuses_unknown_kind_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="known: system-prompts, multi-turn"):
        generate("poisson", seed=1)
    with pytest.raises(ValueError, match="requests"):
        generate("mixed", seed=1, requests=-1)
    with pytest.raises(ValueError, match="block_tokens"):
        generate("mixed", seed=1, block_tokens=0)
    assert generate("mixed", seed=1, requests=0) == []
