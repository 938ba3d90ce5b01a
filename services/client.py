"""A small client of a running Tandem system: what the CLI, the demo and the tests speak.

It plays the pod bridge's part on the bus (publish ``AllocationRequest``, ``JobRequest`` and
``Release`` with msg ids) and watches outcomes on plain core subscriptions (JetStream publishes are ordinary
NATS messages too), so it never creates durable state of its own.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, TypeVar

import msgspec

from schemas import codec, subjects
from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    AllocRecord,
    Assignment,
    ClaimRecord,
    DeadLetter,
    DeviceCommand,
    Freed,
    HealthEvent,
    InventoryQuery,
    JobRecord,
    JobRequest,
    NodeAllocations,
    NodeRecord,
    PodRef,
    PreemptionPlan,
    Release,
    RequestRecord,
)
from services.runtime.kv.read import last_raw_values

if TYPE_CHECKING:
    # Types only: the CLI imports this module before it has decided how to load nats-py
    # (tools.cli.conn), and never loads the service kit behind Bus.
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

# What the allocator says about a request: placed, not now (or never), freed, or making room by
# preempting lower-priority allocations.
Outcome = Assignment | AllocationFailed | Freed | PreemptionPlan
T = TypeVar("T")


class Connection(Protocol):
    """What the client needs of a connection: a service's ``Bus`` or the CLI's own
    (``tools.cli.conn.CliConnection``)."""

    nc: Client
    js: JetStreamContext

    async def publish(
        self,
        subject: str,
        message: msgspec.Struct,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None: ...

    async def request(self, subject: str, message: msgspec.Struct, *, timeout: float = 2.0) -> Msg: ...

    async def kv(self, bucket: str) -> KeyValue: ...


class ClientError(Exception):
    """The system did not answer as expected (timeout, error reply)."""


class TandemClient:
    def __init__(self, bus: Connection) -> None:
        self.bus = bus
        self.outcomes: dict[str, list[tuple[Outcome, dict[str, str]]]] = {}
        self._changed = asyncio.Condition()
        self._subs: list[Subscription] = []

    async def start(self) -> TandemClient:
        for subject in (
            subjects.ALLOC_ASSIGNED_ALL,
            subjects.ALLOC_FAILED,
            subjects.ALLOC_FREED,
            subjects.ALLOC_PREEMPT,
        ):
            self._subs.append(await self.bus.nc.subscribe(subject, cb=self._on_msg))
        return self

    async def close(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()

    async def _on_msg(self, msg: Msg) -> None:
        try:
            event = codec.ALLOC_EVENT.decode(msg.data)
        except codec.DecodeErrors:
            return
        if isinstance(event, Assignment | AllocationFailed | Freed | PreemptionPlan):
            async with self._changed:
                self.outcomes.setdefault(event.request_id, []).append((event, dict(msg.headers or {})))
                self._changed.notify_all()

    async def submit(self, request: AllocationRequest) -> str:
        """Publish ``request`` in a new trace (span ``client.submit``); returns its trace id.
        Every decision about the request, the apply, release, cleanup and free join it. When
        nothing exports this process's spans there is no such span (it would be the missing
        parent of every other): the allocator's first decision starts the trace, returned is
        "", and :meth:`trace_of` says the trace id once the allocator has answered."""
        return await self._publish_new_trace(
            subjects.ALLOC_REQUEST,
            request,
            msg_id=subjects.msg_id(request.request_id),
            attributes={"tandem.request_id": request.request_id, "k8s.pod.name": request.pod.name},
        )

    async def submit_job(self, job: JobRequest) -> str:
        """Publish a whole job (``tandem.alloc.job``, the bridge's message id) in a new trace;
        returns its trace id. The allocator answers ``AllocationFailed`` under the job id while
        it cannot place it, then one ``Assignment`` per pod (``JOB/INDEX``)."""
        return await self._publish_new_trace(
            subjects.ALLOC_JOB,
            job,
            msg_id=subjects.msg_id("job", job.job_id),
            attributes={"tandem.job": job.job_id, "tandem.pods": job.pods},
        )

    async def _publish_new_trace(
        self, subject: str, message: msgspec.Struct, *, msg_id: str, attributes: dict[str, str | int]
    ) -> str:
        from opentelemetry.trace import SpanKind

        from services.runtime.observe.tracing import current_trace_id, exporting, messaging, tracer

        if not exporting():
            await self.bus.publish(subject, message, msg_id=msg_id)
            return ""
        with tracer("tandem.client", service="cli").start_as_current_span(
            "client.submit", kind=SpanKind.PRODUCER
        ) as span:
            span.set_attributes(messaging(subject, "publish"))
            span.set_attributes(attributes)
            await self.bus.publish(subject, message, msg_id=msg_id)
            return current_trace_id() or ""

    async def release(
        self,
        request_id: str,
        *,
        node: str | None = None,
        pod: PodRef | None = None,
        traceparent: str = "",
    ) -> None:
        """Release like the bridge does: to the node's subject when known, else unplaced.

        Each call is a new release (its own ``Nats-Msg-Id``): the duplicate window is there
        to drop a *retried publish*, and a release a person sends again after an earlier one
        went astray is not that; it used to be dropped for two minutes. Releasing twice is
        harmless (the allocator's release handler is idempotent)."""
        assignment = self.assignment(request_id)
        node = node or (assignment.node if assignment else None)
        pod = pod or (assignment.pod if assignment else PodRef(namespace="", name=""))
        release = Release(request_id=request_id, pod=pod, node=node)
        msg_id = subjects.msg_id(request_id, "release", uuid.uuid4().hex)
        from opentelemetry.trace import SpanKind

        from services.runtime.observe.tracing import context_from_traceparent, exporting, messaging, tracer

        # In the allocation's trace: its record's, or the one its assignment arrived in.
        parent = traceparent or self.headers_of(request_id, Assignment).get("traceparent", "")
        if not parent and not exporting():  # no trace to join, and no span to start one (submit)
            await self.bus.publish(subjects.alloc_release(node), release, msg_id=msg_id)
            return
        with tracer("tandem.client", service="cli").start_as_current_span(
            "client.release",
            context=context_from_traceparent(parent) if parent else None,
            kind=SpanKind.PRODUCER,
        ) as span:
            span.set_attributes(messaging(subjects.alloc_release(node), "publish"))
            span.set_attribute("tandem.request_id", request_id)
            await self.bus.publish(subjects.alloc_release(node), release, msg_id=msg_id)

    def assignment(self, request_id: str) -> Assignment | None:
        for event, _ in self.outcomes.get(request_id, []):
            if isinstance(event, Assignment):
                return event
        return None

    async def wait_for(
        self,
        request_id: str | tuple[str, ...],
        kinds: tuple[type, ...] = (Assignment, AllocationFailed),
        *,
        timeout: float = 10.0,
    ) -> Outcome:
        """The first outcome of one of ``kinds`` for the request (waits for it); given several
        ids (a job's own and its first pod's), the first such outcome of any of them."""
        ids = (request_id,) if isinstance(request_id, str) else request_id

        def found() -> Outcome | None:
            for rid in ids:
                for event, _ in self.outcomes.get(rid, []):
                    if isinstance(event, kinds):
                        return event
            return None

        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: found() is not None)
        result = found()
        assert result is not None
        return result

    def trace_of(self, request_id: str) -> str:
        """The trace id the allocator's first answer about the request carried ("" before)."""
        for _, headers in self.outcomes.get(request_id, []):
            parts = headers.get("traceparent", "").split("-")
            if len(parts) == 4 and len(parts[1]) == 32:
                return parts[1]
        return ""

    def headers_of(self, request_id: str, kind: type) -> dict[str, str]:
        for event, headers in self.outcomes.get(request_id, []):
            if isinstance(event, kind):
                return headers
        return {}

    async def command(self, node: str, device: str, action: str, *, reason: str = "") -> HealthEvent:
        cmd = DeviceCommand(node=node, device=device, action=action, reason=reason)  # type: ignore[arg-type]
        reply = await self.bus.request(subjects.node_command(node), cmd, timeout=5.0)
        event = codec.NODE_EVENT.decode(reply.data)
        if not isinstance(event, HealthEvent):
            raise ClientError(f"unexpected reply to {action} {node}/{device}: {event!r}")
        return event

    async def nodes(self, node: str | None = None) -> list[NodeRecord]:
        try:
            msg = await self.bus.request(subjects.QUERY_INVENTORY, InventoryQuery(node=node), timeout=5.0)
        except TimeoutError as exc:
            raise ClientError("no inventory service answered (is the system up?)") from exc
        reply = codec.REPLY.decode(msg.data)
        if reply.error:
            raise ClientError(reply.error)
        return reply.nodes

    async def request_record(self, request_id: str) -> RequestRecord | None:
        return await self._get(subjects.KV_REQUESTS, request_id, codec.REQUEST_RECORD)

    async def _get(self, bucket: str, key: str, decoder: msgspec.msgpack.Decoder[T]) -> T | None:
        """One record of ``bucket`` (None when the key does not exist)."""
        from nats.js.errors import KeyNotFoundError

        kv = await self.bus.kv(bucket)
        try:
            entry = await kv.get(subjects.kv_key(key))
        except KeyNotFoundError:
            return None
        return decoder.decode(entry.value or b"")

    async def request_records(self) -> dict[str, RequestRecord]:
        """Every request record, by request id (one pass over the bucket, not a get per key)."""
        return await self._snapshot(subjects.KV_REQUESTS, codec.REQUEST_RECORD)

    async def claim_records(self) -> dict[str, ClaimRecord]:
        """Every DeviceClaim the pod bridge knows (KV ``tandem-claims``), by its request id;
        none when the bucket does not exist (a system older than claims)."""
        from nats.js.errors import BucketNotFoundError

        try:
            return await self._snapshot(subjects.KV_CLAIMS, codec.CLAIM_RECORD)
        except BucketNotFoundError:
            return {}

    async def job_records(self) -> dict[str, JobRecord]:
        """Every whole job the allocator knows (KV ``tandem-jobs``), by job id."""
        return await self._snapshot(subjects.KV_JOBS, codec.JOB_RECORD)

    async def job_record(self, job_id: str) -> JobRecord | None:
        return await self._get(subjects.KV_JOBS, job_id, codec.JOB_RECORD)

    async def node_records(self) -> dict[str, NodeRecord]:
        """Every node record (KV ``tandem-nodes``) by node name; needs no inventory service."""
        return await self._snapshot(subjects.KV_NODES, codec.NODE_RECORD)

    async def requests_of_pod(self, pod: PodRef) -> list[RequestRecord]:
        """The request records of ``pod`` (namespace and name), newest first."""
        found = [
            r
            for r in (await self.request_records()).values()
            if (r.request.pod.namespace, r.request.pod.name) == (pod.namespace, pod.name)
        ]
        return sorted(found, key=lambda r: r.request.created_at, reverse=True)

    async def holder(self, request_id: str) -> tuple[str, AllocRecord] | None:
        """The node whose allocation record holds ``request_id``, with the allocation."""
        for allocs in await self.allocations():
            rec = allocs.allocations.get(request_id)
            if rec is not None:
                return allocs.node, rec
        return None

    async def _snapshot(self, bucket: str, decoder: msgspec.msgpack.Decoder[T]) -> dict[str, T]:
        """The current value of every key of ``bucket`` (values that do not decode are left
        out: a reader cannot fix a writer's bug); see :mod:`services.runtime.kv.read`."""
        out: dict[str, T] = {}
        for key, data in (await last_raw_values(self.bus.js, await self.bus.kv(bucket), bucket)).items():
            try:
                out[key] = decoder.decode(data)
            except codec.DecodeErrors:
                continue
        return out

    async def dead_letters(self, *, limit: int = 50) -> list[DeadLetter]:
        """The newest ``limit`` messages parked on the dead-letter subjects (oldest first)."""
        from nats.js.errors import NotFoundError

        info = await self.bus.js.stream_info(subjects.DLQ_STREAM)
        last = info.state.last_seq
        first = max(info.state.first_seq, last - limit + 1)
        out = []
        for seq in range(first, last + 1) if info.state.messages else ():
            try:
                raw = await self.bus.js.get_msg(subjects.DLQ_STREAM, seq)
            except NotFoundError:
                continue  # removed by the stream's age limit meanwhile
            out.append(codec.DEAD_LETTER.decode(raw.data or b""))
        return out

    async def allocations(self, nodes: Iterable[str] | None = None) -> list[NodeAllocations]:
        """The allocation records of ``nodes`` (all nodes: one pass over the bucket)."""
        if nodes is None:
            every = await self._snapshot(subjects.KV_ALLOCS, codec.NODE_ALLOCS)
            return [every[k] for k in sorted(every)]
        out = []
        for key in nodes:
            record = await self._get(subjects.KV_ALLOCS, key, codec.NODE_ALLOCS)
            if record is not None:
                out.append(record)
        return out
