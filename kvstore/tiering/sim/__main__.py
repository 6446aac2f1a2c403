"""``python -m kvstore.tiering.sim``: the same command as ``kvstore sim``."""

from kvstore.tiering.sim.cli import main

main()
