"""Node agent metrics kept out of :mod:`.service` (its counters live there).

* :data:`SUBMIT_TO_APPLIED_SECONDS`: request created → devices applied on this node;
* :data:`AGENT_DEVICES` (``tandem_nodeagent_devices{node,kind,state}``): the node's GPUs and
  NICs by state (free, allocated, unhealthy, cordoned — the allocator's states), from what the
  agent itself knows: its discovered topology, its devices' health and the allocation record
  it follows. Computed at scrape time, so it is right from the first scrape after a restart.
  Each node serves its own per-node view, so a fleet of any size has one without the
  allocator rendering every node's series (which it stops doing past ``node_metrics_max``
  nodes: docs/metrics.md). One process may run many agents (``tandem up``, the demo): one
  collector for the process, one set of series per running agent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

SUBMIT_TO_APPLIED_SECONDS = Histogram(
    "tandem_nodeagent_submit_to_applied_seconds",
    "From the request's creation (the assignment's requested_at) to its devices applied on the node",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 15, 60, 300, 1800),
)

# (kind, state) -> devices; None while the agent has not discovered its devices yet.
DeviceCounts = Callable[[], dict[tuple[str, str], int] | None]


class AgentDevices(Collector):
    """``tandem_nodeagent_devices`` of every agent running in this process."""

    def __init__(self) -> None:
        self._agents: dict[str, DeviceCounts] = {}

    def track(self, node: str, counts: DeviceCounts) -> None:
        self._agents[node] = counts

    def untrack(self, node: str, counts: DeviceCounts) -> None:
        """Forget ``node``'s agent, unless another agent of that node took its place since (a
        restart in one process, the new one started before the old one stopped)."""
        if self._agents.get(node) == counts:
            del self._agents[node]

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "tandem_nodeagent_devices",
            "This node's GPUs and NICs by state, as its agent knows them",
            labels=["node", "kind", "state"],
        )
        for node, counts in sorted(self._agents.items()):
            for (kind, state), n in sorted((counts() or {}).items()):
                family.add_metric([node, kind, state], n)
        yield family


AGENT_DEVICES = AgentDevices()
REGISTRY.register(AGENT_DEVICES)
