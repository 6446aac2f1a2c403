"""The simulator, ``kvstore sim`` and ``kvstore tier stat`` run without torch; the real
tier manager says in one line what to install.

Each check runs in a subprocess whose ``import torch`` fails (a meta-path finder
that refuses it), as in a clone installed without the ``torch`` extra.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

_BLOCK_TORCH = textwrap.dedent(
    """
    import sys

    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError("No module named 'torch'", name="torch")
            return None

    sys.meta_path.insert(0, _NoTorch())
    """
)


def run_without_torch(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCK_TORCH + textwrap.dedent(code)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )


def test_the_simulator_imports_and_runs_without_torch() -> None:
    done = run_without_torch(
        """
        import kvstore.tiering.sim
        from click.testing import CliRunner
        from kvstore.cli import main
        result = CliRunner().invoke(
            main, ["sim", "--generate", "mixed", "--requests", "200", "--json"]
        )
        assert result.exit_code == 0, result.output
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


def test_tier_stat_runs_without_torch(tmp_path: Path) -> None:
    done = run_without_torch(
        f"""
        from click.testing import CliRunner
        from kvstore.cli import main
        result = CliRunner().invoke(main, ["tier", "stat", {str(tmp_path)!r}])
        # No stats file here: an error line, not an ImportError.
        assert "torch" not in result.output, result.output
        assert not isinstance(result.exception, ImportError), result.exception
        assert "torch" not in sys.modules
        print("ok", result.exit_code)
        """
    )
    assert done.returncode == 0, done.stderr
    assert "ok" in done.stdout


def test_the_real_tier_manager_names_what_to_install() -> None:
    done = run_without_torch(
        """
        from kvstore.tiering import TierConfig, TierManager
        from kvstore.tiering._torch import TorchMissingError
        try:
            TierManager.open(TierConfig(mover="cpu", dram_bytes=1 << 22, probe_at_open=False))
        except TorchMissingError as e:
            assert isinstance(e, ImportError)
            print(e)
        else:
            raise SystemExit("opened without torch")
        """
    )
    assert done.returncode == 0, done.stderr
    message = done.stdout.strip()
    assert "\n" not in message
    assert "needs torch" in message
    assert "pip install 'kvstore[torch]'" in message
