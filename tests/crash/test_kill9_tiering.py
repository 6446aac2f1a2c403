"""kill -9 of the tier manager: acknowledged NVMe pages, the statistics file, the hit
rate after a restart (docs/tiering.md, "Restart").

The workloads run in processes forked from one zygote (kvstore/testing/tier_crash.py: importing
torch per cycle would cost seconds); each is SIGKILLed at a random moment and the
store reopened by a fresh ``TierManager`` here.

- Write-back: every page the child knew was acknowledged on NVMe (visible in the
  store, then covered by a ``flush()`` begun after that: ``put_many`` alone is durable
  only at the next group commit) is there after the kill, loads through the reopened
  manager with its exact bytes, and every page on NVMe, acknowledged or not, has its
  key's bytes and parent link, and is known to the rebuilt forest. The child's store
  group-commits only every 250 ms, so the acknowledgements rest on the explicit
  flush: acknowledging on visibility alone loses pages here within a cycle or two.
- Statistics: a kill during the save loop (temporary file, fsync, rename) leaves the
  old file or the new one, never a torn one, and the reopened manager loads it; a
  damaged file is treated as absent (nothing of it applied), and never fails the open.
- Hit rate: the NVMe hit rate (block accesses that hit a page with an NVMe copy) of the
  1,000 requests after a kill -9 and reopen is at least 90% of the 1,000 before it,
  with a 70% clean reserve in HBM and DRAM (see the test for the default's 15%).

Each runs with ``hbm="owned"`` and ``hbm="engine"`` (kvstore/testing/tier_crash.py,
``hbm_options``): in engine mode the engine keeps its own GPU cache, which the
workloads play (``EngineHBM``: the blocks it served, the oldest dropped with
``notify_hbm_evicted``), and the manager, which cannot read that copy, must keep a
DRAM or NVMe copy of every page the engine holds. Every workload also checks the
manager's books (used bytes within capacity, page counts and used bytes that are its
pages', no page in the engine's HBM alone) and reports what fails as ``bad`` lines:
there must be none, nor in the reopened manager.

KVSTORE_CRASH_SEED varies the kill moments.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.testing import tier_crash
from kvstore.tiering import TierManager
from kvstore.tiering.manager import STATS_FILE
from kvstore.tiering.statsfile import read_stats_file

SEED = int(os.environ.get("KVSTORE_CRASH_SEED", "20261201"))
WRITEBACK_CYCLES = 4
STATS_CYCLES = 6
# Kills land at random times, a save in flight at about a third of them: with six alone,
# none landed mid-save in about one run in twenty (CI, 2026-12-07). The loop goes on past
# six until one has, at most this far.
STATS_MAX_CYCLES = 30


HBM_MODES = pytest.mark.parametrize("hbm", tier_crash.HBM_MODES)


@pytest.fixture(scope="module")
def zygote() -> Iterator[Any]:
    process = tier_crash.Zygote()
    yield process
    process.close()


def assert_sigkilled(work: Any) -> None:
    assert work.status is not None
    assert os.WIFSIGNALED(work.status), (work.status, work.lines()[-3:])
    assert os.WTERMSIG(work.status) == signal.SIGKILL


def bad_lines(work: Any) -> list[str]:
    """What the workload found wrong in the manager's books (see the module doc)."""
    return [line for line in work.lines() if line.startswith("bad ")]


# -- write-back -------------------------------------------------------------------------


