"""The inventory's gauges, computed from its state when Prometheus scrapes: a restarted
replica reports every node it loaded from KV at its first scrape, before any node event."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from services.inventory.service import Inventory


class InventoryState(Collector):
    """``tandem_inventory_nodes{status}``: the nodes this replica knows, ready or lost."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory

    def collect(self) -> Iterator[Metric]:
        statuses = list(self.inventory.status.values())
        nodes = GaugeMetricFamily(
            "tandem_inventory_nodes", "Nodes known to this inventory replica by status", labels=["status"]
        )
        ready = sum(1 for s in statuses if s == "ready")
        nodes.add_metric(["ready"], ready)
        nodes.add_metric(["lost"], len(statuses) - ready)
        yield nodes
