"""A small client of a running Tandem system: what the CLI, the demo and the tests speak.

It plays the pod bridge's part on the bus (publish ``AllocationRequest`` / ``Release`` with
msg ids) and watches outcomes on plain core subscriptions (JetStream publishes are ordinary
NATS messages too), so it never creates durable state of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import KeyNotFoundError, NoKeysError, NotFoundError

from schemas import codec, subjects
from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    Assignment,
    DeadLetter,
    DeviceCommand,
    Freed,
    HealthEvent,
    InventoryQuery,
    NodeAllocations,
    NodeRecord,
    PodRef,
    Release,
    RequestRecord,
)
from services.runtime.bus import Bus

Outcome = Assignment | AllocationFailed | Freed


class ClientError(Exception):
    """The system did not answer as expected (timeout, error reply)."""


class TandemClient:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.outcomes: dict[str, list[tuple[Outcome, dict[str, str]]]] = {}
        self._changed = asyncio.Condition()
        self._subs: list[Subscription] = []

    async def start(self) -> TandemClient:
        for subject in (subjects.ALLOC_ASSIGNED_ALL, subjects.ALLOC_FAILED, subjects.ALLOC_FREED):
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
        if isinstance(event, Assignment | AllocationFailed | Freed):
            async with self._changed:
                self.outcomes.setdefault(event.request_id, []).append((event, dict(msg.headers or {})))
                self._changed.notify_all()

    async def submit(self, request: AllocationRequest) -> None:
        await self.bus.publish(subjects.ALLOC_REQUEST, request, msg_id=subjects.msg_id(request.request_id))

    async def release(self, request_id: str, *, node: str | None = None, pod: PodRef | None = None) -> None:
        """Release like the bridge does: to the node's subject when known, else unplaced."""
        assignment = self.assignment(request_id)
        node = node or (assignment.node if assignment else None)
        pod = pod or (assignment.pod if assignment else PodRef(namespace="", name=""))
        release = Release(request_id=request_id, pod=pod, node=node)
        await self.bus.publish(
            subjects.alloc_release(node), release, msg_id=subjects.msg_id(request_id, "release")
        )

    def assignment(self, request_id: str) -> Assignment | None:
        for event, _ in self.outcomes.get(request_id, []):
            if isinstance(event, Assignment):
                return event
        return None

    async def wait_for(
        self,
        request_id: str,
        kinds: tuple[type, ...] = (Assignment, AllocationFailed),
        *,
        timeout: float = 10.0,
    ) -> Outcome:
        """The first outcome of one of ``kinds`` for the request (waits for it)."""

        def found() -> Outcome | None:
            for event, _ in self.outcomes.get(request_id, []):
                if isinstance(event, kinds):
                    return event
            return None

        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: found() is not None)
        result = found()
        assert result is not None
        return result

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
        kv = await self.bus.kv(subjects.KV_REQUESTS)
        try:
            entry = await kv.get(subjects.kv_key(request_id))
        except KeyNotFoundError:
            return None
        return codec.REQUEST_RECORD.decode(entry.value or b"")

    async def dead_letters(self, *, limit: int = 50) -> list[DeadLetter]:
        """The newest ``limit`` messages parked on the dead-letter subjects (oldest first)."""
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
        kv = await self.bus.kv(subjects.KV_ALLOCS)
        try:
            # nats-py's keys() can name a key twice when it is written while being listed.
            keys = list(nodes) if nodes is not None else sorted(set(await kv.keys()))
        except NoKeysError:
            return []
        out = []
        for key in keys:
            try:
                entry = await kv.get(subjects.kv_key(key))
            except KeyNotFoundError:
                continue
            out.append(codec.NODE_ALLOCS.decode(entry.value or b""))
        return out
