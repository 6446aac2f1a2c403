"""Where does kvstore's time go? Profile the put and get paths of tools/bench.py.

A thin command line over ``kvstore.bench.syscall_profile``: its docstring says what it measures.

    .venv/bin/python tools/profile_kvstore.py --dir ./bench-data                # all workloads
    .venv/bin/python tools/profile_kvstore.py --dir ./bench-data --workload put_1m --top 25
"""

from __future__ import annotations

import sys

from kvstore.bench.syscall_profile import main

if __name__ == "__main__":
    sys.exit(main())
