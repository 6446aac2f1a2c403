"""What the tier manager moves bytes with: the mover, the slot pools, the copies, NVMe.

``open_backends`` is the one place that tells real memory from the simulator's
(``mover="fake"``, docs/tiering.md, "The simulator"): real arenas, a threaded mover
and a ``KVStore``; or virtual slots, the fake mover on a virtual clock, and the
sized twins of the copies and the NVMe tier. Above it, the manager's components
make the same calls either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from kvstore.tiering.arena import Arena, SlotPool, VirtualSlots
from kvstore.tiering.config import TierConfig
from kvstore.tiering.copies import Copies, SimulatedCopies
from kvstore.tiering.cost import Bandwidth, make_bandwidths
from kvstore.tiering.fake_mover import FakeMover, VirtualClock
from kvstore.tiering.mover import make_mover
from kvstore.tiering.mover_api import Mover, Path
from kvstore.tiering.nvme import NvmeTier, open_nvme

__all__ = ["Backends", "open_backends"]

_WARMUP_SAMPLES = 2  # a real mover's first samples per path, discarded


class Backends(NamedTuple):
    bandwidth: dict[str, Bandwidth]  # the fitted rate and latency per path
    mover: Mover
    clock: VirtualClock | None  # the simulator's virtual clock; None: real time
    hbm: SlotPool  # owned HBM's slots (a pool of none without owned HBM)
    dram: SlotPool
    copies: Copies
    nvme: NvmeTier
    simulated: bool


def open_backends(
    config: TierConfig, *, priors: Mapping[str, float], slot_bytes: int, owned_hbm: bool
) -> Backends:
    """The backends ``config`` asks for; the caller closes ``mover`` and ``nvme``."""
    simulated = config.mover == "fake"
    # A real mover's first copies of each path are cold (page faults, thread
    # start): discarded. The fake mover's timings are exact.
    bandwidth = make_bandwidths(
        config.bandwidth_bytes_per_s,
        config.latency_s,
        priors=priors,
        warmup=0 if simulated else _WARMUP_SAMPLES,
    )
    clock: VirtualClock | None = None
    mover: Mover
    hbm: SlotPool = VirtualSlots(0, slot_bytes)
    dram: SlotPool
    if simulated:
        clock = VirtualClock()
        if config.clock is not None:
            clock.set(config.clock())
        mover = FakeMover(
            {Path(p): b.rate for p, b in bandwidth.items()},
            {Path(p): b.latency_s for p, b in bandwidth.items()},
            clock,
        )
        if owned_hbm:
            hbm = VirtualSlots(config.hbm_bytes // slot_bytes, slot_bytes)
        dram = VirtualSlots(config.dram_bytes // slot_bytes, slot_bytes)
        copies: Copies = SimulatedCopies(mover, hbm, dram)
    else:
        mover = make_mover(config.mover, config.device)
        try:
            if owned_hbm:
                hbm = Arena(config.hbm_bytes, slot_bytes, config.device, name="hbm")
            pin = config.device.startswith("cuda")
            dram = Arena(config.dram_bytes, slot_bytes, "cpu", pin=pin, name="dram")
        except BaseException:
            mover.close()
            raise
        copies = Copies(mover, hbm, dram)
    try:
        nvme = open_nvme(config, mover, slot_bytes, simulated=simulated)
    except BaseException:
        mover.close()
        raise
    return Backends(bandwidth, mover, clock, hbm, dram, copies, nvme, simulated)
