"""The offload latency histogram: ``kv_offload_latency_seconds{src_layer,dst_layer}``.

Each completed copy or NVMe transfer the manager harvests is counted by its path's
(source, destination) layers (docs/tiering.md, "Metrics and alerts"); ``snapshot`` is
what ``TierStats.offload_latency_s`` holds. State under the manager's lock.
"""

from __future__ import annotations

from kvstore.tiering.mover_api import Path

__all__ = ["OFFLOAD_BUCKETS_S", "OffloadLatency"]

OFFLOAD_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5)
_LAYERS = {
    Path.D2H: ("0", "1"),
    Path.H2D: ("1", "0"),
    Path.D2D: ("0", "0"),
    Path.NVME_WRITE: ("1", "2"),
    Path.NVME_READ: ("2", "1"),
}
_KEYS = {path: f"{a}->{b}" for path, (a, b) in _LAYERS.items()}


class OffloadLatency:
    """Cumulative buckets, sum and count of transfer seconds per "src->dst" layers."""

    def __init__(self) -> None:
        self._rows: dict[str, list[float]] = {}

    def observe(self, path: Path, seconds: float) -> None:
        key = _KEYS.get(path)
        if key is None:
            return
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = [0.0] * (len(OFFLOAD_BUCKETS_S) + 2)
        for i, bound in enumerate(OFFLOAD_BUCKETS_S):
            if seconds <= bound:
                row[i] += 1
        row[-2] += seconds
        row[-1] += 1

    def snapshot(self) -> dict[str, tuple[tuple[float, ...], tuple[int, ...], float, int]]:
        return {
            k: (OFFLOAD_BUCKETS_S, tuple(int(c) for c in v[:-2]), v[-2], int(v[-1]))
            for k, v in self._rows.items()
        }
