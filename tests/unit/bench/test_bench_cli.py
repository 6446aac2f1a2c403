"""``kvstore bench``: the JSON document's shape, with tiny sizes and without fio.

fio is hidden (PATH has no fio) so the test is fast and the same everywhere;
the bench must then say fio is unavailable and still run everything else.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvstore.bench.cli import bench
from kvstore.bench.report import TARGETS

KVSTORE_ROWS = {
    "kvstore.put_durable",
    "kvstore.get_many_cold",
    "kvstore.get_many_into_cold",
    "kvstore.get_single_cold",
    "kvstore.mixed_70_30",
}
HOT_ROWS = {
    "hot.cpu_put_many",
    "hot.cpu_get_many",
    "hot.lookup",
    "hot.lookup_overlay",
    "hot.lookup_entry",
    "hot.pin_unpin",
    "hot.pin_unpin_overlay",
    "hot.meta_updates_g1",
    "hot.meta_updates_g256",
}
PEER_ROWS = {
    "peer.file_per_page_buffered",
    "peer.file_per_page_fsync",
    "peer.file_per_page_read_cold",
    "peer.tmp_rename_fsync",
    "peer.lmdb_1_per_txn",
    "peer.lmdb_64_per_txn",
    "peer.lmdb_read_cold",
    "peer.safetensors_fsync",
    "peer.safetensors_read_cold",
    "peer.odirect_pool_write",
    "peer.odirect_pool_read",
}
TINY = [
    "--page-kib",
    "64",
    "--size-mib",
    "2",
    "--hot-pages",
    "100",
    "--peer-reads",
    "16",
    "--runtime",
    "5",  # a cap, not a duration: tiny phases finish long before it
    "--settle",
    "0",
    "--allow-buffered",  # tmp_path may be tmpfs
    "--json",
]


@pytest.fixture
def no_fio_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def _run(args: list[str]) -> dict[str, object]:
    result = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)  # stdout is exactly one JSON document
    assert isinstance(document, dict)
    assert "Done-when targets" in result.stderr  # the table went to stderr
    return document


@pytest.mark.usefixtures("no_fio_on_path")
def test_compare_without_fio_reports_every_row(tmp_path: Path) -> None:
    bench_dir = tmp_path / "bench"
    document = _run(["--dir", str(bench_dir), "--compare", *TINY])

    fio = document["fio"]
    assert isinstance(fio, dict)
    assert fio["available"] is False and fio["ran"] is False
    assert "not found" in fio["reason"]

    measurements = document["measurements"]
    assert isinstance(measurements, list)
    by_name = {m["name"]: m for m in measurements}
    # pin_many/unpin_many are measured only where the store has them.
    assert set(by_name) - {"hot.pin_unpin_batched"} == KVSTORE_ROWS | HOT_ROWS | PEER_ROWS | {
        "hot.meta_updates_g16",
        "hot.meta_updates_g1024",
    }
    assert not any(name.startswith("fio.") for name in by_name)

    put = by_name["kvstore.put_durable"]
    assert put["durable"] is True and put["page_bytes"] == 64 << 10
    # 2 MiB is 32 pages of 64 KiB; the bench writes at least one batch of 64.
    assert put["ops"] == 64 and put["bytes_moved"] == 64 * (64 << 10)
    assert put["mb_per_s"] > 0 and put["p50_us"] <= put["p99_us"]
    # 64 pages can take less CPU than one accounting tick: present and sane, maybe 0.
    assert 0 <= put["extra"]["user_us_per_page"] < 1e6
    assert by_name["kvstore.get_many_cold"]["cold"] in ("O_DIRECT", "page cache (O_DIRECT refused)")
    assert by_name["peer.file_per_page_buffered"]["durable"] is False
    for name in ("peer.file_per_page_read_cold", "peer.lmdb_read_cold"):
        assert by_name[name]["cold"] == "fadvise"
        assert by_name[name]["ops"] == 16
    assert by_name["hot.lookup"]["ops_per_s"] > 0

    targets = {row["key"]: row for row in document["targets"]}  # type: ignore[union-attr]
    assert set(targets) == {target.key for target in TARGETS}
    # fio is absent and scaling did not run: those targets say so instead of guessing.
    assert targets["vs_fio_writes"]["status"] == "not measured"
    assert targets["scaling_pages"]["status"] == "not measured"
    ratio = targets["durable_writes_vs_lmcache"]
    assert ratio["status"] in ("met", "not met")
    assert ratio["value"] == pytest.approx(
        put["mb_per_s"] / by_name["peer.file_per_page_fsync"]["mb_per_s"]
    )
    # Scratch data is cleaned up after every phase.
    assert [p.name for p in bench_dir.iterdir()] == []


@pytest.mark.usefixtures("no_fio_on_path")
def test_report_reprints_a_saved_run(tmp_path: Path) -> None:
    saved = tmp_path / "run.json"
    _run(["--dir", str(tmp_path / "bench"), "--out", str(saved), *TINY])
    document = json.loads(saved.read_text())
    assert {m["name"] for m in document["measurements"]} >= KVSTORE_ROWS
    result = CliRunner().invoke(bench, ["--report", str(saved)])
    assert result.exit_code == 0
    assert "kvstore put_many(64, sync=True)" in result.stdout


def test_json_is_printed_when_the_run_cannot_start(tmp_path: Path) -> None:
    """--json promised one JSON document on stdout; a failed run printed none."""
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    result = CliRunner().invoke(bench, ["--quick", "--json", "--dir", str(blocker / "bench")])
    assert result.exit_code == 8
    document = json.loads(result.stdout)
    assert document["exit_code"] == 8
    assert document["error"]["type"] == "NotADirectoryError"


# -- --against-fio: the ratio table of kvstore/bench/fio_ratios.py (tools/bench.py) --------

RATIO_RUN = Path(__file__).resolve().parents[3] / "docs/img/bench-tools-2026-12-01-engines.json"


def test_against_fio_reprints_a_saved_ratio_run() -> None:
    result = CliRunner().invoke(bench, ["--against-fio", "--report", str(RATIO_RUN)])
    assert result.exit_code == 0, result.output
    for label in ("durable put 1 MiB x32 + flush", "get_many 64 x 256 KiB", "get 256 KiB"):
        assert label in result.output


def test_against_fio_passes_the_common_options_and_the_exit_code_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstore.bench import fio_ratios

    seen: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 3  # a target failed

    monkeypatch.setattr(fio_ratios, "main", fake_main)
    args = ["--against-fio", "--dir", str(tmp_path), "--quick", "--json", "--fio", "none"]
    result = CliRunner().invoke(bench, [*args, "--io-depth", "8", "--out", str(tmp_path / "r")])
    assert result.exit_code == 3
    (argv,) = seen
    assert argv[:6] == ["--dir", str(tmp_path), "--io-depth", "8", "--settle", "1.0"]
    assert {"--quick", "--json", "--skip-fio"} <= set(argv)
    assert argv[argv.index("--out") + 1] == str(tmp_path / "r")


def test_against_fio_without_fio_says_so_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It used to die in a traceback (FileNotFoundError: 'fio') before any workload.
    from kvstore.bench import fio_ratios

    rc = fio_ratios.main(["--dir", str(tmp_path / "d"), "--fio", str(tmp_path / "no-fio")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "fio not found" in err and "--skip-fio" in err
    assert not (tmp_path / "d").exists()


def test_machine_facts_need_no_fio_for_a_skip_fio_run(tmp_path: Path) -> None:
    from kvstore.bench import fio_ratios

    info = fio_ratios.machine_info(tmp_path, str(tmp_path / "no-fio"))
    assert info["fio"] == "not found"


def _fio(profile: str, *, read_mbps: float, write_mbps: float, usr: float, sys: float) -> Any:
    from kvstore.bench.fio_ratios import FioResult

    nan = float("nan")
    return FioResult(
        profile, read_mbps, write_mbps, 0.0, 0.0, nan, nan, nan, nan, nan, nan, nan, nan,
        10.0, usr, sys, 0.0, {},
    )  # fmt: skip


def test_fios_own_cpu_per_gb_is_the_reference_beside_kvstores() -> None:
    """fio at 1,161 MB/s using 7.41% of a CPU spent 0.0638 core-s per GB; the report puts
    that beside kvstore's CPU per GB of the same I/O, with the ratio."""
    from kvstore.bench.fio_ratios import KvResult, build_rows

    read = _fio("randread_256k_qd32", read_mbps=1161.0, write_mbps=0.0, usr=0.63, sys=6.78)
    assert read.cpu_s_per_gb == pytest.approx(0.0638, abs=1e-4)
    write = _fio("seq_write_256k_sync32", read_mbps=0.0, write_mbps=2409.5, usr=10.25, sys=18.96)
    assert write.cpu_s_per_gb == pytest.approx(0.1212, abs=1e-4)
    assert math.isnan(_fio("idle", read_mbps=0.0, write_mbps=0.0, usr=1.0, sys=1.0).cpu_s_per_gb)

    def kv(workload: str, cpu: float) -> KvResult:
        return KvResult(workload, 256 << 10, 1, 1, 1.0, 1.0, 0.0, 0.0, 0, 0.0, {},
                        cpu_s_per_gb=cpu)  # fmt: skip

    rows = {
        row.label: row
        for row in build_rows(
            {"randread_256k_qd32": read, "seq_write_256k_sync32": write},
            {"get_many_into": kv("get_many_into", 0.3), "put_256k": kv("put_256k", 0.2)},
            {},
        )
    }
    into = rows["CPU per GB: get_many_into 256 KiB vs fio randread QD32's own"]
    assert into.kv == 0.3 and into.fio == pytest.approx(0.0638, abs=1e-4)
    assert into.ratio == pytest.approx(0.3 / read.cpu_s_per_gb)
    put = rows["CPU per GB: put 256 KiB vs fio's own (same syncs)"]
    assert put.ratio == pytest.approx(0.2 / write.cpu_s_per_gb)
    # The absolute target row is unchanged: no fio column, judged on its bound.
    target = rows["CPU per GB: get_many_into 256 KiB, aligned"]
    assert target.fio is None and target.status == "FAIL"
