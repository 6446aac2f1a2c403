"""The ``auto`` choice between the staged (pinned) and GDS backends, measured once per host.

At the first load of a ``TensorIO`` with ``backend="auto"`` on CUDA, up to
``PROBE_PAGES`` of that load's own pages are read into scratch tensors by each
backend (one warm-up pass, one timed pass); the faster wins. The result is
cached per (store path, device) for the life of the process, so later
``TensorIO`` instances do not probe again. No page is written by a probe.
A GDS backend that cannot be built, or fails during the probe, loses with
its error as the reason. Without CUDA there is nothing to choose: ``cpu``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["PROBE_PAGES", "ProbeResult", "cached", "choose"]

PROBE_PAGES = 8

_cache: dict[tuple[str, str], ProbeResult] = {}
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Which backend ``auto`` uses and why; ``gbps`` holds the measured rates (GB/s)."""

    backend: str
    reason: str
    gbps: Mapping[str, float] = field(default_factory=dict)


def cached(store_path: str, device: str) -> ProbeResult | None:
    with _lock:
        return _cache.get((store_path, device))


def _rate(run: Callable[[], int]) -> float:
    run()  # warm-up: first-touch costs, cuFile handle setup
    start = time.perf_counter()
    moved = run()
    return moved / max(time.perf_counter() - start, 1e-9) / 1e9


def choose(
    store_path: str,
    device: str,
    pinned: Callable[[], int],
    gds: Callable[[], int] | None,
    gds_unavailable: str,
) -> ProbeResult:
    """Time each runnable (it returns the bytes it moved), cache and return the faster."""
    found = cached(store_path, device)
    if found is not None:
        return found
    rates = {"pinned": _rate(pinned)}
    reason = gds_unavailable
    if gds is not None:
        try:
            rates["gds"] = _rate(gds)
        except Exception as e:  # any GDS failure means "use pinned", with the reason kept
            reason = f"gds failed during the probe: {e}"
    if "gds" in rates and rates["gds"] > rates["pinned"]:
        result = ProbeResult("gds", "probe: gds was faster", rates)
    else:
        result = ProbeResult("pinned", reason or "probe: pinned was faster", rates)
    with _lock:
        _cache.setdefault((store_path, device), result)
        return _cache[(store_path, device)]
