"""``python -m services.allocator``: run one allocator replica."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from services.allocator.metrics import AllocatorState
from services.allocator.service import Allocator
from services.runtime.nats.bus import Bus
from services.runtime.observe.metrics import register_state
from services.runtime.process.lifecycle import service_main
from services.runtime.settings import Settings


@dataclass
class Replica:
    """The allocator with its gauges, counted as it starts, once its records are read (before
    it reports ready), not at the first scrape."""

    allocator: Allocator
    gauges: AllocatorState

    async def start(self) -> None:
        await self.allocator.start()
        self.gauges.prime()

    async def stop(self) -> None:
        await self.allocator.stop()


async def build(bus: Bus, settings: Settings) -> Replica:
    allocator = Allocator(
        bus,
        instance=settings.instance,
        node_policy=settings.node_policy,
        device_classes=settings.device_classes,
        finished_request_ttl=settings.finished_request_ttl,
        claim_timeout=settings.claim_timeout,
        fabric_tiers=settings.fabric_tiers,
    )
    # Its gauges, computed at each scrape.
    gauges = AllocatorState(allocator, node_metrics_max=settings.node_metrics_max)
    register_state(gauges)
    return Replica(allocator, gauges)


if __name__ == "__main__":
    sys.exit(service_main("allocator", build))
