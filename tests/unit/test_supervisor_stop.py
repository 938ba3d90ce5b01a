"""A task that outlives ``Supervisor.aclose``'s bound is logged, with its frames, in either
log format — the console renderer used to raise on the report (it takes ``stack`` for a
formatted traceback), turning a slow stop into a crash."""

from __future__ import annotations

import asyncio

import pytest

from services.runtime.observe.logging import setup_logging
from services.runtime.process.tasks import Supervisor


@pytest.mark.parametrize("json", [True, False])
async def test_a_task_that_does_not_stop_is_reported_not_raised(
    json: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    setup_logging(json=json)
    release = asyncio.Event()
    started = asyncio.Event()

    async def stubborn() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await release.wait()  # its cleanup outlasts the bound
            raise

    tasks = Supervisor("test")
    tasks.spawn("stubborn", stubborn, restart=False)
    await asyncio.wait_for(started.wait(), timeout=5)  # cancelled only once it runs
    await tasks.aclose(timeout=0.05)
    release.set()
    out = capfd.readouterr().err
    assert "task_did_not_stop" in out and "test:stubborn" in out
    assert "frames" in out and "tasks.py:" in out  # where it was stuck
