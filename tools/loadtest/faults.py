"""A NATS server taken away in the middle of a run and brought back: killed
(``--kill-server-at F``) or cut off the network (``--partition-server-at F``).

Production profile only (three servers, every stream R3). Once ``F`` of the requests are
submitted, the server leading ``KV_tandem-allocs`` — the bucket every decision writes — goes:

* **killed**: SIGKILLed (no goodbye to its peers or clients, as a crashed machine), down for
  ``--kill-down`` seconds, then started again on the same ports and store
  (:meth:`~services.runtime.process.embedded.EmbeddedNatsCluster.restart`). Its clients see
  their connection closed and reconnect to the others at once, through the callout again;
* **cut off**: the servers run in network namespaces of their own for such a run
  (:mod:`tools.loadtest.production`), and that server's link goes down for ``--partition-for``
  seconds (:meth:`~services.runtime.process.embedded.EmbeddedNatsCluster.partition`): it runs
  on, alone, and nothing reaches it or leaves it. Its clients see silence, not a closed
  connection, until their pings go unanswered (``nats_ping_interval``); its peers stop hearing
  it, and the two of them elect new leaders for what it led. Then the link is back up, and it
  rejoins: whatever it had started alone (it can commit nothing without a quorum) gives way to
  what the other two decided.

Either way the harness waits until the server is healthy again, i.e. current with the streams
it replicates. The load goes on meanwhile; the report says which server went, for how long, and
how long it took to be healthy after it was back (``nats_kill`` / ``nats_partition``), and the
longest time without a decision during the load (``longest_stall_s``, every run). The
invariants and the ledger judge the run as any other: nothing lost, nothing held twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Literal

import nats.errors

from services.runtime.errors import EmbeddedServerError
from services.runtime.nats.bus import Bus
from services.runtime.process.embedded import EmbeddedNatsCluster
from services.runtime.process.podnet import PodNetworkError
from tools.loadtest.errors import LoadtestError
from tools.loadtest.report import FaultFigures

LEADER_STREAM = "KV_tandem-allocs"
RESTART_S = 90.0

Progress = Callable[[str], None]
FaultKind = Literal["kill", "partition"]


class ServerFault:
    def __init__(
        self, cluster: EmbeddedNatsCluster, bus: Bus, *, kind: FaultKind, down_s: float, progress: Progress
    ) -> None:
        self.cluster = cluster
        self.bus = bus
        self.kind = kind
        self.down_s = down_s
        self.progress = progress
        self.figures = FaultFigures(down_s=down_s)

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
        try:
            if self.kind == "kill":
                await asyncio.to_thread(self.cluster.kill, index)
                self.progress(f"SIGKILLed nats-server {self.figures.server}; back in {self.down_s:g} s")
            else:
                await asyncio.to_thread(self.cluster.partition, index)
                self.progress(f"cut nats-server {self.figures.server} off the network for {self.down_s:g} s")
            await asyncio.sleep(self.down_s)
            began = time.perf_counter()
            if self.kind == "kill":
                await asyncio.to_thread(self.cluster.restart, index, timeout=RESTART_S)
            else:
                await asyncio.to_thread(self.cluster.rejoin, index)
                await asyncio.to_thread(self.cluster.wait_healthy, [index], timeout=RESTART_S)
        except (EmbeddedServerError, PodNetworkError) as exc:
            raise LoadtestError(f"nats-server {name} did not come back: {str(exc).splitlines()[0]}") from exc
        self.figures.back_s = round(time.perf_counter() - began, 3)
        self.progress(f"nats-server {name} healthy again after {self.figures.back_s:g} s")
