"""The allocator service: allocation requests in, committed placements out.

Decisions are serial and in memory; everything that waits on NATS runs many at a time. The
parts, one module each:

* :mod:`.readmodel` mirrors KV ``tandem-nodes`` and ``tandem-allocs`` into the pure core, with
  the devices of decisions whose commits are in flight held tentatively;
* :mod:`.commits` holds the writes as pure mutations; :class:`~services.runtime.records.RecordStore`
  writes them with compare-and-set, one write in flight per record, the mutations that
  arrive meanwhile folded into the next one (group commit);
* :mod:`.requestbook` keeps the request records: claims, pending reasons, outcomes;
* :mod:`.replicas` says which replicas are alive and which nodes this one decides on first;
* :mod:`.jobs` (with :mod:`.jobcommits`) places whole jobs: the two-phase commit across nodes;
* :mod:`.preemption` records preemption plans and keeps the preemptor's devices reserved;
* :mod:`.wire` builds the wire assignment of a placement;
* :mod:`.frees` is the free path: releases, verified cleanups, devices back;
* :mod:`.retries` decides pending requests again when capacity may have grown;
* this module is the placement loop: requests, releases and node reports come from durable
  pull consumers that hand over up to ``concurrency`` messages at once.

One request, start to finish (each step idempotent, keyed by ``request_id``):

1. already placed (a node record holds the request id) → publish the assignment again (same
   ``Nats-Msg-Id``) and stop: a redelivery never allocates twice; the same request already
   in hand (a redelivery while it is decided) waits for that outcome;
2. ``allocator.decide``: the core picks node + devices jointly (this replica's shard first);
   the devices are held tentatively, so the decisions taken while this one commits see them
   as used;
3. *claim*: the request record is written with compare-and-set, already as the outcome
   (``assigned`` to the node, owner = this instance), so two replicas never place one request
   on two nodes;
4. ``allocator.commit``: add the allocation to the node's record with compare-and-set. That
   one write is the commit and the node agent's event (the server republishes it on
   ``tandem.allocs.<node>``). If another replica wrote the record first and took a device
   (or the room left on a GPU this request takes a share of), the write fails for this
   request only, which is decided again;
5. publish ``Assignment`` on the node's subject (for the pod bridge and the CLI), then ack the
   request: a lost event means a redelivery, which publishes it again (step 1).

Unschedulable: the request record says ``pending`` with the reason before the request is
acked (rewritten and announced with ``AllocationFailed`` only when the reason says something
new); pending requests are decided again, highest priority first, when capacity may have
grown and every ``retry_interval``, and only a decision that finds a place writes anything.
A release marks the allocation ``releasing`` in the node's record (the agent sees it there
and cleans up); a verified ``Cleaned`` drops it and the request record says ``freed``
(:mod:`.frees`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from schemas import codec, limits, subjects
from schemas.config import DeviceClass
from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    AllocRecord,
    Assignment,
    NodeAllocations,
    NodeRecord,
)
from services.allocator import commits, metrics
from services.allocator.core import Cluster, InvalidRequest, Placement, Unschedulable
from services.allocator.core.gang import DEFAULT_TIERS
from services.allocator.frees import Frees
from services.allocator.jobs import Jobs
from services.allocator.preemption import Preemptions
from services.allocator.readmodel import HOSTNAME_LABEL, ReadModel
from services.allocator.replicas import Replicas
from services.allocator.requestbook import RequestBook
from services.allocator.retries import PendingRetries
from services.allocator.wire import build_assignment
from services.runtime import tracing
from services.runtime.bus import Bus, Delivery, Retry
from services.runtime.kvwatch import watch_bucket, watch_raw
from services.runtime.logging import get_logger
from services.runtime.records import Conflict, RecordStore, RecordTooLarge
from services.runtime.tasks import Service, Supervisor
from services.runtime.tracing import context_from_traceparent, current_traceparent, traceparent_of, tracer

__all__ = ["HOSTNAME_LABEL", "Allocator", "build_assignment"]

log = get_logger(__name__)
_tracer = tracer("tandem.allocator", service="allocator")

CommitHook = Callable[[AllocationRequest, Placement], Awaitable[None]]
MAX_COMMIT_ATTEMPTS = 8
# Messages handled at once per consumer: decisions stay serial (they never await), the
# commits, claims and publishes of that many requests are in flight together. Each request
# waits on a few round trips in a row, so what is in flight, not the CPU, bounded the
# allocator under load: at 256, tandem loadtest at 5,000 nodes left it idle a quarter of the
# time (docs/benchmarks.md, "Running system").
REQUEST_CONCURRENCY = 512
# Releases and cleanup reports, as wide as requests: a freed request waits on three writes in
# a row (its record, the node's record, Freed), and with fewer in flight than requests the
# free path fell behind under load (cleanup reports piled up, freed devices came back seconds
# late and arrivals were refused meanwhile).
EVENT_CONCURRENCY = REQUEST_CONCURRENCY
# Messages one pull asks for (topped up at half). Replicas share each consumer and the server
# hands a message to a waiting pull, so a replica whose pulls ask for many takes a long run of
# them into its own queue even while it falls behind, and the other waits idle (at 512, one of
# two replicas held most requests in flight). At 64 the deliveries interleave finely, and two
# replicas' tail latency dropped with one replica's unchanged (docs/benchmarks.md,
# "Measurements behind the code").
PULL_BATCH = 64


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
        finished_request_ttl: float | None = None,
        fabric_tiers: Sequence[str] = DEFAULT_TIERS,
        fault_job_prepare_pause: float = 0.0,
    ) -> None:
        self.bus = bus
        self.instance = instance
        self.model = ReadModel(Cluster(policy=policy, device_classes=device_classes))
        self.cluster = self.model.cluster
        self.concurrency = concurrency
        # Test seam: awaited between decide and commit so a test can force two replicas to
        # race on one node with the same stale view.
        self.before_commit = before_commit
        self.node_allocs: RecordStore[NodeAllocations] = RecordStore(
            bus, subjects.KV_ALLOCS, codec.NodeAllocsDecoder(), on_change=self.model.on_allocs
        )
        self.book = RequestBook(
            bus,
            instance=instance,
            claim_timeout=claim_timeout,
            placed=self.model.placed,
            finished_ttl=finished_request_ttl,
        )
        self.replicas = Replicas(bus, instance=instance, model=self.model)
        self.jobs = Jobs(
            bus,
            instance=instance,
            model=self.model,
            node_allocs=self.node_allocs,
            claim_timeout=claim_timeout,
            tiers=fabric_tiers,
            prepare_pause=fault_job_prepare_pause,
        )
        self.preemptions = Preemptions(
            bus,
            instance=instance,
            model=self.model,
            book=self.book,
            node_allocs=self.node_allocs,
            device_classes=self.cluster.device_classes,
        )
        self._inflight: dict[str, asyncio.Future[str]] = {}  # request id → its outcome
        self.frees = Frees(
            bus,
            model=self.model,
            node_allocs=self.node_allocs,
            book=self.book,
            jobs=self.jobs,
            inflight=self._inflight,
        )
        self.retries = PendingRetries(
            model=self.model,
            book=self.book,
            preemptions=self.preemptions,
            jobs=self.jobs,
            inflight=self._inflight,
            decide=self._decide,
            handle=self.handle_request,
            concurrency=concurrency,
            retry_interval=retry_interval,
            every_interval=self._refreeze,
        )
        self._frozen_at = 0  # nodes known at the last gc.freeze
        self._tasks = Supervisor("allocator")

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

    @property
    def pending(self) -> dict[str, AllocationRequest]:
        return self.book.pending

    @property
    def claim_timeout(self) -> float:
        return self.book.claim_timeout

    @claim_timeout.setter
    def claim_timeout(self, seconds: float) -> None:
        self.book.claim_timeout = seconds
        self.jobs.claim_timeout = seconds

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        began = time.monotonic()
        watches: list[tuple[str, Callable[[asyncio.Event], Awaitable[None]]]] = [
            # Cluster labels first, so that nodes are indexed with them from the start.
            (
                subjects.KV_NODE_LABELS,
                lambda r: watch_bucket(
                    self.bus.js,
                    subjects.KV_NODE_LABELS,
                    codec.NODE_LABELS,
                    lambda k, v, _: self.model.on_node_labels(k, v),
                    ready=r,
                ),
            ),
            (
                subjects.KV_ALLOCS,
                lambda r: watch_raw(self.bus.js, subjects.KV_ALLOCS, self.node_allocs.observe, ready=r),
            ),
            (
                subjects.KV_NODES,
                lambda r: watch_bucket(
                    self.bus.js,
                    subjects.KV_NODES,
                    codec.NODE_RECORD,
                    lambda k, v, _: self.model.on_node_record(k, v),
                    ready=r,
                ),
            ),
            (
                subjects.KV_REQUESTS,
                lambda r: watch_raw(self.bus.js, subjects.KV_REQUESTS, self.book.store.observe, ready=r),
            ),
            (
                subjects.KV_JOBS,
                lambda r: watch_raw(self.bus.js, subjects.KV_JOBS, self.jobs.store.observe, ready=r),
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
                subjects.CONSUMER_ALLOCATOR_JOBS,
                subjects.ALLOC_JOB,
                self.jobs.on_job,
                EVENT_CONCURRENCY,
            ),
            (
                subjects.ALLOC_STREAM,
                subjects.CONSUMER_ALLOCATOR_RELEASES,
                subjects.ALLOC_RELEASE_ALL,
                self.frees.on_release,
                EVENT_CONCURRENCY,
            ),
            (
                subjects.NODE_STREAM,
                subjects.CONSUMER_ALLOCATOR_NODE,
                subjects.ALLOCATOR_NODE_FILTERS,
                self.frees.on_node_report,
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
                        batch=PULL_BATCH,
                        concurrency=c,
                        # Every handler is idempotent: a lost ack costs a redelivery.
                        confirm_acks=False,
                    )
                ),
            )
        await self.replicas.start(self._tasks)
        # Job commits a crashed replica left half-done are settled before new decisions.
        await self.jobs.sweep()
        self._tasks.spawn("retry-pending", self.retries.run)
        log.info(
            "allocator_started",
            instance=self.instance,
            nodes=len(self.model.nodes),
            allocations=len(self.model.placed),
            pending=len(self.pending),
            seconds=round(time.monotonic() - began, 3),
        )

    async def stop(self) -> None:
        await self.replicas.stop()
        await self._tasks.aclose()
        await self.node_allocs.aclose()
        await self.book.aclose()
        await self.jobs.aclose()

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
        if claimed is None and request_id in self.book.claims:
            claimed = self.book.claims[request_id].request
        if claimed is not None:
            # Committed, but the request record may not say so (its write was lost, or it
            # names the node of an earlier attempt): make it match the node record, or it
            # would be "recovered" again and again.
            await self.book.mark_assigned(claimed, node=node)
        # In the request's trace, like the first announcement: the bridge's bind joins it.
        with tracing.within(context_from_traceparent(self.book.traceparent(request_id))):
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
            known = self.book.store.cached(rid)
            commits.check_same(known[0] if known is not None else None, req)
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
        # The request's trace: the one it arrived in, or — for a retry of a pending request —
        # the one its record keeps, so an hour of retries is one trace, not 720.
        retry = context is None
        trace = self.book.traceparent(rid) if retry else traceparent_of(context)
        if retry:
            context = context_from_traceparent(trace)
        was_pending = rid in self.book.pending  # for metrics.PENDING_AGE_AT_PLACEMENT_SECONDS
        for _ in range(MAX_COMMIT_ATTEMPTS):
            with _tracer.start_as_current_span(
                "allocator.decide", context=context, kind=SpanKind.CONSUMER
            ) as span:
                span.set_attributes(_pod_attributes(req))
                span.set_attributes(tracing.messaging(subjects.ALLOC_REQUEST, "process"))
                span.set_attribute("tandem.retry", retry)
                t0 = time.perf_counter()
                try:
                    decision = first if first is not None else self._decide(req)
                    first = None
                except InvalidRequest as exc:
                    # Retrying cannot help (e.g. a device class removed from the config after
                    # admission): say so once and stop, instead of redelivering forever.
                    span.set_attributes({"tandem.outcome": "rejected", "tandem.reason": str(exc)})
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    metrics.DECISIONS.labels("rejected").inc()
                    await self._reject(req, str(exc))
                    return "rejected"
                metrics.DECISION_SECONDS.observe(time.perf_counter() - t0)
                if isinstance(decision, Unschedulable):
                    metrics.DECISIONS.labels("unschedulable").inc()
                    span.set_attributes({"tandem.outcome": "unschedulable", "tandem.reason": decision.reason})
                    span.set_status(Status(StatusCode.ERROR, limits.clip(decision.reason, 500)))
                    # A message (not a retry): a plan it recorded before is published again.
                    preempting = await self.preemptions.consider(req, traceparent=trace, republish=not retry)
                    if preempting is not None:
                        return preempting
                    return await self._unschedulable(req, decision, traceparent=trace)
                decided = trace_api.set_span_in_context(span, context)
                span.set_attributes(
                    {
                        "tandem.candidates": decision.candidates,
                        "tandem.scope": decision.scope,
                        "k8s.node.name": decision.node,
                    }
                )
                node = decision.node
                # Rare (a preferred scope missed), and it may decide once more: only then.
                note = ""
                if not decision.met:
                    self.model.catch_up()  # the reason looks beyond this replica's shard
                    note = self.cluster.scope_reason(req, decision)
                assignment = build_assignment(req, decision, instance=self.instance, scope_note=note)
                # Until the commit lands, the next decisions must see these devices as used.
                self.model.hold_tentative(
                    node, rid, assignment.device_ids(), shares=assignment.shares(), sharing=assignment.sharing
                )
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
                        if not await self.book.claim(req, node=node, traceparent=trace):
                            self.model.drop_tentative(node, rid)
                            if rid in self.model.placed:
                                await self._republish(rid)
                            return "duplicate"
                        claimed = node
                    committed = await self._commit(req, assignment)
                except RecordTooLarge as exc:
                    # This node's record has no room until an allocation leaves it: decide
                    # again without the node. A request only it can take waits (pending,
                    # saying so) instead of failing; it is not this request's fault.
                    self.model.drop_tentative(node, rid)
                    self.model.close_full(node, str(exc))
                    metrics.RECORD_FULL.inc()
                    span.set_attributes({"tandem.outcome": "record_full", "tandem.reason": str(exc)})
                    log.warning("node_record_full", node=node, request_id=rid, why=str(exc))
                    continue
                except BaseException:
                    self.model.drop_tentative(node, rid)
                    raise
            if not committed:
                self.model.drop_tentative(node, rid)
                metrics.COMMIT_CONFLICTS.inc()
                continue
            metrics.DECISIONS.labels("assigned").inc()
            metrics.REQUEST_TO_ASSIGNMENT_SECONDS.observe(max(0.0, assignment.decided_at - req.created_at))
            if was_pending:
                metrics.PENDING_AGE_AT_PLACEMENT_SECONDS.observe(
                    max(0.0, assignment.decided_at - req.created_at)
                )
            for pair in assignment.pairs:
                metrics.PAIRS.labels(pair.scope).inc()
            self.book.placed_now(rid)
            # The claim said "assigned" to this node and the node record now holds it. The
            # event is published before the request is acked, so a lost event means a
            # redelivery, which republishes it (step 1), not a pod that never hears back. It
            # is announced as a child of the decision, so the bridge's bind joins the trace.
            with tracing.within(decided):
                await self.bus.publish(
                    subjects.alloc_assigned(node), assignment, msg_id=subjects.msg_id(rid, "assigned")
                )
            log.debug("assigned", request_id=rid, node=node, scope=decision.scope)
            return "assigned"
        raise Retry(f"request {rid}: lost the commit race {MAX_COMMIT_ATTEMPTS} times")

    def _decide(self, req: AllocationRequest) -> Placement | Unschedulable:
        """The replicas' decision, with devices reserved for the request by a preemption
        given back to it first (services/allocator/preemption.py); a refusal names the
        nodes the core does not count (:meth:`.ReadModel.explain`)."""
        decision = self.preemptions.decide(req, self.replicas.decide)
        if isinstance(decision, Unschedulable):
            return self.model.explain(req.node_selector, decision)
        return decision

    async def _commit(self, req: AllocationRequest, assignment: Assignment) -> bool:
        """Add the allocation to the node's record; False when a device went to another."""
        with _tracer.start_as_current_span("allocator.commit", kind=SpanKind.PRODUCER) as cspan:
            cspan.set_attributes(tracing.messaging(subjects.node_allocs(assignment.node), "publish"))
            rec = AllocRecord(
                assignment=assignment,
                priority=req.priority,
                traceparent=current_traceparent() or "",
                # A DeviceClaim's devices are never evicted for another request
                # (docs/sharing.md, "Preemption").
                preemptible=req.claim is None,
            )
            room = self._share_room(req, assignment) if assignment.shares() else None
            try:
                await self.node_allocs.update(
                    assignment.node,
                    commits.add_allocation(assignment.node, req.request_id, rec, share_room=room),
                )
            except RecordTooLarge:
                raise
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

    def _share_room(self, req: AllocationRequest, assignment: Assignment) -> commits.ShareRoom:
        """What the node's GPUs can hold in shares, checked again by the commit against the
        node's record as it is then (:mod:`.commits`)."""
        topo = self.cluster.topology(assignment.node)
        dc = self.cluster.device_classes.get(req.device_class) or DeviceClass()
        return commits.ShareRoom(
            memory_mib={g.id: g.memory_mib for g in topo.gpus()}, max_shares=dc.max_shares_per_gpu
        )

    async def _reject(self, req: AllocationRequest, reason: str) -> None:
        await self.book.reject(req, reason)
        await self.bus.publish(
            subjects.ALLOC_FAILED,
            AllocationFailed(
                request_id=req.request_id, pod=req.pod, reason=limits.clip(reason), retrying=False
            ),
            msg_id=subjects.msg_id(req.request_id, "rejected"),
        )
        log.info("rejected", request_id=req.request_id, reason=reason)

    async def _unschedulable(self, req: AllocationRequest, why: Unschedulable, *, traceparent: str) -> str:
        """Record the request ``pending`` with its reason and announce a new reason
        (``AllocationFailed``); see :mod:`.requestbook` for how often."""
        try:
            said = await self.book.record_pending(req, why, traceparent=traceparent)
        except commits.AlreadyDone:
            return "duplicate"
        if said is not None and said != why.reason:
            await self.bus.publish(
                subjects.ALLOC_FAILED,
                AllocationFailed(request_id=req.request_id, pod=req.pod, reason=limits.clip(why.reason)),
                msg_id=subjects.msg_id(req.request_id, "failed", zlib.crc32(why.reason.encode())),
            )
            log.info("unschedulable", request_id=req.request_id, reason=why.reason)
        return "pending"

    async def retry_pending(self) -> int:
        """Decide every pending request again now (:mod:`.retries`)."""
        return await self.retries.retry_pending()

    def _refreeze(self) -> None:
        """``gc.freeze`` again once the fleet grew by a tenth since the last time: nodes that
        joined after the start are long-lived objects too, and a full collection over them
        (long at 10,000 nodes) would otherwise land inside some decision."""
        nodes = len(self.model.nodes)
        if nodes > self._frozen_at * 1.1 + 10:
            gc.freeze()
            self._frozen_at = nodes
