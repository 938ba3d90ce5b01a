"""The event-loop lag monitor sees a blocked loop and names the collection inside it."""

from __future__ import annotations

import asyncio
import gc
import time

import structlog.testing

from services.runtime.looplag import GC_PAUSE, LOOP_LAG, watch_loop


def _count(histogram: object, **labels: str) -> float:
    metric = histogram.labels(**labels) if labels else histogram  # type: ignore[attr-defined]
    return next(s.value for s in metric.collect()[0].samples if s.name.endswith("_count"))


async def test_a_blocked_loop_is_measured_and_logged_with_its_collections() -> None:
    lags_before = _count(LOOP_LAG)
    with structlog.testing.capture_logs() as logs:
        task = asyncio.get_running_loop().create_task(watch_loop(interval=0.01, warn_after=0.05))
        await asyncio.sleep(0.05)
        gc.collect()  # a full collection while the loop is held ...
        time.sleep(0.12)  # noqa: ASYNC251 - the point: hold the loop longer than warn_after
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert _count(LOOP_LAG) > lags_before
    assert _count(GC_PAUSE, generation="2") >= 1
    stalls = [e for e in logs if e["event"] == "event_loop_stalled"]
    assert stalls and stalls[0]["seconds"] >= 0.1
    assert gc.callbacks == [cb for cb in gc.callbacks if type(cb).__name__ != "_GcTimer"]
