"""The node agent service: one per GPU node.

It publishes the node's inventory snapshot at start and on every change, a heartbeat every
``heartbeat_interval`` (core NATS: a lost heartbeat is harmless, a missing run of them is the
signal), and a health event whenever a device's health or cordon changes — from the backend
(XID, link down), from operator commands (``tandem.node.<node>.command``), or from recovery
after a clean period.

What to apply and clean comes from the node's allocation record (KV ``tandem-allocs``), which
the agent follows with :class:`~services.nodeagent.follow.AllocationsFollower` (a plain
subscription to the server's republish of the record plus direct gets; no durable consumer
per node):

* a new allocation → ``Applier.apply`` → ``Applied`` (idempotent: re-applying is a no-op in
  appliers, so an agent that restarts simply applies what its record holds);
* an allocation marked ``releasing`` → ``Applier.cleanup`` + no compute process left on the
  GPUs → ``Cleaned``. A cleanup that cannot be verified marks each device unhealthy with its
  own problem and reports ``Cleaned(ok=False)``: the allocator keeps them held rather than
  freeing them silently. The agent then tries the cleanup again, 1 s after the failure and
  doubling up to every 5 minutes (``cleanup.retry_delay``), until it is verified (then
  ``Cleaned(ok=True)`` frees the devices) or the allocation leaves the record;
  ``tandem_nodeagent_cleanups_unverified`` counts the allocations waiting, the alert's metric.

A failed device returns to service after its clean period only if the backend's probe finds
nothing wrong with it then (and no unverified cleanup holds it); see ``health.recover_due``.

The record carries each allocation's trace context, so apply and cleanup join its trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import trace
from prometheus_client import Counter, Gauge

from schemas import codec, subjects
from schemas.messages import (
    AllocRecord,
    Applied,
    Assignment,
    Cleaned,
    DeviceCommand,
    DeviceHealth,
    HealthEvent,
    Heartbeat,
    NodeAllocations,
    NodeInventory,
)
from schemas.topology import NodeTopology, locate
from services.nodeagent.backends.base import Applier, BackendError, DiscoveryBackend
from services.nodeagent.cleanup import (
    RETRY_FIRST_S,
    RETRY_MAX_S,
    gpu_problems,
    mig_problems,
    problems_by_device,
    retry_delay,
)
from services.nodeagent.dra.plugin import AgentView, KubeletPlugin
from services.nodeagent.dra.publisher import SliceApi
from services.nodeagent.dra.sync import SliceSync
from services.nodeagent.follow import AllocationsFollower, node_actions
from services.nodeagent.health import HealthTracker, recover_due
from services.nodeagent.metrics import AGENT_DEVICES, SUBMIT_TO_APPLIED_SECONDS
from services.nodeagent.netns import NetnsNotReady
from services.runtime.nats.bus import Bus, Delivery, Retry
from services.runtime.observe.logging import get_logger
from services.runtime.observe.metrics import device_states
from services.runtime.observe.tracing import context_from_traceparent, messaging, tracer
from services.runtime.process.tasks import Service, Supervisor

log = get_logger(__name__)

HEALTH_CHANGES = Counter(
    "tandem_nodeagent_health_changes_total", "Device health/cordon changes published", ["healthy"]
)
for _healthy in ("true", "false"):
    # Shown from 0: increase() over a series born at its first change misses that change.
    HEALTH_CHANGES.labels(_healthy)
APPLIES = Counter("tandem_nodeagent_applies_total", "Assignments applied, by result", ["result"])
CLEANUPS = Counter(
    "tandem_nodeagent_cleanups_total", "Releases cleaned up, by verification result", ["result"]
)
CLEANUP_FAILURES = Counter(
    "tandem_nodeagent_cleanup_failures_total", "Cleanup attempts that could not be verified (retries too)"
)
CLEANUPS_UNVERIFIED = Gauge(
    "tandem_nodeagent_cleanups_unverified",
    "Allocations whose cleanup is not verified yet (devices held; the agent keeps retrying)",
)


@dataclass(slots=True)
class Unverified:
    """A release whose cleanup failed: tried again at ``next_at`` (loop time)."""

    rec: AllocRecord
    attempts: int
    next_at: float
    reasons: dict[str, str]  # device → its problem


def device_ids(topology: NodeTopology) -> list[str]:
    """Every allocatable device id of a node: GPUs, NIC PFs and their VFs."""
    ids: list[str] = []
    for loc in locate(topology):
        ids.append(loc.device.id)
        ids.extend(vf.name for vf in getattr(loc.device, "vfs", []))
    return ids


class NodeAgent(Service):
    def __init__(
        self,
        bus: Bus,
        *,
        node: str,
        backend: DiscoveryBackend,
        applier: Applier,
        heartbeat_interval: float = 2.0,
        clean_period: float = 60.0,
        rescan_interval: float = 30.0,
        resync_interval: float = 30.0,
        cleanup_retry_first: float = RETRY_FIRST_S,
        cleanup_retry_max: float = RETRY_MAX_S,
        clock: Callable[[], float] = time.time,
        slice_api: SliceApi | None = None,
    ) -> None:
        self.bus = bus
        self.node = node
        self.backend = backend
        self.applier = applier
        self.heartbeat_interval = heartbeat_interval
        self.rescan_interval = rescan_interval
        self.clock = clock
        self.health = HealthTracker([], clean_period=clean_period)
        self.topology: NodeTopology | None = None
        self.generation = 0
        self.assignments: dict[str, Assignment] = {}  # applied, by request id
        self.record: NodeAllocations | None = None  # the allocation record last handled
        self.cleaning: set[str] = set()  # releases handled (cleaned or reported unverified)
        self.unverified: dict[str, Unverified] = {}  # failed cleanups to try again, by request id
        self.cleanup_retry_first = cleanup_retry_first
        self.cleanup_retry_max = cleanup_retry_max
        self._work = asyncio.Lock()  # record handling and cleanup retries never overlap
        self._retry_wake = asyncio.Event()
        self.follower = AllocationsFollower(
            bus, node=node, on_record=self._on_record, resync_interval=resync_interval
        )
        self.heartbeats_paused = False  # tests and the demo simulate a silent node
        # DRA: the node's devices as ResourceSlices, kept up to date beside the inventory.
        self.slice_api = slice_api
        self.slices = None if slice_api is None else SliceSync(slice_api, node=node, view=self._device_view)
        # The DRA kubelet plugin (setting dra_plugin): set by the builder, which gives it
        # dra_view; the agent runs it and tells it when devices or their health change.
        self.kubelet_plugin: KubeletPlugin | None = None
        self._seq = 0
        self._tasks = Supervisor(f"nodeagent:{node}")
        # Its spans say which node made them (service.instance.id and k8s.node.name).
        self._tracer = tracer(
            "tandem.nodeagent", service="nodeagent", instance=node, attributes={"k8s.node.name": node}
        )

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await self.rescan(force=True)
        await self.bus.serve(
            subjects.node_command(self.node), decoder=codec.COMMAND, handler=self._on_command
        )
        self._tasks.spawn("heartbeat", self._heartbeat_loop)
        self._tasks.spawn("health", self._health_loop)
        self._tasks.spawn("rescan", self._rescan_loop)
        self._tasks.spawn("recovery", self._recovery_loop)
        self._tasks.spawn("cleanup-retry", self._cleanup_retry_loop)
        if self.slices is not None:
            self._tasks.spawn("resource-slices", self.slices.run)
            self.slices.changed()
        if self.kubelet_plugin is not None:
            self._tasks.spawn("dra-kubelet-plugin", self.kubelet_plugin.run)
        await self.follower.start()
        AGENT_DEVICES.track(self.node, self.device_counts)
        log.info("nodeagent_started", node=self.node, backend=self.backend.name)

    async def stop(self) -> None:
        AGENT_DEVICES.untrack(self.node, self.device_counts)
        await self.follower.stop()
        await self._tasks.aclose()
        await self.backend.close()
        if self.slice_api is not None:
            await self.slice_api.close()
        CLEANUPS_UNVERIFIED.dec(len(self.unverified))
        self.unverified.clear()

    def device_counts(self) -> dict[tuple[str, str], int] | None:
        """This node's GPUs and NICs by state (``tandem_nodeagent_devices``); None before
        its devices are discovered."""
        if self.topology is None:
            return None
        return device_states(self.topology, self.health.state, self.record)

    # -- inventory and health ---------------------------------------------------------------

    async def rescan(self, *, force: bool = False) -> None:
        """Discover again; publish a new snapshot when the hardware changed (hot-plug)."""
        topology = await self.backend.discover()
        if not force and topology == self.topology:
            return
        self.topology = topology
        self.health.ensure(device_ids(topology))
        await self.publish_inventory()

    async def publish_inventory(self) -> None:
        assert self.topology is not None
        self.generation += 1
        inv = NodeInventory(
            node=self.node,
            topology=self.topology,
            generation=self.generation,
            health=dict(self.health.state),
            agent=self.backend.name,
            ts=self.clock(),
        )
        await self.bus.publish(subjects.node_inventory(self.node), inv)
        self._devices_changed()

    def _devices_changed(self) -> None:
        if self.slices is not None:
            self.slices.changed()
        if self.kubelet_plugin is not None:
            self.kubelet_plugin.changed()

    def dra_view(self) -> AgentView:
        """What the DRA kubelet plugin checks a claim against: devices, health, the record."""
        return AgentView(self.topology, dict(self.health.state), self.record)

    def _device_view(self) -> tuple[NodeTopology | None, dict[str, DeviceHealth]]:
        """What the ResourceSlices describe: the devices and their health, now."""
        return self.topology, dict(self.health.state)

    async def _publish_health(self, device: str) -> HealthEvent:
        h = self.health.state[device]
        event = HealthEvent(
            node=self.node,
            device=device,
            healthy=h.healthy,
            cordoned=h.cordoned,
            reason=h.reason,
            ts=self.clock(),
        )
        await self.bus.publish(subjects.node_health(self.node), event)
        self._devices_changed()
        HEALTH_CHANGES.labels(str(h.healthy).lower()).inc()
        log.info("device_health", device=device, healthy=h.healthy, cordoned=h.cordoned, reason=h.reason)
        return event

    async def _heartbeat_loop(self) -> None:
        while True:
            if not self.heartbeats_paused:
                self._seq += 1
                beat = Heartbeat(node=self.node, seq=self._seq, generation=self.generation, ts=self.clock())
                await self.bus.publish_core(subjects.node_heartbeat(self.node), beat)
            await asyncio.sleep(self.heartbeat_interval)

    async def _recovery_loop(self) -> None:
        """Return devices to service after their clean period, if a probe finds them usable
        (its own loop: a slow probe must not delay heartbeats)."""
        while True:
            for device in await recover_due(self.health, probe=self._probe, now=self.clock()):
                await self._publish_health(device)
            await asyncio.sleep(self.heartbeat_interval)

    async def _probe(self, device: str) -> str | None:
        """Why a device is still unusable: a cleanup not verified yet, or what the backend
        sees now; None when neither."""
        for u in self.unverified.values():
            if device in u.reasons:
                return f"cleanup failed: {u.reasons[device]}"
        try:
            return await self.backend.probe(device)
        except BackendError as exc:
            return f"cannot probe: {exc}"

    async def _rescan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.rescan_interval)
            await self.rescan()

    async def _health_loop(self) -> None:
        async for change in self.backend.health_changes():
            if change.device not in self.health.state:
                log.warning("health_for_unknown_device", device=change.device)
                continue
            now = self.clock()
            if change.healthy:
                changed = self.health.recover(change.device, now=now, reason=change.reason or "recovered")
            else:
                changed = self.health.fail(change.device, change.reason, now=now)
            if changed is not None:
                await self._publish_health(change.device)

    async def _on_command(self, cmd: DeviceCommand, _: Delivery) -> HealthEvent | None:
        if cmd.device not in self.health.state:
            return HealthEvent(node=self.node, device=cmd.device, healthy=False, reason="unknown device")
        now = self.clock()
        reason = cmd.reason or f"operator {cmd.action}"
        if cmd.action == "fail":
            self.health.fail(cmd.device, reason, now=now)
        elif cmd.action == "cordon":
            self.health.cordon(cmd.device, reason, now=now)
        else:
            # recover / uncordon: the operator's word, but a device that is still lost (or
            # still held by an unverified cleanup) stays failed with what the probe found.
            still = await self._probe(cmd.device)
            if cmd.action == "recover":
                self.health.recover(cmd.device, now=now, reason=reason)
            else:
                self.health.uncordon(cmd.device, now=now)
            if still:
                self.health.fail(cmd.device, still, now=now)
        return await self._publish_health(cmd.device)

    # -- apply and cleanup -------------------------------------------------------------------

    async def _on_record(self, node: str, record: NodeAllocations | None, _revision: int) -> None:
        """Make the node match its record (calls never overlap; see AllocationsFollower)."""
        async with self._work:
            self.record = record
            actions = node_actions(record, applied=self.assignments, cleaning=self.cleaning)
            for rid in actions.gone:  # freed: nothing of it is left to do
                self.assignments.pop(rid, None)
                self.cleaning.discard(rid)
                self._verified(rid)
            for rec in actions.apply:
                await self._apply(rec)
            for rec in actions.cleanup:
                await self._cleanup(rec)

    async def _apply(self, rec: AllocRecord) -> None:
        assignment = rec.assignment
        context = context_from_traceparent(rec.traceparent)
        with self._tracer.start_as_current_span(
            "nodeagent.apply", context=context, kind=trace.SpanKind.CONSUMER
        ) as span:
            span.set_attributes(messaging(subjects.node_allocs(self.node), "process"))
            span.set_attributes(
                {
                    "k8s.node.name": self.node,
                    "k8s.pod.uid": assignment.pod.uid,
                    "k8s.pod.name": assignment.pod.name,
                    "k8s.namespace.name": assignment.pod.namespace,
                    "tandem.request_id": assignment.request_id,
                }
            )
            try:
                await self.applier.apply(assignment)
                result = Applied(request_id=assignment.request_id, node=self.node, ts=self.clock())
            except NetnsNotReady as exc:
                # The pod's sandbox does not exist yet (the allocator decides before kubelet
                # starts the pod): look again later rather than report a failed apply.
                raise Retry(str(exc), delay=2.0) from exc
            except BackendError as exc:
                span.set_status(trace.StatusCode.ERROR, str(exc))
                result = Applied(request_id=assignment.request_id, node=self.node, ok=False, error=str(exc))
            APPLIES.labels("ok" if result.ok else "failed").inc()
            if result.ok and rec.state == "assigned" and assignment.requested_at:
                SUBMIT_TO_APPLIED_SECONDS.observe(max(0.0, result.ts - assignment.requested_at))
            await self.bus.publish(
                subjects.node_applied(self.node),
                result,
                msg_id=subjects.msg_id(assignment.request_id, "applied"),
            )
            # Only now: if the report could not be published, the record is handed over
            # again and the (idempotent) apply and its report are repeated.
            self.assignments[assignment.request_id] = assignment

    async def _cleanup(self, rec: AllocRecord, *, attempt: int = 1) -> None:
        """Clean up and verify; report the first verdict, and a later verified one."""
        assignment = rec.assignment
        request_id = assignment.request_id
        devices = assignment.device_ids()
        context = context_from_traceparent(rec.traceparent)
        with self._tracer.start_as_current_span(
            "nodeagent.cleanup", context=context, kind=trace.SpanKind.CONSUMER
        ) as span:
            span.set_attributes(messaging(subjects.node_allocs(self.node), "process"))
            span.set_attributes(
                {"k8s.node.name": self.node, "tandem.request_id": request_id, "tandem.attempt": attempt}
            )
            try:
                problems = await self.applier.cleanup(assignment)
            except BackendError as exc:  # not verified either: retried like any other problem
                problems = [f"cleanup raised: {exc}"]
            # Shared GPUs with other shares still applied here run those shares' processes;
            # so do MIG-mode GPUs with other instances in use (see services.nodeagent.cleanup).
            busy = frozenset(
                g.index
                for other in self.assignments.values()
                if other.request_id != request_id
                for g in other.gpus
                if g.shared or g.mig is not None
            ) & frozenset(g.index for g in assignment.gpus if g.shared or g.mig is not None)
            instances: dict[int, list[str]] = {}
            for g in assignment.gpus:
                if g.mig is not None:
                    instances.setdefault(g.index, []).append(g.mig.device)
            indices = list(dict.fromkeys(g.index for g in assignment.gpus))
            problems += mig_problems(await gpu_problems(self.backend, indices, busy=busy), instances)
            reasons = problems_by_device(problems, devices)
            if problems:
                span.set_status(trace.StatusCode.ERROR, "; ".join(problems))
                CLEANUP_FAILURES.inc()
                log.warning("cleanup_unverified", request_id=request_id, attempt=attempt, problems=problems)
                for device, reason in reasons.items():
                    # Unchanged reason on a retry: no new event, but the clean period restarts.
                    if device in self.health.state and self.health.fail(
                        device, f"cleanup failed: {reason}", now=self.clock()
                    ):
                        await self._publish_health(device)
            self.assignments.pop(request_id, None)
            if problems and attempt > 1:
                self._retry_later(rec, attempt, reasons)  # reported unverified already
                return
            cleaned = Cleaned(
                request_id=request_id,
                node=self.node,
                ok=not problems,
                devices=devices,
                problems=problems,
                ts=self.clock(),
            )
            CLEANUPS.labels("verified" if cleaned.ok else "unverified").inc()
            await self.bus.publish(
                subjects.node_cleaned(self.node),
                cleaned,
                msg_id=subjects.msg_id(request_id, "cleaned", "ok" if cleaned.ok else "failed"),
            )
            # Only once reported: a report that could not be published is made again when
            # the record is handed over again (cleanup is idempotent).
            self.cleaning.add(request_id)
            if problems:
                self._retry_later(rec, attempt, reasons)
            else:
                self._verified(request_id)

    def _retry_later(self, rec: AllocRecord, attempt: int, reasons: dict[str, str]) -> None:
        rid = rec.assignment.request_id
        if rid not in self.unverified:
            CLEANUPS_UNVERIFIED.inc()
        delay = retry_delay(attempt, first=self.cleanup_retry_first, cap=self.cleanup_retry_max)
        loop = asyncio.get_running_loop()
        self.unverified[rid] = Unverified(
            rec=rec, attempts=attempt, next_at=loop.time() + delay, reasons=reasons
        )
        self._retry_wake.set()

    def _verified(self, request_id: str) -> None:
        """Stop retrying: the cleanup was verified, or the allocation left the record."""
        if self.unverified.pop(request_id, None) is not None:
            CLEANUPS_UNVERIFIED.dec()

    async def _cleanup_retry_loop(self) -> None:
        """Try unverified cleanups again when they are due (see ``retry_delay``)."""
        loop = asyncio.get_running_loop()
        while True:
            self._retry_wake.clear()
            now = loop.time()
            due = sorted((u.next_at, rid) for rid, u in self.unverified.items())
            if not due or due[0][0] > now:
                timeout = None if not due else due[0][0] - now
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._retry_wake.wait(), timeout)
                continue
            async with self._work:
                u = self.unverified.get(due[0][1])
                if u is None or u.next_at > loop.time():  # freed or rescheduled meanwhile
                    continue
                try:
                    await self._cleanup(u.rec, attempt=u.attempts + 1)
                except Exception as exc:  # e.g. the verified report could not be published
                    log.error("cleanup_retry_failed", request_id=due[0][1], error=repr(exc))
                    self._retry_later(u.rec, u.attempts + 1, u.reasons)
