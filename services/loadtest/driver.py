"""The load itself: submit requests, keep the fleet at its target utilisation, time outcomes.

The driver plays the pod bridge's part on the bus: ``AllocationRequest`` on
``tandem.alloc.request`` and ``Release`` on ``tandem.alloc.release.<node>``, with the bridge's
``Nats-Msg-Id`` s. It watches outcomes with plain core subscriptions (a JetStream publish is an
ordinary NATS message too, so no consumer is created): ``Assignment``, ``AllocationFailed``,
``Freed`` and the nodes' ``Applied``. Every time is taken on one monotonic clock in this
process: *submit* just before the publish is queued, an outcome when its message is handled
here.

Utilisation: ``target = util * fleet GPUs``. *Placed* GPUs are those of requests held
(assigned, not released) or pending (answered unschedulable, to be placed when capacity
frees); *in flight* are those of requests not answered yet. The fill: requests go out while
placed + in flight stays below the target (so an open loop does not overshoot it). Once placed
reaches the target the fill is over, and from then on every new request is preceded by the
release of a random held one (a second one too if that was not enough) whenever placed is at
or above the target — so the fleet stays at the target, the requests in flight land on top of
it, and the allocator keeps deciding on a full fleet, with frees in the mix. After the fill,
requests wait only when placed + in flight reaches the whole fleet (more work than the fleet
can hold would only turn into a storm of unschedulable answers), so at most the free share of
the fleet (``1 - util``) is in flight. The time arrivals spent waiting at these gates is
reported (``arrival_wait_s``); a system slower than the offered rate shows there, and in
``decisions_per_s``.

Pacing: with ``rate`` the i-th request is due at ``start + i / rate`` (an open-loop arrival
schedule: a slow system does not slow the arrivals, short of the gates above); without it,
requests go out as fast as they can with at most ``max_in_flight`` awaiting their first
answer.

Counting (see ``docs/benchmarks.md``): a request's *first outcome* is its first
``Assignment`` or ``AllocationFailed``; ``decisions_per_s`` = first outcomes / (last first
outcome - first submit). Latencies are over requests whose first outcome was an assignment
(a request that waited for capacity measures the fleet being full, not the allocator).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from schemas import codec, subjects
from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    Applied,
    Assignment,
    Freed,
    PodRef,
    Release,
)
from services.loadtest.mix import NAMESPACE, RequestStream
from services.loadtest.publisher import AsyncPublisher

# Subscriptions see every outcome of the run; never drop one for being slow.
SUB_PENDING_MSGS = 4_000_000
SUB_PENDING_BYTES = 1024 * 1024 * 1024
# Releases before one arrival at most: one keeps the count level, a second pulls the fleet back
# to its target when big requests replaced small ones.
RELEASES_PER_ARRIVAL = 2


@dataclass(slots=True)
class Req:
    gpus: int
    submitted: float
    measured: bool = True  # False: the readiness probe, outside every figure
    first: float | None = None
    assigned: float | None = None
    node: str | None = None
    applied: float | None = None
    failed: bool = False
    rejected: bool = False
    released: float | None = None
    freed: float | None = None
    held_at: int = -1  # index in LoadDriver._held, -1 when not held


class LoadDriver:
    def __init__(
        self,
        nc: NATS,
        publisher: AsyncPublisher,
        *,
        stream: RequestStream,
        fleet_gpus: int,
        util: float,
        requests: int,
        rate: float | None,
        max_in_flight: int,
        seed: int,
    ) -> None:
        self.nc = nc
        self.publisher = publisher
        self.stream = stream
        self.target = util * fleet_gpus
        self.fleet_gpus = fleet_gpus
        self.total = requests
        self.rate = rate
        self.max_in_flight = max_in_flight
        self.rng = random.Random(seed ^ 0x5EED)
        self.reqs: dict[str, Req] = {}  # the measured requests
        self.extra_placements: set[str] = set()  # assignments of one request to two nodes
        self.held_gpus = 0
        self.in_flight_gpus = 0
        self.pending_gpus = 0
        self.peak_held_gpus = 0
        self.filled = False
        self.arrival_wait_s = 0.0
        self.first_outcomes = 0
        self.last_first: float | None = None
        self.started: float | None = None
        self.submit_done: float | None = None
        self._held: list[str] = []
        self._progress = asyncio.Event()
        self._subs: list[Subscription] = []
        self._probes: dict[str, Req] = {}

    # -- observation --------------------------------------------------------------------------

    async def observe(self) -> None:
        for subject, cb in (
            (subjects.ALLOC_ASSIGNED_ALL, self._on_alloc),
            (subjects.ALLOC_FAILED, self._on_alloc),
            (subjects.ALLOC_FREED, self._on_alloc),
            # Every node's applied subject (schemas has no constant for the wildcard).
            (subjects.node_applied("*"), self._on_node),
        ):
            sub = await self.nc.subscribe(
                subject,
                cb=cb,
                pending_msgs_limit=SUB_PENDING_MSGS,
                pending_bytes_limit=SUB_PENDING_BYTES,
            )
            self._subs.append(sub)
        await self.nc.flush()

    async def close(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()

    def _req(self, rid: str) -> Req | None:
        return self.reqs.get(rid) or self._probes.get(rid)

    async def _on_alloc(self, msg: Msg) -> None:
        now = time.perf_counter()
        try:
            event = codec.ALLOC_EVENT.decode(msg.data)
        except codec.DecodeErrors:
            return
        if not isinstance(event, Assignment | AllocationFailed | Freed):
            return
        rid = event.request_id
        req = self._req(rid)
        if req is None:
            return
        if isinstance(event, Assignment):
            if req.node is not None and req.node != event.node:
                self.extra_placements.add(rid)
            if req.assigned is None:
                req.assigned, req.node = now, event.node
                if req.measured and req.first is not None:  # placed after waiting as pending
                    self.pending_gpus -= req.gpus
                self._first(req, now)
                if req.measured and req.released is None:
                    self._hold(rid, req)
        elif isinstance(event, AllocationFailed):
            was_pending = req.failed and not req.rejected and req.assigned is None
            req.rejected = req.rejected or not event.retrying
            if not req.failed and req.assigned is None:
                req.failed = True
                self._first(req, now)
                if req.measured and not req.rejected:
                    self.pending_gpus += req.gpus
            elif was_pending and req.rejected and req.measured:  # given up for good
                self.pending_gpus -= req.gpus
        elif req.freed is None:
            req.freed = now
            if req.measured and req.first is None:  # cancelled before any other answer
                self._first(req, now)

    async def _on_node(self, msg: Msg) -> None:
        now = time.perf_counter()
        try:
            event = codec.NODE_EVENT.decode(msg.data)
        except codec.DecodeErrors:
            return
        if isinstance(event, Applied) and event.ok:
            req = self._req(event.request_id)
            if req is not None and req.applied is None:
                req.applied = now

    def _first(self, req: Req, now: float) -> None:
        if req.first is not None:
            return
        req.first = now
        if req.measured:
            self.first_outcomes += 1
            self.last_first = now
            self.in_flight_gpus -= req.gpus
        self._progress.set()

    def _hold(self, rid: str, req: Req) -> None:
        req.held_at = len(self._held)
        self._held.append(rid)
        self.held_gpus += req.gpus
        self.peak_held_gpus = max(self.peak_held_gpus, self.held_gpus)
        self._progress.set()

    def _unhold(self, req: Req) -> None:
        """Swap-remove from the held list (O(1), so a random pick stays cheap)."""
        i, last = req.held_at, self._held[-1]
        self._held[i] = last
        self.reqs[last].held_at = i
        self._held.pop()
        req.held_at = -1
        self.held_gpus -= req.gpus

    # -- load -----------------------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        """Measured requests without an answer yet."""
        return len(self.reqs) - self.first_outcomes

    @property
    def placed_gpus(self) -> int:
        return self.held_gpus + self.pending_gpus

    def submit(self, request: AllocationRequest, *, measured: bool = True) -> Req:
        """Publish ``request``; ``measured=False`` tracks it outside the load (the probe)."""
        rid = request.request_id
        req = Req(gpus=request.gpus, submitted=time.perf_counter(), measured=measured)
        if measured:
            self.reqs[rid] = req
            self.in_flight_gpus += req.gpus
        else:
            self._probes[rid] = req
        self.publisher.submit(
            subjects.ALLOC_REQUEST, codec.encode(request), msg_id=subjects.msg_id("request", rid)
        )
        return req

    def release(self, rid: str) -> None:
        req = self._req(rid)
        if req is None or req.node is None or req.released is not None:
            return
        if req.held_at >= 0:
            self._unhold(req)
        req.released = time.perf_counter()
        subject = subjects.alloc_release(req.node)
        pod = PodRef(namespace=NAMESPACE, name=rid, uid=rid)
        msg = Release(request_id=rid, pod=pod, node=req.node)
        self.publisher.submit(subject, codec.encode(msg), msg_id=subjects.msg_id("release", rid, subject))

    async def _wait_progress(self, alive: Callable[[], None] | None) -> None:
        self._progress.clear()
        try:
            await asyncio.wait_for(self._progress.wait(), 1.0)
        except TimeoutError:
            if alive is not None:
                alive()

    async def run(
        self,
        *,
        checkpoints: dict[int, Callable[[], None]] | None = None,
        alive: Callable[[], None] | None = None,
    ) -> None:
        """Submit ``requests``; right after submit number ``k`` of ``checkpoints`` call its hook
        (it must not block: it starts a task), and call ``alive`` now and then (it raises when
        a child process died)."""
        start = self.started = time.perf_counter()
        hooks = checkpoints or {}
        for i in range(self.total):
            if i % 256 == 0 and alive is not None:
                alive()
            if self.rate is not None:
                ahead = start + i / self.rate - time.perf_counter()
                if ahead > 0.001:
                    await asyncio.sleep(ahead)
                elif i % 64 == 0:
                    await asyncio.sleep(0)  # let answers in while catching up
            else:
                while self.outstanding >= self.max_in_flight:
                    await self._wait_progress(alive)
                if i % 64 == 0:
                    await asyncio.sleep(0)
            await self._gate(alive)
            self.filled = self.filled or self.placed_gpus >= self.target
            for _ in range(RELEASES_PER_ARRIVAL if self.filled else 0):
                if not self._held or self.placed_gpus < self.target:
                    break
                self.release(self._held[self.rng.randrange(len(self._held))])
            self.submit(self.stream.next())
            hook = hooks.get(i + 1)
            if hook is not None:
                hook()
        self.submit_done = time.perf_counter()

    async def _gate(self, alive: Callable[[], None] | None) -> None:
        """Wait while the work in the fleet is at its limit: the target during the fill, the
        whole fleet afterwards (see the module docstring)."""
        began = time.perf_counter()
        while self.in_flight_gpus > 0:
            limit = self.fleet_gpus if self.filled else self.target
            if self.placed_gpus + self.in_flight_gpus < limit:
                break
            await self._wait_progress(alive)
        self.arrival_wait_s += time.perf_counter() - began

    def settled(self) -> bool:
        """Every request has an answer and every release its ``Freed``."""
        return self.outstanding == 0 and all(
            r.freed is not None for r in self.reqs.values() if r.released is not None
        )

    async def drain(self, *, timeout: float, alive: Callable[[], None] | None = None) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.settled():
            if loop.time() > deadline:
                return False
            if alive is not None:
                alive()
            await asyncio.sleep(0.1)
        return True
