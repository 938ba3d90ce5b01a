"""Durable consumption and core subscriptions: each message checked, decoded and handed to
its handler, then acked, redelivered or parked on the dead-letter subject.

:func:`run_consumer` runs a durable pull consumer (the pull protocol: :mod:`.puller`): each
message is checked and decoded (:func:`services.runtime.nats.deadletters.check`); one refused
there, or whose handler raises :class:`Refuse`, is dead-lettered and acked (never retried,
never fatal); a handler that returns normally is acked with a confirmed ack (the server answers
it; the effect is committed first, DESIGN.md "ack only after the effect"); a handler that
raises is nak'ed with a growing delay and redelivered, and parked on the dead-letter subject
after ``MAX_HANDLER_ATTEMPTS`` deliveries; a handler that raises :class:`Retry` (an expected
wait, e.g. a pod sandbox not created yet) is redelivered without limit (parked only after
``MAX_RETRY_DELIVERIES``, a wait that is not going to end). A handler whose KV calls meet a
stream without a leader is run again in place rather than nak'ed (NATS is at fault, not the
message). :func:`serve_requests` does the same checks for a core NATS subscription and answers
a refused or failed request with its reason.

Both run on a :class:`ConsumingBus`: what they need of :class:`~services.runtime.nats.bus.Bus`,
whose ``consume`` and ``serve`` call them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import ServiceUnavailableError
from opentelemetry import context as otel_context
from prometheus_client import Counter

from schemas import codec
from services.runtime.nats.deadletters import check
from services.runtime.nats.jsack import position
from services.runtime.nats.puback import AckInbox
from services.runtime.nats.publish import PUBLISH_ATTEMPT_TIMEOUT_S, TRANSIENT_NATS_ERRORS, cancelling
from services.runtime.nats.puller import Puller
from services.runtime.observe.logging import get_logger
from services.runtime.observe.tracing import extract
from services.runtime.settings import Settings

log = get_logger(__name__)
T = TypeVar("T")

# Deliveries of one message whose handler raised (not Retry) before it goes to the DLQ.
MAX_HANDLER_ATTEMPTS = 8
# Deliveries of one message whose handler keeps asking to wait (Retry) before it is parked on
# the DLQ: a wait that long (at least minutes, with Retry's delays) is not going to end.
MAX_RETRY_DELIVERIES = 500

REDELIVERIES = Counter(
    "tandem_redeliveries_total", "Messages handed back for redelivery (nak)", ["service", "why"]
)
REDELIVERY_REASONS = ("retry", "handler_failed", "dead_letter_failed")


class Retry(Exception):
    """Raised by a handler to have the message redelivered after ``delay`` seconds."""

    def __init__(self, reason: str, *, delay: float = 1.0) -> None:
        super().__init__(reason)
        self.delay = delay


class Refuse(Exception):
    """Raised by a handler for a message that must not be acted on (e.g. a request id reused
    for a different request): it is dead-lettered with ``reason`` and acked, never retried."""


@dataclass(slots=True)
class Delivery:
    """What a handler knows about the message besides its decoded body."""

    subject: str
    headers: dict[str, str]
    num_delivered: int
    context: otel_context.Context = field(default_factory=otel_context.Context)
    # The message's sequence in its stream: stamped by the server, so it orders one sender's
    # messages on one subject without trusting the sender's clock (0 for core NATS).
    stream_seq: int = 0


Handler = Callable[[T, Delivery], Awaitable[None]]


def count_redeliveries_from_zero(service: str) -> None:
    """Show ``tandem_redeliveries_total`` for ``service`` from 0: increase() over a series born
    at 1 sees no increase."""
    for why in REDELIVERY_REASONS:
        REDELIVERIES.labels(service, why)


class ConsumingBus(Protocol):
    """What consuming needs of the bus it runs on (:class:`~services.runtime.nats.bus.Bus`)."""

    nc: NATS
    js: JetStreamContext
    acks: AckInbox
    service: str
    settings: Settings
    # How long an ack, or a handler meeting a stream without a leader, is retried.
    publish_retry_for: float
    # (stream, durable) of every consumer run: consumer-lag polling reads them.
    consumers: set[tuple[str, str]]
    # Unsubscribed when the bus closes, before its drain.
    subscriptions: list[Any]

    async def dead_letter(
        self,
        *,
        subject: str,
        data: bytes,
        error: str,
        headers: dict[str, str] | None = None,
        why: str = "refused",
    ) -> bool: ...


async def run_consumer(
    bus: ConsumingBus,
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
    """Run a durable pull consumer on ``bus`` until ``stop`` is set (or the task is cancelled):
    what :meth:`Bus.consume <services.runtime.nats.bus.Bus.consume>` does (its docstring says
    what the arguments mean)."""
    filters = [filter_subject] if isinstance(filter_subject, str) else list(filter_subject)
    config = api.ConsumerConfig(
        name=durable,
        durable_name=durable,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=bus.settings.ack_wait,
        # Room for every message handed over or running on each of a few replicas.
        max_ack_pending=max(1000, (batch + concurrency) * 4),
        deliver_policy=api.DeliverPolicy.NEW if deliver_new else api.DeliverPolicy.ALL,
        **({"filter_subject": filters[0]} if len(filters) == 1 else {"filter_subjects": filters}),
    )
    await _ensure_consumer(bus.js, stream, config)
    bus.consumers.add((stream, durable))
    puller = Puller(bus.nc, bus.subscriptions, stream=stream, durable=durable, batch=batch)
    await puller.open()
    gate = asyncio.Semaphore(concurrency)
    running: set[asyncio.Task[None]] = set()

    async def deliver(msg: Msg) -> None:
        try:
            await _deliver(bus, msg, decoder, handler, confirm_ack=confirm_acks)
        finally:
            gate.release()

    try:
        while stop is None or not stop.is_set():
            msg = await puller.next()
            if msg is None:
                if puller.consumer_gone:
                    try:
                        await _ensure_consumer(bus.js, stream, config)
                    except TRANSIENT_NATS_ERRORS as exc:
                        log.warning("consumer_recreate_failed", durable=durable, error=repr(exc))
                        await asyncio.sleep(1.0)
                continue
            await gate.acquire()
            if concurrency == 1:
                await deliver(msg)
                continue
            task = asyncio.get_running_loop().create_task(deliver(msg), name=f"consume:{durable}")
            running.add(task)  # held here, awaited on the way out: not a bare task
            task.add_done_callback(running.discard)
    finally:
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        await puller.close()


async def _ensure_consumer(js: JetStreamContext, stream: str, config: api.ConsumerConfig) -> None:
    """Create the durable consumer, or bring an existing one to ``config``."""
    try:
        await js.add_consumer(stream, config)
    except ServiceUnavailableError:
        await asyncio.sleep(0.25)
        await js.add_consumer(stream, config)


async def confirmed_ack(bus: ConsumingBus, msg: Msg) -> None:
    """Confirmed ack that rides out a consumer leader election: the effect is committed,
    so a lost ack would only cost a redelivery after ack_wait; acking again is harmless."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bus.publish_retry_for
    delay = 0.1
    while True:
        try:
            await bus.acks.ack(msg, timeout=PUBLISH_ATTEMPT_TIMEOUT_S)
            return
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            if cancelling():
                raise asyncio.CancelledError from exc
            if loop.time() + delay > deadline:
                raise
            log.info("ack_retry", subject=msg.subject, error=repr(exc))
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


