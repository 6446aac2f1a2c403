"""What a page costs to move and to recompute, measured; κ per tier; the load plan.

``Bandwidth`` fits ``seconds = α + bytes / B`` per path from completed transfers
(exponentially weighted least squares, so a drifting disk is followed within a few
dozen transfers); ``Compute`` fits the effective prefill FLOP/s from what the engine
reports through ``observe_prefill``. Both start from priors per device class
(``class_priors``: a GPU node's or a CPU host's), which samples refine; a sample
that disagrees with the estimate by more than 8x is held until three in a row
agree (one slow copy on a busy host cannot move it), and the first copies of a
real mover are discarded (cold caches, first-touch page faults).
``CostModel.plan`` picks how many of a hit
prefix's pages to load so that the time to first token is smallest: 0 pages means
recompute everything (MISS). Pure arithmetic on floats: no locks, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.tiering.config import ModelCost

__all__ = [
    "CPU_BANDWIDTH_BYTES_PER_S",
    "CPU_COMPUTE_FLOPS",
    "DEFAULT_BANDWIDTH_BYTES_PER_S",
    "DEFAULT_LATENCY_S",
    "GPU_COMPUTE_FLOPS",
    "LOAD_PATHS",
    "Bandwidth",
    "Compute",
    "CostModel",
    "PlanCost",
    "class_priors",
]

HBM, DRAM, NVME = 0, 1, 2

# Seeds until transfers are measured: an H100-class node with a PCIe Gen5 NVMe.
DEFAULT_BANDWIDTH_BYTES_PER_S: Mapping[str, float] = {
    "d2d": 1.0e12,
    "h2d": 2.5e10,
    "d2h": 2.5e10,
    "h2h": 1.0e10,
    "nvme_read": 6.0e9,
    "nvme_write": 3.0e9,
}
DEFAULT_LATENCY_S: Mapping[str, float] = {
    "d2d": 5e-6,
    "h2d": 1e-5,
    "d2h": 1e-5,
    "h2h": 5e-6,
    "nvme_read": 1e-4,
    "nvme_write": 2e-4,
}
# A CPU host's class: every copy path is a host memcpy (a conservative few GB/s for
# one thread), and prefill runs on the CPU: 1 TFLOP/s is above what a server CPU
# sustains on a prefill, so recompute looks cheaper than it is (a CPU-class κ errs
# toward recomputing, never toward a tier it cannot pay back).
CPU_BANDWIDTH_BYTES_PER_S: Mapping[str, float] = {
    "d2d": 5.0e9,
    "h2d": 5.0e9,
    "d2h": 5.0e9,
    "h2h": 5.0e9,
    "nvme_read": 6.0e9,
    "nvme_write": 3.0e9,
}
GPU_COMPUTE_FLOPS = 4.0e14  # an H100-class GPU's effective prefill rate
CPU_COMPUTE_FLOPS = 1.0e12
# How a page reaches the engine's destination from each tier.
LOAD_PATHS: Mapping[int, tuple[str, ...]] = {
    HBM: ("d2d",),
    DRAM: ("h2d",),
    NVME: ("nvme_read", "h2d"),
}

_DECAY = 0.97  # weight kept by older samples per new one: ~33 transfers of memory
_MIN_FIT_SAMPLES = 8
# A sample whose implied rate is off the estimate by more than this factor is an
# outlier: held (not folded in) until _CONFIRM of them in a row, off the same way,
# say the path really changed; then the fit restarts from them.
_OUTLIER = 8.0
_CONFIRM = 3


def class_priors(device_class: str) -> tuple[Mapping[str, float], float]:
    """(bandwidth seeds per path, C_eff seed) for ``"gpu"`` or ``"cpu"``."""
    if device_class == "gpu":
        return DEFAULT_BANDWIDTH_BYTES_PER_S, GPU_COMPUTE_FLOPS
    if device_class == "cpu":
        return CPU_BANDWIDTH_BYTES_PER_S, CPU_COMPUTE_FLOPS
    raise ValueError(f"device class must be 'gpu' or 'cpu', got {device_class!r}")


class Bandwidth:
    """``seconds = α + bytes / B`` for one path, fitted from completed transfers.

    Robust to what a cold or busy host does to a few samples: the first ``warmup``
    samples are discarded, and a sample more than 8x off the estimate is held until
    three in a row agree (then the fit restarts from them: the path changed).
    ``last_sample_s`` is when a sample last landed (the caller's clock), for probes.
    """

    __slots__ = (
        "_held",
        "_held_dir",
        "_held_samples",
        "_s",
        "_sx",
        "_sxx",
        "_sxy",
        "_sy",
        "last_sample_s",
        "latency_s",
        "outliers",
        "rate",
        "samples",
        "warmup",
    )

    def __init__(self, bytes_per_s: float, latency_s: float, *, warmup: int = 0) -> None:
        if not (math.isfinite(bytes_per_s) and bytes_per_s > 0):
            raise ValueError(f"a bandwidth must be a finite rate > 0, got {bytes_per_s!r}")
        if not (math.isfinite(latency_s) and latency_s >= 0):
            raise ValueError(f"a latency must be finite and >= 0, got {latency_s!r}")
        self.rate = float(bytes_per_s)
        self.latency_s = float(latency_s)
        self.samples = 0
        self.warmup = warmup
        self.outliers = 0  # samples held and then dropped (never folded in)
        self.last_sample_s = -math.inf
        self._held = 0
        self._held_dir = 0
        self._held_samples: list[tuple[float, float]] = []
        self._s = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def seconds(self, nbytes: float, transfers: int = 1) -> float:
        return transfers * self.latency_s + nbytes / self.rate

    def set(self, bytes_per_s: float, latency_s: float | None = None) -> None:
        """Replace the estimate (a calibration, a persisted value): the fit restarts."""
        if not (math.isfinite(bytes_per_s) and bytes_per_s > 0):
            raise ValueError(f"a bandwidth must be a finite rate > 0, got {bytes_per_s!r}")
        self.rate = float(bytes_per_s)
        if latency_s is not None and math.isfinite(latency_s) and latency_s >= 0:
            self.latency_s = float(latency_s)
        self._restart()

    def _restart(self) -> None:
        # samples counts toward the least-squares fit's minimum: a fresh fit waits for
        # _MIN_FIT_SAMPLES again before it separates α from B.
        self.samples = 0
        self._s = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._held = self._held_dir = 0
        self._held_samples = []

    def observe(self, nbytes: int, seconds: float, now: float | None = None) -> None:
        """Fold one transfer in; a zero-byte or non-positive-time sample is ignored."""
        if nbytes <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        if now is not None:
            self.last_sample_s = now
        if self.warmup > 0:
            self.warmup -= 1
            return
        x, y = float(nbytes), float(seconds)
        busy = y - self.latency_s
        # Off by what the estimate predicts this transfer takes: a time ratio stays
        # well conditioned where latency dominates (x / (y - α) would not).
        off = (self.latency_s + x / self.rate) / y
        if off > _OUTLIER or off < 1.0 / _OUTLIER:
            direction = 1 if off > 1.0 else -1
            if direction != self._held_dir:
                self.outliers += self._held  # held the other way: dropped
                self._held, self._held_dir, self._held_samples = 0, direction, []
            self._held += 1
            self._held_samples.append((x, y))
            if self._held < _CONFIRM:
                return
            # The path changed (a busy host, a new disk, a wrong seed): start over from
            # the held samples' median rate.
            held = sorted(
                hx / (hy - self.latency_s if hy > self.latency_s else hy)
                for hx, hy in self._held_samples
            )
            rate = held[len(held) // 2]
            if math.isfinite(rate) and rate > 0:
                self.rate = rate
            self._restart()
            return
        if self._held:
            self.outliers += self._held
            self._held, self._held_dir, self._held_samples = 0, 0, []
        self.samples += 1
        self._s = self._s * _DECAY + 1.0
        self._sx = self._sx * _DECAY + x
        self._sy = self._sy * _DECAY + y
        self._sxx = self._sxx * _DECAY + x * x
        self._sxy = self._sxy * _DECAY + x * y
        mean_x = self._sx / self._s
        var_x = self._sxx / self._s - mean_x * mean_x
        if self.samples >= _MIN_FIT_SAMPLES and var_x > 0.01 * mean_x * mean_x:
            slope = (self._sxy / self._s - mean_x * (self._sy / self._s)) / var_x
            intercept = self._sy / self._s - slope * mean_x
            if slope > 0 and intercept >= 0 and math.isfinite(1.0 / slope):
                self.rate, self.latency_s = 1.0 / slope, intercept
                return
        # Transfers all of one size cannot separate α from B: keep α, fit B. A transfer
        # that was nearly all latency says next to nothing about B: it moves nothing.
        if busy <= 0.1 * y:
            return
        weight = 0.2 if self.samples > 1 else 1.0
        rate = (1 - weight) * self.rate + weight * (x / busy)
        if math.isfinite(rate) and rate > 0:
            self.rate = rate

    def to_json(self) -> dict[str, float]:
        return {"bytes_per_s": self.rate, "latency_s": self.latency_s, "samples": self.samples}


class Compute:
    """Effective prefill FLOP/s, from the engine's measured prefills."""

    __slots__ = ("flops_per_s", "samples")

    def __init__(self, flops_per_s: float) -> None:
        if not (math.isfinite(flops_per_s) and flops_per_s > 0):
            raise ValueError(f"a compute rate must be finite and > 0, got {flops_per_s!r}")
        self.flops_per_s = float(flops_per_s)
        self.samples = 0

    def observe(self, flops: float, seconds: float) -> None:
        """Fold one measured prefill in; a non-finite or non-positive one is ignored
        (the caller refuses it first: ``TierManager.observe_prefill``)."""
        if not (flops > 0 and math.isfinite(flops)) or not (seconds > 0 and math.isfinite(seconds)):
            return
        rate = flops / seconds
        if not (math.isfinite(rate) and rate > 0):
            return
        self.samples += 1
        weight = 1.0 if self.samples == 1 else 0.1
        self.flops_per_s = (1 - weight) * self.flops_per_s + weight * rate


@dataclass(frozen=True, slots=True)
class PlanCost:
    """The numbers behind a load plan; all times in seconds."""

    load_pages: int
    ttft_s: float  # with ``load_pages`` loaded
    ttft_recompute_s: float  # load nothing
    ttft_load_all_s: float  # load every hit page
    load_s: float  # the transfer part of ``ttft_s``
    recompute_s: float  # the prefill part of ``ttft_s``


class CostModel:
    """T_transfer and T_recompute for pages and prefixes; κ; the load plan."""

    def __init__(
        self,
        model: ModelCost,
        tokens_per_page: int,
        compute: Compute,
        bandwidth: Mapping[str, Bandwidth],
        *,
        layer_overlap: bool = False,
    ) -> None:
        self.model = model
        self.tokens_per_page = tokens_per_page
        self.compute = compute
        self.bandwidth = bandwidth
        self.layer_overlap = layer_overlap

    # -- single terms ------------------------------------------------------

    def recompute_s(self, tokens: int, context: int = 0) -> float:
        """Prefill time of ``tokens`` tokens after ``context`` cached tokens."""
        if tokens <= 0:
            return 0.0
        return self.model.prefill_flops(tokens, context) / self.compute.flops_per_s

    def transfer_s(self, tier: int, nbytes: int, transfers: int = 1) -> float:
        """Time to bring ``nbytes`` from ``tier`` to the destination."""
        return sum(self.bandwidth[p].seconds(nbytes, transfers) for p in LOAD_PATHS[tier])

    def kappa(self, tier: int, page_bytes: int) -> float:
        """κ: recompute time of one page at context 0 over its load time from ``tier``."""
        load = self.transfer_s(tier, page_bytes)
        return self.recompute_s(self.tokens_per_page) / load if load > 0 else math.inf

    def value_density(
        self, reuse_p: float, depth: int, nbytes: int, tier: int, formula: str = "charged"
    ) -> float:
        """Value density in s per byte. ``"charged"``: (p·T_recompute − T_{tier→HBM}) /
        bytes, the transfer charged whether or not the page is reused; ``"expected"``:
        p·(T_recompute − T_{tier→HBM}) / bytes, the expected benefit (a transfer
        happens only on a reuse). docs/tiering.md, "Admission"."""
        tokens = self.tokens_per_page
        recompute = self.recompute_s(tokens, depth * tokens)
        transfer = self.transfer_s(tier, nbytes)
        if formula == "expected":
            return reuse_p * (recompute - transfer) / max(nbytes, 1)
        return (reuse_p * recompute - transfer) / max(nbytes, 1)

    # -- the plan ------------------------------------------------------------

    def plan(
        self,
        tiers: Sequence[int],
        nbytes: Sequence[int],
        total_tokens: int,
        *,
        extra_s: Sequence[float] | None = None,
    ) -> PlanCost:
        """How many leading pages of a hit to load so that TTFT is smallest.

        ``tiers[i]`` is where hit page i is served from, ``nbytes[i]`` its size,
        ``total_tokens`` the request's prompt (at least the hit's tokens);
        ``extra_s[i]`` is time page i must still wait for (a read in flight). Loads
        from one tier share one transfer latency (one batch per path). Without layer
        overlap TTFT = load + recompute of the rest; with it, the larger of the two.
        Ties go to loading fewer pages: a load that saves nothing is not worth its
        risk. O(len(tiers)).
        """
        hit = len(tiers)
        tpp = self.tokens_per_page
        total_tokens = max(total_tokens, hit * tpp)
        rate = self.compute.flops_per_s
        bandwidth = self.bandwidth
        # prefill_flops(total - loaded, loaded), expanded: one multiply-add per page.
        two_n = 2.0 * self.model.n_params
        half_a = 0.5 * self.model.attention_flops_per_token_context
        total_sq = total_tokens * total_tokens
        rec0 = (two_n * total_tokens + half_a * total_sq) / rate
        best_pages, best_ttft, best_load, best_rec = 0, rec0, 0.0, rec0
        ttft = rec0
        paths_seen: set[str] = set()
        load = 0.0
        waited = 0.0
        overlap = self.layer_overlap
        last_tier = -1
        per_byte = 0.0
        for i in range(hit):
            tier = tiers[i]
            if tier != last_tier:  # a run of pages from one tier: its paths once
                last_tier = tier
                per_byte = 0.0
                for path in LOAD_PATHS[tier]:
                    fit = bandwidth[path]
                    per_byte += 1.0 / fit.rate
                    if path not in paths_seen:
                        paths_seen.add(path)
                        load += fit.latency_s
            load += nbytes[i] * per_byte
            if extra_s is not None and extra_s[i] > waited:
                waited = extra_s[i]
            loaded = (i + 1) * tpp
            rec = (two_n * (total_tokens - loaded) + half_a * (total_sq - loaded * loaded)) / rate
            moving = load if load > waited else waited
            ttft = (moving if moving > rec else rec) if overlap else moving + rec
            if ttft < best_ttft:
                best_pages, best_ttft, best_load, best_rec = i + 1, ttft, moving, rec
        return PlanCost(
            load_pages=best_pages,
            ttft_s=best_ttft,
            ttft_recompute_s=rec0,
            ttft_load_all_s=ttft,
            load_s=best_load,
            recompute_s=best_rec,
        )

    def ttft_s(self, tiers: Sequence[int], nbytes: Sequence[int], total_tokens: int) -> float:
        """TTFT when every page in ``tiers`` is loaded (what an always-load peer pays)."""
        return self.plan(tiers, nbytes, total_tokens).ttft_load_all_s


def make_bandwidths(
    rates: Mapping[str, float],
    latencies: Mapping[str, float],
    *,
    priors: Mapping[str, float] = DEFAULT_BANDWIDTH_BYTES_PER_S,
    warmup: int = 0,
) -> dict[str, Bandwidth]:
    """One ``Bandwidth`` per path: the class ``priors``, overridden by
    ``rates``/``latencies``; each discards its first ``warmup`` samples."""
    out = {}
    for path, default in priors.items():
        out[path] = Bandwidth(
            rates.get(path, default), latencies.get(path, DEFAULT_LATENCY_S[path]), warmup=warmup
        )
    unknown = (set(rates) | set(latencies)) - set(out)
    if unknown:
        raise ValueError(f"unknown transfer paths {sorted(unknown)}; known: {sorted(out)}")
    return out
