"""``kvstore bench``: kvstore against fio and its peers' write paths, on one directory.

Layers: ``common`` (results, timing, cold caches, machine facts) <- ``fio``,
``kv`` (kvstore workloads and hot paths), ``peers`` (file per page, temp +
rename, LMDB, safetensors, O_DIRECT thread pool), ``scaling`` (sweeps and
plots) <- ``report`` (targets, JSON, tables) <- ``runner`` (one run) <- ``cli``.
Beside them, on ``common``, the benchmarks behind tools/: ``fio_ratios``
(tools/bench.py), ``tiering`` and ``tiering_cli`` (the tier manager), ``churn``,
``reopen``, ``get_latency``, ``index_check``, ``syscall_profile``, ``ab_hot_paths``,
``gpu_check`` and ``vllm_tier``. See docs/benchmarks.md for what each number means
and how to reproduce it.
"""

from kvstore.bench.common import Measurement
from kvstore.bench.runner import BenchOptions, run_bench

__all__ = ["BenchOptions", "Measurement", "run_bench"]
