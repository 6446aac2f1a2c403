"""The tier manager's measurements on a CUDA device (skipped without one).

Run on an H200 through the lent machine (docs/benchmarks.md, "Tier manager
soundness"); the CPU side of the same checks is tests/unit/tiering/.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvstore.tiering import ModelCost, TierConfig, TierManager  # noqa: E402
from kvstore.tiering.cost import DEFAULT_BANDWIDTH_BYTES_PER_S  # noqa: E402

pytestmark = pytest.mark.gpu
PAGE = 256 << 10


def test_the_open_calibrates_every_copy_path_on_cuda(tmp_path: Path) -> None:
    # Each of h2d, d2h and d2d is timed at open, synchronizing the device the copies
    # ran on (a d2h copy's destination is host memory: synchronizing *its* device
    # raised, and d2h and d2d kept the priors).
    config = TierConfig(
        device="cuda:0",
        hbm="owned",
        hbm_bytes=8 * PAGE,
        dram_bytes=16 * PAGE,
        page_bytes=PAGE,
        tokens_per_page=16,
        nvme_path=str(tmp_path / "nvme"),
        model=ModelCost(8e9, 32, 32, 128, 16 << 10),
    )
    with TierManager.open(config) as tm:
        rates = tm.stats().bandwidth_bytes_per_s
        for path in ("h2d", "d2h", "d2d"):
            assert rates[path] != DEFAULT_BANDWIDTH_BYTES_PER_S[path], (path, rates)
        assert "probe:failures" not in tm.stats().admissions
        assert tm._counters.get("probe:failures", 0) == 0
