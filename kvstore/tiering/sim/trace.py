"""Request traces for the tier simulator: the Mooncake JSONL format and a generator.

A trace is a list of ``Request``: arrival time, prompt and output lengths, and
the request's prefix chain of block ids (``hash_ids`` in the file). The format
is the one of the Mooncake FAST'25 trace release, one JSON object per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500,
     "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}

``timestamp`` is milliseconds from the start of the trace; ``hash_ids`` are
chained block hashes, 512 tokens a block by default: two requests share an id
only when the whole prefix up to and including that block is the same, so
block i's parent is block i-1 of the same request. Fields other than these four
are ignored; blank lines are skipped.

The file is UTF-8 text, gzipped or not (read by its magic bytes, whatever its
name), with at least one request. A name in ``PACKAGED_TRACES`` that is not a
file here reads the trace shipped with kvstore (``mooncake-conversation``: the
Mooncake FAST'25 conversation trace, Apache-2.0, attribution in
kvstore/tiering/sim/data/NOTICE). Anything else
is a ``TraceError`` naming the file and, for a bad line, the line: bytes that
are not UTF-8, JSON nested too deeply for the parser, a number too long to
convert, a token count of 2**53 or more (not a count the cost model's floats
can hold). An error quotes at most a short excerpt of the bad value.

Invariants kept here:

- Timestamps never decrease. Requests are replayed in file order, which must
  be arrival order; a trace that goes back in time is refused (``TraceError``
  names the line) rather than silently reordered, since reordering would change
  which request warms the cache for which.
- ``trace_facts`` uses the fixed hit semantics shared by every model in
  ``peers.py``: a request's prefix hit is its run of leading blocks already
  seen; an infinite cache therefore hits every block access but the first of
  each id (ids are chained, so a seen block implies its whole prefix was seen).
- ``generate`` is deterministic for a seed and assigns ids through a dict keyed
  by (parent id, block content), so its ids are chained-hash-like too.
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import heapq
import io
import itertools
import json
import math
import os
import random
import re
import reprlib
import sys
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from importlib import resources
from typing import IO, Any, cast

from kvstore.errors import KVStoreError

__all__ = [
    "ALL_KINDS",
    "DEFAULT_BLOCK_TOKENS",
    "DEFAULT_REQUESTS",
    "GENERATOR_KINDS",
    "PACKAGED_TRACES",
    "SERVING_KINDS",
    "Request",
    "TraceError",
    "TraceFacts",
    "capacity_blocks",
    "generate",
    "load_trace",
    "trace_facts",
    "write_trace",
]

DEFAULT_BLOCK_TOKENS = 512
# The four kinds the default policy was tuned on; what each generates for a seed is
# fixed (tools/sim_identity.py fingerprints the manager's decisions on them).
GENERATOR_KINDS = ("system-prompts", "multi-turn", "long-docs", "mixed")
# What serving looks like now (docs/tiering.md, "Workloads"): agent sessions, RAG,
# scans mixed into both, long-prompt mixes.
SERVING_KINDS = ("agent", "rag", "scans", "long-prompts")
ALL_KINDS = GENERATOR_KINDS + SERVING_KINDS
# Requests per kind when none is given: each trace is ~100k-300k block accesses
# (a few seconds of replay) for the new kinds; the first four keep their 2,000.
DEFAULT_REQUESTS: dict[str, int] = {
    "system-prompts": 2000,
    "multi-turn": 2000,
    "long-docs": 2000,
    "mixed": 2000,
    "agent": 2000,
    "rag": 5000,
    "scans": 3000,
    "long-prompts": 2000,
}
# Long prompts are 10k-100k tokens (docs/tiering.md, "Workloads").
LONG_PROMPT_TOKENS = (10_000, 100_000)
_MAX_COUNT = 2**53  # token counts: floats hold every integer below it
# Bytes that are not UTF-8, as the "surrogateescape" error handler decodes them.
_UNDECODABLE = re.compile("[\udc80-\udcff]")
_GZIP_MAGIC = b"\x1f\x8b"
# Traces shipped as package data (kvstore/tiering/sim/data/, attribution in its NOTICE),
# readable by name wherever a trace path is taken: `kvstore sim mooncake-conversation`.
PACKAGED_TRACES: dict[str, str] = {"mooncake-conversation": "mooncake_conversation.jsonl.gz"}


class TraceError(KVStoreError, ValueError):
    """A trace file line is not a valid request record.

    The message names the file, the line number and the field that is wrong.
    Each line must be a JSON object with ``timestamp`` (milliseconds, a number
    >= 0, never smaller than the line before), ``input_length`` and
    ``output_length`` (integers >= 0) and ``hash_ids`` (a list of integers).
    """

    hint = (
        "fix or drop that line; each line needs timestamp (ms, non-decreasing), "
        "input_length, output_length and hash_ids (list of ints)"
    )


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace, owned by whoever loaded or generated it.

    ``blocks`` is the prefix chain: block i's parent is block i-1.
    """

    timestamp_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TraceFacts:
    """Sizes of a trace and the best hit ratio any cache could reach on it."""

    requests: int
    block_accesses: int
    unique_blocks: int
    max_hit_ratio: float


