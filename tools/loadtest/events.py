"""The simulated fleet's JSON lines on its stdout (:mod:`tools.loadtest.fleet`), by event name:
``ready`` (every inventory stored), ``overlap`` and ``cleanup_failed`` as they happen, ``stats``
when it stops. Read by ``tandem loadtest`` and ``tandem chaos``."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from tools.loadtest.errors import LoadtestError
from tools.loadtest.procs import Child


class FleetEvents:
    """The fleet's JSON lines on its stdout, by event name."""

    def __init__(self, child: Child) -> None:
        self.child = child
        self.events: dict[str, dict[str, Any]] = {}  # the last of each name
        self.seen: Counter[str] = Counter()  # how many of each name (overlap, cleanup_failed)
        self.changed = asyncio.Event()
        self.closed = asyncio.Event()

    async def read(self) -> None:
        stdout = self.child.proc.stdout
        assert stdout is not None
        try:
            while line := await stdout.readline():
                with contextlib.suppress(msgspec.DecodeError):
                    event = msgspec.json.decode(line, type=dict[str, Any])
                    name = str(event.get("event"))
                    self.events[name] = event
                    self.seen[name] += 1
                    self.changed.set()
        finally:
            self.closed.set()

    async def wait(self, name: str, *, deadline: float, alive: Callable[[], None]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        while name not in self.events:
            alive()
            if loop.time() > deadline:
                raise LoadtestError(
                    f"fleet did not report {name!r} in time"
                    f"{': ' + self.child.tail() if self.child.tail() else ''} (log: {self.child.log})"
                )
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), 0.5)
        return self.events[name]