@pytest.mark.timeout(120)
@HBM_MODES
def test_kill9_during_writeback_keeps_every_acknowledged_page(
    tmp_path: Path, zygote: Any, hbm: str
) -> None:
    rng = random.Random(SEED)
    path = tmp_path / "nvme"
    acked: set[bytes] = set()
    unacked_on_nvme = 0
    for cycle in range(WRITEBACK_CYCLES):
        report = tmp_path / f"writeback-{cycle}.log"
        with zygote.workload(
            report, mode="writeback", dir=str(path), seed=SEED, cycle=cycle, hbm=hbm
        ) as work:
            work.wait_for("ready", 60)
            time.sleep(rng.uniform(0.2, 0.8))
            killed_at = time.monotonic()
        assert_sigkilled(work)
        assert not bad_lines(work), (cycle, bad_lines(work)[:3])
        if hbm == "engine":  # the engine's cache did drop pages, and said so
            engine = [line.split() for line in work.lines() if line.startswith("engine ")]
            assert engine and int(engine[-1][1]) > 0, (cycle, engine[-1:])
        acks = [line.split()[1:] for line in work.lines() if line.startswith("ack ")]
        new = {key.encode() for ack in acks for key in ack[1:]}
        assert new, f"cycle {cycle}: nothing was acknowledged"
        # Pages were still being written and acknowledged when the kill landed.
        assert killed_at - float(acks[-1][0]) < 0.5, (cycle, killed_at, acks[-1][0])
        acked |= new
        # Earlier cycles' pages must survive this cycle's kill and reopen too.
        check = tier_crash.check_writeback(path, acked, hbm=hbm)
        assert check.violations == 0, (cycle, check)
        assert check.loaded == len(acked), (cycle, check)
        unacked_on_nvme += check.stored - len(acked)
    print(f"{len(acked)} acknowledged pages checked; {unacked_on_nvme} unacknowledged on NVMe")


# -- statistics --------------------------------------------------------------------------


def stamp_of(file: Path) -> str | None:
    if not file.exists():
        return None
    return repr(json.loads(file.read_text())["saved_at_unix_s"])


@pytest.mark.timeout(120)
@HBM_MODES
def test_kill9_during_stats_save_leaves_the_old_or_the_new_file(
    tmp_path: Path, zygote: Any, hbm: str
) -> None:
    rng = random.Random(SEED + 1)
    path = tmp_path / "nvme"
    file = path / STATS_FILE
    on_disk: str | None = None  # the file's stamp before the cycle (None: no file)
    # Kills with a save begun and not finished; that left the temporary file; all.
    mid_save = torn_tmp = kills = 0
    for cycle in range(STATS_MAX_CYCLES):
        if cycle >= STATS_CYCLES and mid_save:
            break
        report = tmp_path / f"stats-{cycle}.log"
        with zygote.workload(
            report, mode="stats", dir=str(path), seed=SEED, cycle=cycle, hbm=hbm
        ) as work:
            work.wait_for("ready", 60)
            time.sleep(rng.uniform(0.05, 0.4))
        assert_sigkilled(work)
        assert not bad_lines(work), (cycle, bad_lines(work)[:3])
        old = on_disk
        begun_since: set[str] = set()  # saves begun after the last one that finished
        for line in work.lines():
            word, _, stamp = line.partition(" ")
            if word == "saved":
                old, begun_since = stamp, set()
            elif word == "begin":
                begun_since.add(stamp)
        mid_save += bool(begun_since)
        torn_tmp += file.with_name(file.name + ".tmp").exists()
        # Whole, and the old or the new: read_stats_file checks every field it reads.
        if old is None and not begun_since:
            assert not file.exists()
        else:
            read_stats_file(path)
            assert stamp_of(file) in {old} | begun_since, (cycle, old, begun_since)
            options = tier_crash.hbm_options(hbm, tier_crash.STATS_PAGE)
            with TierManager.open(
                tier_crash.tier_config(path, tier_crash.STATS_PAGE, **options)
            ) as tm:
                assert tm._counters.get("restart:stats_loaded") == 1, tm._counters
        on_disk = stamp_of(file)  # closing the checker saved its own statistics
        kills += 1
    print(f"{mid_save} of {kills} kills during a save, {torn_tmp} left the temporary file")
    assert mid_save > 0, "no kill landed while a save was in flight"


