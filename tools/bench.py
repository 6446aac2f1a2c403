"""kvstore against fio, the ratio table: a thin CLI over kvstore/bench/fio_ratios.py
(``kvstore bench --against-fio`` runs the same with the common options)."""

import sys

from kvstore.bench.fio_ratios import main

if __name__ == "__main__":
    sys.exit(main())
