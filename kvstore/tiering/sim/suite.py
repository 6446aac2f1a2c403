"""``kvstore sim --suite``: every workload kind × seeds × capacity triples, judged.

Each run replays one trace at one capacity triple through every peer model and
the kvstore policy (or the variants given), then judges kvstore against the
peers on three targets (docs/tiering.md, "The suite"):

- (a) TTFT p50 at most ``TTFT_FACTOR`` (1.01) × the best peer's;
- (b) hit ratio at most ``HIT_SLACK`` (0.5 percentage points) below the best peer's;
- (c) NVMe blocks written at most ``WRITE_FACTOR`` (2) × the fewest written by any
  peer whose hit ratio is within ``HIT_SLACK`` of kvstore's or above (no such peer:
  met, there is nothing to compare with).

The peers are every model of ``peers.POLICIES`` but the reference ones (the
infinite cache and always-recompute, ``plots.REFERENCE_POLICIES``).

Seeds are split (``SEED_SPLITS``): tune a policy on ``tune``, judge it on
``holdout``, whose results are not looked at while tuning. The generated traces
of a kind and seed are the same on every machine (``trace.generate``), and the
replay is deterministic, so a run's verdict repeats exactly.

The replays run one after another by default (``jobs=1``); ``jobs`` > 1 runs the
(workload, seed) groups in that many processes. The results are the same either
way and come back in the same order.

A peer's results depend on the trace, the capacities and the machine, never on
kvstore's settings: ``peer_results`` reads them from an earlier suite's document
so that judging another kvstore variant replays only kvstore (``reuse``). A run
reuses them only where its trace facts, capacities and machine are the earlier
run's; any other run replays the peers as well.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.tiering.config import ModelCost
from kvstore.tiering.sim.peers import PEER_MODELS_VERSION, POLICIES
from kvstore.tiering.sim.plots import REFERENCE_POLICIES, is_kvstore
from kvstore.tiering.sim.replay import Machine, run
from kvstore.tiering.sim.trace import ALL_KINDS, Request, generate, load_trace

__all__ = [
    "HIT_SLACK",
    "SEED_SPLITS",
    "SUITE_CAPACITIES",
    "TTFT_FACTOR",
    "WRITE_FACTOR",
    "Check",
    "SuiteCase",
    "SuiteRun",
    "Verdict",
    "by_workload",
    "capacity_text",
    "judge",
    "parse_seeds",
    "peer_results",
    "run_label",
    "run_suite",
    "suite_cases",
    "summary",
]

# Tune on these seeds; judge on the held-out ones (docs/tiering.md, "The suite").
SEED_SPLITS: dict[str, tuple[int, ...]] = {"tune": (1, 2, 3), "holdout": (101, 102, 103)}
SUITE_CAPACITIES: tuple[tuple[float, float, float], ...] = (
    (0.02, 0.10, 0.5),
    (0.01, 0.05, 0.25),
    (0.005, 0.02, 0.1),
)
TTFT_FACTOR = 1.01
HIT_SLACK = 0.005
WRITE_FACTOR = 2.0
# Hit ratios are ratios of block counts; a difference of exactly 0.5 pp must pass
# whatever the float rounding of the two ratios.
_EPSILON = 1e-12


# -- the verdict -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Check:
    """One target of one run: kvstore's number, the peers' one it is held to, the
    peer that has it (None when no peer qualifies), and whether it is met."""

    target: str
    passed: bool
    kvstore: float
    reference: float | None
    peer: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "kvstore": self.kvstore,
            "reference": self.reference,
            "peer": self.peer,
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    """A kvstore policy's three checks on one run: ``ttft``, ``hit_ratio``, ``nvme_writes``."""

    policy: str
    ttft: Check
    hit_ratio: Check
    nvme_writes: Check

    @property
    def checks(self) -> tuple[Check, Check, Check]:
        return self.ttft, self.hit_ratio, self.nvme_writes

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "passed": self.passed,
            **{check.target: check.to_json() for check in self.checks},
        }


