"""tools/powerloss.py's command line (kvstore/testing/powerloss_cli.py), briefly: each
mode's summary is what docs/reliability.md describes, and the same seed gives the
same cases."""

from __future__ import annotations

import json

import pytest

from kvstore.testing import powerloss_cli


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, object]]:
    status = powerloss_cli.main([*argv, "--json", "-q"])
    summary = json.loads(capsys.readouterr().out)
    for key in ("seconds", "open_seconds_p50", "open_seconds_max"):
        summary.pop(key, None)
    return status, summary


@pytest.mark.timeout(120)
def test_power_loss_cases_are_counted_per_policy_and_repeat_by_seed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ("--cases", "6", "--steps", "25", "--cases-per-trace", "4", "--seed", "3")
    status, summary = _run(capsys, *argv)
    assert status == 0 and summary["violations"] == 0, summary
    assert summary["cases"] == 6 and summary["traces"] == 2, summary
    assert summary["cases_per_policy"] == {"drop": 2, "prefix": 2, "dirs": 2}, summary
    assert _run(capsys, *argv) == (status, summary)


@pytest.mark.timeout(120)
def test_double_and_torn_wal_modes(capsys: pytest.CaptureFixture[str]) -> None:
    status, summary = _run(capsys, "--mode", "double", "--cases", "2", "--steps", "20")
    assert status == 0 and summary["mode"] == "double" and summary["cases"] == 2, summary
    status, summary = _run(capsys, "--mode", "tear-wal", "--stride", "97", "--seed", "1")
    assert status == 0 and summary["mode"] == "tear-wal", summary
    assert summary["cases"] > 0 and summary["violations"] == 0, summary