def stats_config(path: Path, hbm: str = "owned", **overrides: Any) -> Any:
    options = {**tier_crash.hbm_options(hbm, tier_crash.STATS_PAGE), **overrides}
    return tier_crash.tier_config(path, tier_crash.STATS_PAGE, control_interval_s=0.0, **options)


def observable(tm: TierManager) -> tuple[Any, ...]:
    """What the statistics file sets, as the manager shows it."""
    stats = tm.stats()
    reuse = tm._reuse.p(0, False, "")  # the reuse estimate of the class of fresh roots
    return (stats.tau, dict(stats.bandwidth_bytes_per_s), stats.compute_flops, reuse)


def good_stats_file(path: Path, hbm: str) -> dict[str, Any]:
    """A manager's statistics, every field moved off its default."""
    with TierManager.open(stats_config(path, hbm)) as tm:
        keys = [b"k%d" % i for i in range(40)]
        tm.offer(keys, [tier_crash.page_tensor(k, tier_crash.STATS_PAGE) for k in keys])
        assert tm.drain()
        for _ in range(5):
            tm.lookup(keys[:10])
        tm.observe_prefill(512, 0, 0.25)
    data = read_stats_file(path)
    assert data["heat"] and data["compute_flops"] != stats_config(path).compute_flops
    return data