def judge(results: Sequence[Mapping[str, Any]], policy: str = "kvstore") -> Verdict:
    """The three targets for ``policy`` against the peers among ``results`` (rows of
    ``run``'s ``results``: policy, hit_ratio, nvme_blocks_written, ttft_p50_s).

    Raises ValueError when ``policy`` is not among the results or no peer is.
    """
    mine = [r for r in results if r["policy"] == policy]
    if not mine:
        raise ValueError(f"no result for {policy!r} to judge")
    kv = mine[0]
    peers = [
        r for r in results if not is_kvstore(r["policy"]) and r["policy"] not in REFERENCE_POLICIES
    ]
    if not peers:
        raise ValueError("no peer results to judge against")
    fastest = min(peers, key=lambda r: float(r["ttft_p50_s"]))
    kv_ttft = float(kv["ttft_p50_s"])
    best_ttft = float(fastest["ttft_p50_s"])
    ttft = Check("ttft", kv_ttft <= TTFT_FACTOR * best_ttft, kv_ttft, best_ttft, fastest["policy"])
    most = max(peers, key=lambda r: float(r["hit_ratio"]))
    kv_hits = float(kv["hit_ratio"])
    best_hits = float(most["hit_ratio"])
    hits = Check(
        "hit_ratio",
        kv_hits >= best_hits - HIT_SLACK - _EPSILON,
        kv_hits,
        best_hits,
        most["policy"],
    )
    kv_writes = int(kv["nvme_blocks_written"])
    rivals = [r for r in peers if float(r["hit_ratio"]) >= kv_hits - HIT_SLACK - _EPSILON]
    if rivals:
        thrifty = min(rivals, key=lambda r: int(r["nvme_blocks_written"]))
        fewest = int(thrifty["nvme_blocks_written"])
        writes = Check(
            "nvme_writes",
            kv_writes <= WRITE_FACTOR * fewest,
            kv_writes,
            fewest,
            thrifty["policy"],
        )
    else:  # kvstore has more hits than every peer by more than the slack
        writes = Check("nvme_writes", True, kv_writes, None, None)
    return Verdict(policy, ttft, hits, writes)


# -- the runs --------------------------------------------------------------------------


def parse_seeds(text: str) -> tuple[str, tuple[int, ...]]:
    """``tune`` / ``holdout`` (``SEED_SPLITS``) or comma-separated integers ->
    (the split's name or ``custom``, the seeds)."""
    name = text.strip().lower()
    if name in SEED_SPLITS:
        return name, SEED_SPLITS[name]
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not re.fullmatch(r"[+-]?\d+", part):
            known = " or ".join(SEED_SPLITS)
            raise ValueError(
                f"--seeds {text!r}: {part!r} is neither a seed (an integer) nor a split ({known})"
            )
        if int(part) not in seeds:
            seeds.append(int(part))
    return "custom", tuple(seeds)


@dataclass(frozen=True, slots=True)
class SuiteCase:
    """One trace of the suite, replayed at every capacity triple: a generated kind
    and seed (``requests`` None: the kind's default count), or a trace file."""

    workload: str
    seed: int | None = None
    requests: int | None = None
    path: str | None = None
    limit: int | None = None
    capacities: tuple[tuple[float, float, float], ...] = SUITE_CAPACITIES

    def load(self, block_tokens: int) -> list[Request]:
        if self.path is not None:
            return load_trace(self.path, limit=self.limit)
        assert self.seed is not None
        return generate(
            self.workload, seed=self.seed, requests=self.requests, block_tokens=block_tokens
        )

    def trace_name(self, requests: Sequence[Request]) -> str:
        if self.path is not None:
            return self.path
        return f"generated:{self.workload}:seed={self.seed}:requests={len(requests)}"


def suite_cases(
    kinds: Sequence[str] = ALL_KINDS,
    seeds: Sequence[int] = SEED_SPLITS["tune"],
    capacities: Sequence[tuple[float, float, float]] = SUITE_CAPACITIES,
    *,
    traces: Sequence[str] = (),
    requests: int | None = None,
    limit: int | None = None,
) -> list[SuiteCase]:
    """Every kind × seed, then every trace file (a real trace has no seed)."""
    for kind in kinds:
        if kind not in ALL_KINDS:
            raise ValueError(f"unknown workload kind {kind!r}; known: {', '.join(ALL_KINDS)}")
    if not capacities:
        raise ValueError("the suite needs at least one capacity triple")
    if not seeds and kinds:
        raise ValueError("the suite needs at least one seed for the generated kinds")
    triples = tuple((c[0], c[1], c[2]) for c in capacities)
    cases = [
        SuiteCase(kind, seed, requests, capacities=triples) for kind in kinds for seed in seeds
    ]
    cases += [SuiteCase(_trace_label(path), None, None, path, limit, triples) for path in traces]
    if not cases:
        raise ValueError("nothing to run: no workload kind and no trace")
    return cases


