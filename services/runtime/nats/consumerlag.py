"""Consumer lag: how far each durable consumer a service runs is behind its stream.

:func:`watch_consumers` asks the server for each consumer's info every
:data:`CONSUMER_POLL_S` and keeps :data:`services.runtime.observe.metrics.CONSUMER_PENDING` up to
date (a lagging service shows there before it shows anywhere else). It lives in the NATS kit,
which reports into :mod:`services.runtime.observe.metrics` (reconnects, this lag); the metrics
know no bus, so neither imports the other back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from nats.js.errors import NotFoundError

from services.runtime.nats.bus import Bus
from services.runtime.observe.logging import get_logger
from services.runtime.observe.metrics import CONSUMER_PENDING

__all__ = ["CONSUMER_POLL_S", "watch_consumers"]

log = get_logger(__name__)

# How often the consumer infos are asked for: one small request per consumer.
CONSUMER_POLL_S = 5.0


async def watch_consumers(buses: Iterable[Bus], *, interval: float = CONSUMER_POLL_S) -> None:
    """Keep :data:`CONSUMER_PENDING` up to date for every durable consumer the buses run."""
    buses = list(buses)
    while True:
        for bus in buses:
            for stream, durable in sorted(bus.consumers):
                try:
                    info = await bus.js.consumer_info(stream, durable)
                except NotFoundError:
                    continue  # being recreated (Bus.consume does it): the next poll sees it
                except Exception as exc:  # NATS away: keep the last value
                    log.debug("consumer_info_failed", consumer=durable, error=repr(exc))
                    continue
                CONSUMER_PENDING.labels(bus.service, durable).set(info.num_pending or 0)
        await asyncio.sleep(interval)