def damaged_variants(good: dict[str, Any]) -> dict[str, bytes]:
    text = json.dumps(good)
    heat_damaged = {**good, "heat": [*good["heat"][:-1], ["not hex", 1.0, 0.0]]}
    zero_bandwidth = json.loads(text)
    next(iter(zero_bandwidth["bandwidth"].values()))["bytes_per_s"] = 0.0
    short_tau = json.loads(text)
    short_tau["tau"]["gain"] = [0.0]
    return {
        "empty": b"",
        "torn": text[: len(text) // 2].encode(),
        "garbage": bytes(random.Random(5).randrange(256) for _ in range(4096)),
        "zeros": bytes(4096),
        "a list": b"[]",
        "version 2": json.dumps({**good, "version": 2}).encode(),
        "no bandwidth": json.dumps({k: v for k, v in good.items() if k != "bandwidth"}).encode(),
        "bandwidth a list": json.dumps({**good, "bandwidth": []}).encode(),
        "bad heat row": json.dumps(heat_damaged).encode(),
        "zero bandwidth": json.dumps(zero_bandwidth).encode(),
        "short tau gain": json.dumps(short_tau).encode(),
    }


@HBM_MODES
def test_a_damaged_stats_file_is_treated_as_absent(tmp_path: Path, hbm: str) -> None:
    good = good_stats_file(tmp_path / "good", hbm)
    with TierManager.open(stats_config(tmp_path / "fresh", hbm)) as tm:
        cold = observable(tm)
    (tmp_path / "good" / STATS_FILE).write_text(json.dumps(good))
    with TierManager.open(stats_config(tmp_path / "good", hbm)) as tm:
        warm = observable(tm)
    assert warm != cold  # the good file does change what the manager shows
    failures = []
    for name, content in damaged_variants(good).items():
        path = tmp_path / name.replace(" ", "-")
        TierManager.open(stats_config(path, hbm)).close()  # a store, with a cold file
        (path / STATS_FILE).write_bytes(content)
        try:
            with TierManager.open(stats_config(path, hbm)) as tm:
                seen = observable(tm)
                counters = dict(tm._counters)
                keys = [b"a", b"b"]
                pages = [tier_crash.page_tensor(k, tier_crash.STATS_PAGE) for k in keys]
                tm.offer(keys, pages).hbm_release.wait(10)
                got = tier_crash.load_pages(tm, keys, tier_crash.STATS_PAGE)
                works = len(got) == 2 and all(map(torch.equal, got, pages))
        except Exception as e:
            failures.append(f"{name}: the open or the manager raised {type(e).__name__}: {e}")
            continue
        if counters.get("restart:stats_unreadable") != 1 or "restart:stats_loaded" in counters:
            failures.append(f"{name}: not reported unreadable: {counters}")
        if seen != cold:
            failures.append(f"{name}: partly applied: {seen} != {cold}")
        if not works:
            failures.append(f"{name}: the manager does not serve pages")
        read_stats_file(path)  # closing replaced the damaged file with a whole one
    assert not failures, "\n".join(failures)


# -- hit rate after a restart ---------------------------------------------------------


@pytest.mark.timeout(180)
@HBM_MODES
def test_nvme_hit_rate_after_kill9_restart(tmp_path: Path, zygote: Any, hbm: str) -> None:
    """The 1,000 requests after a kill -9 and reopen hit NVMe at >= 90% of the rate
    of the 1,000 before the kill. HBM and DRAM are lost; the forest comes back from
    NVMe meta, the statistics from the file (saved every 0.5 s), DRAM is warmed.

    The NVMe hit rate counts block accesses that hit a page with an NVMe copy,
    whichever tier served it (the "served" numbers split the hits by tier). The
    manager runs with its defaults (``tier_crash.replay_config``): what a crash costs
    is what only HBM or DRAM held. On this trace the DRAM clean reserve grows under
    the write-heavy replay, and the ratio measured 0.92-1.02 (five runs at 62504c8);
    with the fixed 15% reserve before it, 0.81-0.92. KVSTORE_TIER_RESTART_CONFIG
    (JSON TierConfig overrides, e.g. '{"watermark_low": 0.3}') reruns it with other
    settings.

    With hbm="engine" the engine's cache is the 64 pages of ``hbm_bytes`` (empty
    again after the kill, as the engine's GPU cache would be), and the manager serves
    the hits from DRAM and NVMe only."""
    path = tmp_path / "nvme"
    total, start, measured = 3000, 1000, 1000
    overrides = {"hbm": hbm, **json.loads(os.environ.get("KVSTORE_TIER_RESTART_CONFIG", "{}"))}
    with zygote.workload(
        tmp_path / "replay.log",
        mode="replay",
        dir=str(path),
        seed=SEED,
        total=total,
        start=start,
        measured=measured,
        config=overrides,
    ) as work:
        lines = work.wait_for("done", 150)
    assert_sigkilled(work)
    assert not bad_lines(work), bad_lines(work)[:3]
    count_line = next(line for line in lines if line.startswith("count "))
    before = tier_crash.HitCount(**json.loads(count_line.split(" ", 1)[1]))
    requests = tier_crash.trace(SEED, total)[start + measured :]
    with TierManager.open(tier_crash.replay_config(path, **overrides)) as tm:
        rebuilt = tm.stats().pages_by_tier
        stats_loaded = tm._counters.get("restart:stats_loaded")
        after = tier_crash.HitCount()
        engine = tier_crash.engine_cache(tm)
        tier_crash.replay(tm, requests, after, engine=engine)
        bad = tier_crash.accounting_errors(tm) + (engine.errors() if engine else [])
    report = (
        f"{hbm}: before: {before.nvme_hit_rate:.3f} NVMe ({before.hit_rate:.3f} any tier, "
        f"served {before.served}); after: {after.nvme_hit_rate:.3f} NVMe "
        f"({after.hit_rate:.3f}, served {after.served}); rebuilt {rebuilt}"
    )
    if engine is not None:
        report += f"; the engine dropped {engine.notified} pages after the reopen"
    print(report)
    assert not bad, bad
    assert engine is None or engine.notified > 0, report
    assert before.requests == after.requests == measured
    assert before.nvme_hit_rate > 0.2, report  # NVMe did serve this workload
    assert rebuilt[0] == rebuilt[1] == 0 and rebuilt[2] > 0, report
    assert stats_loaded == 1  # the statistics survived the kill
    assert after.nvme_hit_rate >= 0.9 * before.nvme_hit_rate, report
