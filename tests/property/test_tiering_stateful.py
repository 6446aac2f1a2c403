"""The tier manager against a model, under random offer/lookup/load/pin/step/reopen.

A real NVMe store in a temporary directory, ``device="cpu"`` and tiny tiers (HBM 3
slots, DRAM 6 slots, 16 KiB pages, low watermarks) so pages flow down to NVMe and
back within a few steps. Keys form three chains of six pages; offers send a run of
a chain with its parent links, so prefix closure is exercised on every offer.

The model is ``key -> bytes``: the bytes the manager holds for a resident page.
Keys are content hashes to the manager (an offer of a present page may copy the
offered bytes into HBM beside the old copy), so while the model holds a key it is
offered again with the model's bytes; only a key gone from every tier is offered
with new bytes (and a new size). A key offered while resident is "present"; a key
offered while absent is admitted with the offered bytes or declined. Whether a key is
resident is asked of the manager (``pin`` answers False for a page in no tier,
and a successful pin is undone at once); a model key found absent was dropped
and leaves the model. Checked after every step:

- per tier, used bytes <= capacity bytes;
- a resident key is in the model (nothing resurrects, nothing appears unoffered);
- a page pinned with ``pin``, and a page an unfinished load still waits for, stays
  resident and loses no tier (white-box: ``tm._pages``);
- every completed load yields exactly the model's bytes, as of ``prepare_load``;
- no orphan is admitted: an admitted page's parent was resident before the offer
  or admitted / present earlier in the same batch;
- after ``drain``, the NVMe tier's page count is the store's key count.

Close-and-reopen keeps exactly the pages the store holds (asked with
``store.info`` before the close) and nothing else.

Two machines: admission ``all`` and the default ``value_density``. Set
KVSTORE_TIER_EXAMPLES (default 20) for a longer soak.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import ClassVar

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore.tiering import LoadHandle, ModelCost, TierConfig, TierManager

PAGE = 16 * 1024
CHAINS = 3
CHAIN_PAGES = 6
SMALL_MODEL = ModelCost(1e9, 8, 8, 64, PAGE // 16)


def chain_key(chain: int, position: int) -> bytes:
    return f"c{chain}p{position}".encode()


ALL_KEYS = [chain_key(c, p) for c in range(CHAINS) for p in range(CHAIN_PAGES)]
SIZES = st.sampled_from([PAGE, PAGE, 4096, 10_000, 1])

SETTINGS = settings(
    max_examples=int(os.environ.get("KVSTORE_TIER_EXAMPLES", "20")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def page_bytes(key: bytes, version: int, size: int) -> bytes:
    """Distinct bytes per (key, version): any bytes a load returns can be named."""
    return random.Random(f"{key!r}/{version}").randbytes(size)


Load = tuple[LoadHandle, list[bytes], list[torch.Tensor], list[bytes]]


class TierMachine(RuleBasedStateMachine):
    """The rules; subclasses choose the admission mode."""

    admission: ClassVar[str] = "all"

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="kvstore-tier-stateful-"))
        self.model: dict[bytes, bytes] = {}
        self.pinned: dict[bytes, int] = {}  # key -> tier bits when first pinned
        # Unfinished loads: the handle, its keys, destinations and expected bytes.
        self.loads: list[Load] = []
        self.sources: list[torch.Tensor] = []  # kept alive until the copies land (R2)
        self.version = 0
        self.tm = self.open()

    def open(self) -> TierManager:
        return TierManager.open(
            TierConfig(
                device="cpu",
                hbm_bytes=3 * PAGE,
                dram_bytes=6 * PAGE,
                page_bytes=PAGE,
                tokens_per_page=16,
                nvme_path=str(self.directory / "nvme"),
                nvme_options={"segment_bytes": 1 << 20, "gc_interval_s": 0},
                model=SMALL_MODEL,
                compute_flops=1e11,  # slow: by the seeded bandwidths, loading wins everywhere
                admission=self.admission,
                hysteresis_s=0.0,
                watermark_low=0.3,
                watermark_warn=0.5,
                watermark_force=0.7,
                probe_at_open=False,
                control_interval_s=0,  # the rules drive step(): one thread of control
                warm_dram_on_open=False,
            )
        )

    # -- helpers -------------------------------------------------------------

    def resident(self, key: bytes) -> bool:
        """Ask the manager, without moving anything: a pin succeeds only if resident."""
        if self.tm.pin([key]) == [True]:
            self.tm.unpin([key])
            return True
        return False

    def quiesce(self) -> None:
        """Let the mover finish what is queued, without harvesting it: the rule that
        follows then sees every earlier completion, whatever the threads' timing, so
        an example replays the same way (hypothesis needs that to shrink)."""
        deadline = time.monotonic() + 10
        while self.tm._mover.in_flight_bytes() > 0:
            assert time.monotonic() < deadline, "the mover never went idle"
            time.sleep(0.0005)

    def tier_bits(self, key: bytes) -> int:
        rec = self.tm._pages.get(key)
        return 0 if rec is None else rec.tiers

    def forget_absent(self) -> None:
        """Model keys the manager no longer holds were dropped (a cache may drop)."""
        for key in list(self.model):
            if not self.resident(key):
                assert key not in self.pinned, f"{key!r} dropped while pinned"
                del self.model[key]

    # -- rules ---------------------------------------------------------------

    @rule(
        chain=st.integers(0, CHAINS - 1),
        length=st.integers(1, 4),
        sizes=st.lists(SIZES, min_size=4, max_size=4),
    )
    def extend_chain(self, chain: int, length: int, sizes: list[int]) -> None:
        """What an engine does: offer the pages after the chain's resident prefix."""
        self.quiesce()
        start = 0
        while start < CHAIN_PAGES and self.resident(chain_key(chain, start)):
            start += 1
        if start < CHAIN_PAGES:
            self.offer(chain, start, length, sizes)

    @rule(
        chain=st.integers(0, CHAINS - 1),
        start=st.integers(0, CHAIN_PAGES - 1),
        length=st.integers(1, 4),
        sizes=st.lists(SIZES, min_size=4, max_size=4),
    )
    def offer(self, chain: int, start: int, length: int, sizes: list[int]) -> None:
        """Any run of a chain: its first page may be present, absent or an orphan."""
        self.quiesce()
        end = min(start + length, CHAIN_PAGES)
        keys = [chain_key(chain, p) for p in range(start, end)]
        parents: list[bytes | None] = [
            chain_key(chain, p - 1) if p else None for p in range(start, end)
        ]
        before = {p: self.resident(p) for p in parents if p is not None and p not in keys}
        self.version += 1
        values = [
            self.model.get(k) or page_bytes(k, self.version, s)
            for k, s in zip(keys, sizes, strict=False)
        ]
        srcs = [torch.frombuffer(bytearray(v), dtype=torch.uint8) for v in values]
        self.sources.extend(srcs)
        out = self.tm.offer(keys, srcs, parents=parents)
        kept: set[bytes] = set()
        for key, parent, value, tier, reason in zip(
            keys, parents, values, out.tiers, out.reasons, strict=True
        ):
            if reason == "present":
                assert key in self.model, f"{key!r} present but never admitted"
                assert tier is not None
                kept.add(key)
            elif reason == "admitted":
                assert tier is not None
                if parent is not None:
                    parent_ok = before.get(parent, False) or parent in kept
                    assert parent_ok, f"{key!r} admitted with a non-resident parent {parent!r}"
                self.model[key] = value
                kept.add(key)
            else:
                event(f"offer declined: {reason}")
                assert tier is None, (key, reason)
                assert key not in self.pinned
                self.model.pop(key, None)
                if reason.startswith("orphan"):
                    assert parent is not None
                    assert not before.get(parent, False) and parent not in kept, (
                        f"{key!r} declined as an orphan of resident {parent!r}"
                    )

    @rule(chain=st.integers(0, CHAINS - 1), length=st.integers(1, CHAIN_PAGES))
    def lookup_and_load(self, chain: int, length: int) -> None:
        self.quiesce()
        if len(self.loads) >= 2:
            self.finish_load()
        keys = [chain_key(chain, p) for p in range(length)]
        result = self.tm.lookup(keys)
        hit = result.hit_pages
        assert list(result.plan.keys) == keys[:hit]
        for key in keys[:hit]:
            assert key in self.model, f"{key!r} hit but never admitted"
        if hit < length:
            assert not self.resident(keys[hit])
            self.model.pop(keys[hit], None)
        event(f"lookup served from tiers {sorted(set(result.plan.tiers))}")
        plan = result.plan
        # The plan weighs measured bandwidths (tiny, noisy transfers here) against
        # recomputing: it may load fewer pages than hit, never more.
        assert plan.load_pages <= hit
        event(f"plan loads {'all' if plan.load_pages == hit else 'part'} of the hit")
        dst = [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(plan.load_pages)]
        handle = self.tm.prepare_load(plan, dst)
        expected = [self.model[k] for k in keys[: plan.load_pages]]
        self.loads.append((handle, keys[: plan.load_pages], dst, expected))

    @rule()
    def finish_load(self) -> None:
        self.quiesce()
        if not self.loads:
            return
        handle, keys, dst, expected = self.loads.pop(0)
        assert handle.wait(10), "a load never finished"
        loaded = self.tm.complete_load(handle)
        assert loaded == len(keys), (loaded, handle.results)
        self.check_loaded(handle, keys, dst, expected)

    def check_loaded(
        self, handle: LoadHandle, keys: list[bytes], dst: list[torch.Tensor], expected: list[bytes]
    ) -> None:
        for i, key in enumerate(keys):
            nbytes = handle.results[i]
            if not nbytes:
                continue
            assert nbytes == len(expected[i]), (key, nbytes, len(expected[i]))
            got = bytes(dst[i][:nbytes].numpy())
            assert got == expected[i], f"{key!r}: wrong bytes"

    @rule(key=st.sampled_from(ALL_KEYS))
    def pin(self, key: bytes) -> None:
        self.quiesce()
        if key in self.pinned or len(self.pinned) >= 2:
            return
        if self.tm.pin([key]) == [True]:
            assert key in self.model
            self.pinned[key] = self.tier_bits(key)

    @rule(key=st.sampled_from(ALL_KEYS))
    def unpin(self, key: bytes) -> None:
        self.quiesce()
        # No precondition on the pins: which pins took depends on the mover's timing,
        # and hypothesis needs the rules it draws to depend on its data alone.
        if key not in self.pinned:
            return
        self.tm.unpin([key])
        del self.pinned[key]

    @rule(times=st.integers(1, 4))
    def step(self, times: int) -> None:
        self.quiesce()
        for _ in range(times):
            self.tm.step()

    @rule()
    def drain(self) -> None:
        self.quiesce()
        assert self.tm.drain(10)
        self.sources.clear()
        stats = self.tm.stats()
        event(f"pages by tier after drain: {min(stats.pages_by_tier[2], 3)}+ on NVMe")
        assert stats.pages_by_tier[2] == len(self.tm.store), (
            stats.pages_by_tier,
            len(self.tm.store),
        )

    @rule()
    def close_and_reopen(self) -> None:
        self.quiesce()
        assert self.tm.drain(10)
        self.forget_absent()
        store = self.tm.store
        on_nvme = {k for k in ALL_KEYS if store.info(k) is not None}
        assert on_nvme <= set(self.model), (
            f"the store holds dropped pages {on_nvme - set(self.model)}"
        )
        old, loads = self.tm, self.loads
        old.close()
        for handle, keys, dst, expected in loads:
            assert handle.done(), "close left a load unsettled"
            self.check_loaded(handle, keys, dst, expected)
            old.complete_load(handle)
        self.loads = []
        self.pinned.clear()
        self.sources.clear()
        self.model = {k: v for k, v in self.model.items() if k in on_nvme}
        self.tm = self.open()
        stats = self.tm.stats()
        assert stats.pages_by_tier == (0, 0, len(on_nvme))

    # -- invariants ----------------------------------------------------------

    @invariant()
    def within_capacity(self) -> None:
        stats = self.tm.stats()
        for tier in range(3):
            assert stats.used_bytes[tier] <= stats.capacity_bytes[tier], (tier, stats.used_bytes)
        assert stats.used_bytes[0] == stats.pages_by_tier[0] * PAGE
        assert stats.used_bytes[1] == stats.pages_by_tier[1] * PAGE

    @invariant()
    def residents_are_modelled(self) -> None:
        for key in ALL_KEYS:
            if self.resident(key):
                assert key in self.model, f"{key!r} resident but not in the model"
        self.forget_absent()

    @invariant()
    def pinned_pages_stay(self) -> None:
        for key, bits in self.pinned.items():
            now = self.tier_bits(key)
            assert now & bits == bits, f"pinned {key!r} left a tier: {bits:03b} -> {now:03b}"
        for handle, keys, _, _ in self.loads:
            for i, key in enumerate(keys):
                if handle.results[i] is None:
                    assert self.resident(key), f"{key!r} dropped under an unfinished load"

    def teardown(self) -> None:
        try:
            self.tm.close()
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(self.directory)


class ValueDensityMachine(TierMachine):
    admission = "value_density"


TestTieringAll = TierMachine.TestCase
TestTieringAll.settings = SETTINGS
TestTieringValueDensity = ValueDensityMachine.TestCase
TestTieringValueDensity.settings = SETTINGS
