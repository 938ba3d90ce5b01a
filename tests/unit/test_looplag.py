"""The event-loop lag monitor sees a blocked loop and names the collection inside it."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from typing import Any

import pytest

from services.runtime.observe import looplag
from services.runtime.observe.looplag import GC_PAUSE, LOOP_LAG, watch_loop


def _count(histogram: Any, **labels: str) -> float:
    metric = histogram.labels(**labels) if labels else histogram
    return float(next(s.value for s in metric.collect()[0].samples if s.name.endswith("_count")))


async def _until(condition: Callable[[], bool], *, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0)


class _Recorder:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append((event, fields))


async def test_a_blocked_loop_is_measured_and_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(looplag, "log", recorder)  # structlog may be cached by earlier tests
    lags_before = _count(LOOP_LAG)
    gc2_before = _count(GC_PAUSE, generation="2")
    task = asyncio.get_running_loop().create_task(watch_loop(interval=0.01, warn_after=0.05))
    await _until(lambda: _count(LOOP_LAG) > lags_before)  # the monitor is running
    gc.collect()  # a full collection while the loop is held ...
    time.sleep(0.12)  # noqa: ASYNC251 - the point: hold the loop longer than warn_after
    await _until(lambda: bool(recorder.warnings))  # the monitor's next wake-up reports it
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert _count(LOOP_LAG) > lags_before
    assert _count(GC_PAUSE, generation="2") > gc2_before
    stalls = [fields for event, fields in recorder.warnings if event == "event_loop_stalled"]
    assert stalls and stalls[0]["seconds"] >= 0.1
    assert not any(type(cb).__name__ == "_GcTimer" for cb in gc.callbacks)  # removed on the way out