# ---------------------------------------------------------------------------
# Loading and writing


def load_trace(path: str | os.PathLike[str], *, limit: int | None = None) -> list[Request]:
    """Read a Mooncake-format JSONL trace; at most ``limit`` requests if given.

    Raises ``TraceError`` naming the file, line and field on the first bad line
    (bytes that are not UTF-8 included) or when the file holds no request (unless
    ``limit`` is 0), and ``OSError`` when the file cannot be read.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    name = os.fspath(path)
    requests: list[Request] = []
    previous_ms = 0.0
    with _open_trace(name) as lines:
        try:
            for line_number, line in enumerate(lines, start=1):
                if limit is not None and len(requests) >= limit:
                    break
                if not line.isascii():
                    _check_utf8(name, line_number, line)
                if not line.strip():
                    continue
                request, previous_ms = _parse_line(name, line_number, line, previous_ms)
                requests.append(request)
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise _trace_error(
                f"{name}: a damaged gzip file ({e or type(e).__name__})",
                "gzip -t FILE says where; fetch or compress the trace again",
            ) from e
    if not requests and limit != 0:
        raise _trace_error(
            f"{name}: no requests (the file is empty or blank)",
            "a trace has one JSON request object per line",
        )
    return requests


@contextlib.contextmanager
def _open_trace(name: str) -> Iterator[IO[str]]:
    """The trace's lines: the file ``name`` (gunzipped if it starts with gzip's magic),
    or the packaged trace of that name when no such file exists."""
    packaged = PACKAGED_TRACES.get(name)
    with contextlib.ExitStack() as stack:
        raw: IO[bytes]
        if packaged is not None and not os.path.lexists(name):
            data = resources.files("kvstore.tiering.sim").joinpath("data", packaged)
            raw = stack.enter_context(data.open("rb"))
        else:
            raw = stack.enter_context(open(name, "rb"))
        # peek, not read + seek: a trace may be a pipe (<(zcat FILE)).
        peek = getattr(raw, "peek", None)
        magic = peek(2)[:2] if peek is not None else b""
        binary: IO[bytes] = raw
        if magic == _GZIP_MAGIC:
            binary = cast("IO[bytes]", stack.enter_context(gzip.GzipFile(fileobj=raw, mode="rb")))
        # surrogateescape: a bad byte is found on its line, not in a read-ahead chunk.
        yield stack.enter_context(
            io.TextIOWrapper(binary, encoding="utf-8", errors="surrogateescape")
        )


def _trace_error(message: str, hint: str) -> TraceError:
    error = TraceError(message)
    error.hint = hint
    return error


def _check_utf8(name: str, line_number: int, line: str) -> None:
    bad = _UNDECODABLE.search(line)
    if bad is None:
        return
    where = f"{name}:{line_number}"
    byte = ord(bad.group()) - 0xDC00
    raise _trace_error(
        f"{where}: not UTF-8 (byte 0x{byte:02x} at column {bad.start() + 1})",
        "a trace is UTF-8 JSONL; re-encode the file (iconv -t UTF-8)",
    )


def _short(value: object) -> str:
    """``repr`` cut to a few dozen characters (a bad line may hold megabytes)."""
    return reprlib.repr(value)


def _parse_line(
    name: str, line_number: int, line: str, previous_ms: float
) -> tuple[Request, float]:
    where = f"{name}:{line_number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
    except RecursionError:
        raise TraceError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # int(): more digits than sys.get_int_max_str_digits()
        raise TraceError(
            f"{where}: not valid JSON (a number has more than "
            f"{sys.get_int_max_str_digits()} digits)"
        ) from e
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")
    timestamp_ms = _number_field(where, record, "timestamp")
    if timestamp_ms < previous_ms:
        raise TraceError(
            f"{where}: field 'timestamp' is {timestamp_ms:g} ms, before the previous "
            f"line's {previous_ms:g} ms; requests must be in arrival order "
            "(sort the file by timestamp)"
        )
    input_tokens = _count_field(where, record, "input_length")
    output_tokens = _count_field(where, record, "output_length")
    blocks = _hash_ids_field(where, record)
    request = Request(timestamp_ms / 1000.0, input_tokens, output_tokens, blocks)
    return request, timestamp_ms


def _field(where: str, record: dict[str, Any], field: str) -> object:
    if field not in record:
        raise TraceError(f"{where}: missing field '{field}'")
    value: object = record[field]
    return value


def _number_field(where: str, record: dict[str, Any], field: str) -> float:
    value = _field(where, record, field)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(f"{where}: field '{field}' must be a number, got {_short(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the largest float
        number = math.inf
    if not math.isfinite(number) or number < 0:
        raise TraceError(f"{where}: field '{field}' must be finite and >= 0, got {_short(value)}")
    return number


def _count_field(where: str, record: dict[str, Any], field: str) -> int:
    value = _field(where, record, field)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: field '{field}' must be an integer, got {_short(value)}")
    if value < 0:
        raise TraceError(f"{where}: field '{field}' must be >= 0, got {_short(value)}")
    if value >= _MAX_COUNT:
        raise TraceError(f"{where}: field '{field}' must be < 2**53, got {_short(value)}")
    return value


def _hash_ids_field(where: str, record: dict[str, Any]) -> tuple[int, ...]:
    value = _field(where, record, "hash_ids")
    if not isinstance(value, list):
        raise TraceError(f"{where}: field 'hash_ids' must be a list, got {_short(value)}")
    for index, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise TraceError(
                f"{where}: field 'hash_ids'[{index}] must be an integer, got {_short(item)}"
            )
    return tuple(value)


def write_trace(requests: Iterable[Request], path: str | os.PathLike[str]) -> None:
    """Write requests in the same JSONL format (timestamps rounded to whole ms)."""
    with open(os.fspath(path), "w", encoding="utf-8") as out:
        for request in requests:
            record = {
                "timestamp": round(request.timestamp_s * 1000.0),
                "input_length": request.input_tokens,
                "output_length": request.output_tokens,
                "hash_ids": list(request.blocks),
            }
            out.write(json.dumps(record, separators=(", ", ": ")))
            out.write("\n")


# ---------------------------------------------------------------------------
# Facts and capacities


def trace_facts(requests: Sequence[Request]) -> TraceFacts:
    """Count requests, block accesses and unique blocks; the infinite-cache hit ratio.

    The hit ratio follows the fixed semantics: per request, the run of leading
    blocks seen in any earlier request (or earlier in the same one) is a hit.
    """
    seen: set[int] = set()
    accesses = 0
    hits = 0
    for request in requests:
        blocks = request.blocks
        accesses += len(blocks)
        for block in blocks:
            if block not in seen:
                break
            hits += 1
        seen.update(blocks)
    ratio = hits / accesses if accesses else 0.0
    return TraceFacts(len(requests), accesses, len(seen), ratio)


def capacity_blocks(
    fractions: tuple[float, float, float], unique_blocks: int
) -> tuple[int, int, int]:
    """Tier capacities (HBM, DRAM, NVMe) in blocks: each fraction of ``unique_blocks``, floored.

    The product is taken on the fraction's decimal value (``0.29`` is 29/100,
    not 0.28999...), so ``--capacity 0.29`` of 100 blocks is 29, not 28.
    """
    if len(fractions) != 3:
        raise ValueError(f"need three capacity fractions (hbm, dram, nvme), got {fractions!r}")
    if unique_blocks < 0:
        raise ValueError(f"unique_blocks must be >= 0, got {unique_blocks}")
    out: list[int] = []
    for fraction in fractions:
        if not math.isfinite(fraction) or fraction < 0:
            raise ValueError(f"capacity fractions must be finite and >= 0, got {fraction!r}")
        out.append(math.floor(Fraction(repr(float(fraction))) * unique_blocks))
    return out[0], out[1], out[2]


# ---------------------------------------------------------------------------
# Synthetic traces
#
# Each shape first yields (arrival ms, block contents, output tokens); a block's
# content is any hashable that stands for its 512 tokens. ``_assign_ids`` then
# maps (parent id, content) to ids in arrival order, which is what a chained
# content hash does.

_Content = tuple[object, ...]
_Draft = tuple[int, tuple[_Content, ...], int]


def generate(
    kind: str,
    *,
    seed: int,
    requests: int | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> list[Request]:
    """A synthetic trace of ``requests`` requests (``DEFAULT_REQUESTS[kind]`` if None),
    the same for the same arguments.

    ``system-prompts``: a few shared system prompts, Zipf popularity, each
    followed by a short unique user message. ``multi-turn``: chat sessions
    whose every turn extends the previous turn's whole prefix, with think time
    between turns, sessions interleaved, Poisson session arrivals.
    ``long-docs``: mostly one-off long documents, plus a small reused core of
    reference documents. ``mixed``: the three interleaved on one clock.

    ``agent``: agent sessions on a few large shared tool-definition prefixes (Zipf
    popularity), many turns a few seconds apart, each appending a tool call and its
    output to a growing context, some turns backtracking (the last blocks dropped,
    the session going on differently). ``rag``: a document of a large corpus (Zipf
    popularity) after one of a few system prompts, then the question. ``scans``:
    agent sessions and RAG with one-off long documents, never seen again, mixed in.
    ``long-prompts``: prompts of 10k-100k tokens, most never reused, a minority
    re-read over minutes by later turns or by other users, their popularity fading
    as new ones arrive. docs/tiering.md, "Workloads", has the numbers.
    """
    if kind not in ALL_KINDS:
        raise ValueError(f"unknown trace kind {kind!r}; known: {', '.join(ALL_KINDS)}")
    if requests is None:
        requests = DEFAULT_REQUESTS[kind]
    if requests < 0:
        raise ValueError(f"requests must be >= 0, got {requests}")
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    rng = random.Random(seed)
    drafts: list[_Draft]
    if kind == "system-prompts":
        drafts = _system_prompts(rng, requests)
    elif kind == "multi-turn":
        drafts = _multi_turn(rng, requests)
    elif kind == "long-docs":
        drafts = _long_docs(rng, requests)
    elif kind == "mixed":
        drafts = _mixed(rng, requests)
    elif kind == "agent":
        drafts = _agent(rng, requests)
    elif kind == "rag":
        drafts = _rag(rng, requests)
    elif kind == "scans":
        drafts = _scans(rng, requests)
    else:
        drafts = _long_prompts(rng, requests, block_tokens)
    return _assign_ids(rng, drafts, block_tokens)


def _poisson_arrivals(rng: random.Random, rate_per_s: float) -> Iterator[int]:
    """Arrival times in whole milliseconds of a Poisson process."""
    now_s = 0.0
    while True:
        yield round(now_s * 1000.0)
        now_s += rng.expovariate(rate_per_s)


def _zipf_picker(rng: random.Random, n: int, s: float) -> Iterator[int]:
    cumulative = list(itertools.accumulate(1.0 / (rank**s) for rank in range(1, n + 1)))
    total = cumulative[-1]
    while True:
        yield min(bisect.bisect_left(cumulative, rng.random() * total), n - 1)


def _system_prompts(
    rng: random.Random, requests: int, tag: str = "sp", rate_per_s: float = 4.0
) -> list[_Draft]:
    prompts = [tuple((tag, "system", p, i) for i in range(rng.randint(2, 10))) for p in range(8)]
    pick = _zipf_picker(rng, len(prompts), 1.1)
    arrivals = _poisson_arrivals(rng, rate_per_s)
    drafts: list[_Draft] = []
    for n in range(requests):
        user = tuple((tag, "user", n, j) for j in range(rng.randint(1, 2)))
        drafts.append((next(arrivals), prompts[next(pick)] + user, rng.randint(20, 600)))
    return drafts


def _multi_turn(rng: random.Random, requests: int, tag: str = "mt") -> list[_Draft]:
    """Sessions on one clock: a heap of (next turn time, session) pops in time order."""
    arrivals = _poisson_arrivals(rng, 0.5)
    pending: list[tuple[int, int, tuple[_Content, ...], int]] = []
    sessions = itertools.count()
    drafts: list[_Draft] = []
    next_start = next(arrivals)
    while len(drafts) < requests:
        if not pending or next_start <= pending[0][0]:
            session = next(sessions)
            opening = tuple((tag, session, 0, j) for j in range(rng.randint(1, 4)))
            heapq.heappush(pending, (next_start, session, opening, 2 + int(rng.expovariate(0.25))))
            next_start = next(arrivals)
            continue
        at_ms, session, prefix, turns_left = heapq.heappop(pending)
        output_tokens = rng.randint(50, 800)
        drafts.append((at_ms, prefix, output_tokens))
        if turns_left > 1:
            turn = len(drafts)
            # The next turn carries this turn's answer and a new user message.
            extension = tuple((tag, session, turn, j) for j in range(rng.randint(1, 3)))
            think_ms = round(rng.expovariate(1 / 30.0) * 1000.0) + 1
            heapq.heappush(pending, (at_ms + think_ms, session, prefix + extension, turns_left - 1))
    return drafts


def _long_docs(
    rng: random.Random, requests: int, tag: str = "ld", rate_per_s: float = 1.0
) -> list[_Draft]:
    core = [tuple((tag, "core", d, i) for i in range(rng.randint(8, 24))) for d in range(4)]
    arrivals = _poisson_arrivals(rng, rate_per_s)
    drafts: list[_Draft] = []
    for n in range(requests):
        question = ((tag, "question", n),)
        if rng.random() < 0.15:
            blocks = core[rng.randrange(len(core))] + question
        else:
            blocks = tuple((tag, "doc", n, i) for i in range(rng.randint(16, 64))) + question
        drafts.append((next(arrivals), blocks, rng.randint(50, 400)))
    return drafts


def _mixed(rng: random.Random, requests: int) -> list[_Draft]:
    """The three shapes in the proportions 30/40/30, merged on one clock.

    The sessions set the trace's duration; the other two shapes arrive at the
    rates that spread their requests over the same time.
    """
    n_prompts, n_turns = requests * 3 // 10, requests * 4 // 10
    n_docs = requests - n_prompts - n_turns
    turns = _multi_turn(random.Random(rng.random()), n_turns, tag="mixed-mt")
    duration_s = max(1.0, turns[-1][0] / 1000.0) if turns else 1.0
    prompts = _system_prompts(
        random.Random(rng.random()), n_prompts, "mixed-sp", max(n_prompts, 1) / duration_s
    )
    docs = _long_docs(random.Random(rng.random()), n_docs, "mixed-ld", max(n_docs, 1) / duration_s)
    return list(heapq.merge(prompts, turns, docs, key=lambda draft: draft[0]))


# -- what serving looks like now (docs/tiering.md, "Workloads") ---------------------


def _agent(
    rng: random.Random, requests: int, tag: str = "ag", session_gap_s: float = 12.0
) -> list[_Draft]:
    """Agent sessions on one clock (a heap of (next turn time, session), as in
    ``_multi_turn``).

    Six tool-definition/system prefixes of 8-32 blocks (4k-16k tokens at 512 a
    block), Zipf(1.2) popularity. A session opens with a task of 1-3 blocks and runs
    4 + Exp(mean 16) turns, each 1 + Exp(mean 3) s after the previous one (the tool
    runs, the model answers), until its context passes 256 blocks. A turn's request
    is the prefix and the whole context; then the context grows by the tool call and
    its output (1 + 0-6 blocks), or, one turn in eight, first drops its last 1-8
    blocks (a backtrack: the agent abandons a path and continues differently).
    """
    prefixes = [tuple((tag, "tools", p, i) for i in range(rng.randint(8, 32))) for p in range(6)]
    pick = _zipf_picker(rng, len(prefixes), 1.2)
    arrivals = _poisson_arrivals(rng, 1.0 / session_gap_s)
    # (at ms, session, prefix, context, turns left, the task's blocks)
    pending: list[tuple[int, int, int, tuple[_Content, ...], int, int]] = []
    sessions = itertools.count()
    drafts: list[_Draft] = []
    next_start = next(arrivals)
    while len(drafts) < requests:
        if not pending or next_start <= pending[0][0]:
            session = next(sessions)
            task = tuple((tag, session, "task", j) for j in range(rng.randint(1, 3)))
            turns = 4 + int(rng.expovariate(1 / 16))
            heapq.heappush(pending, (next_start, session, next(pick), task, turns, len(task)))
            next_start = next(arrivals)
            continue
        at_ms, session, prefix, context, turns_left, task_blocks = heapq.heappop(pending)
        blocks = prefixes[prefix] + context
        drafts.append((at_ms, blocks, rng.randint(20, 400)))
        if turns_left <= 1 or len(blocks) > 256:
            continue
        turn = len(drafts)
        if rng.random() < 0.125 and len(context) > task_blocks:
            context = context[: -rng.randint(1, min(8, len(context) - task_blocks))]
        output = rng.choice((0, 0, 1, 1, 2, 2, 3, 4, 6))
        context += tuple((tag, session, turn, j) for j in range(1 + output))
        gap_ms = round((1.0 + rng.expovariate(1 / 3.0)) * 1000.0)
        heapq.heappush(
            pending, (at_ms + gap_ms, session, prefix, context, turns_left - 1, task_blocks)
        )
    return drafts


def _rag(
    rng: random.Random, requests: int, tag: str = "rag", rate_per_s: float = 4.0
) -> list[_Draft]:
    """Poisson arrivals; each request is one of three system prompts (2-6 blocks,
    Zipf(1.0)), one document of a 20,000-document corpus (4-32 blocks, 2k-16k
    tokens; Zipf(1.0) over the corpus) and a question of 1-2 blocks."""
    prompts = [tuple((tag, "system", p, i) for i in range(rng.randint(2, 6))) for p in range(3)]
    pick_prompt = _zipf_picker(rng, len(prompts), 1.0)
    lengths = [rng.randint(4, 32) for _ in range(20_000)]
    pick_doc = _zipf_picker(rng, len(lengths), 1.0)
    arrivals = _poisson_arrivals(rng, rate_per_s)
    drafts: list[_Draft] = []
    for n in range(requests):
        doc = next(pick_doc)
        blocks = (
            prompts[next(pick_prompt)]
            + tuple((tag, "doc", doc, i) for i in range(lengths[doc]))
            + tuple((tag, "question", n, j) for j in range(rng.randint(1, 2)))
        )
        drafts.append((next(arrivals), blocks, rng.randint(50, 400)))
    return drafts


def _scans(rng: random.Random, requests: int) -> list[_Draft]:
    """Agent sessions (40% of requests), RAG (45%) and scans (15%) on one clock: a
    scan is a one-off document of 48-192 blocks (24k-98k tokens) that shares no
    block with anything (it is never seen again). The sessions set the duration
    (half as many as in ``agent``), the others arrive at the rates that fill it."""
    n_agent, n_rag = requests * 40 // 100, requests * 45 // 100
    n_scans = requests - n_agent - n_rag
    agent = _agent(random.Random(rng.random()), n_agent, "scans-ag", session_gap_s=24.0)
    duration_s = max(1.0, agent[-1][0] / 1000.0) if agent else 1.0
    rag = _rag(random.Random(rng.random()), n_rag, "scans-rag", max(n_rag, 1) / duration_s)
    scan_rng = random.Random(rng.random())
    arrivals = _poisson_arrivals(scan_rng, max(n_scans, 1) / duration_s)
    scans: list[_Draft] = []
    for n in range(n_scans):
        blocks = tuple(("scan", n, i) for i in range(scan_rng.randint(48, 192)))
        scans.append((next(arrivals), blocks, scan_rng.randint(50, 400)))
    return list(heapq.merge(agent, rag, scans, key=lambda draft: draft[0]))


def _long_prompt_blocks(block_tokens: int) -> tuple[int, int]:
    """The fewest and most blocks of a prompt of 10k-100k tokens: ``_assign_ids``
    fills the last block partly, so n blocks are (n-1)*block_tokens+1 to
    n*block_tokens tokens."""
    low_tokens, high_tokens = LONG_PROMPT_TOKENS
    low = -(-(low_tokens - 1) // block_tokens) + 1
    high = high_tokens // block_tokens
    if low + 8 > high:
        raise ValueError(
            f"long-prompts needs prompts of {low_tokens:,}-{high_tokens:,} tokens; "
            f"block_tokens={block_tokens} leaves too few blocks between them "
            f"(use block_tokens <= {(high_tokens - low_tokens) // 10})"
        )
    return low, high


@dataclass(slots=True)
class _Context:
    """A long prompt that is re-read: its blocks, birth, end of interest, weight."""

    blocks: tuple[_Content, ...]
    born_s: float
    until_s: float
    weight: float


def _long_prompts(
    rng: random.Random,
    requests: int,
    block_tokens: int,
    tag: str = "lp",
    rate_per_s: float = 0.8,
) -> list[_Draft]:
    """Poisson arrivals of prompts of 10k-100k tokens (log-uniform length).

    70% of requests are new prompts, 30% re-read a live one. A new prompt is
    re-readable with probability 1/4 (so most are never reused): it lives
    30 s + Exp(mean 240 s) and has a Pareto(1.5) weight that fades with
    e-folding time 120 s, so popularity drifts to what arrived lately. A re-read
    picks a live prompt by weight; half are the same user's next turn (the
    prompt grows by 1-4 blocks for good), half another user's question on it
    (1-2 blocks of their own). No request leaves 10k-100k tokens.
    """
    low, high = _long_prompt_blocks(block_tokens)
    log_low, log_high = math.log(low), math.log(high - 6 + 1)
    arrivals = _poisson_arrivals(rng, rate_per_s)
    live: list[_Context] = []
    drafts: list[_Draft] = []
    for n in range(requests):
        at_ms = next(arrivals)
        now_s = at_ms / 1000.0
        live = [c for c in live if c.until_s > now_s]
        if live and rng.random() < 0.3:
            weights = [c.weight * math.exp((c.born_s - now_s) / 120.0) for c in live]
            context = rng.choices(live, weights)[0]
            grow = rng.randint(1, 4)
            if rng.random() < 0.5 and len(context.blocks) + grow + 2 <= high:
                context.blocks += tuple((tag, "turn", n, j) for j in range(grow))
                blocks = context.blocks
            else:
                asks = rng.randint(1, 2)
                blocks = context.blocks + tuple((tag, "ask", n, j) for j in range(asks))
        else:
            length = min(high - 6, max(low, int(math.exp(rng.uniform(log_low, log_high)))))
            blocks = tuple((tag, "prompt", n, i) for i in range(length))
            if rng.random() < 0.25:
                until_s = now_s + 30.0 + rng.expovariate(1 / 240.0)
                live.append(_Context(blocks, now_s, until_s, rng.paretovariate(1.5)))
        drafts.append((at_ms, blocks, rng.randint(50, 800)))
    return drafts


def _assign_ids(rng: random.Random, drafts: list[_Draft], block_tokens: int) -> list[Request]:
    drafts.sort(key=lambda draft: draft[0])
    ids: dict[tuple[int, _Content], int] = {}
    out: list[Request] = []
    for at_ms, contents, output_tokens in drafts:
        parent = -1
        chain: list[int] = []
        for content in contents:
            block = ids.setdefault((parent, content), len(ids))
            chain.append(block)
            parent = block
        # The last block is partly filled, as in the Mooncake trace.
        input_tokens = max(1, len(chain) * block_tokens - rng.randrange(block_tokens))
        out.append(Request(at_ms / 1000.0, input_tokens, output_tokens, tuple(chain)))
    return out
