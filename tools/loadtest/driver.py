"""The load itself: submit requests, keep the fleet at its target utilisation, time outcomes.

The driver plays the pod bridge's part on the bus: ``AllocationRequest`` on
``tandem.alloc.request`` and ``Release`` on ``tandem.alloc.release.<node>``, with the bridge's
``Nats-Msg-Id`` s and, as the bridge does, the ``traceparent`` of the pod's trace (made up per
request here; in a cluster the admission webhook starts it and annotates the pod), so the
allocator handles each request inside its caller's trace, as it does behind the bridge. It
watches outcomes with plain core subscriptions (a JetStream publish is an ordinary NATS
message too, so no consumer is created): ``Assignment``, ``AllocationFailed``, ``Freed`` and
the nodes' ``Applied``. Every time is taken on one monotonic clock in this process: *submit*
just before the publish is queued, an outcome when its message is handled here.

Utilisation: ``target = util * fleet GPUs``. The *demand* is the GPUs of every request held
(assigned, not released), pending (answered unschedulable, to be placed when capacity frees)
or in flight (not answered yet) — what the fleet holds once everything is answered. While
the demand is below the target, a new request just adds load (the fill; while the requests in
flight already make up the target, the driver waits for them). From then on every
new request is preceded by the release of a random held one whenever the demand is at the
target (and of a second one when held + pending alone is, after big requests replaced small
ones). A released request's devices are freed only when the node has cleaned up and the
allocator has dropped the allocation, so until its ``Freed`` it still takes room: new
requests wait while held + being freed + in flight would exceed the whole fleet. So the
allocator sees a fleet at the target plus what is still being freed — never more than the
fleet — and keeps deciding on a full fleet with frees in the mix. Requests in flight are part of the
demand, so a long queue (a system slower than the arrivals) leaves the fleet emptier: that
is what a slow scheduler does to a cluster, and ``util_mean`` (the held share at each arrival
after the fill) shows it. Hence the open loop's default in-flight bound is 5 % of the fleet's
GPUs in requests. The time arrivals spent waiting is ``arrival_wait_s``.

Pending requests are given up after ``give_up`` seconds, as a user deletes a pod that does not
start: a ``Release`` without a node (``tandem.alloc.release._unplaced``), which the allocator
turns into a cancel. Without that, the mix's 8-GPU requests (a whole free server each) pile up
and crowd out everything else (docs/benchmarks.md, "Measurements behind the code") — the core
benchmark drops a refused request at once.

Pacing: with ``rate`` the i-th request is due at ``start + i / rate`` (an open-loop arrival
schedule: a slow system does not slow the arrivals, short of the fill's wait); without it,
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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue

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
from tools.loadtest.mix import NAMESPACE, UNITS_PER_GPU, RequestStream, weight
from tools.loadtest.publisher import AsyncPublisher

# An answer or a Freed not seen this long is looked up in KV (recover_missed), this many at a time.
MISSED_AFTER_S = 3.0
MISSED_BATCH = 256
# Subscriptions see every outcome of the run; never drop one for being slow.
SUB_PENDING_MSGS = 4_000_000
SUB_PENDING_BYTES = 1024 * 1024 * 1024
# Longest wait of one arrival for room in the fleet.
STALL_S = 30.0


@dataclass(slots=True)
class Req:
    gpus: int  # in hundredths of a GPU (mix.weight)
    submitted: float
    traceparent: str  # the pod's trace, on its request and its release
    shared: bool = False  # asks a share of a GPU
    measured: bool = True  # False: the readiness probe, outside every figure
    first: float | None = None
    assigned: float | None = None
    node: str | None = None
    allocator: str = ""  # the replica whose Assignment came first (Assignment.allocator)
    applied: float | None = None
    failed: bool = False
    rejected: bool = False
    released: float | None = None
    freed: float | None = None
    pending: bool = False  # answered unschedulable, not placed yet, not given up
    releasing: bool = False  # released while held, Freed not seen yet
    cancelled: bool = False  # given up while pending: released unplaced
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
        give_up: float = 0.0,
    ) -> None:
        self.nc = nc
        self.publisher = publisher
        self.stream = stream
        # Counted in hundredths of a GPU, as requests weigh (a share its compute percent).
        self.fleet_gpus = fleet_gpus * UNITS_PER_GPU
        self.target = util * self.fleet_gpus
        self.total = requests
        self.rate = rate
        self.max_in_flight = max_in_flight
        self.give_up = give_up
        self.rng = random.Random(seed ^ 0x5EED)
        self._trace_ids = random.Random(seed ^ 0x7ACE)  # apart: the load's own draws stay as they were
        self.reqs: dict[str, Req] = {}  # the measured requests
        self.extra_placements: set[str] = set()  # assignments of one request to two nodes
        self.held_gpus = 0
        self.in_flight_gpus = 0
        self.pending_gpus = 0
        self.releasing_gpus = 0
        self.peak_held_gpus = 0
        self.filled = False
        self.util_sum = 0.0  # held share at each arrival after the fill
        self.util_samples = 0
        self.cancelled = 0
        self.arrival_wait_s = 0.0
        self.first_outcomes = 0
        self.last_first: float | None = None
        self.started: float | None = None
        self.submit_done: float | None = None
        self._held: list[str] = []
        self._progress = asyncio.Event()
        self._subs: list[Subscription] = []
        self._probes: dict[str, Req] = {}
        self._pending: deque[tuple[float, str]] = deque()  # (answered unschedulable at, id)
        self._last_recovery = 0.0
        self.recovered = 0  # outcomes read from KV after their event was missed

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
                req.assigned, req.node, req.allocator = now, event.node, event.allocator
                self._unpend(req)  # placed after waiting as pending
                self._first(req, now)
                if req.measured and req.released is None:
                    self._hold(rid, req)
        elif isinstance(event, AllocationFailed):
            req.rejected = req.rejected or not event.retrying
            if req.rejected:
                self._unpend(req)  # refused for good: nothing will be placed
            elif not req.failed and req.assigned is None and req.released is None and req.measured:
                req.pending = True
                self.pending_gpus += req.gpus
                self._pending.append((now, rid))
            if not req.failed and req.assigned is None:
                req.failed = True
                self._first(req, now)
        elif req.freed is None:
            req.freed = now
            if req.releasing:
                req.releasing = False
                self.releasing_gpus -= req.gpus
                self._progress.set()  # room in the fleet for a waiting arrival
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

    def _unpend(self, req: Req) -> None:
        if req.pending:
            req.pending = False
            self.pending_gpus -= req.gpus

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
    def demand(self) -> int:
        """GPUs held, pending or in flight: what the fleet has to hold once all is answered."""
        return self.held_gpus + self.pending_gpus + self.in_flight_gpus

    def submit(self, request: AllocationRequest, *, measured: bool = True) -> Req:
        """Publish ``request``; ``measured=False`` tracks it outside the load (the probe)."""
        rid = request.request_id
        req = Req(
            gpus=weight(request),
            shared=request.shared,
            submitted=time.perf_counter(),
            traceparent=self._traceparent(),
            measured=measured,
        )
        if measured:
            self.reqs[rid] = req
            self.in_flight_gpus += req.gpus
        else:
            self._probes[rid] = req
        self.publisher.submit(
            subjects.ALLOC_REQUEST,
            codec.encode(request),
            msg_id=subjects.msg_id("request", rid),
            headers={"traceparent": req.traceparent},
        )
        return req

    def _traceparent(self) -> str:
        """A W3C ``traceparent`` for a new pod's trace: version 00, random non-zero trace and
        parent ids, sampled."""
        trace_id = self._trace_ids.getrandbits(128) or 1
        span_id = self._trace_ids.getrandbits(64) or 1
        return f"00-{trace_id:032x}-{span_id:016x}-01"

    def release(self, rid: str) -> None:
        """Release a placed request on its node's subject, or cancel a pending one on the
        unplaced subject (the allocator cancels it, or forwards it if it was placed since)."""
        req = self._req(rid)
        if req is None or req.released is not None or (req.node is None and not req.pending):
            return
        if req.held_at >= 0:
            self._unhold(req)
            req.releasing = True
            self.releasing_gpus += req.gpus
        if req.pending:
            req.cancelled = True
            self._unpend(req)
        req.released = time.perf_counter()
        subject = subjects.alloc_release(req.node)
        pod = PodRef(namespace=NAMESPACE, name=rid, uid=rid)
        msg = Release(request_id=rid, pod=pod, node=req.node)
        self.publisher.submit(
            subject,
            codec.encode(msg),
            msg_id=subjects.msg_id("release", rid, subject),
            headers={"traceparent": req.traceparent},
        )

    async def _wait_progress(self, alive: Callable[[], None] | None) -> None:
        self._progress.clear()
        try:
            await asyncio.wait_for(self._progress.wait(), 1.0)
        except TimeoutError:
            if alive is not None:
                alive()
            await self.recover_missed()

    async def recover_missed(self) -> int:
        """Outcomes are watched with core subscriptions, which miss what is published while
        this process reconnects (a NATS server died): a request unanswered, or a release not
        freed, for ``MISSED_AFTER_S`` is looked up in its request record (KV, the system's own
        state) and its outcome taken as seen now. Returns how many were recovered; their
        answers are timed when recovered, so they can only lengthen the latencies."""
        now = time.perf_counter()
        if now - self._last_recovery < MISSED_AFTER_S:
            return 0
        self._last_recovery = now
        stale = [
            rid
            for rid, r in self.reqs.items()
            if now - (r.released if r.released is not None else r.submitted) > MISSED_AFTER_S
            and ((r.first is None) or (r.released is not None and r.freed is None and not r.rejected))
        ]
        if not stale:
            return 0
        try:
            kv = await self.nc.jetstream().key_value(subjects.KV_REQUESTS)
            allocs = await self.nc.jetstream().key_value(subjects.KV_ALLOCS)
        except Exception:  # the bucket's stream is electing a leader: look again later
            return 0
        recovered = 0
        for rid in stale[:MISSED_BATCH]:
            try:
                entry = await kv.get(subjects.kv_key(rid))
                record = codec.REQUEST_RECORD.decode(entry.value or b"")
            except Exception:  # not written yet, or NATS still settling: look again later
                continue
            req = self.reqs[rid]
            claim = record.state == "assigned" and req.first is None
            if claim and not await _holds(allocs, record.node or "", rid):
                # Only a claim yet (written before the commit): if the commit on that node
                # fails, the request is decided again, elsewhere. Taken as an answer once the
                # node's record holds it (a harness that took the claim saw one request
                # "assigned" to two nodes: a 10,000-node run of two replicas).
                continue
            now = time.perf_counter()
            if req.first is None and record.state in ("assigned", "releasing", "freed") and record.node:
                req.assigned, req.node, req.allocator = now, record.node, record.owner
                self._first(req, now)
                if req.released is None:
                    self._hold(rid, req)
                recovered += 1
            elif req.first is None and record.state in ("pending", "rejected"):
                req.failed = True
                req.rejected = record.state == "rejected"
                self._first(req, now)
                recovered += 1
            if req.released is not None and req.freed is None and record.state in ("freed", "cancelled"):
                req.freed = now
                if req.releasing:
                    req.releasing = False
                    self.releasing_gpus -= req.gpus
                self._progress.set()
                recovered += 1
        self.recovered += recovered
        return recovered

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
            self._give_up_pending()
            await self._make_room(alive)
            if self.filled:
                self.util_sum += self.held_gpus / max(1, self.fleet_gpus)
                self.util_samples += 1
            self.submit(self.stream.next())
            hook = hooks.get(i + 1)
            if hook is not None:
                hook()
        self.submit_done = time.perf_counter()

    def _give_up_pending(self) -> None:
        """Cancel requests pending longer than ``give_up`` (a user deleting a pod that waits)."""
        if self.give_up <= 0:
            return
        horizon = time.perf_counter() - self.give_up
        while self._pending and self._pending[0][0] < horizon:
            _, rid = self._pending.popleft()
            req = self.reqs[rid]
            if req.pending:
                self.release(rid)
                self.cancelled += 1

    async def _make_room(self, alive: Callable[[], None] | None) -> None:
        """Before an arrival. During the fill: wait while the requests in flight already make
        up the target. After it: release a random held request when the demand is at the
        target, and a second one when held + pending alone is (big requests replaced small
        ones) — never more, so a long queue never makes the driver empty the fleet at once.
        Then wait while held + being freed + in flight fill the whole fleet (at most
        ``STALL_S``, so a ``Freed`` that never comes cannot stop the run)."""
        began = time.perf_counter()
        while not self.filled:
            if self.held_gpus + self.pending_gpus >= self.target:
                self.filled = True
            elif self.demand >= self.target and self.in_flight_gpus > 0:
                await self._wait_progress(alive)
                continue
            break
        if self.filled and self._held and self.demand >= self.target:
            self._release_random()
            if self._held and self.held_gpus + self.pending_gpus >= self.target:
                self._release_random()
        # Devices being freed are still taken: never more work than the whole fleet holds.
        while (
            self.held_gpus + self.releasing_gpus + self.in_flight_gpus >= self.fleet_gpus
            and (self.in_flight_gpus > 0 or self.releasing_gpus > 0)
            and time.perf_counter() - began < STALL_S
        ):
            await self._wait_progress(alive)
        self.arrival_wait_s += time.perf_counter() - began

    def _release_random(self) -> None:
        self.release(self._held[self.rng.randrange(len(self._held))])

    def release_all(self) -> int:
        """Release every held request and cancel every pending one (the end of a run that
        must leave the fleet empty); returns how many were sent. Requests not answered yet
        are left alone: drain first."""
        chosen = [rid for rid, r in self.reqs.items() if r.released is None and (r.held_at >= 0 or r.pending)]
        for rid in chosen:
            self.release(rid)
        return len(chosen)

    def settled(self) -> bool:
        """Every request has an answer and every release its ``Freed`` — a cancel's too: the
        allocator answers one with ``Freed`` at once when nothing was placed, or places and
        then frees the request when its decision was already in flight, and a run that stops
        before that ``Freed`` would report devices still held as lost."""
        return self.outstanding == 0 and all(
            r.freed is not None for r in self.reqs.values() if r.released is not None and not r.rejected
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
            await self.recover_missed()
        return True


async def _holds(allocs: KeyValue, node: str, request_id: str) -> bool:
    """Whether ``node``'s allocation record holds ``request_id`` (False while it cannot be read)."""
    try:
        entry = await allocs.get(subjects.kv_key(node))
        return request_id in codec.NODE_ALLOCS.decode(entry.value or b"").allocations
    except Exception:  # not written yet, or NATS still settling: look again later
        return False
