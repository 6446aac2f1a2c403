"""What a page is worth, and where: the reuse estimate, the value density, admission and τ.

``Valuation`` holds the tier manager's judgement of pages (docs/tiering.md,
"Admission" and "Eviction"): the reuse estimator (ghost entries per class), the
admission rule with its thresholds τ per tier (``TauController``), Φ's cost term, and
the value density with its recompute and transfer times cached until a bandwidth fit
or ``observe_prefill`` moves them. NVMe admission is decided once per admission epoch
(τ's period, and each change of the κ gates) per page. State under the manager's lock.
"""

from __future__ import annotations

import math

from kvstore.tiering.config import TierConfig
from kvstore.tiering.cost import LOAD_PATHS, Bandwidth, Compute, CostModel
from kvstore.tiering.displace import Displacement
from kvstore.tiering.pages import NVME, TIER_NAMES, PageRec
from kvstore.tiering.payoff import WritePayoff
from kvstore.tiering.policy import Admission, ReuseEstimator, TauController
from kvstore.tiering.results import UNBOUNDED_BYTES

__all__ = ["GHOST_ENTRIES_MAX", "GHOST_ENTRIES_MIN", "Valuation", "ghost_entries_for"]


GHOST_ENTRIES_MIN = 4096
GHOST_ENTRIES_MAX = 1 << 18  # ~200 bytes an entry: ~50 MB at most


