"""Reference models of the peers' tiering policies, for trace comparison.

Each class models one peer over three tiers (0 HBM, 1 DRAM, 2 NVMe) with
capacities in blocks; a tier of capacity 0 is absent. Tier 0 in every peer is
the engine's GPU prefix cache: an LRU over blocks, like vLLM's block_pool free
queue or SGLang's radix cache. The models are written from the peers' code
(named in each docstring) and are a few dozen lines each: they keep what
decides hits and NVMe writes, and drop timing, concurrency and sizes.

Fixed semantics, the same in every model so results compare across tools
(``PeerPolicy.request``):

1. The prefix hit is the run of leading blocks resident in some tier, stopping
   at the first block in none; each is counted in the tier it is served from
   (the highest holding it), all decided before anything moves.
2. The peer's hit actions run (promotion, write-back into DRAM).
3. Every block of the request is offered as computed, in order (parent = the
   previous block), and placed per the peer's policy.
4. Recency: the request's blocks become the most recent in every tier that
   holds them, the leading block most recent of all, so chains are evicted
   from the tail first (vLLM frees a request's blocks in reverse order for the
   same reason; SGLang evicts leaves first).

``nvme_blocks_written`` counts block writes to NVMe, the wear metric.
"""

from __future__ import annotations

import abc
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvstore.tiering.sim.trace import Request

__all__ = [
    "PEER_MODELS_VERSION",
    "POLICIES",
    "PeerPolicy",
    "PeerResult",
    "make_peer",
    "replay_peer",
]

HBM, DRAM, NVME = 0, 1, 2
# Raised whenever a peer model's decisions change: a suite's saved peer results
# (``kvstore sim --suite --peers-from``) are reused only under the same version.
PEER_MODELS_VERSION = 1


class _LRU:
    """Blocks in recency order, oldest first; ``insert`` returns the block it pushed out.

    A capacity of 0 holds nothing: inserting returns the block itself, so a
    caller can tell "stored" (victim is not the block) from "not stored".
    """

    __slots__ = ("capacity", "entries")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def touch(self, block: int) -> None:
        if block in self.entries:
            self.entries.move_to_end(block)

    def insert(self, block: int) -> int | None:
        entries = self.entries
        if block in entries:
            entries.move_to_end(block)
            return None
        if self.capacity == 0:
            return block
        entries[block] = None
        if len(entries) > self.capacity:
            return entries.popitem(last=False)[0]
        return None

    def remove(self, block: int) -> None:
        self.entries.pop(block, None)


class PeerPolicy(abc.ABC):
    """One peer's placement over (hbm, dram, nvme) with capacities in blocks."""

    name: ClassVar[str]

    def __init__(self, capacity_blocks: tuple[int, int, int]) -> None:
        if len(capacity_blocks) != 3 or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in capacity_blocks
        ):
            raise ValueError(
                f"capacity_blocks must be three integers >= 0 (hbm, dram, nvme), "
                f"got {capacity_blocks!r}"
            )
        self.capacity_blocks = (capacity_blocks[0], capacity_blocks[1], capacity_blocks[2])
        self.nvme_blocks_written = 0
        self.hbm = _LRU(capacity_blocks[0])
        self.dram = _LRU(capacity_blocks[1])
        self.nvme = _LRU(capacity_blocks[2])

    def resident(self, block: int) -> int | None:
        """The tier a hit on ``block`` would be served from, or None."""
        if block in self.hbm:
            return HBM
        if block in self.dram:
            return DRAM
        if block in self.nvme:
            return NVME
        return None

    def request(self, blocks: Sequence[int], now_s: float) -> tuple[int, int, int]:
        """Serve one request under the fixed semantics; returns its hits per tier."""
        served: list[int] = []
        for block in blocks:
            tier = self.resident(block)
            if tier is None:
                break
            served.append(tier)
        self._start(blocks, served, now_s)
        for block, tier in zip(blocks, served, strict=False):
            self._hit(block, tier)
        for block in blocks:
            self._place(block)
        self._refresh(blocks)
        return served.count(HBM), served.count(DRAM), served.count(NVME)

    def _start(self, blocks: Sequence[int], served: list[int], now_s: float) -> None:
        """Per-request bookkeeping before hits are applied (clocks, counters)."""
        return  # most peers keep none

    @abc.abstractmethod
    def _hit(self, block: int, tier: int) -> None:
        """What the peer does for a hit served from ``tier``."""

    @abc.abstractmethod
    def _place(self, block: int) -> None:
        """Place one block of the request, offered as computed."""

    def _refresh(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):
            self.hbm.touch(block)
            self.dram.touch(block)
            self.nvme.touch(block)

    def _write_nvme(self, block: int) -> None:
        """Write ``block`` to NVMe (if there is one); its LRU victim is dropped."""
        if self.nvme.capacity > 0:
            self.nvme_blocks_written += 1
            self.nvme.insert(block)


