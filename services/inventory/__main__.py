"""``python -m services.inventory``: run one inventory replica."""

from __future__ import annotations

import sys

from services.inventory.service import Inventory
from services.runtime.bus import Bus
from services.runtime.lifecycle import service_main
from services.runtime.settings import Settings


async def build(bus: Bus, settings: Settings) -> Inventory:
    return Inventory(bus, lost_after=settings.node_lost_after)


if __name__ == "__main__":
    sys.exit(service_main("inventory", build))