def _trace_label(path: str) -> str:
    name = os.path.basename(os.path.normpath(path)) or path
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


@dataclass(frozen=True, slots=True)
class _Settings:
    model: ModelCost
    block_tokens: int
    machine: Machine
    variants: tuple[str, ...]


# A run's peer results are reused only where these fields of ``run``'s document match
# (the trace's identity and size, the capacities in blocks, the modelled machine).
_SAME_RUN = (
    "trace",
    "requests",
    "block_accesses",
    "unique_blocks",
    "max_hit_ratio",
    "capacity_blocks",
    "machine",
)
# The fields of a result ``judge`` reads.
_JUDGED = ("hit_ratio", "nvme_blocks_written", "ttft_p50_s")
# (workload, seed) -> capacity triple -> an earlier run's document
SavedRuns = dict[tuple[str, int | None], dict[tuple[float, float, float], dict[str, Any]]]


def peer_results(document: Any, *, model: str, block_tokens: int) -> SavedRuns:
    """The peers' results of an earlier suite (its ``--json`` document or ``suite.json``),
    by run. Raises ValueError, naming the problem, for a document that is not a suite's,
    or whose model, block size or peer models differ from this suite's (their results
    would not be this suite's)."""
    if not isinstance(document, dict) or not isinstance(document.get("suite"), dict):
        raise ValueError('not the JSON of a kvstore sim --suite run (no "suite" header)')
    header = document["suite"]
    version = header.get("peer_models")
    if version != PEER_MODELS_VERSION:
        raise ValueError(
            f"its peer models are version {version} (this kvstore's: {PEER_MODELS_VERSION}); "
            "their results would not be this version's"
        )
    for key, mine in (("model", model), ("block_tokens", block_tokens)):
        if header.get(key) != mine:
            raise ValueError(f"it was run with {key} {header.get(key)!r}, this suite with {mine!r}")
    runs = document.get("runs")
    if not isinstance(runs, list):
        raise ValueError('its "runs" is not a list')
    saved: SavedRuns = {}
    for index, entry in enumerate(runs):
        try:
            workload, seed = str(entry["workload"]), entry["seed"]
            capacity = tuple(float(c) for c in entry["capacity"])
            results = entry["results"]
            names = {r["policy"] for r in results}
            for r in results:  # what judging reads of a peer's result
                for key in _JUDGED:
                    float(r[key])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"runs[{index}] is not a suite run: {e!r}") from e
        if len(capacity) != 3 or not set(POLICIES) <= names:
            continue  # not a whole run: its peers are replayed
        triple = (capacity[0], capacity[1], capacity[2])
        saved.setdefault((workload, seed if isinstance(seed, int) else None), {})[triple] = entry
    return saved


def _reused_peers(saved: Mapping[str, Any] | None, fresh: Mapping[str, Any]) -> list[Any] | None:
    """The saved run's peer results where it is the same run as ``fresh``; else None."""
    if saved is None or any(saved.get(key) != fresh[key] for key in _SAME_RUN):
        return None
    by_name = {r["policy"]: r for r in saved["results"]}
    return [by_name[name] for name in POLICIES]


@dataclass(slots=True)
class SuiteRun:
    """One replay of the suite: ``run``'s document, and a verdict per kvstore variant."""

    workload: str
    seed: int | None
    capacity: tuple[float, float, float]
    document: dict[str, Any]
    verdicts: list[Verdict] = field(default_factory=list)
    peers_reused: bool = False  # the peers' results came from an earlier suite

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts)

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "seed": self.seed,
            "capacity": list(self.capacity),
            "passed": self.passed,
            "verdicts": [v.to_json() for v in self.verdicts],
            "peers_reused": self.peers_reused,
            **self.document,
        }


def capacity_text(capacity: Sequence[float]) -> str:
    """``(0.02, 0.1, 0.5)`` -> ``"0.02,0.1,0.5"``."""
    return ",".join(f"{c:g}" for c in capacity)


def run_label(workload: str, seed: int | None, capacity: Sequence[float]) -> str:
    """``agent seed 1 @ 0.02,0.1,0.5``; a trace file's run has no seed."""
    seeded = workload if seed is None else f"{workload} seed {seed}"
    return f"{seeded} @ {capacity_text(capacity)}"


