"""The NATS side of a service behind one object: :class:`Bus`, what a service holds.

``publish`` puts the W3C trace context and the ``Nats-Msg-Id`` (server-side dedup) on every
JetStream publish and rides out a stream leader election (:mod:`.publish`). :meth:`Bus.consume`
runs a durable pull consumer and :meth:`Bus.serve` a core subscription (:mod:`.consume`): what
does not fit its subject, does not decode or is refused by its handler goes to
``tandem.dlq.<service>`` (:mod:`.deadletters`). :meth:`Bus.open` connects (:mod:`.connection`)
and provisions the streams and buckets (:mod:`.provision`); :meth:`Bus.close` drains within a
bound whatever state NATS is in.

The names callers use are exported here, so a service imports one module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api
from nats.js.kv import KeyValue

from schemas import codec, subjects
from services.runtime.nats.connection import CLOSE_TIMEOUT_S, ConnectError, close_connection, connect
from services.runtime.nats.consume import (
    Delivery,
    Handler,
    Refuse,
    Retry,
    count_redeliveries_from_zero,
    run_consumer,
    serve_requests,
)
from services.runtime.nats.deadletters import DEAD_LETTERS, DeadLetters
from services.runtime.nats.provision import KV_BUCKETS, provision
from services.runtime.nats.puback import AckInbox, MsgIds
from services.runtime.nats.publish import (
    PUBLISH_ATTEMPT_TIMEOUT_S,
    PUBLISH_RETRY_S,
    TRANSIENT_NATS_ERRORS,
    TRANSIENT_PUBLISH_ERRORS,
    publish_acked,
)
from services.runtime.observe.tracing import inject
from services.runtime.settings import Settings

__all__ = [
    "DEAD_LETTERS",
    "KV_BUCKETS",
    "PUBLISH_ATTEMPT_TIMEOUT_S",
    "TRANSIENT_NATS_ERRORS",
    "TRANSIENT_PUBLISH_ERRORS",
    "Bus",
    "ConnectError",
    "Delivery",
    "Handler",
    "Refuse",
    "Retry",
    "connect",
    "provision",
]


class Bus:
    """A service's connection: traced publishes, KV handles, consumers, dead letters."""

    def __init__(self, nc: NATS, *, service: str, settings: Settings) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        # JetStream publishes and their acknowledgements, without nats-py's per-request
        # machinery (services/runtime/nats/puback.py), and cheap unique message ids.
        self.acks = AckInbox(nc)
        self.msg_ids = MsgIds()
        self.service = service
        self.settings = settings
        self._kv: dict[str, KeyValue] = {}
        # Unsubscribed on close, before the drain: the consumers' inboxes, the served subjects.
        self.subscriptions: list[Any] = []
        self.publish_retry_for = PUBLISH_RETRY_S
        self._dead_letters = DeadLetters(service)
        # (stream, durable) of every consumer this bus runs: consumer-lag polling reads them.
        self.consumers: set[tuple[str, str]] = set()
        count_redeliveries_from_zero(service)

    @property
    def closed(self) -> asyncio.Event:
        """Set when the connection is closed for good (the service must restart)."""
        event = getattr(self.nc, "closed_event", None)
        if event is None:  # a plain nats-py client (tests): make one that tracks nothing
            event = asyncio.Event()
            self.nc.closed_event = event  # type: ignore[attr-defined]
        return event

    @classmethod
    async def open(cls, settings: Settings, *, provision_streams: bool = True) -> Bus:
        nc = await connect(settings)
        bus = cls(nc, service=settings.service, settings=settings)
        if provision_streams:
            await provision(bus.js, replicas=settings.stream_replicas)
        return bus

    async def close(self, *, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Drain, then close; without the drain during an outage or past ``timeout``.

        Never raises for the state NATS is in, and returns within about ``timeout`` seconds
        (:mod:`services.runtime.nats.connection`, "Closing")."""
        await close_connection(self.nc, self.subscriptions, timeout=timeout)

    async def kv(self, bucket: str) -> KeyValue:
        if bucket not in self._kv:
            self._kv[bucket] = await self.js.key_value(bucket)
        return self._kv[bucket]

    async def publish(
        self,
        subject: str,
        message: msgspec.Struct,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """JetStream publish with trace context and dedup id; waits for the stream's ack,
        riding out a stream leader election (:mod:`services.runtime.nats.publish`)."""
        hdrs = inject(headers)
        if msg_id:
            hdrs["Nats-Msg-Id"] = msg_id
        await self._js_publish(subject, codec.encode(message), hdrs)

    async def _js_publish(self, subject: str, data: bytes, headers: dict[str, str]) -> api.PubAck:
        return await publish_acked(
            self.acks, self.msg_ids, subject, data, headers, retry_for=self.publish_retry_for
        )

    async def publish_raw(self, subject: str, data: bytes, *, headers: dict[str, str]) -> api.PubAck:
        """JetStream publish of bytes as they are (a KV write with its own headers), with the
        same retries as :meth:`publish`; returns the stream's ack."""
        return await self._js_publish(subject, data, dict(headers))

    async def publish_core(self, subject: str, message: msgspec.Struct) -> None:
        """Core NATS publish (no persistence) for messages whose loss is harmless."""
        await self.nc.publish(subject, codec.encode(message), headers=inject())

    async def request(self, subject: str, message: msgspec.Struct, *, timeout: float = 2.0) -> Msg:
        return await self.nc.request(subject, codec.encode(message), timeout=timeout, headers=inject())

    async def dead_letter(
        self,
        *,
        subject: str,
        data: bytes,
        error: str,
        headers: dict[str, str] | None = None,
        why: str = "refused",
    ) -> bool:
        """Store a refused message on ``tandem.dlq.<service>``: the reason, the subject, the
        first bytes and the digest of the payload (never all of it). Within the source's
        budget only (:mod:`services.runtime.nats.deadletters`); returns whether it was stored."""
        letter = self._dead_letters.letter(subject=subject, data=data, error=error, headers=headers, why=why)
        if letter is None:
            return False
        await self._js_publish(subjects.dlq(self.service), codec.encode(letter), inject())
        return True

    async def consume(
        self,
        *,
        stream: str,
        durable: str,
        filter_subject: str | list[str],
        decoder: msgspec.msgpack.Decoder[Any],
        handler: Handler[Any],
        batch: int = 64,
        stop: asyncio.Event | None = None,
        deliver_new: bool = False,
        concurrency: int = 1,
        confirm_acks: bool = True,
    ) -> None:
        """Run a durable pull consumer until ``stop`` is set (or the task is cancelled).

        A continuous pull: one pull request for ``batch`` messages stays open on the server
        and is topped up when half of it has arrived, so a message is handed over the moment
        it is stored (nats-py's ``fetch`` waits for its whole batch or its timeout).
        ``concurrency`` > 1 runs that many handlers at once (each message still acked only
        after its handler returned). ``confirm_acks=False`` sends acks without waiting for the
        server's confirmation: for idempotent handlers a lost ack costs a redelivery, not a
        round trip per message. What happens to each message: :mod:`services.runtime.nats.consume`.
        """
        await run_consumer(
            self,
            stream=stream,
            durable=durable,
            filter_subject=filter_subject,
            decoder=decoder,
            handler=handler,
            batch=batch,
            stop=stop,
            deliver_new=deliver_new,
            concurrency=concurrency,
            confirm_acks=confirm_acks,
        )

    async def serve(
        self,
        subject: str,
        *,
        decoder: msgspec.msgpack.Decoder[Any],
        handler: Callable[[Any, Delivery], Awaitable[msgspec.Struct | None]],
        queue: str = "",
        error_reply: Callable[[str], msgspec.Struct] | None = None,
        concurrent: bool = False,
    ) -> None:
        """Core NATS subscription (request/reply or fire-and-forget) with the same checks as
        :meth:`consume`. A request that is refused or whose handler fails is answered with
        ``error_reply(reason)`` (when given), so the caller learns why at once instead of
        waiting for its timeout. ``concurrent``: each message's handler runs as a task of its
        own (nats-py runs one subscription's callbacks one after another)."""
        await serve_requests(
            self,
            subject,
            decoder=decoder,
            handler=handler,
            queue=queue,
            error_reply=error_reply,
            concurrent=concurrent,
        )
