"""The allocator service: allocation requests in, committed placements out.

Decisions are serial and in memory; everything that waits on NATS runs many at a time. The
parts, one module each:

* :mod:`.readmodel` mirrors KV ``tandem-nodes`` and ``tandem-allocs`` into the pure core, with
  the devices of decisions whose commits are in flight held tentatively;
* :mod:`.commits` holds the writes as pure mutations; :class:`~services.runtime.records.RecordStore`
  writes them with compare-and-set, one write in flight per record, the mutations that
  arrive meanwhile folded into the next one (group commit);
* this module is the placement loop: requests, releases and node reports come from durable
  pull consumers that hand over up to ``concurrency`` messages at once.

One request, start to finish (each step idempotent, keyed by ``request_id``):

1. already placed (a node record holds the request id) → publish the assignment again (same
   ``Nats-Msg-Id``) and stop: a redelivery never allocates twice; the same request already
   in hand (a redelivery while it is decided) waits for that outcome;
2. ``allocator.decide``: the core picks node + devices jointly; the devices are held
   tentatively, so the decisions taken while this one commits see them as used;
3. *claim* the request record with compare-and-set (``deciding``, owner = this instance), so
   two replicas never place one request on two nodes;
4. ``allocator.commit``: add the allocation to the node's record with compare-and-set. That
   one write is the commit and the node agent's event (the server republishes it on
   ``tandem.allocs.<node>``). If another replica wrote the record first and took a device,
   the write fails for this request only, which is decided again;
5. ack the request; in the background mark the request record ``assigned`` and publish
   ``Assignment`` on the node's subject (for the pod bridge and the CLI).

Unschedulable: the request record says ``pending`` with the reason (one ``AllocationFailed``
per distinct reason) before the request is acked; pending requests are decided again,
highest priority first, when capacity may have grown and every ``retry_interval``, and only
a decision that finds a place writes anything. A release marks the allocation ``releasing``
in the node's record (the agent sees it there and cleans up); a verified ``Cleaned`` drops
it. ``Applied`` marks it ``applied``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from opentelemetry.context import Context

from schemas import codec, subjects
from schemas.config import DeviceClass
from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    AllocatorHeartbeat,
    AllocRecord,
    AssignedNic,
    Assignment,
    Cleaned,
    Freed,
    NodeAllocations,
    NodeRecord,
    Release,
    RequestRecord,
)
from services.allocator import commits, metrics
from services.allocator.core import Cluster, InvalidRequest, Placement, Unschedulable
from services.allocator.readmodel import HOSTNAME_LABEL, SHARD_LABEL, ReadModel
from services.runtime.bus import Bus, Delivery, Retry
from services.runtime.kvwatch import watch_bucket, watch_raw
from services.runtime.logging import get_logger
from services.runtime.records import Conflict, RecordStore
from services.runtime.tasks import Service, Supervisor
from services.runtime.tracing import current_traceparent, tracer

__all__ = ["HOSTNAME_LABEL", "Allocator", "build_assignment"]

log = get_logger(__name__)
_tracer = tracer("tandem.allocator")

CommitHook = Callable[[AllocationRequest, Placement], Awaitable[None]]
MAX_COMMIT_ATTEMPTS = 8
# Messages handled at once per consumer: decisions stay serial (they never await), the
# commits, claims and publishes of that many requests are in flight together.
REQUEST_CONCURRENCY = 256
EVENT_CONCURRENCY = 64
# Replica membership: a heartbeat this often; a replica silent for MEMBER_LOST_S is gone.
MEMBER_INTERVAL_S = 1.0
MEMBER_LOST_S = 3.5
# Request records kept in memory: those a later write of this replica will change.
LIVE_REQUEST_STATES = frozenset({"pending", "deciding", "assigned"})
# A pending request's reason, when only its numbers changed, is rewritten at most this often.
REASON_REFRESH_S = 30.0
# Capacity events within this long are answered by one pass over the pending requests.
RETRY_COALESCE_S = 0.1


def reason_key(reason: str) -> str:
    """What a refusal says at its head ("no node can take 8 GPUs + 8 NICs"), without the
    per-node breakdown whose counts move with every free and every placement."""
    return reason.split(":", 1)[0]


def build_assignment(req: AllocationRequest, placement: Placement, *, instance: str) -> Assignment:
    """The wire assignment for a placement, with the pod's network wishes applied per NIC."""
    net = req.network
    nics: list[AssignedNic] = []
    for i, nic in enumerate(placement.nics):
        if net is not None:
            nic = msgspec.structs.replace(
                nic,
                ifname=f"{net.ifname_prefix}{i + 1}",
                mtu=net.mtu,
                addresses=[net.addresses[i]] if i < len(net.addresses) else [],
            )
        nics.append(nic)
    return Assignment(
        request_id=req.request_id,
        pod=req.pod,
        node=placement.node,
        gpus=list(placement.gpus),
        nics=nics,
        pairs=list(placement.pairs),
        scope=placement.scope,
        candidates=placement.candidates,
        allocator=instance,
        requested_at=req.created_at,
    )


