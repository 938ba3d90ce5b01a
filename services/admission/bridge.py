"""The pod bridge: persisted Tandem pods ⇄ allocation messages.

Inputs and what they cause (all idempotent, keyed by ``request_id = <pod uid>.1``):

* a managed pod that still carries the gate ``tandem.io/allocation`` → ``alloc.request``
  (``Nats-Msg-Id`` from the request id, span ``bridge.request`` under the pod's
  ``tandem.io/traceparent``);
* ``alloc.assigned.<node>`` (durable ``CONSUMER_BRIDGE``) → one merge patch on the pod: required
  node affinity to the node, ``tandem.io/assignment``, gate removed (span ``bridge.bind``, child
  of the allocator's span). A pod that is gone gets its devices released instead;
* ``alloc.failed`` (durable ``CONSUMER_BRIDGE_FAILED``) → one Warning Event per pod whose count
  and lastTimestamp move while it stays pending (at most one write per ``event_interval`` for an
  unchanged reason);
* a managed pod deleted or finished (Succeeded/Failed) → ``alloc.release`` on the node's release
  subject (span ``bridge.release``);
* ``alloc.preempt`` (durable ``CONSUMER_BRIDGE_PREEMPT``) → the victims' pods evicted through
  the Eviction API, respecting PodDisruptionBudgets (:mod:`.evictions`).

Nothing is lost while the bridge is down: outcomes wait in the durable consumers, and every
(re)list of pods runs :meth:`Bridge.resync`, which compares the pods with the allocator's
``RequestRecord``\\ s in ``KV_REQUESTS`` — gated pods without a record are requested, records
whose pod is gone are released, and a gated pod whose record is already ``assigned`` is bound
from the node's allocation record. Nothing is duplicated: each publish carries a stable msg id
(the server drops repeats within its window) and the bridge checks the records before
re-requesting after a restart.

Pods that ask through DRA ResourceClaims (with ``dra_kube``) are handed to
:class:`~services.admission.drabridge.DraBridge` with their outcomes and ``Freed`` events
(durable ``CONSUMER_BRIDGE_FREED``): their claims, not the pods, hold the devices, so a pod's
end releases nothing here, and a record that holds claims is never released for a pod gone.

DeviceClaims (``tandem.io/claim`` on a pod, the ``DeviceClaim`` resource) are handled by
:class:`~services.admission.claimbridge.ClaimBridge`; this class hands it the claim's pods and
outcomes (request ids ``claim-<uid>``) and lists claims before pods, so a restarted bridge
knows every claim before it judges a pod that uses one.

Handlers ack only after the effect is committed (Bus.consume); a Kubernetes conflict (the pod
changed since it was read) is retried by redelivery, which re-reads the pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from nats.js.errors import KeyNotFoundError

from schemas import codec, subjects
from schemas.config import DeviceClass
from schemas.messages import (
    AllocationFailed,
    Assignment,
    Freed,
    JobRecord,
    PodRef,
    PreemptionPlan,
    Release,
    RequestRecord,
)
from services.admission import claims, drapods, evictions, jobwatch, metrics, names, podrules, podwrites
from services.admission.claimbridge import ClaimBridge
from services.admission.drabridge import ClaimApi, DraBridge
from services.admission.errors import InvalidPod, PolicyError
from services.admission.nodelabels import NodeLabelMirror
from services.kube.client import KubeApi
from services.kube.errors import Conflict, KubeError, NotFound
from services.runtime.kv.watch import read_bucket
from services.runtime.nats.bus import Bus, Delivery, Retry
from services.runtime.observe.logging import get_logger
from services.runtime.observe.tracing import context_from_traceparent, tracer
from services.runtime.process.tasks import Supervisor

log = get_logger(__name__)

ACTIVE_STATES = frozenset({"pending", "deciding", "assigned"})
# Assignments bound at once (docs/benchmarks.md, "Through the real API").
BIND_CONCURRENCY = 32


class Bridge:
    def __init__(
        self,
        *,
        kube: KubeApi,
        bus: Bus,
        device_classes: dict[str, DeviceClass],
        event_interval: float = 30.0,
        watch_timeout: int = 300,
        relist_backoff: float = 1.0,
        job_wait_timeout: float = 60.0,
        mirror_node_labels: bool = True,
        clock: Callable[[], float] = time.time,
        claim_tick: float = 1.0,
        eviction_backoff: float = 1.0,
        dra_kube: ClaimApi | None = None,
    ) -> None:
        self.kube = kube
        self.bus = bus
        self.device_classes = device_classes
        self.event_interval = event_interval
        self.watch_timeout = watch_timeout
        self.relist_backoff = relist_backoff
        # A job still missing pods after this long gets an Event on the pods it has.
        self.job_wait_timeout = job_wait_timeout
        self.jobs = jobwatch.Gatherer()
        # Fabric labels of Nodes into KV for the allocator (services.admission.nodelabels).
        self.mirror_node_labels = mirror_node_labels
        self.clock = clock
        # First delay before a preemption blocked by a PodDisruptionBudget is tried again.
        self.eviction_backoff = eviction_backoff
        self.instance = bus.settings.instance
        self._tracer = tracer("tandem.bridge")
        self._requested: set[str] = set()
        self._released: set[str] = set()
        # The latest object of each managed pod as the list and the watch delivered it, by
        # (namespace, name): a bind patches from it instead of reading the pod again (one
        # round trip to the API server instead of two); a stale one costs a 409 and a read.
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._events: dict[tuple[str, str], podwrites.EventState] = {}
        self.synced = asyncio.Event()
        """Set after the first resync finished (tests and readiness wait on it)."""
        self.claims = ClaimBridge(
            kube=kube,
            bus=bus,
            device_classes=device_classes,
            record_event=self.record_event,
            clock=clock,
            watch_timeout=watch_timeout,
            relist_backoff=relist_backoff,
            tick=claim_tick,
        )
        # Pods asking through DRA ResourceClaims (docs/dra.md), when the cluster serves them.
        self.dra = (
            DraBridge(
                kube=dra_kube,
                bus=bus,
                device_classes=device_classes,
                record_event=self.record_event,
                watch_timeout=watch_timeout,
                relist_backoff=relist_backoff,
                clock=clock,
            )
            if dra_kube is not None
            else None
        )

    # -- running ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Watch pods and consume outcomes until ``stop`` is set (or the task is cancelled)."""
        sup = Supervisor("bridge")
        sup.spawn("claims", lambda: self.claims.watch(stop, records=self.request_records))
        sup.spawn("claim-expiry", lambda: self.claims.expire(stop))
        sup.spawn("pods", lambda: self.watch_pods(stop))
        # Outcomes of the allocator, one durable consumer each. Binds of different pods are
        # independent and each is a round trip or two to the API server, so many run at once
        # (one at a time, they capped a fleet's placements at the API server's latency); a
        # bind is idempotent (a bound pod is left alone), so its ack needs no confirmation.
        consumers = [
            (
                "assigned",
                subjects.CONSUMER_BRIDGE,
                subjects.ALLOC_ASSIGNED_ALL,
                self.on_outcome,
                BIND_CONCURRENCY,
            ),
            ("failed", subjects.CONSUMER_BRIDGE_FAILED, subjects.ALLOC_FAILED, self.on_outcome, 1),
            ("preempt", subjects.CONSUMER_BRIDGE_PREEMPT, subjects.ALLOC_PREEMPT, self.on_preemption, 1),
        ]
        if self.dra is not None:
            dra = self.dra
            sup.spawn("dra-claims", lambda: dra.watch(stop, records=self.request_records))
            consumers.append(
                ("freed", subjects.CONSUMER_BRIDGE_FREED, subjects.ALLOC_FREED, self.on_freed, 1)
            )
        for task, durable, subject, handler, concurrency in consumers:
            sup.spawn(
                task,
                lambda d=durable, f=subject, h=handler, c=concurrency: self.bus.consume(  # type: ignore[misc]
                    stream=subjects.ALLOC_STREAM,
                    durable=d,
                    filter_subject=f,
                    decoder=codec.ALLOC_EVENT,
                    handler=h,
                    stop=stop,
                    concurrency=c,
                    confirm_acks=c == 1,
                ),
            )
        sup.spawn("events", lambda: self.flush_events(stop))
        if self.mirror_node_labels:
            mirror = NodeLabelMirror(kube=self.kube, bus=self.bus, watch_timeout=self.watch_timeout)
            sup.spawn("node-labels", lambda: mirror.run(stop))
        try:
            await stop.wait()
        finally:
            await sup.aclose()

    async def flush_events(self, stop: asyncio.Event) -> None:
        """Write the counts held back by the throttle, so an Event's count catches up even when
        the failures stop arriving."""
        interval = max(self.event_interval, 1.0)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            now = self.clock()
            await self._report_incomplete_jobs(now)
            for (ns, name), state in list(self._events.items()):
                if not podwrites.flush_due(state, now=now, min_interval=self.event_interval):
                    continue
                try:
                    await self.kube.patch_event(
                        ns, name, podwrites.event_update(message=state.message, count=state.count, now=now)
                    )
                except NotFound:
                    self._events.pop((ns, name), None)
                    continue
                state.written_count, state.written_at = state.count, now

    async def watch_pods(self, stop: asyncio.Event) -> None:
        """List + resync, then watch from the list's version; on any watch end, do it again."""
        await self.claims.synced.wait()  # claims before the pods that use them
        if self.dra is not None:
            await self.dra.synced.wait()
        while not stop.is_set():
            try:
                # Records first, then pods: a record whose pod is missing from the later list
                # really is orphaned (the pod existed when the request was made).
                records = await self.request_records()
                job_records = await self.job_records()
                pods, version = await self.kube.list_pods(label_selector=names.MANAGED_SELECTOR)
                await self.resync(pods, records)
                await self.resync_jobs(pods, job_records)
                self.claims.pods_synced.set()
                await self.claims.finish_deletions()
                self.synced.set()
                async for kind, obj in self.kube.watch_pods(
                    label_selector=names.MANAGED_SELECTOR,
                    resource_version=version,
                    timeout_s=self.watch_timeout,
                ):
                    await self.on_pod_event(kind, obj)
            except KubeError as exc:
                log.warning("pod_watch_restart", error=str(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.relist_backoff)

    # -- resync ----------------------------------------------------------------------------

    async def request_records(self) -> dict[str, RequestRecord]:
        return await read_bucket(self.bus.js, subjects.KV_REQUESTS, codec.REQUEST_RECORD)

    async def job_records(self) -> dict[str, JobRecord]:
        return await read_bucket(self.bus.js, subjects.KV_JOBS, codec.JOB_RECORD)

    async def resync_jobs(self, pods: list[dict[str, Any]], records: dict[str, JobRecord]) -> None:
        """Pods of jobs that went away while the bridge was down: a placed job's missing pod
        is released alone, a job not placed yet is cancelled."""
        live = {(p.get("metadata") or {}).get("uid") for p in pods}
        for job_id, record in records.items():
            if record.state not in ("pending", "aborted", "committing", "committed"):
                continue
            if self.dra is not None and any(
                self.dra.holds(record.job.pod_id(i)) for i in range(record.job.pods)
            ):
                continue  # its pods' DRA claims hold the devices: released through the claims (drajobbridge)
            gone = [
                i
                for i, ref in enumerate(record.job.members)
                if ref.uid and ref.uid not in live and await self._pod_gone(ref)
            ]
            if not gone:
                continue
            if record.state != "committed":
                ref = record.job.members[gone[0]]
                await self.publish_release(
                    job_id,
                    ref,
                    node=None,
                    reason="pod of the job deleted while the bridge was away",
                    traceparent=None,
                )
                continue
            for i in gone:
                node = record.placement[i] if i < len(record.placement) else None
                await self.publish_release(
                    record.job.pod_id(i),
                    record.job.members[i],
                    node=node,
                    reason="pod deleted while the bridge was away",
                    traceparent=None,
                )

    async def resync(self, pods: list[dict[str, Any]], records: dict[str, RequestRecord]) -> None:
        live: set[str] = set()
        self._pods = {_key_of(raw): raw for raw in pods}
        for raw in pods:
            try:
                pod = podrules.read_pod(raw)
            except InvalidPod:
                continue
            if pod.metadata.uid:
                live.add(pod.metadata.uid)
            rid = podrules.request_id_for(pod.metadata.uid or "")
            record = records.get(rid)
            if record is not None:
                # The allocator has it: never re-request after a restart.
                self._requested.add(rid)
            await self.on_pod_event("ADDED", raw)
            if (
                record is not None
                and record.state == "assigned"
                and record.node
                and names.GATE in pod.gates
                and not pod.terminal
            ):
                await self._bind_from_record(pod, raw, record)
        await self.claims.prune(live)
        if self.dra is not None:
            await self.dra.pods_resynced(live)
        for rid, record in records.items():
            uid = record.request.pod.uid
            if record.request.claim is not None:
                continue  # a claim's request: the claim half resyncs it against the claims
            if self.dra is not None and self.dra.holds(rid):
                continue  # holds DRA claims' devices: freed when the claims go, not with the pod
            if record.state not in ACTIVE_STATES or not uid or uid in live or rid in self._released:
                continue
            if await self._pod_gone(record.request.pod):
                await self.publish_release(
                    rid,
                    record.request.pod,
                    node=record.node,
                    reason="pod deleted while the bridge was away",
                    traceparent=None,
                )

    async def _pod_gone(self, ref: PodRef) -> bool:
        """Confirm with a GET (a pod may merely have lost its label)."""
        try:
            raw = await self.kube.get_pod(ref.namespace, ref.name)
        except NotFound:
            return True
        return (raw.get("metadata") or {}).get("uid") != ref.uid

    async def _bind_from_record(
        self, pod: podrules.PodView, raw: dict[str, Any], record: RequestRecord
    ) -> None:
        assert record.node is not None
        kv = await self.bus.kv(subjects.KV_ALLOCS)
        try:
            entry = await kv.get(subjects.kv_key(record.node))
        except KeyNotFoundError:
            return
        if entry.value is None:
            return
        allocs = codec.NODE_ALLOCS.decode(entry.value)
        rec = allocs.allocations.get(record.request.request_id)
        if rec is None:
            return
        with contextlib.suppress(Retry):
            await self._bind(rec.assignment, raw=raw)

    # -- pods ------------------------------------------------------------------------------

    async def on_pod_event(self, kind: str, raw: dict[str, Any]) -> None:
        try:
            pod = podrules.read_pod(raw)
        except InvalidPod as exc:
            log.warning("unreadable_pod", error=str(exc))
            return
        # The API server filters by label; check again so a lax server cannot widen the scope.
        if pod.labels.get(names.MANAGED) != "true" or not pod.metadata.uid:
            return
        if self.dra is not None and drapods.asks_claims(pod):
            # Asks through DRA ResourceClaims: the claims hold the devices, not the pod.
            if kind == "DELETED":
                self._pods.pop(_key_of(raw), None)
            else:
                self._pods[_key_of(raw)] = raw
            await self.dra.on_pod_event(kind, pod, raw)
            return
        if names.CLAIM in pod.annotations:
            # Uses a DeviceClaim: no request of its own, and its end frees nothing.
            await self.claims.on_pod_event(kind, pod, raw)
            return
        rid = podrules.request_id_for(pod.metadata.uid)
        if kind == "DELETED":
            self._pods.pop(_key_of(raw), None)
            await self.release(pod, reason="pod deleted")
            self._released.discard(rid)
            return
        self._pods[_key_of(raw)] = raw
        if pod.terminal:
            phase = pod.status.phase if pod.status else ""
            await self.release(pod, reason=f"pod {phase}")
            return
        try:
            member = jobwatch.membership(pod)
        except PolicyError as exc:
            await self.record_event(pod, reason=jobwatch.EVENT_REASON_INVALID, message=str(exc))
            return
        if member is not None:
            if not pod.metadata.deletionTimestamp:
                await self.gather(pod, member)
            return
        if names.GATE in pod.gates and not pod.metadata.deletionTimestamp:
            await self.request(pod)

    async def request(self, pod: podrules.PodView) -> None:
        rid = podrules.request_id_for(pod.metadata.uid or "")
        if rid in self._requested:
            return
        try:
            req = podrules.allocation_request(pod, device_classes=self.device_classes)
        except (PolicyError, InvalidPod) as exc:
            await self.record_event(pod, reason=names.EVENT_REASON_INVALID, message=str(exc))
            return
        if req is None:
            return
        parent = context_from_traceparent(pod.annotations.get(names.TRACEPARENT))
        with self._tracer.start_as_current_span("bridge.request", context=parent) as span:
            _pod_attributes(span, req.pod)
            span.set_attribute("tandem.request_id", rid)
            span.set_attribute("tandem.gpus", req.gpus)
            span.set_attribute("tandem.rdma", req.rdma)
            await self.bus.publish(subjects.ALLOC_REQUEST, req, msg_id=subjects.msg_id("request", rid))
        metrics.BRIDGE_REQUESTS.inc()
        self._requested.add(rid)
        log.info("allocation_requested", request_id=rid, namespace=req.pod.namespace, pod=req.pod.name)

    async def gather(self, pod: podrules.PodView, member: jobwatch.Membership) -> None:
        """A pod of a job: requested with the whole job once every pod of it exists."""
        key, complete = self.jobs.add(pod, member, now=self.clock())
        if complete is None or not any(names.GATE in p.gates for p in complete):
            return
        try:
            job = jobwatch.job_request(complete, device_classes=self.device_classes)
        except (PolicyError, InvalidPod) as exc:
            for p in complete:
                await self.record_event(p, reason=jobwatch.EVENT_REASON_INVALID, message=str(exc))
            return
        parent = context_from_traceparent(pod.annotations.get(names.TRACEPARENT))
        with self._tracer.start_as_current_span("bridge.request_job", context=parent) as span:
            span.set_attribute("tandem.job", job.job_id)
            span.set_attribute("tandem.pods", job.pods)
            span.set_attribute("tandem.gpus", job.gpus)
            span.set_attribute("tandem.rdma", job.rdma)
            await self.bus.publish(subjects.ALLOC_JOB, job, msg_id=subjects.msg_id("job", job.job_id))
        self.jobs.requested(key, job.job_id)
        metrics.BRIDGE_REQUESTS.inc()
        log.info("job_requested", job=job.job_id, namespace=job.namespace, pods=job.pods)

    async def _report_incomplete_jobs(self, now: float) -> None:
        gatherers = [self.jobs] if self.dra is None else [self.jobs, self.dra.jobs.gather]
        waiting = [w for g in gatherers for w in g.waiting(now=now, timeout=self.job_wait_timeout)]
        for group, size, present in waiting:
            message = (
                f"job {group}: {len(present)} of {size} pods exist; Tandem requests devices for the "
                "whole job once all of its pods exist (nothing is held meanwhile)"
            )
            for pod in present:
                with contextlib.suppress(NotFound):
                    await self.record_event(pod, reason=jobwatch.EVENT_REASON_WAITING, message=message)

    async def release(self, pod: podrules.PodView, *, reason: str) -> None:
        rid = podrules.request_id_for(pod.metadata.uid or "")
        job, _ = self.jobs.remove(pod)
        bound = podwrites.read_assignment_annotation(pod)
        if job is not None and (bound is None or not bound.request_id.startswith(f"{job}/")):
            # A pod of a job that is not placed yet: the job cannot run without it.
            rid = job
        elif bound is not None and "/" in bound.request_id:
            rid = bound.request_id  # one pod of a placed job: its devices alone
        if rid in self._released:
            return
        await self.publish_release(
            rid,
            podrules.pod_ref(pod),
            node=podwrites.release_node(pod),
            reason=reason,
            traceparent=pod.annotations.get(names.TRACEPARENT),
        )
        for event_reason in (names.EVENT_REASON_FAILED, names.EVENT_REASON_INVALID):
            key = f"{pod.metadata.uid}/{event_reason}"
            self._events.pop(
                (pod.metadata.namespace or "", podwrites.event_name(pod.metadata.name or "", key)), None
            )

    async def publish_release(
        self, rid: str, ref: PodRef, *, node: str | None, reason: str, traceparent: str | None
    ) -> None:
        msg = Release(request_id=rid, pod=ref, node=node, reason=reason)
        with self._tracer.start_as_current_span(
            "bridge.release", context=context_from_traceparent(traceparent)
        ) as span:
            _pod_attributes(span, ref)
            if node:
                span.set_attribute("k8s.node.name", node)
            span.set_attribute("tandem.request_id", rid)
            span.set_attribute("tandem.release.reason", reason)
            # The node is part of the id: a release to ``_unplaced`` (pod deleted while pending)
            # and a later one to the node chosen meanwhile are different events.
            subject = subjects.alloc_release(node)
            await self.bus.publish(subject, msg, msg_id=subjects.msg_id("release", rid, subject))
        metrics.BRIDGE_RELEASES.inc()
        self._released.add(rid)
        self._requested.discard(rid)
        log.info("allocation_released", request_id=rid, node=node, reason=reason)

    # -- outcomes --------------------------------------------------------------------------

    async def on_outcome(self, msg: Any, delivery: Delivery) -> None:
        if isinstance(msg, Assignment | AllocationFailed) and claims.is_claim_request(msg.request_id):
            if isinstance(msg, Assignment):
                await self.claims.on_assignment(msg)
            else:
                await self.claims.on_failed(msg)
        elif isinstance(msg, Assignment):
            with self._tracer.start_as_current_span("bridge.bind", context=delivery.context) as span:
                _pod_attributes(span, msg.pod)
                span.set_attribute("k8s.node.name", msg.node)
                span.set_attribute("tandem.request_id", msg.request_id)
                await self._bind(msg, raw=self._seen(msg.pod))
        elif isinstance(msg, AllocationFailed):
            await self.on_failed(msg)
        # Other kinds on these subjects are not the bridge's business; ack them.

    async def on_preemption(self, msg: Any, delivery: Delivery) -> None:
        if isinstance(msg, PreemptionPlan):
            await evictions.evict_victims(self, msg, delivery)

    def claim_consumers(self, request_id: str) -> list[PodRef] | None:
        """The pods using the DRA claims ``request_id`` holds (a preemption's victims)."""
        return self.dra.consumers(request_id) if self.dra is not None else None

    def _seen(self, ref: PodRef) -> dict[str, Any] | None:
        """The pod as the watch last delivered it, if it is still that pod (same uid)."""
        raw = self._pods.get((ref.namespace, ref.name))
        if raw is None or (raw.get("metadata") or {}).get("uid") != ref.uid:
            return None
        return raw

    async def _bind(self, a: Assignment, *, raw: dict[str, Any] | None) -> None:
        if raw is None:
            try:
                raw = await self.kube.get_pod(a.pod.namespace, a.pod.name)
            except NotFound:
                raw = None
        pod = podrules.read_pod(raw) if raw is not None else None
        if raw is None or pod is None or pod.metadata.uid != a.pod.uid:
            if self.dra is not None and self.dra.holds(a.request_id):
                return  # claims hold the devices: released once no pod uses them (drabridge)
            # The pod went away before it could be bound: give the devices back.
            await self.publish_release(
                a.request_id, a.pod, node=a.node, reason="pod gone before binding", traceparent=None
            )
            metrics.BRIDGE_BINDS.labels("pod_gone").inc()
            return
        if self.dra is not None and drapods.asks_claims(pod):
            try:
                await self.dra.on_assignment(a, raw)
            except Retry:
                if self._pods.get((a.pod.namespace, a.pod.name)) is raw:
                    del self._pods[(a.pod.namespace, a.pod.name)]
                raise
            return
        if podwrites.is_bound(pod, a.request_id):
            return
        if pod.terminal or pod.metadata.deletionTimestamp:
            return  # the pod watch releases it
        if names.GATE not in pod.gates:
            log.warning("gate_already_removed", request_id=a.request_id, pod=pod.metadata.name)
            return
        try:
            await self.kube.patch_pod(a.pod.namespace, a.pod.name, podwrites.bind_patch(raw, a))
        except Conflict as exc:
            # Changed since this version (or the watch is behind): read it again next time.
            if self._pods.get((a.pod.namespace, a.pod.name)) is raw:
                del self._pods[(a.pod.namespace, a.pod.name)]
            raise Retry(f"pod changed while binding: {exc}", delay=0.2) from None
        except NotFound:
            await self.publish_release(
                a.request_id, a.pod, node=a.node, reason="pod gone before binding", traceparent=None
            )
            metrics.BRIDGE_BINDS.labels("pod_gone").inc()
            return
        metrics.BRIDGE_BINDS.labels("bound").inc()
        log.info("pod_bound", request_id=a.request_id, node=a.node, pod=a.pod.name)

    async def on_freed(self, msg: Any, delivery: Delivery) -> None:
        if isinstance(msg, Freed) and self.dra is not None:
            await self.dra.on_freed(msg)

    async def on_failed(self, f: AllocationFailed) -> None:
        if self.dra is not None:
            await self.dra.on_failed(f)
        members = self.jobs.job_of(f.request_id)
        if not members and self.dra is not None:
            members = self.dra.jobs.gather.job_of(f.request_id)  # a job whose pods ask through claims
        if members:
            # A job that cannot be placed yet: every pod of it says why.
            for pod in members:
                if names.GATE in pod.gates:
                    await self.record_event(pod, reason=names.EVENT_REASON_FAILED, message=f.reason)
            return
        try:
            raw = await self.kube.get_pod(f.pod.namespace, f.pod.name)
        except NotFound:
            return
        pod = podrules.read_pod(raw)
        if pod.metadata.uid != f.pod.uid or podwrites.is_bound(pod, f.request_id):
            return  # another pod by that name, or a late failure for a pod placed since
        await self.record_event(pod, reason=names.EVENT_REASON_FAILED, message=f.reason)

    async def record_event(
        self, pod: podrules.PodView, *, reason: str, message: str, involved: dict[str, Any] | None = None
    ) -> None:
        """One Warning Event per object and reason (module docstring); on the pod, or on
        ``involved`` (a ResourceClaim: ``pod`` then names only its namespace, name and uid)."""
        ns, uid = pod.metadata.namespace or "", pod.metadata.uid or ""
        name = podwrites.event_name(pod.metadata.name or "", f"{uid}/{reason}")
        state = self._events.setdefault((ns, name), podwrites.EventState())
        now = self.clock()
        if not podwrites.event_due(state, message=message, now=now, min_interval=self.event_interval):
            return
        if state.written_count == 0:
            body = podwrites.event_body(
                pod,
                name=name,
                reason=reason,
                message=message,
                count=state.count,
                now=now,
                instance=self.instance,
                involved=involved,
            )
            try:
                await self.kube.create_event(ns, body)
            except Conflict:
                # Written by an earlier bridge: carry its count on.
                existing = await self.kube.get_event(ns, name)
                state.count += int(existing.get("count") or 1)
                await self.kube.patch_event(
                    ns, name, podwrites.event_update(message=message, count=state.count, now=now)
                )
        else:
            try:
                await self.kube.patch_event(
                    ns, name, podwrites.event_update(message=message, count=state.count, now=now)
                )
            except NotFound:  # expired (events have a TTL): start again
                body = podwrites.event_body(
                    pod,
                    name=name,
                    reason=reason,
                    message=message,
                    count=state.count,
                    now=now,
                    instance=self.instance,
                    involved=involved,
                )
                await self.kube.create_event(ns, body)
        state.written_count = state.count
        state.written_at = now
        log.info("pod_event", pod=pod.metadata.name, reason=reason, count=state.count)


def _pod_attributes(span: Any, ref: PodRef) -> None:
    span.set_attribute("k8s.namespace.name", ref.namespace)
    span.set_attribute("k8s.pod.name", ref.name)
    if ref.uid:
        span.set_attribute("k8s.pod.uid", ref.uid)


def _key_of(raw: dict[str, Any]) -> tuple[str, str]:
    meta = raw.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")
