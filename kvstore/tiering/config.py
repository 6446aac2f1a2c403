"""Configuration of the tier manager: ``TierConfig``, ``ModelCost`` and the model presets.

Everything here is a frozen value checked at construction, so a bad option fails at
``TierManager.open`` with the field named, never later on an engine's thread. Sizes
carry ``_bytes``, times ``_s``; the names are the ones docs/tiering.md uses, so
engines and docs can rely on them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "ADMISSION_MODES",
    "EVICTION_POLICIES",
    "MODEL_PRESETS",
    "PLACEMENTS",
    "ModelCost",
    "TierConfig",
    "parse_admission",
]

ADMISSION_MODES = ("value_density", "all", "freq2", "store_threshold:N")
EVICTION_POLICIES = ("phi", "lru", "arc")
PLACEMENTS = ("write_back", "write_through", "exclusive")
_MOVERS = ("auto", "cpu", "cuda", "fake")
VALUE_FORMULAS = ("expected", "charged")
# Deprecated value_formula spellings -> the name they stand for.
_VALUE_FORMULA_ALIASES = {"seed001": "charged"}


def _check_remote(config: TierConfig) -> None:
    if not isinstance(config.remote_backend, str) or not config.remote_backend:
        raise ValueError(f"remote_backend must be a backend name, got {config.remote_backend!r}")
    if config.mover == "fake":
        raise ValueError("the fake mover moves no bytes: it cannot serve a remote tier")
    if not isinstance(config.remote_namespace, str) or not config.remote_namespace:
        raise ValueError(
            "remote_namespace must name what the pages are (model, dtype, parallel layout): "
            "two nodes share a page only under the same namespace"
        )
    if not (_finite(config.remote_deadline_s) and config.remote_deadline_s > 0):
        raise ValueError(f"remote_deadline_s must be > 0, got {config.remote_deadline_s!r}")
    if not (_finite(config.remote_health_s) and config.remote_health_s > 0):
        raise ValueError(f"remote_health_s must be > 0, got {config.remote_health_s!r}")
    if not (_finite(config.remote_tau) and config.remote_tau >= 0):
        raise ValueError(f"remote_tau must be finite and >= 0, got {config.remote_tau!r}")
    for name in ("remote_max_pages", "remote_workers"):
        _positive_int(name, getattr(config, name))


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class ModelCost:
    """What recomputing a prefix costs: its prefill FLOPs (docs/tiering.md, "Admission").

    Recomputing ``tokens`` tokens after ``context`` tokens already in the cache costs
    ``2·N·tokens`` for the weights plus ``4·L·H_q·D_h·c`` per token at context ``c``
    for attention (QKᵀ and AV), summed: ``2·L·H_q·D_h·((context + tokens)² − context²)``.
    ``kv_bytes_per_token`` is what one token's K and V take across all layers.
    """

    n_params: float
    layers: int
    q_heads: int
    head_dim: int
    kv_bytes_per_token: int

    def __post_init__(self) -> None:
        if not (_finite(self.n_params) and self.n_params > 0):
            raise ValueError(
                f"ModelCost.n_params must be a finite number > 0, got {self.n_params!r}"
            )
        for name in ("layers", "q_heads", "head_dim", "kv_bytes_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelCost.{name} must be a positive int, got {value!r}")

    @property
    def attention_flops_per_token_context(self) -> float:
        """FLOPs one token spends per token of context before it (4·L·H_q·D_h)."""
        return 4.0 * self.layers * self.q_heads * self.head_dim

    def prefill_flops(self, tokens: int, context: int = 0) -> float:
        """FLOPs to compute ``tokens`` tokens that follow ``context`` cached ones."""
        end = context + tokens
        return 2.0 * self.n_params * tokens + 0.5 * self.attention_flops_per_token_context * (
            end * end - context * context
        )

    @classmethod
    def preset(cls, name: str) -> ModelCost:
        """A named model (``MODEL_PRESETS``); ValueError lists the known names."""
        try:
            return MODEL_PRESETS[name]
        except KeyError:
            known = ", ".join(sorted(MODEL_PRESETS))
            raise ValueError(f"unknown model preset {name!r}; known: {known}") from None


def _kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    return 2 * layers * kv_heads * head_dim * dtype_bytes


MODEL_PRESETS: Mapping[str, ModelCost] = MappingProxyType(
    {
        # bf16 K and V, GQA with 8 KV heads: 128 KiB per token for 8B, 320 KiB for 70B.
        "llama-3.1-8b": ModelCost(8.03e9, 32, 32, 128, _kv_bytes(32, 8, 128)),
        "llama-3.1-70b": ModelCost(70.6e9, 80, 64, 128, _kv_bytes(80, 8, 128)),
        "qwen2.5-7b": ModelCost(7.6e9, 28, 28, 128, _kv_bytes(28, 4, 128)),
        "mistral-7b": ModelCost(7.2e9, 32, 32, 128, _kv_bytes(32, 8, 128)),
        # The tiny model of tests/integrations (HF LlamaConfig, 2 layers, fp32).
        "tiny-llama": ModelCost(2.0e6, 2, 4, 16, _kv_bytes(2, 2, 16, 4)),
    }
)


def parse_admission(mode: str) -> tuple[str, int]:
    """``"store_threshold:3"`` -> ``("store_threshold", 3)``; other modes -> ``(mode, 0)``."""
    if mode in ("value_density", "all", "freq2"):
        return mode, 0
    name, _, count = mode.partition(":")
    if name == "store_threshold" and count.isdigit() and int(count) >= 1:
        return name, int(count)
    raise ValueError(f"admission must be one of {', '.join(ADMISSION_MODES)}, got {mode!r}")


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Options for ``TierManager.open``.

    Tiers: 0 HBM (``hbm_bytes``; ``hbm="owned"``: kvstore owns a page pool there,
    ``"engine"``: the engine keeps its GPU cache and reports it), 1 DRAM (one arena of
    ``dram_bytes``), 2 NVMe (a ``KVStore`` at ``nvme_path``, opened with
    ``nvme_options``; without a path and with the fake mover, a bookkeeping tier of
    ``nvme_bytes`` for simulation). See docs/tiering.md for every option's reason.
    """

    device: str = "cpu"
    hbm: str = "owned"
    hbm_bytes: int = 0
    dram_bytes: int = 256 << 20
    page_bytes: int = 1 << 20
    tokens_per_page: int = 256
    nvme_path: str | None = None
    nvme_options: Mapping[str, Any] = field(default_factory=dict)
    nvme_bytes: int | None = None  # None: the store's capacity_bytes, else unbounded
    model: ModelCost = field(default_factory=lambda: MODEL_PRESETS["llama-3.1-8b"])
    # Effective prefill FLOP/s until observe_prefill has measured it. None: the device
    # class's prior (a GPU's 4e14 on cuda, a CPU's 1e12 on cpu; kvstore.tiering.cost).
    compute_flops: float | None = None
    layer_overlap: bool = False  # True: a load overlaps the recompute of the rest
    # Policies (the defaults were chosen by `kvstore sim`, docs/tiering.md).
    admission: str = "value_density"
    # "expected": p·(T_recompute − T_transfer) (the transfer is paid only on a reuse);
    # "charged": p·T_recompute − T_transfer (the transfer charged whether or not the
    # page is reused; "seed001" is its deprecated alias). Chosen by `kvstore sim`.
    value_formula: str = "expected"
    eviction: str = "phi"
    placement: str = "write_back"
    # Φ = w1·recency + w2·log1p(hits) + w3·recompute-per-byte − w4·SLO deficit.
    phi_weights: tuple[float, float, float, float] = (1.0, 1.0, 0.0, 1.0)
    recency_scale_s: float = 60.0  # one unit of recency per this many seconds of age
    # Φ's probation term for a page not yet reused: + w·ln p(reuse) of its class (the
    # reuse estimator's, by depth and tag), so pages of classes that seldom come back
    # rank below those of classes that do. 0: off. Chosen by `kvstore sim --suite`.
    phi_reuse_weight: float = 1.0
    hit_half_life_s: float = 600.0  # decayed hit counts halve in this time
    hysteresis_s: float = 1.0
    # An offered page that finds DRAM full of pages being written back waits this long
    # for one of them to free its slot instead of being declined (docs/tiering.md,
    # "Eviction and placement"). 0: declined at once. 2 s: twice the writes that write
    # pacing lets queue (one second's), not swept.
    offer_wait_s: float = 2.0
    watermark_warn: float = 0.90
    watermark_force: float = 0.95
    watermark_low: float = 0.85
    max_dwpd: float | None = None  # NVMe write budget that τ_nvme steers toward
    emergency_write_s: float = 2.0  # in-flight NVMe write bytes above this much bandwidth
    # The reuse estimator's history (the ghost map): how many recently seen keys it
    # remembers, the horizon within which a page seen again counts as reused. None:
    # half the pages HBM, DRAM and NVMe hold together, 4,096 to 256 Ki (chosen by
    # `kvstore sim --suite`; docs/tiering.md, "Admission").
    ghost_entries: int | None = None
    reuse_prior: tuple[float, float] = (1.0, 3.0)  # Beta prior (reuses, non-reuses) per class
    tau_initial: float = 0.0  # s of saved time per byte; admit at VD >= τ
    # τ_nvme also rises while NVMe is above its warn watermark (else: the budget only).
    tau_pressure: bool = False
    # NVMe admission by measured payoff (docs/tiering.md, "Admission by payoff"): a
    # class of pages is written while at least this share of its writes is read back
    # from NVMe (ghosts measure a closed class). None: every page VD admits is written.
    nvme_write_payoff: float | None = 0.001
    # A write into a full NVMe only of a page asked for at least twice lately and more
    # often than the page it displaces, while miniature models of NVMe show the rule
    # serving more hits (docs/tiering.md, "Admission against the displaced page").
    # False: never.
    nvme_displacement: bool = True
    persist_stats_s: float = 30.0
    warm_dram_on_open: bool = True
    control_interval_s: float = 0.002  # 0: no control thread; the caller drives step()
    mover: str = "auto"
    clock: Callable[[], float] | None = None  # the fake mover's virtual clock, for sim
    # Seeds for the bandwidth fit (bytes/s) and per-transfer latency (s), per path;
    # replaced by what completed transfers measure (and the open-time probe).
    bandwidth_bytes_per_s: Mapping[str, float] = field(default_factory=dict)
    latency_s: Mapping[str, float] = field(default_factory=dict)
    probe_at_open: bool = True
    # The remote tier (docs/tiering.md, "The remote tier"): a cluster store below NVMe,
    # shared by the nodes. None: no remote tier. remote_options go to the backend
    # ("mooncake": master, hostname, segment_bytes, ...); remote_namespace keeps models,
    # dtypes, parallel layouts apart (the engine adapters derive it); a remote call past
    # remote_deadline_s is given up on (its pages are late misses).
    remote_backend: str | None = None
    remote_options: Mapping[str, Any] = field(default_factory=dict)
    remote_namespace: str = ""
    remote_deadline_s: float = 2.0
    remote_max_pages: int = 64  # pages one lookup asks the cluster for
    remote_workers: int = 2  # threads making the remote calls
    remote_health_s: float = 1.0  # a health call this often (reconnects a degraded tier)
    remote_tau: float = 0.0  # publish at value density >= this (s of recompute per byte)

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not (
            self.device == "cpu" or self.device.startswith("cuda")
        ):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.hbm not in ("owned", "engine"):
            raise ValueError(f"hbm must be 'owned' or 'engine', got {self.hbm!r}")
        for name in ("hbm_bytes", "dram_bytes"):
            _non_negative_int(name, getattr(self, name))
        for name in ("page_bytes", "tokens_per_page"):
            _positive_int(name, getattr(self, name))
        if self.ghost_entries is not None:
            _positive_int("ghost_entries", self.ghost_entries)
        if self.nvme_bytes is not None:
            _non_negative_int("nvme_bytes", self.nvme_bytes)
        if self.nvme_path is not None and not isinstance(self.nvme_path, str):
            raise ValueError(f"nvme_path must be a str or None, got {self.nvme_path!r}")
        if not isinstance(self.model, ModelCost):
            raise ValueError(f"model must be a ModelCost, got {type(self.model).__name__}")
        parse_admission(self.admission)
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {self.eviction!r}")
        if isinstance(self.value_formula, str) and self.value_formula in _VALUE_FORMULA_ALIASES:
            new = _VALUE_FORMULA_ALIASES[self.value_formula]
            warnings.warn(
                f"value_formula={self.value_formula!r} is deprecated; use {new!r}",
                DeprecationWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "value_formula", new)
        if self.value_formula not in VALUE_FORMULAS:
            raise ValueError(
                f"value_formula must be one of {VALUE_FORMULAS}, got {self.value_formula!r}"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.mover not in _MOVERS:
            raise ValueError(f"mover must be one of {_MOVERS}, got {self.mover!r}")
        if len(self.phi_weights) != 4 or not all(_finite(w) for w in self.phi_weights):
            raise ValueError(f"phi_weights must be four finite numbers, got {self.phi_weights!r}")
        if self.compute_flops is not None and not (
            _finite(self.compute_flops) and self.compute_flops > 0
        ):
            raise ValueError(
                f"compute_flops must be a finite number > 0 or None, got {self.compute_flops!r}"
            )
        for name in (
            "recency_scale_s",
            "hit_half_life_s",
            "emergency_write_s",
        ):
            value = getattr(self, name)
            if not (_finite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name in (
            "hysteresis_s",
            "offer_wait_s",
            "persist_stats_s",
            "control_interval_s",
            "tau_initial",
            "phi_reuse_weight",
        ):
            value = getattr(self, name)
            if not (_finite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not 0 < self.watermark_low <= self.watermark_warn <= self.watermark_force <= 1:
            raise ValueError(
                "watermarks must satisfy 0 < low <= warn <= force <= 1, got "
                f"low={self.watermark_low} warn={self.watermark_warn} "
                f"force={self.watermark_force}"
            )
        if self.nvme_write_payoff is not None and not (
            _finite(self.nvme_write_payoff) and 0 <= self.nvme_write_payoff <= 1
        ):
            raise ValueError(
                f"nvme_write_payoff must be in [0, 1] or None, got {self.nvme_write_payoff!r}"
            )
        if self.max_dwpd is not None and not (_finite(self.max_dwpd) and self.max_dwpd > 0):
            raise ValueError(f"max_dwpd must be > 0 or None, got {self.max_dwpd!r}")
        if len(self.reuse_prior) != 2 or not all(_finite(v) and v > 0 for v in self.reuse_prior):
            raise ValueError(f"reuse_prior must be two numbers > 0, got {self.reuse_prior!r}")
        if self.mover == "fake" and self.nvme_path is not None:
            raise ValueError("the fake mover moves no bytes: it cannot serve a real nvme_path")
        if self.clock is not None and self.mover != "fake":
            raise ValueError("clock= is the fake mover's virtual clock; set mover='fake'")
        if self.remote_backend is not None:
            _check_remote(self)
        for path, value in self.bandwidth_bytes_per_s.items():
            if not (_finite(value) and value > 0):
                raise ValueError(
                    f"bandwidth_bytes_per_s[{path!r}] must be a finite rate > 0, got {value!r}"
                )
        for path, value in self.latency_s.items():
            if not (_finite(value) and value >= 0):
                raise ValueError(f"latency_s[{path!r}] must be finite and >= 0, got {value!r}")

    @property
    def device_class(self) -> str:
        """``"gpu"`` or ``"cpu"``: whose priors seed the cost model. The fake mover
        models a GPU node (``kvstore sim``), whatever ``device`` says."""
        return "gpu" if self.device.startswith("cuda") or self.mover == "fake" else "cpu"

    @property
    def admission_mode(self) -> tuple[str, int]:
        return parse_admission(self.admission)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