def _pod_attributes(req: AllocationRequest) -> dict[str, str | int]:
    return {
        "k8s.pod.uid": req.pod.uid,
        "k8s.pod.name": req.pod.name,
        "k8s.namespace.name": req.pod.namespace,
        "tandem.request_id": req.request_id,
        "tandem.gpus": req.gpus,
        "tandem.rdma": req.rdma,
    }


class Allocator(Service):
    def __init__(
        self,
        bus: Bus,
        *,
        instance: str,
        policy: str = "binpack",
        device_classes: dict[str, DeviceClass] | None = None,
        retry_interval: float = 5.0,
        claim_timeout: float = 30.0,
        before_commit: CommitHook | None = None,
        concurrency: int = REQUEST_CONCURRENCY,
    ) -> None:
        self.bus = bus
        self.instance = instance
        self.model = ReadModel(Cluster(policy=policy, device_classes=device_classes))
        self.cluster = self.model.cluster
        self.retry_interval = retry_interval
        self.claim_timeout = claim_timeout
        self.concurrency = concurrency
        # Test seam: awaited between decide and commit so a test can force two replicas to
        # race on one node with the same stale view.
        self.before_commit = before_commit
        self.node_allocs: RecordStore[NodeAllocations] = RecordStore(
            bus, subjects.KV_ALLOCS, codec.NODE_ALLOCS, on_change=self.model.on_allocs
        )
        self.requests: RecordStore[RequestRecord] = RecordStore(
            bus,
            subjects.KV_REQUESTS,
            codec.REQUEST_RECORD,
            on_change=self._on_request_record,
            retain=lambda r: r.state in LIVE_REQUEST_STATES,
        )
        self.pending: dict[str, AllocationRequest] = {}
        self.deciding: dict[str, RequestRecord] = {}  # claimed records, to recover abandoned ones
        self._inflight: dict[str, asyncio.Future[str]] = {}  # request id → its outcome
        self._members: dict[str, float] = {}  # other live replicas → last heartbeat (monotonic)
        self._shard: str | None = None  # this replica's shard while there are several
        self._frozen_at = 0  # nodes known at the last gc.freeze
        self._tasks = Supervisor("allocator")
        self._kv: dict[str, KeyValue] = {}

    # -- the read model, as tests and the CLI see it ------------------------------------------

    @property
    def nodes(self) -> dict[str, NodeRecord]:
        return self.model.nodes

    @property
    def placed(self) -> dict[str, str]:
        return self.model.placed

    @property
    def allocs(self) -> dict[str, tuple[NodeAllocations | None, int]]:
        return self.node_allocs.cache

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        began = time.monotonic()
        for bucket in (subjects.KV_NODES, subjects.KV_ALLOCS, subjects.KV_REQUESTS):
            self._kv[bucket] = await self.bus.kv(bucket)
        watches: list[tuple[str, Callable[[asyncio.Event], Awaitable[None]]]] = [
            (
                subjects.KV_ALLOCS,
                lambda r: watch_raw(self._kv[subjects.KV_ALLOCS], self.node_allocs.observe, ready=r),
            ),
            (
                subjects.KV_NODES,
                lambda r: watch_bucket(
                    self._kv[subjects.KV_NODES],
                    codec.NODE_RECORD,
                    lambda k, v, _: self.model.on_node_record(k, v),
                    ready=r,
                ),
            ),
            (
                subjects.KV_REQUESTS,
                lambda r: watch_raw(self._kv[subjects.KV_REQUESTS], self.requests.observe, ready=r),
            ),
        ]
        for bucket, watch in watches:
            ready = asyncio.Event()
            self._tasks.spawn(f"watch-{bucket}", lambda w=watch, r=ready: w(r))  # type: ignore[misc]
            await asyncio.wait_for(ready.wait(), 60)
        # The decoded topologies of a large fleet are ~0.7 M long-lived objects; moving them out
        # of the collector's generations keeps full collections out of decision latency
        # (docs/benchmarks.md, "gc.freeze").
        gc.freeze()
        self._frozen_at = len(self.model.nodes)
        consumers: list[tuple[str, str, str | list[str], Any, int]] = [
            (
                subjects.ALLOC_STREAM,
                subjects.CONSUMER_ALLOCATOR_REQUESTS,
                subjects.ALLOC_REQUEST,
                self._on_request,
                self.concurrency,
            ),
            (
                subjects.ALLOC_STREAM,
                subjects.CONSUMER_ALLOCATOR_RELEASES,
                subjects.ALLOC_RELEASE_ALL,
                self._on_release,
                EVENT_CONCURRENCY,
            ),
            (
                subjects.NODE_STREAM,
                subjects.CONSUMER_ALLOCATOR_NODE,
                subjects.ALLOCATOR_NODE_FILTERS,
                self._on_node_report,
                EVENT_CONCURRENCY,
            ),
        ]
        for stream, durable, filters, handler, concurrency in consumers:
            decoder = codec.NODE_EVENT if stream == subjects.NODE_STREAM else codec.ALLOC_EVENT
            self._tasks.spawn(
                durable,
                lambda st=stream, d=durable, f=filters, h=handler, c=concurrency, dec=decoder: (  # type: ignore[misc]
                    self.bus.consume(
                        stream=st,
                        durable=d,
                        filter_subject=f,
                        decoder=dec,
                        handler=h,
                        batch=max(64, c),
                        concurrency=c,
                        # Every handler is idempotent: a lost ack costs a redelivery.
                        confirm_acks=False,
                    )
                ),
            )
        self._members_sub = await self.bus.nc.subscribe(subjects.ALLOCATOR_HEARTBEAT, cb=self._on_member)
        self._tasks.spawn("members", self._members_loop)
        self._tasks.spawn("retry-pending", self._retry_loop)
        log.info(
            "allocator_started",
            instance=self.instance,
            nodes=len(self.model.nodes),
            allocations=len(self.model.placed),
            pending=len(self.pending),
            seconds=round(time.monotonic() - began, 3),
        )

    async def stop(self) -> None:
        if getattr(self, "_members_sub", None) is not None:
            with contextlib.suppress(Exception):
                await self._members_sub.unsubscribe()
        await self._tasks.aclose()
        await self.node_allocs.aclose()
        await self.requests.aclose()

    # -- replicas ---------------------------------------------------------------------------

    async def _on_member(self, msg: Msg) -> None:
        try:
            beat = codec.ALLOCATOR_HEARTBEAT.decode(msg.data)
        except codec.DecodeErrors:
            return  # not a heartbeat; membership only steers which nodes come first
        if beat.instance != self.instance:
            self._members[beat.instance] = time.monotonic()

    async def _members_loop(self) -> None:
        """Say we are alive; split the nodes among the replicas alive (sorted by name, each
        takes the shard of its position), so replicas rarely decide on the same node."""
        while True:
            beat = AllocatorHeartbeat(instance=self.instance)
            await self.bus.publish_core(subjects.ALLOCATOR_HEARTBEAT, beat)
            cutoff = time.monotonic() - MEMBER_LOST_S
            for name in [n for n, seen in self._members.items() if seen < cutoff]:
                del self._members[name]
            live = sorted([*self._members, self.instance])
            self.model.set_shards(len(live))
            self._shard = str(live.index(self.instance)) if len(live) > 1 else None
            await asyncio.sleep(MEMBER_INTERVAL_S)

    def _decide(self, req: AllocationRequest) -> Placement | Unschedulable:
        """The core's decision, this replica's shard of the nodes first: with several
        replicas, each fills its own nodes and their commits seldom meet on one node. Only
        when no node of the shard can take the request are all nodes asked (so a request is
        unschedulable only when no node at all can take it). A pinned request goes straight
        to its node."""
        shard = self._shard
        if shard is None or HOSTNAME_LABEL in req.node_selector or SHARD_LABEL in req.node_selector:
            return self.cluster.decide(req)
        mine = msgspec.structs.replace(req, node_selector={**req.node_selector, SHARD_LABEL: shard})
        decision = self.cluster.decide(mine)
        if isinstance(decision, Placement):
            return decision
        return self.cluster.decide(req)

    # -- request records --------------------------------------------------------------------

    def _on_request_record(self, key: str, record: RequestRecord | None, _: int) -> None:
        self.pending.pop(key, None)
        self.deciding.pop(key, None)
        if record is None:
            return
        if record.state == "pending":
            self.pending[key] = record.request
        elif record.state in commits.CLAIMED_STATES and key not in self.model.placed:
            self.deciding[key] = record  # a claim until a node record holds the request

    def _abandoned_claims(self) -> list[AllocationRequest]:
        """Requests a replica claimed and then never committed (it crashed in between).

        A claim is only taken while a message is being handled or a pending request retried;
        the pending path has no message left to redeliver, so without this such a request
        would wait forever."""
        cutoff = time.time() - self.claim_timeout
        abandoned = []
        for rid, r in list(self.deciding.items()):
            if rid in self.model.placed:
                del self.deciding[rid]  # committed: not a claim any more
            elif r.updated_at < cutoff and rid not in self._inflight:
                abandoned.append(r.request)
        return abandoned

    async def _request_record(self, request_id: str) -> RequestRecord | None:
        cached = self.requests.cached(request_id)
        if cached is not None:
            return cached[0]
        record, _ = await self.requests.fetch(request_id)
        return record

    # -- requests ---------------------------------------------------------------------------

    async def _on_request(self, event: object, delivery: Delivery) -> None:
        if isinstance(event, AllocationRequest):
            await self.handle_request(event, context=delivery.context)
        else:
            log.warning("unexpected_message", subject=delivery.subject, kind=type(event).__name__)

    async def _republish(self, request_id: str, *, claimed: AllocationRequest | None = None) -> None:
        """Publish a committed assignment again (same msg id) and finish its request record."""
        node = self.model.placed[request_id]
        record = self.node_allocs.cached(node)
        rec = record[0].allocations.get(request_id) if record and record[0] else None
        if rec is None:
            return  # freed meanwhile
        if claimed is None and request_id in self.deciding:
            claimed = self.deciding[request_id].request
        if claimed is not None:
            # Committed, but the request record may not say so (its write was lost, or it
            # names the node of an earlier attempt): make it match the node record, or it
            # would be "recovered" again and again.
            await self.requests.update(
                request_id,
                commits.put_request(
                    RequestRecord(request=claimed, state="assigned", node=node, owner=self.instance)
                ),
            )
        await self.bus.publish(
            subjects.alloc_assigned(node),
            rec.assignment,
            msg_id=subjects.msg_id(request_id, "assigned"),
        )

    async def handle_request(
        self,
        req: AllocationRequest,
        *,
        context: Context | None = None,
        first: Placement | Unschedulable | None = None,
    ) -> str:
        """Place one request; returns the outcome (``assigned``, ``pending``, ``rejected``,
        ``duplicate``). ``first``: a decision just taken for it (the pending retries')."""
        rid = req.request_id
        if rid in self.model.placed:
            await self._republish(rid)
            return "duplicate"
        running = self._inflight.get(rid)
        if running is not None:
            await asyncio.shield(running)  # the same request, already in hand
            return "duplicate"
        outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._inflight[rid] = outcome
        try:
            result = await self._place(req, context=context, first=first)
        except BaseException as exc:
            outcome.set_exception(exc)
            outcome.exception()  # retrieved: waiters re-raise it, nobody else must
            raise
        else:
            outcome.set_result(result)
            return result
        finally:
            del self._inflight[rid]

    async def _place(
        self, req: AllocationRequest, *, context: Context | None, first: Placement | Unschedulable | None
    ) -> str:
        rid = req.request_id
        claimed: str | None = None  # the node the request record says, once claimed
        for _ in range(MAX_COMMIT_ATTEMPTS):
            with _tracer.start_as_current_span("allocator.decide", context=context) as span:
                span.set_attributes(_pod_attributes(req))
                t0 = time.perf_counter()
                try:
                    decision = first if first is not None else self._decide(req)
                    first = None
                except InvalidRequest as exc:
                    # Retrying cannot help (e.g. a device class removed from the config after
                    # admission): say so once and stop, instead of redelivering forever.
                    span.set_attributes({"tandem.outcome": "rejected", "tandem.reason": str(exc)})
                    metrics.DECISIONS.labels("rejected").inc()
                    await self._reject(req, str(exc))
                    return "rejected"
                metrics.DECISION_SECONDS.observe(time.perf_counter() - t0)
                if isinstance(decision, Unschedulable):
                    metrics.DECISIONS.labels("unschedulable").inc()
                    span.set_attributes({"tandem.outcome": "unschedulable", "tandem.reason": decision.reason})
                    return await self._unschedulable(req, decision)
                span.set_attributes(
                    {
                        "tandem.candidates": decision.candidates,
                        "tandem.scope": decision.scope,
                        "k8s.node.name": decision.node,
                    }
                )
                node = decision.node
                assignment = build_assignment(req, decision, instance=self.instance)
                # Until the commit lands, the next decisions must see these devices as used.
                self.model.hold_tentative(node, rid, assignment.device_ids())
                try:
                    if self.before_commit is not None:
                        await self.before_commit(req, decision)
                    if rid in self.model.placed:
                        # A node record holds this request already: an earlier commit of ours
                        # landed though its reply was lost, and came back through the watch.
                        # Deciding again would place the request a second time.
                        self.model.drop_tentative(node, rid)
                        await self._republish(rid, claimed=req)
                        return "duplicate"
                    if claimed != node:
                        if not await self._claim(req, node=node):
                            self.model.drop_tentative(node, rid)
                            if rid in self.model.placed:
                                await self._republish(rid)
                            return "duplicate"
                        claimed = node
                    committed = await self._commit(req, assignment)
                except BaseException:
                    self.model.drop_tentative(node, rid)
                    raise
            if not committed:
                self.model.drop_tentative(node, rid)
                metrics.COMMIT_CONFLICTS.inc()
                continue
            metrics.DECISIONS.labels("assigned").inc()
            metrics.REQUEST_TO_ASSIGNMENT_SECONDS.observe(max(0.0, assignment.decided_at - req.created_at))
            for pair in assignment.pairs:
                metrics.PAIRS.labels(pair.scope).inc()
            self.pending.pop(rid, None)
            self.deciding.pop(rid, None)
            # The claim said "assigned" to this node and the node record now holds it; the
            # event follows.
            self._publish_later(
                subjects.alloc_assigned(node), assignment, msg_id=subjects.msg_id(rid, "assigned")
            )
            log.debug("assigned", request_id=rid, node=node, scope=decision.scope)
            return "assigned"
        raise Retry(f"request {rid}: lost the commit race {MAX_COMMIT_ATTEMPTS} times")

    async def _claim(self, req: AllocationRequest, *, node: str) -> bool:
        """Take the request for this instance, to be committed on ``node``; False when it has
        an outcome already. Raises Retry while another live replica has it in hand."""
        mutate = commits.claim(
            req,
            node=node,
            instance=self.instance,
            claim_timeout=self.claim_timeout,
            now=time.time(),
            placed=self.model.placed.__contains__,
        )
        try:
            # A request never seen is created without reading it first (the common case).
            await self.requests.update(req.request_id, mutate, assume_absent=True)
        except commits.AlreadyDone:
            return False
        return True

    async def _commit(self, req: AllocationRequest, assignment: Assignment) -> bool:
        """Add the allocation to the node's record; False when a device went to another."""
        with _tracer.start_as_current_span("allocator.commit") as cspan:
            rec = AllocRecord(
                assignment=assignment, priority=req.priority, traceparent=current_traceparent() or ""
            )
            try:
                await self.node_allocs.update(
                    assignment.node, commits.add_allocation(assignment.node, req.request_id, rec)
                )
            except Conflict as exc:
                log.info("commit_conflict", node=assignment.node, request_id=req.request_id, why=str(exc))
                cspan.set_attribute("tandem.committed", False)
                return False
            except Exception:
                # The write may have landed although no reply came: read the record, so that
                # the handler run again finds the request placed instead of placing it anew.
                with contextlib.suppress(Exception):
                    await self.node_allocs.fetch(assignment.node)
                raise
            cspan.set_attribute("tandem.committed", True)
            return True

    async def _reject(self, req: AllocationRequest, reason: str) -> None:
        await self.requests.update(
            req.request_id,
            commits.put_request(RequestRecord(request=req, state="rejected", reason=reason)),
        )
        self.pending.pop(req.request_id, None)
        self._publish_later(
            subjects.ALLOC_FAILED,
            AllocationFailed(request_id=req.request_id, pod=req.pod, reason=reason, retrying=False),
            msg_id=subjects.msg_id(req.request_id, "rejected"),
        )
        log.info("rejected", request_id=req.request_id, reason=reason)

    async def _unschedulable(self, req: AllocationRequest, why: Unschedulable) -> str:
        """Record the request ``pending`` with its reason and announce it (``AllocationFailed``).
        The per-node breakdown of a refusal ("993 nodes: fewer than 2 free GPUs; ...") moves
        with every free and placement; with the same head (:func:`reason_key`) the record is
        rewritten, and the reason announced, at most every ``REASON_REFRESH_S``."""
        rid = req.request_id
        if not self._reason_due(rid, why):
            return "pending"  # nothing new to say: no write
        said: list[str] = []

        def record_pending(current: RequestRecord | None) -> RequestRecord | None:
            if current is not None and current.state in commits.TERMINAL_STATES:
                raise commits.AlreadyDone(current.state)
            if current is not None and current.state in commits.CLAIMED_STATES:
                if rid in self.model.placed:
                    raise commits.AlreadyDone(current.state)
                if current.owner != self.instance and time.time() - current.updated_at < self.claim_timeout:
                    raise Retry(f"request {rid} is being placed by {current.owner}")
            said[:] = [current.reason if current is not None else ""]
            if current is not None and current.state == "pending" and current.reason == why.reason:
                return None
            return RequestRecord(request=req, state="pending", owner="", reason=why.reason)

        try:
            await self.requests.update(rid, record_pending, assume_absent=True)
        except commits.AlreadyDone:
            return "duplicate"
        self.pending[rid] = req
        if said and said[0] != why.reason:
            self._publish_later(
                subjects.ALLOC_FAILED,
                AllocationFailed(request_id=rid, pod=req.pod, reason=why.reason),
                msg_id=subjects.msg_id(rid, "failed", zlib.crc32(why.reason.encode())),
            )
            log.info("unschedulable", request_id=rid, reason=why.reason)
        return "pending"

    def _publish_later(self, subject: str, message: msgspec.Struct, *, msg_id: str) -> None:
        """An event that follows a committed effect: published without holding up the
        request (a failure is logged; the effect is in KV either way)."""
        self._tasks.spawn(
            f"publish:{msg_id}",
            lambda: self.bus.publish(subject, message, msg_id=msg_id),
            restart=False,
        )

    async def retry_pending(self) -> int:
        """Decide every pending request again, highest priority (then oldest) first.

        Each decision is taken here, in priority order, before anything waits; only one that
        finds a place (or has something new to say) goes on, as a task, to claim and commit,
        so a pass over thousands of still-unschedulable requests writes nothing and their
        commits overlap."""
        candidates = {r.request_id: r for r in [*self._abandoned_claims(), *self.pending.values()]}
        order = sorted(candidates.values(), key=lambda r: (-r.priority, r.created_at))
        gate = asyncio.Semaphore(self.concurrency)

        async def retry(req: AllocationRequest, first: Placement | Unschedulable | None) -> bool:
            outcome = ""
            try:
                outcome = await self.handle_request(req, first=first)
                return outcome == "assigned"
            except Retry as r:
                log.info("retry_deferred", request_id=req.request_id, reason=str(r))
                return False
            finally:
                gate.release()
                if isinstance(first, Placement) and outcome != "assigned":
                    self.model.drop_tentative(first.node, req.request_id)

        tasks: list[asyncio.Task[bool]] = []
        for req in order:
            rid = req.request_id
            if rid not in self.pending and rid not in self.deciding:
                continue
            if rid in self._inflight or rid in self.model.placed:
                continue
            await gate.acquire()
            try:
                decision = self._decide(req)
            except InvalidRequest:
                decision = None  # handle_request rejects it, with the reason
            if isinstance(decision, Unschedulable) and not self._reason_due(rid, decision):
                gate.release()
                continue
            if isinstance(decision, Placement):
                # Held now, before the next decision (the task holds it again, idempotently).
                self.model.hold_tentative(decision.node, rid, decision.devices())
            # Held in ``tasks`` and gathered below: not a bare task.
            tasks.append(asyncio.get_running_loop().create_task(retry(req, decision)))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, asyncio.CancelledError):
                log.warning("retry_failed", error=repr(res))
        return sum(1 for res in results if res is True)

    def _reason_due(self, request_id: str, why: Unschedulable) -> bool:
        """Whether an unschedulable request's record needs writing (see _unschedulable)."""
        known = self.requests.cached(request_id)
        was = known[0] if known is not None else None
        return not (
            was is not None
            and was.state == "pending"
            and reason_key(was.reason) == reason_key(why.reason)
            and time.time() - was.updated_at < REASON_REFRESH_S
        )

    def update_gauges(self) -> None:
        totals = self.cluster.totals()
        metrics.DEVICES.labels("gpu", "total").set(totals["gpus"])
        metrics.DEVICES.labels("gpu", "free").set(totals["free_gpus"])
        metrics.DEVICES.labels("nic", "total").set(totals["nics"])
        metrics.DEVICES.labels("nic", "free").set(totals["free_nics"])
        metrics.PENDING.set(len(self.pending))
        for status in ("ready", "lost"):
            metrics.NODES.labels(status).set(sum(1 for r in self.model.nodes.values() if r.status == status))

    async def _retry_loop(self) -> None:
        last_gauges = 0.0
        while True:
            now = time.monotonic()
            if now - last_gauges >= self.retry_interval:
                self.update_gauges()  # walks every group: not on every capacity change
                last_gauges = now
                self._refreeze()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.model.capacity.wait(), self.retry_interval)
                # Frees come in bursts: answer a burst with one pass, not one pass per free.
                await asyncio.sleep(RETRY_COALESCE_S)
            self.model.capacity.clear()
            if self.pending or self.deciding:
                await self.retry_pending()

    def _refreeze(self) -> None:
        """``gc.freeze`` again once the fleet grew by a tenth since the last time: nodes that
        joined after the start are long-lived objects too, and a full collection over them
        (0.7 s at 10,000 nodes) would otherwise land inside some decision."""
        nodes = len(self.model.nodes)
        if nodes > self._frozen_at * 1.1 + 10:
            gc.freeze()
            self._frozen_at = nodes

    # -- release, apply, cleanup ------------------------------------------------------------

    async def _placement_of(self, request_id: str) -> str | None:
        """The node holding ``request_id``, after any decision of it in flight finished."""
        running = self._inflight.get(request_id)
        if running is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(running)
        node = self.model.placed.get(request_id)
        if node is not None:
            return node
        record = await self._request_record(request_id)
        if record is not None and record.node and record.state in ("assigned", "releasing"):
            # Placed by another replica whose write this one's watch has not shown yet.
            await self.node_allocs.fetch(record.node)
        return self.model.placed.get(request_id)

    async def _on_release(self, release: object, delivery: Delivery) -> None:
        if not isinstance(release, Release):
            log.warning("unexpected_message", subject=delivery.subject, kind=type(release).__name__)
            return
        rid = release.request_id
        node = await self._placement_of(rid)
        if node is None:
            if await self._cancel(release):
                return
            # Placed by now (its decision was in flight on another replica): release it.
            node = await self._placement_of(rid)
            if node is None:
                raise Retry(f"release of {rid}: its placement is not visible yet")
        # The node's record says "releasing" (its agent cleans up on seeing it); the request
        # record keeps "assigned" until the devices are freed.
        await self.node_allocs.update(
            node, commits.set_state(rid, "releasing", only_from=frozenset({"assigned", "applied"}))
        )

    async def _cancel(self, release: Release) -> bool:
        """Cancel a request that is not placed (pending, or the release overtook it); False
        when it turned out to be placed after all."""
        rid = release.request_id
        outcome: list[str] = []

        def cancel(current: RequestRecord | None) -> RequestRecord | None:
            if current is not None and current.state in commits.CLAIMED_STATES:
                # No decision of ours is in flight (awaited before): placed, being placed by
                # another replica, or a claim whose commit never happened.
                if rid in self.model.placed:
                    outcome.append("placed")
                    return None
                fresh = time.time() - current.updated_at < self.claim_timeout
                if current.owner != self.instance and fresh:
                    raise Retry(f"release of {rid}: {current.owner} is placing it")
            if current is not None and current.state == "releasing":
                outcome.append("placed")
                return None
            if current is not None and current.state in ("freed", "cancelled", "rejected"):
                outcome.append("done")
                return None
            request = (
                current.request if current else AllocationRequest(request_id=rid, pod=release.pod, gpus=0)
            )
            outcome.append("cancelled")
            return RequestRecord(request=request, state="cancelled", reason="released")

        await self.requests.update(rid, cancel)
        if outcome == ["placed"]:
            return False
        if outcome == ["cancelled"]:
            self.pending.pop(rid, None)
            self._publish_later(
                subjects.ALLOC_FREED, Freed(request_id=rid), msg_id=subjects.msg_id(rid, "freed")
            )
        return True

    async def _on_node_report(self, event: object, delivery: Delivery) -> None:
        if isinstance(event, Cleaned):
            await self._on_cleaned(event, delivery)
        else:
            log.warning("unexpected_message", subject=delivery.subject, kind=type(event).__name__)

    async def _on_cleaned(self, cleaned: Cleaned, delivery: Delivery) -> None:
        rid = cleaned.request_id
        if not cleaned.ok:
            # Never free devices whose cleanup was not verified; the agent has marked them
            # unhealthy and a later verified cleanup frees them.
            log.warning("cleanup_unverified", request_id=rid, problems=cleaned.problems)
            self.requests.submit(rid, commits.request_state("releasing", reason="; ".join(cleaned.problems)))
            return
        with _tracer.start_as_current_span("allocator.free", context=delivery.context) as span:
            span.set_attributes({"tandem.request_id": rid, "k8s.node.name": cleaned.node})
            dropped: list[bool] = []
            drop = commits.drop_allocation(rid, only_from=frozenset({"releasing"}))

            def drop_released(current: NodeAllocations | None) -> NodeAllocations | None:
                new = drop(current)
                dropped[:] = [new is not None]
                return new

            await self.node_allocs.update(cleaned.node, drop_released)
            if not any(dropped):
                # This replica's copy of the record may not show yet that another replica
                # marked the allocation releasing: read it before deciding there is nothing.
                await self.node_allocs.fetch(cleaned.node)
                await self.node_allocs.update(cleaned.node, drop_released)
            if not any(dropped):
                # Not being released on that node (a redelivery after the free, or a report
                # about an allocation nobody released): nothing to free.
                log.info("cleaned_ignored", request_id=rid, node=cleaned.node)
                return
            self.requests.submit(rid, commits.request_state("freed"))
            self._publish_later(
                subjects.ALLOC_FREED,
                Freed(request_id=rid, node=cleaned.node, devices=cleaned.devices),
                msg_id=subjects.msg_id(rid, "freed"),
            )
            log.debug("freed", request_id=rid, node=cleaned.node)