class Infinite(PeerPolicy):
    """An unbounded cache: every block seen before hits, served from HBM; no writes."""

    name = "infinite"

    def __init__(self, capacity_blocks: tuple[int, int, int]) -> None:
        super().__init__(capacity_blocks)
        self.seen: set[int] = set()

    def resident(self, block: int) -> int | None:
        return HBM if block in self.seen else None

    def _hit(self, block: int, tier: int) -> None:
        pass

    def _place(self, block: int) -> None:
        self.seen.add(block)

    def _refresh(self, blocks: Sequence[int]) -> None:
        pass


class Recompute(PeerPolicy):
    """No cache at all: nothing hits, nothing is written."""

    name = "recompute"

    def resident(self, block: int) -> int | None:
        return None

    def _hit(self, block: int, tier: int) -> None:
        pass

    def _place(self, block: int) -> None:
        pass

    def _refresh(self, blocks: Sequence[int]) -> None:
        pass


class VLLM(PeerPolicy):
    """vLLM's OffloadingConnector with the tiering manager: CPU primary, NVMe secondary.

    From vllm/v1/kv_offload/tiering/manager.py (TieringOffloadingManager: "when
    a block is stored to the primary tier, it is cascaded to ALL secondary
    tiers"; a secondary hit is promoted into the CPU tier first),
    cpu/policies/lru.py (CPU LRU), tiering/fs/manager.py (submit_store writes
    every key it is given), reuse_manager.py (``store_threshold``: a block is
    stored only after ``lookup`` has seen it that many times, counts in an LRU
    table of 64,000 entries) and v1/core/block_pool.py (GPU prefix cache LRU).

    Each offered block not already in CPU is stored there (if it passes the
    threshold) and then written to NVMe, even if NVMe still has it: the FS tier
    does not check. A promotion into CPU is not cascaded. The GPU cache and
    the CPU tier drop their LRU victims (copies were made at store time).
    Without a CPU tier nothing reaches NVMe (CPU is the gateway). Simplified:
    lookups count every block past the GPU hit; no async jobs, no pressure
    watermarks of the Ascend fork; a promotion into a full CPU tier evicts
    (vLLM may refuse it); the NVMe tier is an LRU of its capacity.
    """

    name = "vllm"
    store_threshold: ClassVar[int] = 0
    max_tracker_size: ClassVar[int] = 64_000

    def __init__(self, capacity_blocks: tuple[int, int, int]) -> None:
        super().__init__(capacity_blocks)
        self.lookups: OrderedDict[int, int] = OrderedDict()

    def _start(self, blocks: Sequence[int], served: list[int], now_s: float) -> None:
        if not self.store_threshold:
            return
        gpu_hits = 0
        while gpu_hits < len(served) and served[gpu_hits] == HBM:
            gpu_hits += 1
        lookups = self.lookups
        for block in blocks[gpu_hits:]:
            if block in lookups:
                lookups.move_to_end(block)
                lookups[block] += 1
            else:
                if len(lookups) >= self.max_tracker_size:
                    lookups.popitem(last=False)
                lookups[block] = 1

    def _hit(self, block: int, tier: int) -> None:
        if tier == NVME:
            self.dram.insert(block)

    def _place(self, block: int) -> None:
        self.hbm.insert(block)
        if block in self.dram:
            return
        if self.store_threshold and self.lookups.get(block, 0) < self.store_threshold:
            return
        if self.dram.insert(block) != block:
            self._write_nvme(block)


class VLLMThreshold2(VLLM):
    """vLLM as above with ``store_threshold`` 2 (FilterReusedOffloadingManager)."""

    name = "vllm-threshold2"
    store_threshold = 2


