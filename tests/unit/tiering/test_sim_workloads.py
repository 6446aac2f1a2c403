"""The generator's workload kinds (docs/tiering.md, "Workloads"): each is deterministic
for a seed and has the shape it advertises, read off the requests alone (chained
block ids, timestamps, token counts), as a replay sees them. The four first kinds
generate exactly what they always did.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import statistics
from collections import Counter

import pytest

from kvstore.tiering.sim.trace import (
    ALL_KINDS,
    DEFAULT_REQUESTS,
    GENERATOR_KINDS,
    LONG_PROMPT_TOKENS,
    SERVING_KINDS,
    Request,
    generate,
    trace_facts,
)

# SHA-256 (first 16 hex digits) of repr(generate(kind, seed=7, requests=300)) as the four
# first kinds generated before the serving kinds were added: a change to them changes
# every number measured on them.
FIRST_KINDS_SHA256 = {
    "system-prompts": "139dc1757702ca33",
    "multi-turn": "96213b99f2e44abd",
    "long-docs": "ec47bf6a2da4f597",
    "mixed": "8e2899bd942c82cd",
}


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def children_of(requests: list[Request]) -> dict[int, set[int]]:
    children: dict[int, set[int]] = {}
    for request in requests:
        for parent, block in zip((-1, *request.blocks), request.blocks, strict=False):
            children.setdefault(parent, set()).add(block)
    return children


@pytest.mark.parametrize("kind", GENERATOR_KINDS)
def test_the_first_four_kinds_generate_what_they_always_did(kind: str) -> None:
    digest = hashlib.sha256(repr(generate(kind, seed=7, requests=300)).encode()).hexdigest()
    assert digest[:16] == FIRST_KINDS_SHA256[kind]
    assert DEFAULT_REQUESTS[kind] == 2000
    assert generate(kind, seed=7) == generate(kind, seed=7, requests=2000)


@pytest.mark.parametrize("kind", SERVING_KINDS)
def test_serving_kinds_are_deterministic_per_seed_and_well_formed(kind: str) -> None:
    requests = generate(kind, seed=11, requests=300)
    assert requests == generate(kind, seed=11, requests=300)
    assert requests != generate(kind, seed=12, requests=300)
    assert len(requests) == 300
    times = [r.timestamp_s for r in requests]
    assert times == sorted(times)
    parent_of: dict[int, int] = {}
    for request in requests:
        assert request.blocks and request.output_tokens > 0
        assert math.ceil(request.input_tokens / 512) == len(request.blocks)
        for parent, block in zip((-1, *request.blocks), request.blocks, strict=False):
            assert parent_of.setdefault(block, parent) == parent  # chained ids


def test_every_kind_is_known_and_the_default_sizes_replay_in_seconds() -> None:
    assert ALL_KINDS == GENERATOR_KINDS + SERVING_KINDS
    assert set(DEFAULT_REQUESTS) == set(ALL_KINDS)
    for kind in SERVING_KINDS:
        facts = trace_facts(generate(kind, seed=1))
        assert facts.requests == DEFAULT_REQUESTS[kind]
        assert 100_000 <= facts.block_accesses <= 300_000, (kind, facts)


def test_agent_sessions_share_large_prefixes_grow_turn_by_turn_and_backtrack() -> None:
    requests = generate("agent", seed=3, requests=600)
    # A few large shared tool-definition prefixes (8+ blocks), Zipf popularity.
    firsts = Counter(r.blocks[0] for r in requests)
    assert len(firsts) <= 6
    assert len({r.blocks[:8] for r in requests}) == len(firsts)
    counts = sorted(firsts.values(), reverse=True)
    assert counts[0] > 2 * counts[-1]
    # Turns: most requests extend an earlier request (the previous turn) with new
    # blocks, a few seconds after it.
    seen: dict[tuple[int, ...], float] = {}
    gaps = []
    for request in requests:
        blocks = request.blocks
        for cut in range(len(blocks) - 1, 8, -1):
            if blocks[:cut] in seen:
                gaps.append(request.timestamp_s - seen[blocks[:cut]])
                break
        seen[blocks] = request.timestamp_s
    assert len(gaps) > 0.7 * len(requests)
    assert 1.0 <= statistics.median(gaps) <= 10.0
    # Contexts grow long: some requests pass 100 blocks (50k tokens).
    assert max(len(r.blocks) for r in requests) > 100
    # Backtracks: a session's blocks belong to it alone, so besides the ends of the
    # shared prefixes a block has two children only where a turn dropped blocks and
    # went on differently.
    children = children_of(requests)
    branches = [b for b, kids in children.items() if b != -1 and len(kids) > 1]
    assert len(branches) > len(firsts) + 20


def test_rag_puts_zipf_popular_documents_of_a_large_corpus_after_the_system_prompt() -> None:
    requests = generate("rag", seed=3, requests=1500)
    by_prompt: dict[int, list[Request]] = {}
    for request in requests:
        by_prompt.setdefault(request.blocks[0], []).append(request)
    assert len(by_prompt) <= 3  # a few system prompts
    documents: Counter[int] = Counter()
    for group in by_prompt.values():
        # The system prompt is what all of a prompt's requests share.
        shared = min(common_prefix(r.blocks, group[0].blocks) for r in group[1:])
        assert 2 <= shared <= 6
        documents.update(r.blocks[shared] for r in group)  # the document's first block
    # A large corpus: many documents, most read once; Zipf: the top ones read often.
    assert len(documents) > 0.4 * len(requests)
    assert sum(1 for n in documents.values() if n == 1) > 0.5 * len(documents)
    assert documents.most_common(1)[0][1] > 0.02 * len(requests)
    # Each request ends in its own question.
    assert len({r.blocks[-1] for r in requests}) == len(requests)


def test_scans_are_one_off_long_documents_mixed_into_the_others() -> None:
    requests = generate("scans", seed=3, requests=1000)
    uses: Counter[int] = Counter(b for r in requests for b in set(r.blocks))
    firsts = Counter(r.blocks[0] for r in requests)
    scans = [r for r in requests if firsts[r.blocks[0]] == 1 and len(r.blocks) >= 48]
    assert 0.1 * len(requests) <= len(scans) <= 0.2 * len(requests)
    for scan in scans:  # never seen again: no block of a scan is in another request
        assert all(uses[b] == 1 for b in scan.blocks)
    # Mixed in: scans arrive all along, between requests that share their prefixes.
    others = [r for r in requests if r not in scans]
    assert scans[0].timestamp_s < others[len(others) // 4].timestamp_s
    assert scans[-1].timestamp_s > others[3 * len(others) // 4].timestamp_s
    assert trace_facts(others).max_hit_ratio > 0.5
    assert sum(len(s.blocks) for s in scans) > 0.25 * sum(len(r.blocks) for r in requests)


@pytest.mark.parametrize("block_tokens", [512, 64])
def test_long_prompts_are_10k_to_100k_tokens_mostly_never_reused(block_tokens: int) -> None:
    requests = generate("long-prompts", seed=3, requests=800, block_tokens=block_tokens)
    low, high = LONG_PROMPT_TOKENS
    assert all(low <= r.input_tokens <= high for r in requests)
    assert max(r.input_tokens for r in requests) > 5 * min(r.input_tokens for r in requests)
    firsts = Counter(r.blocks[0] for r in requests)
    once = sum(1 for n in firsts.values() if n == 1)
    assert once > 0.75 * len(firsts)  # most prompts are never reused
    rereads = len(requests) - len(firsts)
    assert 0.15 * len(requests) < rereads < 0.4 * len(requests)  # a minority re-read


def test_long_prompts_are_re_read_over_minutes_by_turns_and_users_with_drifting_popularity() -> (
    None
):
    requests = generate("long-prompts", seed=5, requests=1500)
    by_prompt: dict[int, list[Request]] = {}
    for request in requests:
        by_prompt.setdefault(request.blocks[0], []).append(request)
    reused = {first: group for first, group in by_prompt.items() if len(group) > 1}
    spans = [group[-1].timestamp_s - group[0].timestamp_s for group in reused.values()]
    assert statistics.median(spans) > 60.0  # re-read over minutes
    # Later turns extend the prompt as last read; other users' questions branch off it.
    turns = asks = 0
    for group in reused.values():
        for before, after in itertools.pairwise(group):
            if after.blocks[: len(before.blocks)] == before.blocks:
                turns += 1
            else:
                asks += 1
    assert turns > 20 and asks > 20
    # Popularity drifts: what is re-read in the last quarter of the trace was written
    # lately, not what was popular in the first quarter.
    end = requests[-1].timestamp_s
    born = {first: group[0].timestamp_s for first, group in reused.items()}

    def rereads_in(start: float, stop: float) -> list[Request]:
        return [r for group in reused.values() for r in group[1:] if start <= r.timestamp_s < stop]

    early = {r.blocks[0] for r in rereads_in(0, end / 4)}
    late = rereads_in(3 * end / 4, end + 1)
    assert early and late
    assert len(early & {r.blocks[0] for r in late}) < 0.1 * len(early)
    assert sum(1 for r in late if born[r.blocks[0]] < end / 2) < 0.1 * len(late)


def test_long_prompts_refuse_a_block_size_that_leaves_no_room() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        generate("long-prompts", seed=1, requests=10, block_tokens=20_000)
    assert generate("long-prompts", seed=1, requests=0) == []
