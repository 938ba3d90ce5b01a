"""Allocator replicas: who is alive, and which nodes each decides on first.

Replicas share one durable consumer of requests, so any replica may get any request. With
binpack they would all choose the same fullest nodes and their commits would meet there
(measured: 5,321 compare-and-set conflicts in 10,000 requests with two replicas). So each
replica says it is alive on ``tandem.allocator.heartbeat`` every ``MEMBER_INTERVAL_S``; the
replicas heard from in the last ``MEMBER_LOST_S``, sorted by name, split the nodes: the read
model registers each node in the core with its shard (CRC32 of the name modulo the number of
replicas) and a replica asks the core to prefer its own shard (:meth:`Replicas.decide`; the
core's shard preference, services/allocator/core/scores.py). A replica that hears a new one
splits the nodes with it at once and answers with its own heartbeat, so a replica that
starts — or restarts under the same name: beats carry the start time of their process —
knows its peers within a round trip. Shards steer, they do not guard: a replica still falls back to
every node when its shard has no room, and correctness rests on the compare-and-set writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg

from schemas import codec, subjects
from schemas.messages import AllocationRequest, AllocatorHeartbeat
from services.allocator import metrics
from services.allocator.core import Cluster, Placement, Unschedulable
from services.allocator.readmodel import HOSTNAME_LABEL, ReadModel, shard_of
from services.runtime.nats.bus import Bus
from services.runtime.observe.logging import get_logger
from services.runtime.process.tasks import Supervisor

log = get_logger(__name__)

MEMBER_INTERVAL_S = 1.0
MEMBER_LOST_S = 3.5


def decide_in_shard(
    cluster: Cluster,
    req: AllocationRequest,
    shard: str | None,
    *,
    catch_up: Callable[[], None] | None = None,
    on_fallback: Callable[[], None] | None = None,
    fallback: bool = True,
) -> Placement | Unschedulable:
    """The core's decision, on the nodes of ``shard`` first; all nodes when the shard has no
    room (so a request is unschedulable only when no node at all can take it), unless
    ``fallback`` is false (a request another replica handed over: the shard's answer is the
    answer). A pinned request goes straight to its node. ``catch_up`` brings the other
    shards' nodes up to date before a decision looks at them (:meth:`ReadModel.catch_up`).
    Outside its shard a replica takes the last of equally good nodes (the core does, with
    ``prefer_shard``): their owner takes the first, and both taking the same one made every
    such decision a compare-and-set conflict. ``on_fallback`` is told of each decision that
    leaves the shard."""
    if shard is None or HOSTNAME_LABEL in req.node_selector:
        if catch_up is not None:
            catch_up()
        return cluster.decide(req)
    before = catch_up
    if on_fallback is not None:

        def before() -> None:
            on_fallback()
            if catch_up is not None:
                catch_up()

    return cluster.decide(req, prefer_shard=shard, before_fallback=before, fallback=fallback)


class Replicas:
    def __init__(self, bus: Bus, *, instance: str, model: ReadModel) -> None:
        self.bus = bus
        self.instance = instance
        self.model = model
        self._others: dict[str, float] = {}  # other live replicas → last heartbeat (monotonic)
        self._started: dict[str, float] = {}  # other live replicas → when they started
        self._live = [instance]  # every live replica, sorted: shard i is live[i]
        self._beat = AllocatorHeartbeat(instance=instance, started=time.time())
        self._sub: Any = None

    async def start(self, tasks: Supervisor) -> None:
        self._sub = await self.bus.nc.subscribe(subjects.ALLOCATOR_HEARTBEAT, cb=self._on_heartbeat)
        tasks.spawn("replicas", self._loop)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    @property
    def shard(self) -> str | None:
        """This replica's shard while there are several (kept by the read model, which defers
        the other shards' records by it)."""
        return self.model.shard

    def decide(self, req: AllocationRequest, *, fallback: bool = True) -> Placement | Unschedulable:
        # A request that falls back outside the shard is counted: each one looks at the
        # other replicas' nodes, where their commits are in flight.
        return decide_in_shard(
            self.model.cluster,
            req,
            self.shard,
            catch_up=self._catch_up,
            on_fallback=metrics.SHARD_FALLBACKS.inc,
            fallback=fallback,
        )

    def owner(self, node: str) -> str | None:
        """The live replica whose shard ``node`` is in, when that is another replica than
        this one (None: this one's, or no other replica is alive)."""
        live = self._live
        if len(live) < 2 or self.model.shards != len(live):
            return None
        name = live[int(shard_of(node, len(live)))]
        return None if name == self.instance else name

    def _catch_up(self) -> None:
        t0 = time.perf_counter()
        self.model.catch_up()
        metrics.CATCH_UP_SECONDS.inc(time.perf_counter() - t0)

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            beat = codec.ALLOCATOR_HEARTBEAT.decode(msg.data)
        except codec.DecodeErrors:
            return  # not a heartbeat; membership only steers which nodes come first
        if beat.instance == self.instance:
            return
        # New: a name not heard from, or one heard from before it restarted (SIGKILLed and
        # started again within MEMBER_LOST_S, its name still counted alive).
        new = beat.instance not in self._others or self._started.get(beat.instance) != beat.started
        self._others[beat.instance] = time.monotonic()
        self._started[beat.instance] = beat.started
        if new:
            # A replica that just started: split the nodes with it now, and tell it at once
            # that this one is alive. Waiting for the next beats left a new replica deciding on
            # every node for up to two intervals, on the same fullest nodes as the others:
            # a burst of compare-and-set conflicts at the start of a tandem loadtest.
            self._reshard()
            await self._announce()

    async def _announce(self) -> None:
        beat = msgspec.structs.replace(self._beat, ts=time.time())
        await self.bus.publish_core(subjects.ALLOCATOR_HEARTBEAT, beat)

    def _reshard(self) -> None:
        live = sorted([*self._others, self.instance])
        self._live = live
        shard = str(live.index(self.instance)) if len(live) > 1 else None
        if len(live) != self.model.shards or shard != self.shard:
            log.info("replicas_changed", live=live, shard=shard)
        self.model.set_shards(len(live), shard)

    async def _loop(self) -> None:
        while True:
            await self._announce()
            cutoff = time.monotonic() - MEMBER_LOST_S
            for name in [n for n, seen in self._others.items() if seen < cutoff]:
                del self._others[name]
                self._started.pop(name, None)
            self._reshard()
            await asyncio.sleep(MEMBER_INTERVAL_S)
