"""The allocator service: allocation requests in, committed placements out.

Read model: the service mirrors KV ``tandem-nodes`` (hardware, health, ready/lost),
``tandem-allocs`` (what every node has handed out) and ``tandem-requests`` (where each request
stands) into the pure core's :class:`~services.allocator.core.Cluster`. Decisions never read
NATS; only commits write it.

One request, start to finish (each step idempotent, keyed by ``request_id``):

1. already placed (the request id is in some node's allocation record) → publish the
   assignment again (same ``Nats-Msg-Id``) and stop: a redelivery never allocates twice;
2. *claim* the request record with compare-and-set (``pending → deciding``, owner = this
   instance), so two replicas never place one request on two nodes;
3. ``allocator.decide``: the core picks node + devices jointly;
4. ``allocator.commit``: add the allocation to the node's record with compare-and-set on its
   revision. A lost race (another replica committed on that node first) re-reads the record
   and decides again — two allocators can never hand out one device;
5. mark the request ``assigned`` and publish ``Assignment`` to the node's subject.

An unschedulable request is recorded ``pending`` with the reason (one ``AllocationFailed``
per distinct reason, not one per retry) and retried, highest priority first, whenever
capacity changes (devices freed, a node joins or recovers) and every ``retry_interval``.
Devices are freed only when the node agent reports a *verified* cleanup (``Cleaned.ok``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import zlib
from collections.abc import Awaitable, Callable

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from opentelemetry.context import Context

from schemas import codec, subjects
from schemas.config import DeviceClass
from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    AllocRecord,
    Applied,
    AssignedNic,
    Assignment,
    Cleaned,
    Freed,
    NodeAllocations,
    NodeRecord,
    Release,
    RequestRecord,
)
from services.allocator import metrics
from services.allocator.core import Cluster, InvalidRequest, Placement, Unschedulable
from services.runtime.bus import Bus, Delivery, Retry
from services.runtime.kvwatch import watch_bucket
from services.runtime.logging import get_logger
from services.runtime.tasks import Service, Supervisor
from services.runtime.tracing import tracer

log = get_logger(__name__)
_tracer = tracer("tandem.allocator")

CommitHook = Callable[[AllocationRequest, Placement], Awaitable[None]]
MAX_COMMIT_ATTEMPTS = 8
HOSTNAME_LABEL = "kubernetes.io/hostname"


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
    ) -> None:
        self.bus = bus
        self.instance = instance
        self.cluster = Cluster(policy=policy, device_classes=device_classes)
        self.retry_interval = retry_interval
        self.claim_timeout = claim_timeout
        # Test seam: awaited between decide and commit so a test can force two replicas to
        # race on one node with the same stale view.
        self.before_commit = before_commit
        self.nodes: dict[str, NodeRecord] = {}
        self.allocs: dict[str, tuple[NodeAllocations, int]] = {}
        self.placed: dict[str, str] = {}  # request id → node, derived from self.allocs
        self._held: dict[str, set[str]] = {}  # node → request ids held in the core
        self.pending: dict[str, AllocationRequest] = {}
        self.deciding: dict[str, RequestRecord] = {}  # claimed records, to recover abandoned ones
        self._lock = asyncio.Lock()
        self._capacity = asyncio.Event()
        self._tasks = Supervisor("allocator")
        self._kv: dict[str, KeyValue] = {}

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        for bucket in (subjects.KV_NODES, subjects.KV_ALLOCS, subjects.KV_REQUESTS):
            self._kv[bucket] = await self.bus.kv(bucket)
        watches = [
            (subjects.KV_ALLOCS, codec.NODE_ALLOCS, self._on_allocs),
            (subjects.KV_NODES, codec.NODE_RECORD, self._on_node_record),
            (subjects.KV_REQUESTS, codec.REQUEST_RECORD, self._on_request_record),
        ]
        for bucket, decoder, callback in watches:
            ready = asyncio.Event()
            self._tasks.spawn(
                f"watch-{bucket}",
                lambda b=bucket, d=decoder, c=callback, r=ready: watch_bucket(  # type: ignore[misc]
                    self._kv[b], d, c, ready=r
                ),
            )
            await asyncio.wait_for(ready.wait(), 30)
        # The decoded topologies of a large fleet are ~0.7 M long-lived objects; moving them out
        # of the collector's generations keeps full collections out of decision latency
        # (docs/benchmarks.md, "gc.freeze").
        gc.freeze()
        consumers = [
            (subjects.CONSUMER_ALLOCATOR_REQUESTS, subjects.ALLOC_REQUEST, subjects.ALLOC_STREAM),
            (subjects.CONSUMER_ALLOCATOR_RELEASES, subjects.ALLOC_RELEASE_ALL, subjects.ALLOC_STREAM),
            (subjects.CONSUMER_ALLOCATOR_NODE, subjects.NODE_EVENTS_ALL, subjects.NODE_STREAM),
        ]
        for durable, subject, stream in consumers:
            decoder = codec.NODE_EVENT if stream == subjects.NODE_STREAM else codec.ALLOC_EVENT
            self._tasks.spawn(
                durable,
                lambda d=durable, s=subject, st=stream, dec=decoder: self.bus.consume(  # type: ignore[misc]
                    stream=st, durable=d, filter_subject=s, decoder=dec, handler=self._on_event
                ),
            )
        self._tasks.spawn("retry-pending", self._retry_loop)
        log.info("allocator_started", instance=self.instance, nodes=len(self.nodes))

    async def stop(self) -> None:
        await self._tasks.aclose()

    # -- read model -------------------------------------------------------------------------

    def _sync_node(self, node: str) -> None:
        """Make the core's view of ``node`` match the node record and its allocation record."""
        record = self.nodes.get(node)
        if record is None or record.status != "ready":
            # A lost node gets no new allocations; its holds return with it.
            self.cluster.remove_node(node)
            self._held.pop(node, None)
            return
        topo = record.topology
        # Like kubelet, every node carries its own name as a label selectors can use.
        labels = {**topo.labels, HOSTNAME_LABEL: node}
        self.cluster.set_node(node, topo, labels=labels, unavailable=record.unavailable())
        held = self._held.setdefault(node, set())
        allocs = self.allocs.get(node)
        current = dict(allocs[0].allocations) if allocs else {}
        for request_id in held - set(current):
            self.cluster.release(node, request_id)
        for request_id, rec in current.items():
            self.cluster.hold(node, request_id, rec.assignment.device_ids())
        self._held[node] = set(current)

    def _on_node_record(self, key: str, record: NodeRecord | None, _: int) -> None:
        before = self.nodes.get(key)
        if record is None:
            self.nodes.pop(key, None)
        else:
            self.nodes[key] = record
        self._sync_node(key)
        if record is not None and (
            before is None
            or before.status != record.status
            or before.unavailable() != record.unavailable()
            or before.topology != record.topology
        ):
            self._capacity.set()

    def _on_allocs(self, key: str, value: NodeAllocations | None, revision: int) -> None:
        old = self.allocs.get(key)
        if old is not None and old[1] >= revision:
            return  # our own commit already applied it
        for request_id in old[0].allocations if old else {}:
            self.placed.pop(request_id, None)
        if value is None:
            self.allocs.pop(key, None)
        else:
            self.allocs[key] = (value, revision)
            for request_id in value.allocations:
                self.placed[request_id] = key
        self._sync_node(key)
        if old is not None and (value is None or set(old[0].allocations) - set(value.allocations)):
            self._capacity.set()

    def _on_request_record(self, key: str, record: RequestRecord | None, _: int) -> None:
        self.pending.pop(key, None)
        self.deciding.pop(key, None)
        if record is not None and record.state == "pending":
            self.pending[key] = record.request
        elif record is not None and record.state == "deciding":
            self.deciding[key] = record

    def _abandoned_claims(self) -> list[AllocationRequest]:
        """Requests a replica claimed and then never finished (it crashed mid-decision).

        A claim is only taken while a message is being handled or a pending request retried;
        the pending path has no message left to redeliver, so without this such a request
        would wait forever."""
        cutoff = time.time() - self.claim_timeout
        return [r.request for r in self.deciding.values() if r.updated_at < cutoff]

    # -- KV helpers -------------------------------------------------------------------------

    async def _get_request(self, request_id: str) -> tuple[RequestRecord | None, int | None]:
        try:
            entry = await self._kv[subjects.KV_REQUESTS].get(subjects.kv_key(request_id))
        except KeyNotFoundError:
            return None, None
        return codec.REQUEST_RECORD.decode(entry.value or b""), entry.revision

    async def _put_request(self, record: RequestRecord) -> None:
        await self._kv[subjects.KV_REQUESTS].put(
            subjects.kv_key(record.request.request_id), codec.encode(record)
        )

    async def _claim(self, req: AllocationRequest) -> RequestRecord | None:
        """Take the request for this instance; None when it is done or another owns it."""
        kv = self._kv[subjects.KV_REQUESTS]
        for _ in range(MAX_COMMIT_ATTEMPTS):
            current, revision = await self._get_request(req.request_id)
            if current is not None:
                if current.state in ("assigned", "releasing", "freed", "cancelled", "rejected"):
                    return None
                busy = current.state == "deciding" and current.owner != self.instance
                if busy and time.time() - current.updated_at < self.claim_timeout:
                    raise Retry(f"request {req.request_id} is being decided by {current.owner}")
            claim = RequestRecord(
                request=req,
                state="deciding",
                owner=self.instance,
                reason=current.reason if current else "",
            )
            try:
                if revision is None:
                    await kv.create(subjects.kv_key(req.request_id), codec.encode(claim))
                else:
                    await kv.update(subjects.kv_key(req.request_id), codec.encode(claim), last=revision)
                return claim
            except KeyWrongLastSequenceError:
                continue
        raise Retry(f"request {req.request_id}: claim kept conflicting")

    async def _refresh_allocs(self, node: str) -> None:
        try:
            entry = await self._kv[subjects.KV_ALLOCS].get(subjects.kv_key(node))
        except KeyNotFoundError:
            return
        self._on_allocs(node, codec.NODE_ALLOCS.decode(entry.value or b""), entry.revision or 0)

    async def _commit(self, req: AllocationRequest, assignment: Assignment) -> bool:
        """Add the allocation to the node's record with CAS; False when the race was lost."""
        node = assignment.node
        if req.request_id in self.placed:
            return False  # placed while we decided (see _place); never hold it on two nodes
        kv = self._kv[subjects.KV_ALLOCS]
        cached = self.allocs.get(node)
        record = cached[0] if cached else NodeAllocations(node=node)
        clash = record.used() & set(assignment.device_ids())
        if clash:
            await self._refresh_allocs(node)
            return False
        allocations = dict(record.allocations)
        allocations[req.request_id] = AllocRecord(assignment=assignment, priority=req.priority)
        new = NodeAllocations(node=node, allocations=allocations)
        try:
            if cached is None:
                revision = await kv.create(subjects.kv_key(node), codec.encode(new))
            else:
                revision = await kv.update(subjects.kv_key(node), codec.encode(new), last=cached[1])
        except KeyWrongLastSequenceError:
            log.info("commit_conflict", node=node, request_id=req.request_id)
            await self._refresh_allocs(node)
            return False
        self._on_allocs(node, new, revision)
        return True

    async def _update_node_allocs(
        self, node: str, mutate: Callable[[NodeAllocations], NodeAllocations | None]
    ) -> NodeAllocations | None:
        kv = self._kv[subjects.KV_ALLOCS]
        for _ in range(MAX_COMMIT_ATTEMPTS * 4):
            try:
                entry = await kv.get(subjects.kv_key(node))
            except KeyNotFoundError:
                return None
            new = mutate(codec.NODE_ALLOCS.decode(entry.value or b""))
            if new is None:
                return None
            try:
                revision = await kv.update(subjects.kv_key(node), codec.encode(new), last=entry.revision)
            except KeyWrongLastSequenceError:
                continue
            self._on_allocs(node, new, revision)
            return new
        raise Retry(f"allocation record of {node}: too many conflicts")

    # -- requests ---------------------------------------------------------------------------

    async def _on_event(self, event: object, delivery: Delivery) -> None:
        if isinstance(event, AllocationRequest):
            await self.handle_request(event, context=delivery.context)
        elif isinstance(event, Release):
            await self._on_release(event, delivery)
        elif isinstance(event, Cleaned):
            await self._on_cleaned(event, delivery)
        elif isinstance(event, Applied):
            await self._on_applied(event)

    async def _republish(self, request_id: str, *, claimed: AllocationRequest | None = None) -> None:
        """Publish a committed assignment again (same msg id); ``claimed``: we hold its claim."""
        node = self.placed[request_id]
        rec = self.allocs[node][0].allocations[request_id]
        if claimed is None and request_id in self.deciding:
            claimed = self.deciding[request_id].request
        if claimed is not None:
            # Committed, but the request record still says "deciding": the write that marks it
            # assigned failed (its KV stream had no leader for a moment). Finish it now, or
            # the record would stay half-done and be "recovered" again and again.
            await self._put_request(
                RequestRecord(request=claimed, state="assigned", node=node, owner=self.instance)
            )
        await self.bus.publish(
            subjects.alloc_assigned(node),
            rec.assignment,
            msg_id=subjects.msg_id(request_id, "assigned"),
        )

    async def handle_request(self, req: AllocationRequest, *, context: Context | None = None) -> str:
        """Place one request; returns the outcome (``assigned``, ``pending``, ``rejected``,
        ``duplicate``)."""
        if req.request_id in self.placed:
            await self._republish(req.request_id)
            return "duplicate"
        async with self._lock:
            return await self._place(req, context=context)

    async def _place(self, req: AllocationRequest, *, context: Context | None) -> str:
        claim = await self._claim(req)
        if claim is None:
            if req.request_id in self.placed:
                await self._republish(req.request_id)
            return "duplicate"
        for _ in range(MAX_COMMIT_ATTEMPTS):
            if req.request_id in self.placed:
                # A node record already holds this request: an earlier commit of ours landed
                # though its reply was lost (a NATS server died mid-write), and the record came
                # back through the watch or the re-read after a "conflict" with ourselves.
                # Deciding again would place the request a second time.
                await self._republish(req.request_id, claimed=req)
                return "duplicate"
            with _tracer.start_as_current_span("allocator.decide", context=context) as span:
                span.set_attributes(_pod_attributes(req))
                t0 = time.perf_counter()
                try:
                    decision = self.cluster.decide(req)
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
                    await self._unschedulable(req, claim, decision)
                    return "pending"
                span.set_attributes(
                    {
                        "tandem.candidates": decision.candidates,
                        "tandem.scope": decision.scope,
                        "k8s.node.name": decision.node,
                    }
                )
                if self.before_commit is not None:
                    await self.before_commit(req, decision)
                assignment = build_assignment(req, decision, instance=self.instance)
                with _tracer.start_as_current_span("allocator.commit") as cspan:
                    committed = await self._commit(req, assignment)
                    cspan.set_attribute("tandem.committed", committed)
                if not committed:
                    metrics.COMMIT_CONFLICTS.inc()
                    continue
                metrics.DECISIONS.labels("assigned").inc()
                metrics.REQUEST_TO_ASSIGNMENT_SECONDS.observe(
                    max(0.0, assignment.decided_at - req.created_at)
                )
                for pair in assignment.pairs:
                    metrics.PAIRS.labels(pair.scope).inc()
                await self._put_request(
                    RequestRecord(request=req, state="assigned", node=decision.node, owner=self.instance)
                )
                await self.bus.publish(
                    subjects.alloc_assigned(decision.node),
                    assignment,
                    msg_id=subjects.msg_id(req.request_id, "assigned"),
                )
                self.pending.pop(req.request_id, None)
                log.info(
                    "assigned",
                    request_id=req.request_id,
                    node=decision.node,
                    scope=decision.scope,
                    gpus=[g.index for g in assignment.gpus],
                    nics=[n.name for n in assignment.nics],
                )
                return "assigned"
        raise Retry(f"request {req.request_id}: lost the commit race {MAX_COMMIT_ATTEMPTS} times")

    async def _reject(self, req: AllocationRequest, reason: str) -> None:
        await self._put_request(RequestRecord(request=req, state="rejected", reason=reason))
        await self.bus.publish(
            subjects.ALLOC_FAILED,
            AllocationFailed(request_id=req.request_id, pod=req.pod, reason=reason, retrying=False),
            msg_id=subjects.msg_id(req.request_id, "rejected"),
        )
        log.info("rejected", request_id=req.request_id, reason=reason)

    async def _unschedulable(self, req: AllocationRequest, claim: RequestRecord, why: Unschedulable) -> None:
        await self._put_request(RequestRecord(request=req, state="pending", owner="", reason=why.reason))
        self.pending[req.request_id] = req
        if claim.reason != why.reason:
            await self.bus.publish(
                subjects.ALLOC_FAILED,
                AllocationFailed(request_id=req.request_id, pod=req.pod, reason=why.reason),
                msg_id=subjects.msg_id(req.request_id, "failed", zlib.crc32(why.reason.encode())),
            )
            log.info("unschedulable", request_id=req.request_id, reason=why.reason)

    async def retry_pending(self) -> int:
        """Try every pending request again, highest priority (then oldest) first."""
        placed = 0
        candidates = {r.request_id: r for r in [*self._abandoned_claims(), *self.pending.values()]}
        order = sorted(candidates.values(), key=lambda r: (-r.priority, r.created_at))
        for req in order:
            if req.request_id not in self.pending and req.request_id not in self.deciding:
                continue
            try:
                if await self.handle_request(req) == "assigned":
                    placed += 1
            except Retry as r:
                log.info("retry_deferred", request_id=req.request_id, reason=str(r))
        return placed

    def update_gauges(self) -> None:
        totals = self.cluster.totals()
        metrics.DEVICES.labels("gpu", "total").set(totals["gpus"])
        metrics.DEVICES.labels("gpu", "free").set(totals["free_gpus"])
        metrics.DEVICES.labels("nic", "total").set(totals["nics"])
        metrics.DEVICES.labels("nic", "free").set(totals["free_nics"])
        metrics.PENDING.set(len(self.pending))
        for status in ("ready", "lost"):
            metrics.NODES.labels(status).set(sum(1 for r in self.nodes.values() if r.status == status))

    async def _retry_loop(self) -> None:
        while True:
            self.update_gauges()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._capacity.wait(), self.retry_interval)
            self._capacity.clear()
            if self.pending or self.deciding:
                await self.retry_pending()

    # -- release, apply, cleanup ------------------------------------------------------------

    async def _on_release(self, release: Release, delivery: Delivery) -> None:
        node = self.placed.get(release.request_id)
        if node is None:
            await self._refresh_request_placement(release.request_id)
            node = self.placed.get(release.request_id)
        if node is None:
            # Not placed (pending, or the release overtook the request): cancel for good.
            async with self._lock:
                current, _ = await self._get_request(release.request_id)
                request = (
                    current.request
                    if current
                    else AllocationRequest(request_id=release.request_id, pod=release.pod, gpus=0)
                )
                if current is None or current.state in ("pending", "deciding"):
                    await self._put_request(
                        RequestRecord(request=request, state="cancelled", reason="released")
                    )
                    self.pending.pop(release.request_id, None)
                    await self.bus.publish(
                        subjects.ALLOC_FREED,
                        Freed(request_id=release.request_id),
                        msg_id=subjects.msg_id(release.request_id, "freed"),
                    )
                    return
            if current.state not in ("assigned", "releasing"):
                return  # already freed, cancelled or rejected: nothing is held
            # Placed while this release waited for the lock (the request was being decided,
            # e.g. both queued up behind a NATS fail-over): release it as placed, never drop it.
            await self._refresh_request_placement(release.request_id)
            node = self.placed.get(release.request_id)
            if node is None:
                raise Retry(f"release of {release.request_id}: its placement is not visible yet")

        def mark(allocs: NodeAllocations) -> NodeAllocations | None:
            rec = allocs.allocations.get(release.request_id)
            if rec is None or rec.state == "releasing":
                return None
            updated = dict(allocs.allocations)
            updated[release.request_id] = msgspec.structs.replace(
                rec, state="releasing", updated_at=time.time()
            )
            return msgspec.structs.replace(allocs, allocations=updated)

        await self._update_node_allocs(node, mark)
        if delivery.subject == subjects.alloc_release(None):
            # The releaser did not know the node: forward to the node agent that holds it.
            await self.bus.publish(
                subjects.alloc_release(node),
                msgspec.structs.replace(release, node=node),
                msg_id=subjects.msg_id(release.request_id, "release", node),
            )

    async def _refresh_request_placement(self, request_id: str) -> None:
        current, _ = await self._get_request(request_id)
        if current is not None and current.node:
            await self._refresh_allocs(current.node)

    async def _on_applied(self, applied: Applied) -> None:
        def mark(allocs: NodeAllocations) -> NodeAllocations | None:
            rec = allocs.allocations.get(applied.request_id)
            if rec is None or rec.state != "assigned":
                return None
            updated = dict(allocs.allocations)
            updated[applied.request_id] = msgspec.structs.replace(
                rec, state="applied", updated_at=time.time()
            )
            return msgspec.structs.replace(allocs, allocations=updated)

        if not applied.ok:
            log.warning("apply_failed", request_id=applied.request_id, node=applied.node, error=applied.error)
            return
        await self._update_node_allocs(applied.node, mark)

    async def _on_cleaned(self, cleaned: Cleaned, delivery: Delivery) -> None:
        if not cleaned.ok:
            # Never free devices whose cleanup was not verified; the agent has marked them
            # unhealthy and a later verified cleanup frees them.
            log.warning("cleanup_unverified", request_id=cleaned.request_id, problems=cleaned.problems)
            current, _ = await self._get_request(cleaned.request_id)
            if current is not None:
                await self._put_request(
                    msgspec.structs.replace(
                        current, reason="; ".join(cleaned.problems), updated_at=time.time()
                    )
                )
            return
        with _tracer.start_as_current_span("allocator.free", context=delivery.context) as span:
            span.set_attributes({"tandem.request_id": cleaned.request_id, "k8s.node.name": cleaned.node})

            def drop(allocs: NodeAllocations) -> NodeAllocations | None:
                if cleaned.request_id not in allocs.allocations:
                    return None
                rest = {k: v for k, v in allocs.allocations.items() if k != cleaned.request_id}
                return msgspec.structs.replace(allocs, allocations=rest)

            await self._update_node_allocs(cleaned.node, drop)
            current, _ = await self._get_request(cleaned.request_id)
            if current is not None and current.state != "freed":
                await self._put_request(
                    msgspec.structs.replace(current, state="freed", updated_at=time.time())
                )
            await self.bus.publish(
                subjects.ALLOC_FREED,
                Freed(request_id=cleaned.request_id, node=cleaned.node, devices=cleaned.devices),
                msg_id=subjects.msg_id(cleaned.request_id, "freed"),
            )
            self._capacity.set()
            log.info("freed", request_id=cleaned.request_id, node=cleaned.node)
