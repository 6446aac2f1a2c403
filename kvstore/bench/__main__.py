"""``python -m kvstore.bench``: the same command as ``kvstore bench``."""

from kvstore.bench.cli import bench

bench()