def _run_case(
    case: SuiteCase,
    settings: _Settings,
    on_run: Callable[[str], None] | None = None,
    saved: Mapping[tuple[float, float, float], Mapping[str, Any]] | None = None,
) -> list[SuiteRun]:
    requests = case.load(settings.block_tokens)
    name = case.trace_name(requests)
    runs = []
    for capacity in case.capacities:
        if on_run is not None:
            on_run(run_label(case.workload, case.seed, capacity))

        def replay(policies: Sequence[str], capacity: tuple[float, float, float] = capacity) -> Any:
            return run(
                requests,
                capacity_fractions=capacity,
                model=settings.model,
                block_tokens=settings.block_tokens,
                machine=settings.machine,
                policies=policies,
                trace_name=name,
            )

        # kvstore first: its document says whether an earlier run's peers are this one's.
        document = replay(settings.variants)
        peers = _reused_peers(None if saved is None else saved.get(capacity), document)
        reused = peers is not None
        if peers is None:
            peers = replay(list(POLICIES))["results"]
        document["results"] = [*peers, *document["results"]]
        verdicts = [judge(document["results"], variant) for variant in settings.variants]
        runs.append(SuiteRun(case.workload, case.seed, capacity, document, verdicts, reused))
    return runs


def run_suite(
    cases: Sequence[SuiteCase],
    *,
    model: ModelCost,
    block_tokens: int = 512,
    machine: Machine | None = None,
    variants: Sequence[str] = ("kvstore",),
    jobs: int = 1,
    progress: Callable[[str, int], None] | None = None,
    reuse: SavedRuns | None = None,
) -> list[SuiteRun]:
    """Replay every case at each of its capacity triples; runs in the cases' order.

    ``progress(label, done)`` is called as each replay starts (``jobs`` = 1) or as
    each case's replays end (``jobs`` > 1), ``done`` the replays finished so far.
    ``reuse`` (``peer_results``): an earlier suite's runs, whose peer results stand
    in for replaying the peers where a run is the same.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    for variant in variants:
        if not is_kvstore(variant):
            raise ValueError(f"the suite judges kvstore policies; {variant!r} is not one")
    settings = _Settings(model, block_tokens, machine or Machine(), tuple(variants) or ("kvstore",))
    if jobs == 1:
        done = [0]

        def on_run(label: str) -> None:
            if progress is not None:
                progress(label, done[0])
            done[0] += 1

        return [
            run
            for case in cases
            for run in _run_case(case, settings, on_run, _saved_for(reuse, case))
        ]
    out: list[list[SuiteRun]] = [[] for _ in cases]
    finished = 0
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {
            pool.submit(_run_case, case, settings, None, _saved_for(reuse, case)): i
            for i, case in enumerate(cases)
        }
        for future in concurrent.futures.as_completed(futures):
            index = futures[future]
            out[index] = future.result()
            finished += len(out[index])
            if progress is not None:
                case = cases[index]
                seeded = case.workload if case.seed is None else f"{case.workload} seed {case.seed}"
                progress(seeded, finished)
    return [run for runs in out for run in runs]


def _saved_for(
    reuse: SavedRuns | None, case: SuiteCase
) -> dict[tuple[float, float, float], dict[str, Any]] | None:
    return None if reuse is None else reuse.get((case.workload, case.seed))


def summary(runs: Sequence[SuiteRun]) -> dict[str, Any]:
    """Runs and verdicts met, per target and in all; runs whose peers were reused."""
    verdicts = [v for r in runs for v in r.verdicts]
    return {
        "runs": len(runs),
        "passed": sum(r.passed for r in runs),
        "peers_reused": sum(r.peers_reused for r in runs),
        "verdicts": len(verdicts),
        "by_target": {
            target: sum(getattr(v, target).passed for v in verdicts)
            for target in ("ttft", "hit_ratio", "nvme_writes")
        },
    }


def by_workload(runs: Sequence[SuiteRun]) -> Iterator[tuple[str, list[SuiteRun]]]:
    """The runs grouped by workload, in the order the workloads first appear."""
    groups: dict[str, list[SuiteRun]] = {}
    for r in runs:
        groups.setdefault(r.workload, []).append(r)
    yield from groups.items()
