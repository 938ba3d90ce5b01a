"""``tandem chaos`` / ``make soak``: kill components under load, check the invariants after
each round.

Where ``tandem loadtest`` measures the running system, this runs the same processes — a
three-server JetStream cluster, the inventory and two allocator replicas as their own
processes, a simulated fleet process — under a request/release load and SIGKILLs one of them
each round (an allocator, the inventory, the fleet, a NATS server: often the leader of a KV
bucket or of the meta group), starts it again and then reads KV to check that nothing was
held twice, lost, left half-done or leaked (``docs/reliability.md``).

Modules::

    runner   one run: cluster, services, fleet, rounds (load, kill, restart, verdicts), teardown
    victims  the seeded schedule: which component dies each round, when, for how long (pure)
    checker  the invariants, read from KV tandem-allocs and tandem-requests
    report   the JSON line and the human summary (pure)

It reuses :mod:`tools.loadtest` (processes, fleet, load driver, KV snapshots) and its one
error type, :class:`~tools.loadtest.errors.LoadtestError`: a run that cannot go on (a
process that would not start or died on its own, a server that did not come back).
"""

from __future__ import annotations

from tools.chaos.report import ChaosReport, summary, to_json_line
from tools.chaos.runner import ChaosConfig, ChaosRunner, run_chaos

__all__ = ["ChaosConfig", "ChaosReport", "ChaosRunner", "run_chaos", "summary", "to_json_line"]
