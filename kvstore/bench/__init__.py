"""``kvstore bench``: kvstore against fio and its peers' write paths, on one directory.

Layers: ``common`` (results, timing, cold caches, machine facts) <- ``fio``,
``kv`` (kvstore workloads and hot paths), ``peers`` (file per page, temp +
rename, LMDB, safetensors, O_DIRECT thread pool), ``scaling`` (sweeps and
plots) <- ``report`` (targets, JSON, tables) <- ``runner`` (one run) <- ``cli``.
See docs/benchmarks.md for what each number means and how to reproduce it.
"""

from kvstore.bench.common import Measurement
from kvstore.bench.runner import BenchOptions, run_bench

__all__ = ["BenchOptions", "Measurement", "run_bench"]