class LMCache(PeerPolicy):
    """LMCache v1: every chunk put to every backend, each an LRU of its own.

    From lmcache/v1/storage_backend/storage_manager.py (``batched_put`` submits
    to every backend; a backend skips a key it already holds;
    ``batched_get`` searches LocalCPUBackend first and writes a hit from a
    lower backend back into LocalCPUBackend), local_cpu_backend.py and
    local_disk_backend.py (LRU cache policy by default). Simplified: every
    offered block is put to each backend lacking it (LMCache's store mask
    skips the engine's prefix hit instead, so a hit block a backend has lost is
    not put back there); no async put queue, no chunk/token rounding; lookups
    and hits refresh recency in every tier as in the fixed semantics.
    """

    name = "lmcache"

    def _hit(self, block: int, tier: int) -> None:
        if tier == NVME:
            self.dram.insert(block)

    def _place(self, block: int) -> None:
        self.hbm.insert(block)
        if block not in self.dram:
            self.dram.insert(block)
        if block not in self.nvme:
            self._write_nvme(block)


class SGLangWriteThrough(PeerPolicy):
    """SGLang HiCache: device radix tree, host pool (L2), storage backend (L3).

    From python/sglang/srt/mem_cache/hiradix_cache.py and
    managers/cache_controller.py. A block is a radix node. Each request's
    insert bumps ``hit_count`` of every node on its path (new and device
    resident ones); a node not yet backed up is written to host when
    ``hit_count >= write_through_threshold`` (1 for write_through, 2 for
    write_through_selective), and once on host it goes on to L3 (the storage
    backup runs on every completed host write; keys L3 already has are
    skipped). Host eviction (``evict_host``) takes only nodes already evicted
    from the device, least recently used first; a node leaving both device and
    host leaves the tree with its count. A device eviction of a backed-up node
    keeps the host copy; of one not backed up drops it, except under
    write_back, which writes it to host (and so to L3) first. An L3 hit is
    prefetched into host, then loaded to the device. Simplified: per-block
    nodes, no locks, prefetch/load-back thresholds and rate limits ignored; an
    L3 hit whose prefetch finds host full is still counted as an L3 hit (then
    recomputed into the device); L3 is an LRU of its capacity (SGLang leaves L3
    eviction to the backend).
    """

    name = "sglang-write-through"
    write_through_threshold: ClassVar[int] = 1
    write_back: ClassVar[bool] = False

    def __init__(self, capacity_blocks: tuple[int, int, int]) -> None:
        super().__init__(capacity_blocks)
        self.host_shared: set[int] = set()  # on host and on the device
        self.host_only: OrderedDict[int, None] = OrderedDict()  # evictable, LRU first
        self.hit_count: dict[int, int] = {}

    def resident(self, block: int) -> int | None:
        if block in self.hbm:
            return HBM
        if block in self.host_only:
            return DRAM
        if block in self.nvme:
            return NVME
        return None

    def _hit(self, block: int, tier: int) -> None:
        if tier == NVME:
            self._host_write(block, on_device=False)

    def _place(self, block: int) -> None:
        if block in self.hbm:
            self.hbm.touch(block)
            self._inc_hit_count(block)
            return
        # A node evicted from the device but kept on host is re-pointed at
        # the new device copy (loaded back or recomputed); its count stays.
        kept_on_host = block in self.host_only
        if kept_on_host:
            del self.host_only[block]
            self.host_shared.add(block)
        else:
            self.hit_count[block] = 0
        victim = self.hbm.insert(block)
        if victim is not None:
            self._evict_device(victim)
        if not kept_on_host and block in self.hbm:
            self._inc_hit_count(block)

    def _inc_hit_count(self, block: int) -> None:
        if self.write_back or block not in self.hbm:
            return
        count = self.hit_count.get(block, 0) + 1
        self.hit_count[block] = count
        if block not in self.host_shared and count >= self.write_through_threshold:
            self._backup(block, on_device=True)

    def _backup(self, block: int, *, on_device: bool) -> None:
        if self._host_write(block, on_device=on_device) and block not in self.nvme:
            self._write_nvme(block)

    def _host_write(self, block: int, *, on_device: bool) -> bool:
        capacity = self.dram.capacity
        if capacity == 0:
            return False
        if len(self.host_shared) + len(self.host_only) >= capacity:
            if not self.host_only:
                return False
            victim = self.host_only.popitem(last=False)[0]
            self.hit_count.pop(victim, None)
        if on_device:
            self.host_shared.add(block)
        else:
            self.host_only[block] = None
        return True

    def _evict_device(self, victim: int) -> None:
        if victim in self.host_shared:
            self.host_shared.discard(victim)
            self.host_only[victim] = None
        elif self.write_back:
            self._backup(victim, on_device=False)
        else:
            self.hit_count.pop(victim, None)

    def _refresh(self, blocks: Sequence[int]) -> None:
        host_only = self.host_only
        for block in reversed(blocks):
            self.hbm.touch(block)
            if block in host_only:
                host_only.move_to_end(block)
            self.nvme.touch(block)


