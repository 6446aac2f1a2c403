"""Decision fingerprints of the tier manager in simulation: are two trees' decisions identical?

    python tools/sim_identity.py --out new.json [--trace T] [--full]
    python tools/sim_identity.py --out new.json --against base.json

Replays, through the real ``TierManager`` on the fake mover (``kvstore.tiering.sim``),
the generator's four kinds (seed 1, 2,000 requests each) and, given ``--trace``, the
first 3,000 requests of a real trace (``--full``: all of it) at two capacities, plus a
slow disk (``--nvme-gbps 0.5``). Each replay's fingerprint: hits per tier, NVMe pages
and bytes written, recompute tokens, a SHA-256 of every request's modelled TTFT, and
the manager's counters. A refactoring that changes no decision leaves every
fingerprint bit-identical; ``--against`` exits 1 naming the first difference. This
module is the command line of tools/sim_identity.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any

from kvstore.tiering.config import MODEL_PRESETS
from kvstore.tiering.sim import Machine, kvstore_config, simulate_kvstore
from kvstore.tiering.sim.trace import (
    GENERATOR_KINDS,
    Request,
    capacity_blocks,
    generate,
    load_trace,
    trace_facts,
)

CAPACITIES = ((0.02, 0.10, 0.5), (0.01, 0.05, 0.25))


def fingerprint(
    requests: Sequence[Request], fractions: tuple[float, float, float], machine: Machine
) -> dict[str, Any]:
    model = MODEL_PRESETS["llama-3.1-8b"]
    block_tokens = 512
    capacity = capacity_blocks(fractions, trace_facts(requests).unique_blocks)
    config = kvstore_config(capacity, model, block_tokens, machine)
    result = simulate_kvstore(requests, config)
    ttft = hashlib.sha256(b"".join(struct.pack("<d", t) for t in result.ttft_s)).hexdigest()
    return {
        "hits": list(result.hit_blocks_by_tier),
        "accesses": result.block_accesses,
        "nvme_pages_written": result.nvme_blocks_written,
        "nvme_bytes_written": result.nvme_bytes_written,
        "recompute_tokens": result.recompute_tokens,
        "ttft_sha256": ttft,
        "counters": {
            k: result.extra[k] for k in ("evictions", "admissions", "recompute_decisions")
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--trace", help="a Mooncake-format JSONL trace")
    parser.add_argument("--full", action="store_true", help="the whole trace, not 3,000 requests")
    parser.add_argument("--against", help="a fingerprint file to compare with")
    args = parser.parse_args(argv)
    cases: dict[str, dict[str, Any]] = {}
    for kind in GENERATOR_KINDS:
        requests = generate(kind, seed=1, requests=2000)
        cases[f"{kind}/seed1"] = fingerprint(requests, CAPACITIES[0], Machine())
    if args.trace:
        requests = load_trace(args.trace, limit=None if args.full else 3000)
        for fractions in CAPACITIES:
            name = f"trace/{','.join(map(str, fractions))}"
            cases[name] = fingerprint(requests, fractions, Machine())
        cases["trace/slow-disk"] = fingerprint(requests, CAPACITIES[0], Machine(nvme_gbps=0.5))
    with open(args.out, "w") as f:
        json.dump(cases, f, indent=1, sort_keys=True)
    if not args.against:
        return 0
    with open(args.against) as f:
        base = json.load(f)
    for name, got in cases.items():
        want = base.get(name)
        if want != got:
            for key in got:
                if want is None or want.get(key) != got[key]:
                    print(f"DIFFERENT {name}: {key}: {want and want.get(key)} -> {got[key]}")
                    break
            return 1
    print(f"identical: {len(cases)} replays")
    return 0
