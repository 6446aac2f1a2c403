"""The remote tier on the in-process cluster (docs/tiering.md, "The remote tier"):
sharing between two managers, and each fault a miss counted by reason, never a wrong
byte, with local serving going on. The Mooncake twin of these runs in
test_remote_mooncake.py."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvstore.bench.tiering import load_config
from kvstore.errors import CorruptionError
from kvstore.format.remote import (
    encode_remote_header_into,
    remote_key,
    verify_remote_value,
    verify_remote_values,
)
from kvstore.tiering import TierManager
from kvstore.tiering.remote import memory_cluster

PB = 64 << 10
NS = "tiny/float32/tp1/page_first"
_names = itertools.count()


def _config(cluster: str, **overrides: object) -> object:
    options = dict(
        remote_backend="memory",
        remote_options={"cluster": cluster},
        remote_namespace=NS,
        remote_deadline_s=0.5,
        remote_health_s=0.05,
    )
    options.update(overrides)
    return load_config(32, PB, **options)


@pytest.fixture
def cluster() -> Iterator[str]:
    name = f"test-{next(_names)}"
    yield name
    c = memory_cluster(name)
    c.release.set()


def _pages(prefix: str, n: int, seed: int) -> tuple[list[bytes], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    keys = [f"{prefix}{i}".encode() for i in range(n)]
    return keys, [torch.randint(0, 256, (PB,), dtype=torch.uint8, generator=g) for _ in keys]


def _until(tm: TierManager, cond: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tm.step()
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")


def _up(tm: TierManager) -> bool:
    remote = tm.stats().remote
    return remote is not None and remote["state"] == "up"


def _load(tm: TierManager, keys: list[bytes]) -> list[torch.Tensor]:
    r = tm.lookup(keys)
    dst = [torch.zeros(PB, dtype=torch.uint8) for _ in range(r.plan.load_pages)]
    h = tm.prepare_load(r.plan, dst)
    assert h.wait(5)
    tm.complete_load(h)
    return dst[: h.loaded_pages]


def _fetch(tm: TierManager, keys: list[bytes]) -> int:
    """Look up until the remote reads are done; the hit run."""
    r = tm.lookup(keys)
    deadline = time.monotonic() + 5
    while r.remote_pending and time.monotonic() < deadline:
        tm.drain(1)
        tm.step()
        r = tm.lookup(keys)
    return r.hit_pages


def test_a_page_offered_on_a_is_loaded_bit_exact_on_b(cluster: str) -> None:
    keys, srcs = _pages("p", 24, 1)  # read and verified in one call
    with TierManager.open(_config(cluster)) as a, TierManager.open(_config(cluster)) as b:
        _until(a, lambda: _up(a) and _up(b))
        assert a.offer(keys, srcs).admitted == 24
        _until(a, lambda: a.stats().remote["published"] == 24)
        first = b.lookup(keys)
        assert first.hit_pages == 0 and first.remote_pending == 24
        assert _fetch(b, keys) == 24
        got = _load(b, keys)
        assert all(torch.equal(x, y) for x, y in zip(got, srcs, strict=True))
        stats = b.stats()
        assert stats.remote["hits"] == 24 and stats.remote["misses"] == 0
        assert stats.pages_by_tier[1] == 24  # admitted locally, in DRAM
        # pages read from the cluster are not published back
        assert stats.remote["published"] == 0
    # another namespace never sees them
    with TierManager.open(_config(cluster, remote_namespace="other")) as c:
        _until(c, lambda: _up(c))
        assert _fetch(c, keys) == 0


def test_read_timings_split_a_read_into_queue_call_and_checks(cluster: str) -> None:
    keys, srcs = _pages("t", 24, 3)
    with TierManager.open(_config(cluster)) as a, TierManager.open(_config(cluster)) as b:
        _until(a, lambda: _up(a) and _up(b))
        assert a.offer(keys, srcs).admitted == 24
        _until(a, lambda: a.stats().remote["published"] == 24)
        assert b._remote is not None and b._remote.read_timings() == []
        c = memory_cluster(cluster)
        c.hang.set()  # the read blocks in the backend's call until released
        assert b.lookup(keys).remote_pending == 24
        # Held 0.15 s from the lookup: the read, timed from the call's start (on a
        # worker, after the lookup returned), is held at least 0.1 s of it.
        time.sleep(0.15)
        c.hang.clear()
        c.release.set()
        assert _fetch(b, keys) == 24
        [(pages, queued, read, verify)] = b._remote.read_timings()
        assert pages == 24
        assert read >= 0.1 and 0 < verify < read  # the call held it, not the checks
        assert 0 <= queued < 0.1


def _publish_raw(cluster: str, key: bytes, payload: bytes, *, corrupt: bool) -> None:
    head = bytearray(4096)
    encode_remote_header_into(
        memoryview(head), namespace=NS, key=key, payload=payload, parent=None, depth=0, tokens=8
    )
    body = bytearray(payload)
    if corrupt:
        body[100] ^= 0xFF
    memory_cluster(cluster).values[remote_key(NS, key)] = bytes(head) + bytes(body)


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("checksum", "checksum"), ("empty", "empty"), ("short", "short"), ("other_key", "mismatched")],
)
def test_a_bad_value_under_a_real_key_is_a_miss_never_a_page(
    cluster: str, fault: str, reason: str
) -> None:
    key = b"root"
    payload = bytes(range(256)) * (PB // 256)
    _publish_raw(cluster, key, payload, corrupt=fault == "checksum")
    c = memory_cluster(cluster)
    name = remote_key(NS, key)
    if fault == "empty":
        c.empty_gets = True  # is_exist says yes, the read brings 0 bytes
    elif fault == "short":
        c.values[name] = c.values[name][:-4096]
    elif fault == "other_key":
        _publish_raw(cluster, b"elsewhere", payload, corrupt=False)
        c.values[name] = c.values[remote_key(NS, b"elsewhere")]
    local_keys, local = _pages("local", 2, 3)
    with TierManager.open(_config(cluster)) as b:
        _until(b, lambda: _up(b))
        b.offer(local_keys, local)
        b.drain()
        assert _fetch(b, [key]) == 0
        remote = b.stats().remote
        assert remote["hits"] == 0 and remote["miss_reasons"] == {reason: 1}
        assert b.stats().pages_by_tier[1] == 2  # nothing admitted from the cluster
        got = _load(b, local_keys)  # local serving goes on
        assert all(torch.equal(x, y) for x, y in zip(got, local, strict=True))


def test_master_down_degrades_local_serving_goes_on_and_it_reconnects(cluster: str) -> None:
    keys, srcs = _pages("d", 4, 5)
    with TierManager.open(_config(cluster)) as a:
        _until(a, lambda: _up(a))
        memory_cluster(cluster).down = True
        _until(a, lambda: not _up(a))
        assert "unreachable" in a.stats().remote["degraded_reason"]
        assert a.offer(keys, srcs).admitted == 4
        a.drain()
        assert all(torch.equal(x, y) for x, y in zip(_load(a, keys), srcs, strict=True))
        assert a.lookup([b"nowhere"]).remote_pending == 0  # degraded: nothing asked
        assert a.stats().remote["counters"]["publish:degraded"] >= 1
        memory_cluster(cluster).down = False
        _until(a, lambda: _up(a))


def test_a_hung_call_is_a_late_miss_and_its_slots_stay_its_own(cluster: str) -> None:
    keys, srcs = _pages("h", 4, 7)
    with TierManager.open(_config(cluster)) as a:
        _until(a, lambda: _up(a))
        a.offer(keys, srcs)
        _until(a, lambda: a.stats().remote["published"] == 4)
    c = memory_cluster(cluster)
    with TierManager.open(_config(cluster)) as b:
        _until(b, lambda: _up(b))
        c.hang.set()  # every call blocks now: a hung peer
        started = time.monotonic()
        r = b.lookup(keys)
        assert r.remote_pending == 4
        assert time.monotonic() - started < 0.2  # the caller's thread never waits
        _until(b, lambda: not _up(b))
        assert "deadline" in b.stats().remote["degraded_reason"]
        local_keys, local = _pages("l", 3, 9)  # local serving goes on
        assert b.offer(local_keys, local).admitted == 3
        b.drain(2)
        assert all(torch.equal(x, y) for x, y in zip(_load(b, local_keys), local, strict=True))
        c.hang.clear()
        c.release.set()  # the call returns late: its result is dropped
        _until(b, lambda: _up(b))
        assert b.stats().remote["stuck_calls"] == 0
        assert _fetch(b, keys) == 4  # and the next lookup reads them
        assert all(torch.equal(x, y) for x, y in zip(_load(b, keys), srcs, strict=True))


def test_the_wire_value_refuses_what_it_is_not() -> None:
    payload = b"x" * 5000
    head = bytearray(4096)
    encode_remote_header_into(
        memoryview(head), namespace=NS, key=b"k", payload=payload, parent=b"p", depth=1, tokens=8
    )
    page = verify_remote_value(head, payload, namespace=NS, key=b"k", max_payload_bytes=PB)
    assert (page.parent, page.depth, page.tokens, page.payload_bytes) == (b"p", 1, 8, 5000)
    for kwargs, word in (
        (dict(namespace="other", key=b"k"), "mismatched"),
        (dict(namespace=NS, key=b"j"), "mismatched"),
    ):
        with pytest.raises(CorruptionError, match=word):
            verify_remote_value(head, payload, max_payload_bytes=PB, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(CorruptionError, match="checksum"):
        verify_remote_value(head, b"y" * 5000, namespace=NS, key=b"k", max_payload_bytes=PB)
    with pytest.raises(CorruptionError, match="short"):
        verify_remote_value(head, payload[:-1], namespace=NS, key=b"k", max_payload_bytes=PB)
    head[10] ^= 1
    with pytest.raises(CorruptionError, match="unverifiable"):
        verify_remote_value(head, payload, namespace=NS, key=b"k", max_payload_bytes=PB)


def test_the_one_pass_check_gives_each_value_the_reason_the_single_check_gives() -> None:
    payload = b"x" * 5000
    head = bytearray(4096)
    encode_remote_header_into(
        memoryview(head), namespace=NS, key=b"k", payload=payload, parent=b"p", depth=1, tokens=8
    )
    bad = bytearray(head)
    bad[10] ^= 1
    name = remote_key(NS, b"k").encode()
    cases = [  # header, payload, name
        (head, payload, name),
        (head, payload, remote_key(NS, b"j").encode()),
        (head, b"y" * 5000, name),
        (head, payload[:-1], name),
        (bad, payload, name),
    ]
    got = verify_remote_values(
        [c[0] for c in cases],
        [c[1] for c in cases],
        namespace=NS,
        names=[c[2] for c in cases],
        max_payload_bytes=PB,
    )
    assert got[0] == verify_remote_value(
        head, payload, namespace=NS, key=b"k", max_payload_bytes=PB
    )
    assert got[1:] == ["mismatched", "checksum", "short", "unverifiable"]
    other = verify_remote_values(
        [head], [payload], namespace="other", names=[name], max_payload_bytes=PB
    )
    assert other == ["mismatched"]


def test_config_refuses_a_remote_tier_without_a_namespace() -> None:
    with pytest.raises(ValueError, match="remote_namespace"):
        load_config(4, PB, remote_backend="memory")
    with pytest.raises(ValueError, match="unknown remote_backend"):
        TierManager.open(load_config(4, PB, remote_backend="nope", remote_namespace="x"))


def test_metrics_and_tier_stat_show_the_remote_tier(cluster: str, tmp_path: object) -> None:
    from prometheus_client import generate_latest

    from kvstore.telemetry.prometheus import lint_exposition

    with TierManager.open(_config(cluster)) as a:
        _until(a, lambda: _up(a))
        memory_cluster(cluster).down = True
        _until(a, lambda: not _up(a))
        text = generate_latest(a.metrics_registry()).decode()
        assert 'kvstore_tier_degraded{tier="remote"} 1.0' in text
        assert 'kvstore_tier_kappa{tier="remote"}' in text
        assert not lint_exposition(text)
        memory_cluster(cluster).down = False


def test_a_lookup_reads_straight_into_slots_without_a_size_query(cluster: str) -> None:
    # A page smaller than its slot is read into the whole slot and admitted at its own
    # size; where the cluster's run ends is no miss, and the pages after it are not
    # counted either (a size query would have stopped there).
    keys, srcs = _pages("s", 3, 11)
    srcs[2] = srcs[2][: PB // 2].clone()
    with TierManager.open(_config(cluster)) as a:
        _until(a, lambda: _up(a))
        assert a.offer(keys, srcs).admitted == 3
        _until(a, lambda: a.stats().remote["published"] == 3)
    asked = [*keys, b"s-not-published", b"s-after"]
    with TierManager.open(_config(cluster)) as b:
        _until(b, lambda: _up(b))
        assert b.lookup(asked).remote_pending == 5
        assert b.drain(5)
        b.step()
        remote = b.stats().remote
        assert (remote["hits"], remote["misses"]) == (3, 0)
        assert remote["counters"]["lookups:direct"] == 1
        assert "lookups:queried" not in remote["counters"]
        r = b.lookup(keys)
        dst = [torch.zeros(PB, dtype=torch.uint8) for _ in range(3)]
        h = b.prepare_load(r.plan, dst)
        assert h.wait(5)
        b.complete_load(h)
        assert torch.equal(dst[0], srcs[0]) and torch.equal(dst[1], srcs[1])
        assert torch.equal(dst[2][: PB // 2], srcs[2])
        # Nothing in the cluster: an absent run, counted as such, never a miss.
        assert b.lookup([b"nowhere-0", b"nowhere-1"]).remote_pending == 2
        assert b.drain(5)
        b.step()
        assert b.lookup([b"nowhere-0", b"nowhere-1"]).hit_pages == 0
        remote = b.stats().remote
        assert remote["misses"] == 0 and remote["counters"]["lookups:absent"] >= 1
        assert b.stats().pages_by_tier[1] == 3  # the absent run's slots came back


def test_the_default_read_into_asks_sizes_then_reads_exactly(cluster: str) -> None:
    # A backend without its own read_into: the base class's (sizes, then get_into).
    import ctypes

    from kvstore.tiering.remote import MemoryBackend, RemoteBackend

    class Plain(MemoryBackend):
        read_into = RemoteBackend.read_into  # type: ignore[assignment]

    memory_cluster(cluster).values.update({"small": b"abc", "big": b"x" * 64})
    backend = Plain({"cluster": cluster})
    head, body = ctypes.create_string_buffer(2), ctypes.create_string_buffer(30)
    parts = [(ctypes.addressof(head), 2), (ctypes.addressof(body), 30)]
    got = backend.read_into(["small", "big", "none"], [parts, parts, parts])
    assert got == [(3, ""), (0, "too_large"), (0, "absent")]
    assert head.raw == b"ab" and body.raw[:1] == b"c"


def test_pages_written_through_to_nvme_are_published_too(cluster: str, tmp_path: object) -> None:
    # Write-through placement starts each offered page's write-back at once: the page
    # is EVICTING (its DRAM slot valid, read by the write) when the offer's copy lands,
    # and it must be published all the same (SGLang's backend writes through).
    keys, srcs = _pages("w", 4, 13)
    nvme = {"nvme_path": str(tmp_path), "nvme_options": {"segment_bytes": 4 << 20}}
    with TierManager.open(_config(cluster, placement="write_through", **nvme)) as a:
        _until(a, lambda: _up(a))
        assert a.offer(keys, srcs).admitted == 4
        _until(a, lambda: a.stats().remote["published"] == 4)
        a.drain()
        assert all(torch.equal(x, y) for x, y in zip(_load(a, keys), srcs, strict=True))
    with TierManager.open(_config(cluster)) as b:
        _until(b, lambda: _up(b))
        assert _fetch(b, keys) == 4
        assert all(torch.equal(x, y) for x, y in zip(_load(b, keys), srcs, strict=True))


def test_a_transfer_engine_read_returns_only_when_every_piece_has_ended() -> None:
    """The non-spinning reader sleeps between status checks and returns only when every
    batch has finished (1) or failed (-1): running (0) and late (-2) batches may still
    write into their slots, so the call waits them out, however long."""
    from kvstore.tiering.remote_mooncake import MooncakeBackend

    class Engine:
        def __init__(self, scripts: dict[int, list[int]]) -> None:
            self.scripts = scripts
            self.checks = 0

        def transfer_check_status(self, batch: int) -> int:
            self.checks += 1
            script = self.scripts[batch]
            return script.pop(0) if len(script) > 1 else script[0]

    # batch -> statuses it answers in turn (the last repeats); batch 3 is late twice
    engine = Engine({1: [0, 1], 2: [0, 0, -1], 3: [0, -2, -2, 1], 4: [1]})
    started = time.monotonic()
    failed = MooncakeBackend._wait_all(engine, [(1, 0), (2, 0), (3, 1), (4, 2)])
    assert failed == {0}  # key 0's second piece failed; keys 1 and 2 arrived
    assert all(len(script) == 1 and script[0] != 0 for script in engine.scripts.values())
    assert engine.scripts[3] == [1]  # the late batch was waited for until it ended
    assert time.monotonic() - started < 1.0
    assert MooncakeBackend._wait_all(engine, []) == set()


def test_the_mooncake_reader_option_is_checked() -> None:
    from kvstore.tiering.remote_mooncake import MooncakeBackend

    with pytest.raises(ValueError, match="reader"):
        MooncakeBackend({"master": "127.0.0.1:1", "reader": "fast"})
    assert MooncakeBackend({"master": "127.0.0.1:1"}).reader == "engine"


def test_the_transfer_engine_reader_reads_each_piece_where_the_master_says() -> None:
    """Per key: where the master says its value lies (address, size, holder), read piece
    by piece into the parts from their start; absent, too large, refused at submission
    and failed are misses by reason; a value with only a disk replica is read by get."""
    from types import SimpleNamespace

    from kvstore.tiering.remote_mooncake import MooncakeBackend

    def replica(memory: bool, address: int = 0, size: int = 0) -> Any:
        where = SimpleNamespace(buffer_address=address, size=size, transport_endpoint="a:1")
        return SimpleNamespace(
            is_memory_replica=lambda: memory,
            get_memory_descriptor=lambda: SimpleNamespace(buffer_descriptor=where),
        )

    found = {
        "fits": [replica(True, 1000, 6000)],
        "big": [replica(True, 2000, 9000)],
        "disk": [replica(False)],
        "refused": [replica(True, 3000, 100)],
        "fails": [replica(True, 4000, 4096)],
    }

    class Engine:
        def __init__(self) -> None:
            self.reads: list[tuple[str, list[int], list[int], list[int]]] = []

        def batch_transfer_async_read(
            self, holder: str, local: list[int], remote: list[int], lengths: list[int]
        ) -> int:
            if remote[0] == 3000:
                return 0  # refused
            self.reads.append((holder, local, remote, lengths))
            return len(self.reads)

        def transfer_check_status(self, batch: int) -> int:
            return -1 if self.reads[batch - 1][2][0] == 4000 else 1

    backend = MooncakeBackend({"master": "127.0.0.1:1"})
    backend._client = SimpleNamespace(batch_get_replica_desc=lambda keys: found)
    by_get: list[list[str]] = []

    def read_by_get(keys: list[str], parts: list[Any]) -> list[tuple[int, str]]:
        by_get.append(keys)
        return [(77, "")] * len(keys)

    backend._read_by_get = read_by_get  # type: ignore[method-assign]
    engine = Engine()
    keys = ["fits", "big", "disk", "refused", "fails", "none"]
    parts = [[(10_000 * i, 4096), (10_000 * i + 5000, 4096)] for i in range(len(keys))]
    told: list[tuple[int, int]] = []
    got = backend._read_by_engine(engine, keys, parts, lambda i, n: told.append((i, n)))
    assert told == [(0, 6000)]  # wholly landed: only "fits" (not refused, failed, by get)
    assert got == [
        (6000, ""),
        (0, "too_large"),
        (77, ""),
        (0, "transfer"),
        (0, "transfer"),
        (0, "absent"),
    ]
    assert by_get == [["disk"]]
    # "fits": its header block part whole, then the rest of the value into the slot
    assert engine.reads[:2] == [("a:1", [0], [1000], [4096]), ("a:1", [5000], [5096], [1904])]
