"""What survives a restart: the page forest rebuilt from NVMe, and the statistics file.

At open, ``Restart.rebuild`` files every page the manager wrote to the NVMe tier
(their parent links make the prefix forest again) and ``Restart.load`` applies the
statistics file (docs/format.md, "Tier statistics file"): the reuse estimate, τ, the
fitted rates, C_eff, and the hottest pages' heat, queued to warm DRAM. The file is
a cache: one that fails any check costs warm-up, never the open. ``snapshot`` (under
the manager's lock) and ``write`` (outside it, one at a time) save it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.errors import IOFailure, KVStoreError
from kvstore.log.regular import read_regular
from kvstore.tiering.config import TierConfig
from kvstore.tiering.cost import Bandwidth, Compute, CostModel
from kvstore.tiering.evict import Eviction
from kvstore.tiering.loads import Loads
from kvstore.tiering.nvme import NvmeTier
from kvstore.tiering.pages import NVME
from kvstore.tiering.state import TierState
from kvstore.tiering.statsfile import parse_for_manager, write_stats_file
from kvstore.tiering.statsfile import snapshot as make_snapshot
from kvstore.tiering.value import Valuation

__all__ = ["Restart"]

_HEAT_PAGES = 100_000  # pages whose heat is persisted (the hottest)


class Restart:
    """The rebuild at open and the statistics file's load and save."""

    def __init__(
        self,
        config: TierConfig,
        state: TierState,
        value: Valuation,
        *,
        nvme: NvmeTier,
        loads: Loads,
        eviction: Eviction,
        cost: CostModel,
        bandwidth: dict[str, Bandwidth],
        compute: Compute,
        now: Callable[[], float],
    ) -> None:
        self.config = config
        self.path: Path | None = nvme.stats_path
        self.error: str | None = None  # the last load or save failure, for explain
        self._state = state
        self._value = value
        self._nvme = nvme
        self._loads = loads
        self._evict = eviction
        self.cost = cost
        self._bandwidth = bandwidth
        self._compute = compute
        self._now = now
        # Saves run outside the state lock (step and close): one at a time, or two
        # writers would share the temporary file.
        self._write_lock = threading.Lock()

    def rebuild(self) -> None:
        """The prefix forest from the NVMe pages' parent links."""
        state = self._state
        found = self._nvme.rebuild(self._now(), self.config.tokens_per_page)
        for rec in found:
            state.pages[rec.key] = rec
        for rec in found:
            state.set_tier(rec, NVME)
            parent_rec = state.pages.get(rec.parent) if rec.parent is not None else None
            if parent_rec is not None:
                state.child_created(parent_rec)
        self._state.bump("restart:pages_rebuilt", len(found))

    def load(self) -> None:
        """The persisted statistics, all or nothing. Statistics are a cache: a file that
        fails any check (torn, garbage, a rate of 0, a short list) is treated as absent
        and costs warm-up, never the open, a half-applied state or a later raise."""
        path = self.path
        if path is None:
            return
        try:
            raw = read_regular(path)  # O_NONBLOCK, regular files only: a FIFO never blocks
        except FileNotFoundError:
            return
        except (OSError, KVStoreError) as e:
            self._state.bump("restart:stats_unreadable")
            self.error = f"{path}: {e}"
            return
        try:
            parsed = parse_for_manager(json.loads(raw), str(path))
        except (OSError, ValueError, RecursionError, KVStoreError) as e:
            self._state.bump("restart:stats_unreadable")
            self.error = f"{path}: {e}"
            return
        self._value.reuse.load_json(parsed.reuse)
        self._value.tau.load_json(parsed.tau)
        if parsed.payoff is not None and self._value.payoff is not None:
            self._value.payoff.load_json(parsed.payoff)
        for name, (rate, latency_s) in parsed.bandwidth.items():
            # A path the configuration sets is the operator's number, not a seed.
            if name in self._bandwidth and name not in self.config.bandwidth_bytes_per_s:
                self._bandwidth[name].set(rate, latency_s)
        if self.config.compute_flops is None:  # a configured C_eff is the operator's
            self._compute.flops_per_s = parsed.compute_flops
        now = self._now()
        heat = []
        for key, hits, age_s in parsed.heat:
            rec = self._state.pages.get(key)
            if rec is None:
                continue
            rec.hits = hits
            rec.last_access_s = now - age_s
            rec.reused = rec.hits >= 1
            for tier in range(3):
                if rec.in_tier(tier):
                    self._state.orders[tier].touch(rec)
            heat.append(rec)
        if self.config.warm_dram_on_open:
            heat.sort(key=lambda r: -r.hits)
            self._loads.warm.extend(r.key for r in heat)
        self._state.bump("restart:stats_loaded")

    def snapshot(self) -> dict[str, Any]:
        now = self._now()
        hottest = sorted(self._state.pages.values(), key=lambda r: -r.hits)[:_HEAT_PAGES]
        return make_snapshot(
            reuse=self._value.reuse.to_json(),
            tau=self._value.tau.to_json(),
            bandwidth={p: b.to_json() for p, b in self._bandwidth.items()},
            compute_flops=self._compute.flops_per_s,
            heat=[[r.key.hex(), r.hits, max(now - r.last_access_s, 0.0)] for r in hottest],
            payoff=None if self._value.payoff is None else self._value.payoff.to_json(),
            summary={
                "pages_by_tier": list(self._state.count),
                "used_bytes": list(self._state.used),
                "capacity_bytes": list(self._state.capacity),
                "hits_by_tier": list(self._loads.hits),
                "misses": self._loads.misses,
                "lookups": self._loads.lookups,
                "nvme_pages_written": self._evict.nvme_written[0],
                "nvme_bytes_written": self._evict.nvme_written[1],
                "counters": dict(self._state.counters),
                "kappa": [self.cost.kappa(t, self.config.page_bytes) for t in range(3)],
            },
        )

    def write(self, data: dict[str, Any]) -> None:
        path = self.path
        if path is None:
            return
        try:
            with self._write_lock:
                write_stats_file(path, data)
        except (OSError, IOFailure) as e:
            self._state.bump("stats:save_failures")
            self.error = f"{path}: {e}"