def ghost_entries_for(cache_pages: int) -> int:
    """``TierConfig.ghost_entries``'s default: half the pages the tiers hold together,
    4,096 to 256 Ki (an NVMe tier without a capacity counts none). A page seen again
    within that many other keys counts as reused.
    Twice the pages (the simulator's value before) left the horizon longer than most
    traces: no key ever fell out unseen, so every class's p(reuse) stayed near 1 and
    Φ's probation term ranked nothing (`kvstore sim --generate rag`: DRAM 82% pages
    seen once; docs/tiering.md, "Admission")."""
    return max(GHOST_ENTRIES_MIN, min(GHOST_ENTRIES_MAX, cache_pages // 2))


class Valuation:
    """The reuse estimate, admission and τ, and the cached value densities."""

    def __init__(
        self,
        config: TierConfig,
        cost: CostModel,
        compute: Compute,
        slot_bytes: int,
        nvme_capacity: int = 0,
        cache_pages: int = 0,
    ) -> None:
        self.config = config
        self.cost = cost
        self._compute = compute
        mode, threshold = config.admission_mode
        entries = config.ghost_entries
        if entries is None:
            entries = ghost_entries_for(cache_pages)
        self.reuse = ReuseEstimator(entries, config.reuse_prior)
        self.admission = Admission(mode, threshold, self.value_density)
        self.tau = TauController(config.tau_initial, pressure=config.tau_pressure)
        self.admit_epoch = 0  # bumped with every τ update: cached admissions expire
        self._cost_ratios: dict[int, float] = {}  # by depth; a ratio, so C_eff cancels
        self._base_recompute_per_byte = cost.recompute_s(config.tokens_per_page) / slot_bytes
        # (compute rate, recompute s by depth, transfer s by tier); reset by the fits.
        self._vd_cache: tuple[float, dict[int, float], list[float]] | None = None
        # NVMe admission by measured payoff, beside value density; not where the
        # operator chose a fixed rule (another admission mode) or every page on NVMe
        # (write-through); None: off.
        bar = config.nvme_write_payoff
        self.payoff: WritePayoff | None = None
        chosen = config.admission != "value_density" or config.placement == "write_through"
        if bar is not None and nvme_capacity > 0 and not chosen:
            self.payoff = WritePayoff(bar, WritePayoff.horizon(nvme_capacity // slot_bytes))
        self._payoff_changes = 0
        # NVMe admission against the page a write displaces: where NVMe has a capacity
        # to fill and admission is the manager's to choose, as the payoff gate.
        self.displacement: Displacement | None = None
        if (
            config.nvme_displacement
            and 0 < nvme_capacity < UNBOUNDED_BYTES
            and slot_bytes > 0
            and not chosen
        ):
            self.displacement = Displacement(nvme_capacity // slot_bytes, cache_pages)

    def invalidate(self) -> None:
        """A bandwidth fit or the compute rate moved: value densities are computed anew."""
        self._vd_cache = None

    def cost_ratio(self, rec: PageRec) -> float:
        """Φ's cost term: recompute time per byte against a full root page's. A full
        page's ratio depends on its depth alone: it is kept on the record too, where
        the orders read it without calling here (``offer`` resets it with ``nbytes``)."""
        config = self.config
        if rec.tokens == config.tokens_per_page and rec.nbytes == config.page_bytes:
            ratio = self._cost_ratios.get(rec.depth)
            if ratio is None:
                ratio = self._cost_ratios[rec.depth] = self._compute_cost_ratio(rec)
            rec.cost_ratio = ratio
            return ratio
        return self._compute_cost_ratio(rec)

    def _compute_cost_ratio(self, rec: PageRec) -> float:
        per_byte = self.cost.recompute_s(rec.tokens, rec.depth * rec.tokens) / max(rec.nbytes, 1)
        return per_byte / self._base_recompute_per_byte if self._base_recompute_per_byte else 1.0

    def value_density(self, rec: PageRec, tier: int) -> float:
        """The value density (``value_formula``; docs/tiering.md, "Admission") with the
        recompute time per depth and the transfer time per tier cached (for full
        pages) until a fit or ``observe_prefill`` moves them."""
        p = self.reuse.p(rec.depth, rec.reused, rec.tag)
        nbytes = rec.nbytes
        formula = self.config.value_formula
        if nbytes != self.config.page_bytes or rec.tokens != self.config.tokens_per_page:
            return self.cost.value_density(p, rec.depth, nbytes, tier, formula)
        cache = self._vd_cache
        if cache is None or cache[0] != self._compute.flops_per_s:
            cache = self._vd_cache = (self._compute.flops_per_s, {}, [-1.0, -1.0, -1.0])
        transfer = cache[2]
        if transfer[tier] < 0:
            transfer[tier] = self.cost.transfer_s(tier, nbytes)
        recompute = cache[1].get(rec.depth)
        if recompute is None:
            tokens = rec.tokens
            recompute = cache[1][rec.depth] = self.cost.recompute_s(tokens, rec.depth * tokens)
        if formula == "expected":
            return p * (recompute - transfer[tier]) / nbytes
        return (p * recompute - transfer[tier]) / nbytes

    def admits_nvme(self, rec: PageRec) -> bool:
        """NVMe admission, decided once per admission epoch (τ's period) per page."""
        payoff = self.payoff
        if payoff is not None and payoff.changes != self._payoff_changes:
            self._payoff_changes = payoff.changes
            self.admit_epoch += 1  # a class's gate moved: cached admissions expire
        if rec.admit_epoch == self.admit_epoch:
            return rec.admit_nvme
        seen = self.reuse.seen(rec.key)
        ok = self.admission.admit(rec, NVME, seen, self.tau.tau[NVME])
        if ok and payoff is not None and not rec.retained:
            ok = payoff.admits(seen)
        rec.admit_epoch = self.admit_epoch
        rec.admit_nvme = ok
        return ok

    def explain(
        self, rec: PageRec, now: float, capacity: list[int], bandwidth: dict[str, Bandwidth]
    ) -> str:
        """The numbers behind the valuation of one resident page, in words."""
        lines = [repr(rec)]
        p = self.reuse.p(rec.depth, rec.reused, rec.tag)
        rec_s = self.cost.recompute_s(rec.tokens, rec.depth * rec.tokens)
        lines.append(
            f"  depth {rec.depth}, {rec.tokens} tokens, {rec.nbytes} bytes; "
            f"recompute {rec_s * 1e3:.3f} ms; p(reuse) {p:.3f} "
            f"(class depth~{rec.depth}, reused={rec.reused}, tag={rec.tag!r})"
        )
        tau = self.tau.tau
        for tier in range(3):
            xfer = self.cost.transfer_s(tier, rec.nbytes)
            vd = self.value_density(rec, tier)
            kappa = rec_s / xfer if xfer > 0 else math.inf
            admits = self.admission.admit(rec, tier, 0, tau[tier])
            lines.append(
                f"  {TIER_NAMES[tier]:>4}: load {xfer * 1e3:.3f} ms, kappa {kappa:.2f}, "
                f"VD {vd:.3e} s/B vs tau {tau[tier]:.3e} -> "
                f"{'admit' if admits else 'decline'}"
                f"{'  (resident)' if rec.in_tier(tier) else ''}"
            )
            tier_kappa = self.cost.kappa(tier, self.config.page_bytes)
            if tier and capacity[tier] and tier_kappa < 1.0:
                paths = ", ".join(
                    f"{p} {bandwidth[p].rate / 1e6:.1f} MB/s" for p in LOAD_PATHS[tier]
                )
                lines.append(
                    f"        {TIER_NAMES[tier]} not in use: loading a page is measured "
                    f"slower than recomputing it (kappa {tier_kappa:.3g} < 1: {paths}, "
                    f"C_eff {self._compute.flops_per_s:.3g} FLOP/s); probes re-measure it"
                )
        lines.append(
            f"  last access {now - rec.last_access_s:.3f} s ago, decayed hits "
            f"{rec.hits:.2f}, pins {rec.pins}, retained {rec.retained}, "
            f"demoted {max(now - rec.demoted_at_s, 0):.3f} s ago"
        )
        return "\n".join(lines)
