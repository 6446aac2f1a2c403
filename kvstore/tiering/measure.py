"""The tier manager's measurements: calibration at open, κ against 1, exploration.

Every number that enters the cost model is protected three ways (docs/tiering.md,
"Measurements"): class priors that samples refine and a fit that discards cold samples
and holds outliers (``cost.Bandwidth``); a calibration at open with enough bytes that a
timer tick or one slow copy is noise; and exploration: a tier whose κ < 1 is used by
nothing, so nothing would re-measure it, and its load paths are probed through the
mover until the estimate says otherwise. ``Measurements`` owns the probes' state; the
manager calls it under its lock (``step``) and hands it the probes' completions.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterable, MutableMapping
from typing import Any

from kvstore.errors import KVStoreError
from kvstore.tiering.completions import Probe
from kvstore.tiering.config import TierConfig
from kvstore.tiering.cost import LOAD_PATHS, Bandwidth, Compute, CostModel
from kvstore.tiering.mover_api import Mover, Path, Priority, Ticket
from kvstore.tiering.pages import DRAM, NVME, TIER_NAMES, PageRec, PageState
from kvstore.tiering.policy import EvictionOrder

__all__ = ["PROBE_KEY", "Measurements"]

_log = logging.getLogger("kvstore.tiering")
_READY = PageState.READY
_BACKGROUND = Priority.BACKGROUND

# Exploration: a gated path is probed after this long without a sample, the wait
# doubling (to the cap) while probes confirm the estimate.
_PROBE_FIRST_S = 0.1
_PROBE_MAX_S = 5.0
_CALIBRATE_BYTES = 32 << 20  # per copy path at open: past a CPU's cache, past timer ticks
_CALIBRATE_ROUNDS = 3
_PROBE_REGION_BYTES = 16 << 20  # a copy probe's buffers (per path, while a tier is gated)
PROBE_KEY = b"\x00kvstore-tier-probe"  # the NVMe probe page (no kvt meta: not a page)
# Persisted bandwidth more than this factor off a fresh calibration is not trusted.
_TRUST_FACTOR = 4.0
_READ_CHUNK_PAGES = 8  # as the manager's loads read NVMe


class Measurements:
    """Calibration, κ gates and exploration probes for one ``TierManager``."""

    def __init__(
        self,
        config: TierConfig,
        *,
        bandwidth: dict[str, Bandwidth],
        compute: Compute,
        cost: CostModel,
        mover: Mover,
        store: Any,
        nvme_order: EvictionOrder,
        capacity: list[int],
        slot_bytes: int,
        counters: MutableMapping[str, int],
        fake: bool,
    ) -> None:
        self.config = config
        self.bandwidth = bandwidth
        self.compute = compute
        self.cost = cost
        self.mover = mover
        self.store = store
        self.nvme_order = nvme_order
        self.capacity = capacity
        self.slot_bytes = slot_bytes
        self.counters = counters
        self.fake = fake
        self.gated = [False, False, False]  # per tier: κ < 1 (warned once per tier)
        self.error: str | None = None  # the last calibration or probe failure, for humans
        self._probe_every_s: dict[str, float] = {}
        self._probe_due_s: dict[str, float] = {}
        self._probe_scratch: dict[str, tuple[Any, Any]] = {}
        self._probes_in_flight: set[str] = set()
        self._probe_cursor: dict[str, int] = {}
        self._probe_written = False

    def _bump(self, name: str, by: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + by

    def probe_failed(self, probe: Probe) -> None:
        """A probe's completion raised: the path may be probed again."""
        self._probes_in_flight.discard(probe.path)
        if probe.path == "nvme_write":
            self._probes_in_flight.discard("nvme_read")

    def close(self) -> None:
        """Remove the probe page, if one was written."""
        if self._probe_written and self.store is not None:
            with contextlib.suppress(KVStoreError):
                self.store.delete(PROBE_KEY)

    def calibrate(self, nvme_pages: Iterable[PageRec]) -> None:
        """Fresh copy rates at open, with enough bytes that a timer tick or one slow
        copy is noise: per copy path, rounds of copies of ``_CALIBRATE_BYTES`` each,
        the median round. A configured path is the operator's and is not measured.
        NVMe reads: a few existing pages, replacing a persisted rate only when it is
        more than ``_TRUST_FACTOR`` off (one read is a thin sample; history is not)."""
        configured = self.config.bandwidth_bytes_per_s
        try:
            import torch

            cuda = self.config.device.startswith("cuda")
            # Page-sized copies out of a region larger than a CPU's last-level cache, as
            # the arena's copies are: a cached buffer would time the cache, not DRAM.
            size = max(_CALIBRATE_BYTES // self.slot_bytes, 1) * self.slot_bytes
            host = torch.full((size,), 1, dtype=torch.uint8, pin_memory=cuda)
            other = torch.full((size,), 2, dtype=torch.uint8)  # touched: no first faults
            groups: list[tuple[tuple[str, ...], Any, Any]]
            if cuda:
                dev = torch.full((size,), 3, dtype=torch.uint8, device=self.config.device)
                dev2 = torch.empty_like(dev)
                groups = [(("h2d",), host, dev), (("d2h",), dev, host), (("d2d",), dev, dev2)]
            else:
                # On a CPU device every copy path is the same host memcpy: measured once.
                groups = [(("h2d", "d2h", "d2d", "h2h"), host, other)]
            for names, src, dst in groups:
                wanted = [n for n in names if n not in configured]
                if not wanted:
                    continue
                rate = _median_copy_rate(src, dst, self.slot_bytes, self.config.device)
                if rate is not None:
                    for name in wanted:
                        self.bandwidth[name].set(rate)
        except Exception as e:  # a calibration is a seed: a failure keeps the priors
            self._bump("probe:failures")
            self.error = f"calibration: {e}"
        self._calibrate_nvme_read(nvme_pages)

    def _calibrate_nvme_read(self, nvme_pages: Iterable[PageRec]) -> None:
        if self.store is None or "nvme_read" in self.config.bandwidth_bytes_per_s:
            return
        recs = [r for r in itertools.islice(nvme_pages, 64) if r.nbytes > 0][:8]
        if not recs:
            return
        try:
            import torch

            scratch = [torch.empty(r.nbytes, dtype=torch.uint8) for r in recs]
            arrays = [t.numpy() for t in scratch]
            start = time.perf_counter()
            got = self.store.get_many_into([r.key for r in recs], arrays)
            seconds = time.perf_counter() - start
        except Exception as e:
            self._bump("probe:failures")
            self.error = f"calibration: {e}"
            return
        moved = sum(n for n in got if n)
        if not moved or seconds <= 0:
            return
        fresh = moved / seconds
        fit = self.bandwidth["nvme_read"]
        if not 1 / _TRUST_FACTOR <= fresh / fit.rate <= _TRUST_FACTOR:
            self._bump("restart:nvme_read_recalibrated")
            fit.set(fresh)

    def update_gates(self) -> bool:
        """κ per lower tier against 1: a tier with κ < 1 is not used to load from
        (the plan recomputes) nor, for NVMe, written to; say so once, and let the
        exploration probes re-measure it."""
        changed = False
        for tier in (DRAM, NVME):
            if not self.capacity[tier]:
                continue
            kappa = self.cost.kappa(tier, self.config.page_bytes)
            gated = kappa < 1.0
            if gated == self.gated[tier]:
                continue
            changed = True
            self.gated[tier] = gated
            name = TIER_NAMES[tier]
            rates = ", ".join(
                f"{p} {self.bandwidth[p].rate / 1e6:.1f} MB/s" for p in LOAD_PATHS[tier]
            )
            if gated:
                self._bump(f"gate:{name}:closed")
                if self._bump_once(f"gate:{name}:warned") and not self.fake:
                    _log.warning(
                        "kvstore tier manager: loading from %s is measured slower than "
                        "recomputing (kappa %.3g: %s, compute %.3g FLOP/s); %s is not used "
                        "for loads%s until a re-measurement says otherwise (probed every "
                        "%.2g-%.0f s)",
                        name,
                        kappa,
                        rates,
                        self.compute.flops_per_s,
                        name,
                        " or writes" if tier == NVME else "",
                        _PROBE_FIRST_S,
                        _PROBE_MAX_S,
                    )
            else:
                self._bump(f"gate:{name}:opened")
                if not self.fake:
                    _log.info("kvstore tier manager: %s is in use again (kappa %.3g)", name, kappa)
        if self._probe_scratch and not any(self.gated) and not self._probes_in_flight:
            self._probe_scratch.clear()  # probe buffers live only while a tier is gated
        return changed

    def _bump_once(self, name: str) -> bool:
        if self.counters.get(name):
            return False
        self.counters[name] = 1
        return True

    def explore(self, now: float) -> None:
        """Probe the load paths of each gated tier that nothing measured lately: a copy
        of scratch buffers, or a read of one NVMe page (the probe page, written once,
        where NVMe holds none). The wait between probes doubles while they confirm
        the estimate, and starts over when one moves it."""
        if self.fake:
            return
        for tier in (DRAM, NVME):
            if not self.gated[tier]:
                continue
            for name in LOAD_PATHS[tier]:
                if name in self._probes_in_flight or name in self.config.bandwidth_bytes_per_s:
                    continue
                fit = self.bandwidth[name]
                every = self._probe_every_s.get(name, _PROBE_FIRST_S)
                if now - fit.last_sample_s < every or now < self._probe_due_s.get(name, 0.0):
                    continue
                try:
                    started = self._submit_probe(name)
                except Exception as e:  # a probe must never take the control loop down
                    self._bump("probe:failures")
                    self.error = f"probe {name}: {e}"
                    started = False
                self._probe_due_s[name] = now + every
                if started:
                    self._bump("probe:" + name)

    def _submit_probe(self, name: str) -> bool:
        size = self.slot_bytes
        if name == "nvme_read":
            # A read as a load does it: a chunk of pages in one ticket (queue depth,
            # not one page's latency), of full pages NVMe holds, else the probe page.
            if self.store is None:
                return False
            page = self.config.page_bytes
            # A few leaves from the order's head (a bounded scan; nothing is removed).
            picked = self.nvme_order.victims(
                _READ_CHUNK_PAGES,
                lambda r: r.state is _READY and r.nbytes == page,
                4 * _READ_CHUNK_PAGES,
            )
            keys = [r.key for r in picked]
            scratch = self._scratch("nvme", size * _READ_CHUNK_PAGES)[0]
            if not keys:
                if not self._probe_written:
                    self.mover.nvme_write(
                        self.store,
                        [(PROBE_KEY, scratch[:page], None)],
                        priority=_BACKGROUND,
                        tag=Probe("nvme_write", self.bandwidth["nvme_read"].rate),
                    )
                    self._probes_in_flight.add("nvme_read")
                    return True
                keys = [PROBE_KEY] * _READ_CHUNK_PAGES
            self.mover.nvme_read(
                self.store,
                keys,
                [scratch[i * size : i * size + page] for i in range(len(keys))],
                priority=_BACKGROUND,
                tag=Probe(name, self.bandwidth[name].rate),
            )
        else:
            # Page-sized copies, at least 1 MiB a probe, walking through a region
            # larger than a CPU's cache (as the arena's copies do): one buffer copied
            # again and again would time the cache.
            slots = max(_PROBE_REGION_BYTES // size, 1)
            src, dst = self._scratch(name, slots * size)
            reps = min(max(1, (1 << 20) // size), slots)
            first = self._probe_cursor.get(name, 0)
            pairs = []
            for i in range(reps):
                at = (first + i) % slots * size
                pairs.append((src[at : at + size], dst[at : at + size]))
            self._probe_cursor[name] = (first + reps) % slots
            self.mover.copy(
                Path(name), pairs, priority=_BACKGROUND, tag=Probe(name, self.bandwidth[name].rate)
            )
        self._probes_in_flight.add(name)
        return True

    def _scratch(self, name: str, size: int) -> tuple[Any, Any]:
        """Probe buffers per path, allocated at the first probe and kept."""
        pair = self._probe_scratch.get(name)
        if pair is None:
            import torch

            cuda = self.config.device.startswith("cuda")
            device = self.config.device
            host = torch.full((size,), 1, dtype=torch.uint8, pin_memory=cuda)
            if name == "nvme":
                pair = (host, host)
            elif cuda and name == "h2d":
                pair = (host, torch.empty(size, dtype=torch.uint8, device=device))
            elif cuda and name == "d2h":
                pair = (torch.full((size,), 1, dtype=torch.uint8, device=device), host)
            elif cuda and name == "d2d":
                src = torch.full((size,), 1, dtype=torch.uint8, device=device)
                pair = (src, torch.empty_like(src))
            else:
                pair = (host, torch.full((size,), 2, dtype=torch.uint8))
            self._probe_scratch[name] = pair
        return pair

    def probe_done(self, ticket: Ticket, name: str, rate_before: float) -> None:
        if name == "nvme_write":
            self._probes_in_flight.discard("nvme_read")
            if ticket.error is None and ticket.results and ticket.results[0]:
                self._probe_written = True
                self._probe_due_s["nvme_read"] = 0.0  # read it back at the next cycle
            return
        self._probes_in_flight.discard(name)
        if ticket.error is not None:
            self._bump("probe:failures")
            return
        # What this probe measured against what the estimate says: a probe that
        # agrees lets the next wait double; one that disagrees (held by the fit as an
        # outlier until others confirm it, or discarded as a cold sample) or that
        # moved the estimate brings the next probe soon.
        seconds = ticket.seconds()
        rate = self.bandwidth[name].rate
        measured = ticket.moved_bytes / seconds if seconds and seconds > 0 else rate
        every = self._probe_every_s.get(name, _PROBE_FIRST_S)
        if 0.5 <= rate / rate_before <= 2.0 and 0.5 <= measured / rate <= 2.0:
            self._probe_every_s[name] = min(every * 2, _PROBE_MAX_S)
        else:
            self._probe_every_s[name] = _PROBE_FIRST_S


def _median_copy_rate(src: Any, dst: Any, page: int, device: str) -> float | None:
    """Bytes/s of copying ``src`` into ``dst`` one ``page`` at a time: the median of
    a few rounds, after one untimed round (first-touch faults, lazy CUDA init).
    ``device``: the CUDA device to synchronize (the one the copies run on, whichever
    side of the copy is on the host), or "cpu"."""
    import torch

    cuda = device.startswith("cuda")

    pairs = [
        (src[offset : offset + page], dst[offset : offset + page])
        for offset in range(0, src.numel() - page + 1, page)
    ]
    rates = []
    for round_ in range(_CALIBRATE_ROUNDS + 1):
        start = time.perf_counter()
        for s, d in pairs:
            d.copy_(s, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        if round_ and seconds > 0:
            rates.append(page * len(pairs) / seconds)
    if not rates:
        return None
    rates.sort()
    return float(rates[len(rates) // 2])
