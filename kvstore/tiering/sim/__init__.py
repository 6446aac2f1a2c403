"""``kvstore sim``: the tier manager replayed on request traces beside its peers.

The simulator drives the real ``TierManager`` on the fake mover (a virtual clock,
no bytes) and models of the peers' policies, on traces read or generated here:

    replay.py   the replay (``run``, ``simulate_kvstore``, ``Machine``, overrides)
    cli.py      the click command (``kvstore sim``, ``python -m kvstore.tiering.sim``)
    peers.py    the peers' policies (vLLM, LMCache, SGLang, Dynamo, Mooncake models)
    trace.py    Mooncake-format traces: read, generate (docs/tiering.md, "Workloads"),
                the packaged one (data/)
    suite.py    ``--suite``: every kind x seeds x capacities, judged (docs/tiering.md,
                "The suite")
    plots.py    the frontier plots of ``--plot`` and of ``--suite --out``; the plot
                of ``--nodes``
    cluster.py  ``--nodes``: a trace across serving nodes, a manager each, with and
                without a shared pool (docs/tiering.md, "Beyond one machine, by
                simulation")

The tier manager imports none of it. Neither the simulator nor ``kvstore tier stat``
needs torch.
"""

from kvstore.tiering.sim.replay import (
    Machine,
    SimResult,
    kvstore_config,
    parse_overrides,
    run,
    simulate_kvstore,
)

__all__ = ["Machine", "SimResult", "kvstore_config", "parse_overrides", "run", "simulate_kvstore"]
