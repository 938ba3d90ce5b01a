"""``python -m services.inventory``: run one inventory replica."""

from __future__ import annotations

import sys

from services.inventory.metrics import InventoryState
from services.inventory.service import Inventory
from services.runtime.nats.bus import Bus
from services.runtime.observe.metrics import register_state
from services.runtime.process.lifecycle import service_main
from services.runtime.settings import Settings


async def build(bus: Bus, settings: Settings) -> Inventory:
    inventory = Inventory(bus, lost_after=settings.node_lost_after)
    register_state(InventoryState(inventory))  # its gauges, computed at each scrape
    return inventory


if __name__ == "__main__":
    sys.exit(service_main("inventory", build))