async def _handle_through_outage(
    bus: ConsumingBus, msg: Msg, body: Any, delivery: Delivery, handler: Handler[Any]
) -> None:
    """Run the handler; while its KV reads/writes find a stream without a leader (a NATS
    server died, an election is on), run it again here rather than nak the message.

    NATS is at fault, not the message, so this never counts towards parking it on the
    dead-letter subject. And the message stays in hand: a nak sent during the election
    can be lost with the consumer's leader, which strands the message until ack_wait
    (seen in the fail-over test). The handler is idempotent, so running it again is safe;
    ``in_progress`` keeps the server from redelivering it meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bus.publish_retry_for
    delay = 0.25
    while True:
        try:
            await handler(body, delivery)
            return
        except TRANSIENT_NATS_ERRORS as exc:
            if cancelling():
                raise asyncio.CancelledError from exc
            if loop.time() + delay > deadline:
                raise
            log.warning("handler_nats_unavailable", subject=msg.subject, error=repr(exc))
        with contextlib.suppress(Exception):
            await msg.in_progress()
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


async def _deliver(
    bus: ConsumingBus,
    msg: Msg,
    decoder: msgspec.msgpack.Decoder[Any],
    handler: Handler[Any],
    *,
    confirm_ack: bool = True,
) -> None:
    """Check, decode and hand one message over; never raises for what the message is.

    Checked in order, each before any work the next would cost: its size (before
    decoding), its decoding, its kind and node against the subject it arrived on
    (:func:`schemas.routing.refusal`). A refused message is dead-lettered and acked."""
    headers = dict(msg.headers or {})
    body, refused, why = check(msg.subject, msg.data, decoder)
    if refused is not None:
        await _park(bus, msg, error=refused, headers=headers, why=why)
        return
    where = position(msg.reply)
    delivery = Delivery(
        subject=msg.subject,
        headers=headers,
        num_delivered=where.delivered,
        context=extract(headers),
        stream_seq=where.stream_seq,
    )
    try:
        await _handle_through_outage(bus, msg, body, delivery, handler)
    except Refuse as exc:
        await _park(bus, msg, error=str(exc), headers=headers, why="refused")
        return
    except Retry as r:
        if delivery.num_delivered >= MAX_RETRY_DELIVERIES:
            error = f"still waiting after {delivery.num_delivered} deliveries: {r}"
            await _park(bus, msg, error=error, headers=headers, why="retry_exhausted")
            return
        log.info("redeliver", subject=msg.subject, reason=str(r), delay=r.delay)
        REDELIVERIES.labels(bus.service, "retry").inc()
        await msg.nak(delay=r.delay)
        return
    except Exception as exc:
        log.error("handler_failed", subject=msg.subject, error=repr(exc), exc_info=True)
        if delivery.num_delivered >= MAX_HANDLER_ATTEMPTS:
            # A message that keeps breaking its handler is parked, not lost and not
            # retried forever (a poison message would otherwise starve the consumer).
            error = f"handler failed {delivery.num_delivered} times, last: {exc!r}"
            await _park(bus, msg, error=error, headers=headers, why="handler_failed")
            return
        REDELIVERIES.labels(bus.service, "handler_failed").inc()
        await msg.nak(delay=min(0.5 * delivery.num_delivered, 10.0))
        return
    if confirm_ack:
        await confirmed_ack(bus, msg)
    else:
        await msg.ack()


async def _park(bus: ConsumingBus, msg: Msg, *, error: str, headers: dict[str, str], why: str) -> None:
    """Dead-letter a message and ack it. When even the dead letter cannot be stored (NATS
    is down), the message is handed back for later instead of being lost or crashing the
    consumer."""
    try:
        await bus.dead_letter(subject=msg.subject, data=msg.data, error=error, headers=headers, why=why)
        await confirmed_ack(bus, msg)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.warning("dead_letter_failed", subject=msg.subject, error=repr(exc))
        REDELIVERIES.labels(bus.service, "dead_letter_failed").inc()
        with contextlib.suppress(Exception):
            await msg.nak(delay=5.0)


async def serve_requests(
    bus: ConsumingBus,
    subject: str,
    *,
    decoder: msgspec.msgpack.Decoder[Any],
    handler: Callable[[Any, Delivery], Awaitable[msgspec.Struct | None]],
    queue: str = "",
    error_reply: Callable[[str], msgspec.Struct] | None = None,
    concurrent: bool = False,
) -> None:
    """Core NATS subscription (request/reply or fire-and-forget) with the same checks as
    :func:`run_consumer`. A request that is refused or whose handler fails is answered with
    ``error_reply(reason)`` (when given), so the caller learns why at once instead of
    waiting for its timeout. nats-py runs a subscription's callbacks one after another;
    ``concurrent`` runs each message's handler as a task of its own instead, for handlers
    that wait on round trips of their own."""
    running: set[asyncio.Task[None]] = set()  # held: never a bare task

    async def answer_error(msg: Msg, reason: str) -> None:
        if error_reply is not None and msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(codec.encode(error_reply(reason)))

    async def on_msg(msg: Msg) -> None:
        headers = dict(msg.headers or {})
        body, refused, why = check(msg.subject, msg.data, decoder)
        if refused is not None:
            await answer_error(msg, f"refused: {refused}")
            with contextlib.suppress(Exception):
                await bus.dead_letter(
                    subject=msg.subject, data=msg.data, error=refused, headers=headers, why=why
                )
            return
        delivery = Delivery(subject=msg.subject, headers=headers, num_delivered=1, context=extract(headers))
        try:
            reply = await handler(body, delivery)
        except Exception as exc:
            log.error("handler_failed", subject=msg.subject, error=repr(exc), exc_info=True)
            await answer_error(msg, f"failed: {exc}")
            return
        if reply is not None and msg.reply:
            await msg.respond(codec.encode(reply))

    async def start(msg: Msg) -> None:
        task = asyncio.get_running_loop().create_task(on_msg(msg), name=f"serve:{subject}")
        running.add(task)
        task.add_done_callback(running.discard)

    bus.subscriptions.append(await bus.nc.subscribe(subject, queue=queue, cb=start if concurrent else on_msg))
