"""How long the event loop was held, and by what: the p99 of a running service.

A service decides on one event loop; whatever holds it (a long decision, a pass over pending
requests, a garbage collection over a large heap) delays every message behind it. Two
Prometheus histograms say how often and how long:

* ``tandem_event_loop_lag_seconds``: a task sleeps ``interval`` and measures how late it wakes;
* ``tandem_gc_pause_seconds{generation}``: every collection, timed with ``gc.callbacks``.

A stall beyond ``warn_after`` is also logged (``event_loop_stalled``), with the collections
that ran meanwhile, so a latency spike in a load test can be traced to its cause.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

from prometheus_client import Histogram

from services.runtime.observe.logging import get_logger

log = get_logger(__name__)

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LOOP_LAG = Histogram(
    "tandem_event_loop_lag_seconds", "How late a periodic wake-up of the event loop came", buckets=_BUCKETS
)
GC_PAUSE = Histogram(
    "tandem_gc_pause_seconds", "Garbage collections, by generation", ["generation"], buckets=_BUCKETS
)


class _GcTimer:
    def __init__(self) -> None:
        self.started = 0.0
        self.recent: list[tuple[int, float]] = []  # (generation, seconds) since the last stall report

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        took = time.perf_counter() - self.started
        generation = int(info.get("generation", -1))
        GC_PAUSE.labels(str(generation)).observe(took)
        if took >= 0.005:
            self.recent.append((generation, round(took, 4)))
            del self.recent[:-8]


async def watch_loop(*, interval: float = 0.05, warn_after: float = 0.1) -> None:
    """Run until cancelled, measuring the loop's lag (see the module docstring)."""
    timer = _GcTimer()
    gc.callbacks.append(timer)
    try:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(interval)
            lag = max(0.0, time.perf_counter() - before - interval)
            LOOP_LAG.observe(lag)
            if lag >= warn_after:
                log.warning("event_loop_stalled", seconds=round(lag, 3), collections=list(timer.recent))
            timer.recent.clear()
    finally:
        gc.callbacks.remove(timer)
