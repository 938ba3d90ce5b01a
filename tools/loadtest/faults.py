"""A NATS server killed in the middle of a run and brought back (``--kill-server-at F``).

Production profile only (three servers, every stream R3): once ``F`` of the requests are
submitted, the server leading ``KV_tandem-allocs`` — the bucket every decision writes — is
SIGKILLed (no goodbye to its peers or clients, as a crashed machine), stays down
``--kill-down`` seconds and is started again on the same ports and store
(:class:`~services.runtime.process.embedded.EmbeddedNatsCluster`), waiting until it is healthy,
i.e. has caught up with the streams it replicates. The clients on it (a third of the nodes'
connections, perhaps a service) reconnect to the others, through the callout again.

The load goes on meanwhile; the report says which server went, for how long, how long it
took to come back (``nats_kill``), and the longest time without a decision during the load
(``longest_stall_s``, every run). The invariants and the ledger judge the run as any other:
nothing lost, nothing held twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import nats.errors

from services.runtime.errors import EmbeddedServerError
from services.runtime.nats.bus import Bus
from services.runtime.process.embedded import EmbeddedNatsCluster
from tools.loadtest.errors import LoadtestError
from tools.loadtest.report import KillFigures

LEADER_STREAM = "KV_tandem-allocs"
RESTART_S = 90.0

Progress = Callable[[str], None]


class ServerKill:
    def __init__(self, cluster: EmbeddedNatsCluster, bus: Bus, *, down_s: float, progress: Progress) -> None:
        self.cluster = cluster
        self.bus = bus
        self.down_s = down_s
        self.progress = progress
        self.figures = KillFigures(down_s=down_s)

    async def _victim(self) -> tuple[int, str]:
        """The leader of the allocation bucket's stream, else the first server."""
        with contextlib.suppress(nats.errors.Error, TimeoutError, EmbeddedServerError):
            info = (await asyncio.wait_for(self.bus.js.stream_info(LEADER_STREAM), 5.0)).cluster
            if info is not None and info.leader:
                return self.cluster.index_of(info.leader), f"leader of {LEADER_STREAM}"
        return 0, "no leader found"

    async def run(self, *, started: float) -> None:
        index, why = await self._victim()
        name = self.cluster.server_names[index]
        self.figures.server = f"{name} ({why})"
        self.figures.at_s = round(time.perf_counter() - started, 3)
        await asyncio.to_thread(self.cluster.kill, index)
        self.progress(f"SIGKILLed nats-server {self.figures.server}; back in {self.down_s:g} s")
        await asyncio.sleep(self.down_s)
        began = time.perf_counter()
        try:
            await asyncio.to_thread(self.cluster.restart, index, timeout=RESTART_S)
        except EmbeddedServerError as exc:
            raise LoadtestError(f"nats-server {name} did not come back: {str(exc).splitlines()[0]}") from exc
        self.figures.back_s = round(time.perf_counter() - began, 3)
        self.progress(f"nats-server {name} healthy again after {self.figures.back_s:g} s")
