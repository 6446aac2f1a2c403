"""Decision fingerprints of the tier manager in simulation: are two trees' decisions identical?

    python tools/sim_identity.py --out new.json [--trace T] [--full]
    python tools/sim_identity.py --out new.json --against base.json

A thin command line over ``kvstore.testing.sim_identity`` (its docstring says what is
replayed and what a fingerprint holds).
"""

from __future__ import annotations

import sys

from kvstore.testing.sim_identity import main

if __name__ == "__main__":
    sys.exit(main())