class SGLangSelective(SGLangWriteThrough):
    """SGLang HiCache with ``write_through_selective`` (threshold 2); see the base class."""

    name = "sglang-selective"
    write_through_threshold = 2


class SGLangWriteBack(SGLangWriteThrough):
    """SGLang HiCache with ``write_back``: host (and L3) written only on device eviction."""

    name = "sglang-write-back"
    write_back = True


class Dynamo(PeerPolicy):
    """Dynamo KVBM: G1 device, G2 host, G3 disk, offload on registration.

    From lib/llm/src/block_manager/offload.rs (a registered device block is
    offloaded to host, a registered host block to disk; skipped when the
    target already has it, when the frequency filter says no, or when the
    target has no room), offload/filter.rs (FrequencyFilter: each
    ``should_offload`` doubles the block's count, or sets it to 1; offload at
    count >= 2; every flush interval all counts drop by 1 and zeros are
    pruned) and bindings/kvbm/src/block_manager.rs (threshold 2, 600 s, 1e6
    entries). So a block reaches disk on its second host registration within
    the decay window. An onboarded block is registered again on the device,
    so a disk hit re-enters host (onboarding from disk goes straight to the
    device). Simplified: the decay clock ticks on trace time from the first
    request; pools are LRUs; without a host pool nothing reaches disk.
    """

    name = "dynamo"
    frequency_threshold: ClassVar[int] = 2
    flush_interval_s: ClassVar[float] = 600.0
    max_num_entries: ClassVar[int] = 1_000_000

    def __init__(self, capacity_blocks: tuple[int, int, int]) -> None:
        super().__init__(capacity_blocks)
        self.frequency: dict[int, int] = {}
        self.next_decay_s: float | None = None

    def _start(self, blocks: Sequence[int], served: list[int], now_s: float) -> None:
        if self.next_decay_s is None:
            self.next_decay_s = now_s + self.flush_interval_s
        elif now_s >= self.next_decay_s:
            ticks = int((now_s - self.next_decay_s) // self.flush_interval_s) + 1
            self.next_decay_s += ticks * self.flush_interval_s
            self._decay(ticks)

    def _decay(self, ticks: int) -> None:
        self.frequency = {b: c - ticks for b, c in self.frequency.items() if c > ticks}

    def _should_offload(self, block: int) -> bool:
        count = self.frequency.get(block, 0) * 2 or 1
        self.frequency[block] = count
        while len(self.frequency) > self.max_num_entries:
            self._decay(1)
        return count >= self.frequency_threshold

    def _hit(self, block: int, tier: int) -> None:
        pass

    def _place(self, block: int) -> None:
        if block in self.hbm:
            self.hbm.touch(block)
            return
        self.hbm.insert(block)
        if block in self.dram or self.dram.insert(block) == block:
            return
        if self.nvme.capacity > 0 and block not in self.nvme and self._should_offload(block):
            self._write_nvme(block)


class Mooncake(PeerPolicy):
    """Mooncake Store as the engine's DRAM pool, with offload to SSD on evict.

    From mooncake-store/src/master_service.cpp (EvictionThreadFunc: when the
    memory used ratio exceeds ``eviction_high_watermark_ratio`` 0.90, or a put
    found no room, BatchEvict evicts ceil(evictable objects * max(0.05,
    used - 0.90 + 0.05)) objects, earliest lease timeout first; with
    offload-on-evict an object without a local disk replica is queued to SSD,
    one with a replica is just dropped) and include/types.h (the defaults).
    Every computed block is put (a key already present is not rewritten). An
    SSD hit is promoted back into memory; the SSD copy stays. Simplified:
    leases are LRU order; eviction runs right after the put that crossed the
    watermark; one replica; the SSD tier is an LRU of its capacity.
    """

    name = "mooncake"
    high_watermark: ClassVar[float] = 0.90
    evict_ratio: ClassVar[float] = 0.05

    def _hit(self, block: int, tier: int) -> None:
        if tier == NVME:
            self._put(block)

    def _place(self, block: int) -> None:
        self.hbm.insert(block)
        if block not in self.dram:
            self._put(block)

    def _put(self, block: int) -> None:
        capacity = self.dram.capacity
        if capacity == 0:
            return
        if len(self.dram) >= capacity:
            self._batch_evict()
        self.dram.insert(block)
        if len(self.dram) / capacity > self.high_watermark:
            self._batch_evict()

    def _batch_evict(self) -> None:
        entries = self.dram.entries
        used = len(entries) / self.dram.capacity
        target = max(self.evict_ratio, used - self.high_watermark + self.evict_ratio)
        for _ in range(min(len(entries), math.ceil(len(entries) * target))):
            victim = entries.popitem(last=False)[0]
            if victim not in self.nvme:
                self._write_nvme(victim)


class ExclusiveLRU(PeerPolicy):
    """Tiered LRU: each block in exactly one tier, demoted on eviction.

    When L0 is full its LRU page is demoted to L1 rather than dropped; when L1 is
    full, to L2; L2 drops its LRU. A hit in a
    lower tier moves the block up to HBM. NVMe is written only by a DRAM
    demotion. Simplified: no hysteresis, no pins; an absent tier passes a
    demoted block straight to the next one.
    """

    name = "exclusive-lru"

    def _hit(self, block: int, tier: int) -> None:
        pass  # the promotion is the move into HBM in _place

    def _place(self, block: int) -> None:
        # Moving up leaves the lower tier (a block past the first miss may
        # sit in one too).
        self.dram.remove(block)
        self.nvme.remove(block)
        victim = self.hbm.insert(block)
        if victim is None:
            return
        victim = self.dram.insert(victim)
        if victim is not None:
            self._write_nvme(victim)


POLICIES: dict[str, type[PeerPolicy]] = {
    cls.name: cls
    for cls in (
        VLLM,
        VLLMThreshold2,
        LMCache,
        SGLangWriteThrough,
        SGLangSelective,
        SGLangWriteBack,
        Dynamo,
        Mooncake,
        ExclusiveLRU,
        Infinite,
        Recompute,
    )
}


def make_peer(name: str, capacity_blocks: tuple[int, int, int]) -> PeerPolicy:
    """The named peer model with these capacities; ValueError lists the known names."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown peer policy {name!r}; known: {', '.join(POLICIES)}")
    return cls(capacity_blocks)


@dataclass(frozen=True, slots=True)
class PeerResult:
    """One peer's replay of a trace; ``per_request_hits`` is (hbm, dram, nvme) per request."""

    policy: str
    hit_blocks_by_tier: tuple[int, int, int]
    block_accesses: int
    nvme_blocks_written: int
    per_request_hits: list[tuple[int, int, int]]

    @property
    def hit_ratio(self) -> float:
        """Hit blocks over block accesses (0 for an empty trace)."""
        hits = sum(self.hit_blocks_by_tier)
        return hits / self.block_accesses if self.block_accesses else 0.0


def replay_peer(policy: PeerPolicy, requests: Sequence[Request]) -> PeerResult:
    """Run every request through ``policy`` in order and total its hits."""
    per_request: list[tuple[int, int, int]] = []
    hbm = dram = nvme = accesses = 0
    for request in requests:
        hits = policy.request(request.blocks, request.timestamp_s)
        per_request.append(hits)
        hbm += hits[0]
        dram += hits[1]
        nvme += hits[2]
        accesses += len(request.blocks)
    return PeerResult(
        policy.name, (hbm, dram, nvme), accesses, policy.nvme_blocks_written, per_request
    )
