"""NATS for services: connect with reconnect, idempotent provisioning, traced publishing,
and durable pull consumers whose undecodable messages go to the dead-letter subject.

:class:`Bus` is what a service holds. ``publish`` puts the W3C trace context and the
``Nats-Msg-Id`` (server-side dedup) on every JetStream publish. :meth:`Bus.consume` runs a
durable pull consumer: each message is decoded with the stream's union decoder; a decode
failure is published to ``tandem.dlq.<service>`` with the error and the original bytes and
then acked (never retried, never fatal), and so is one whose size, kind or node does not fit
the subject it arrived on (:mod:`schemas.routing`) or whose handler raises :class:`Refuse`;
a handler that returns normally is acked with a confirmed ack (the server answers it; the
effect is committed first, DESIGN.md "ack only after the effect"); a handler that raises is
nak'ed with a growing delay and redelivered, and parked on the dead-letter subject after
``MAX_HANDLER_ATTEMPTS`` deliveries; a handler that raises :class:`Retry` (an expected wait,
e.g. a pod sandbox not created yet) is redelivered without limit.

Closing: :meth:`Bus.close` drains (what arrived is handled, what was published is flushed)
then closes, within :data:`CLOSE_TIMEOUT_S` whatever state NATS is in. During an outage the
client is reconnecting and nats-py's drain refuses (``ConnectionReconnectingError``); there is
nothing to drain *to* then, so the connection is closed at once with one ``nats_drain_skipped``
warning. A drain that does not end in time (NATS half-up: the socket open, nothing answered)
is cut short the same way (``nats_drain_cut_short``). Either way the service exits 0 inside
Kubernetes' grace period: a pod deleted or rolled during an outage is not a crash. Nothing
that matters is lost by it: a JetStream publish counts as done only once its stream acked it
(work cut off before is redone by whoever takes it over), a delivery not acked is redelivered,
and only core-NATS messages still buffered (heartbeats: their loss is harmless) are dropped.

Fail-over: when the server leading a replicated stream dies, the stream has no leader for a
few seconds (4-7 s measured here) and a JetStream publish fails with "no responders" or times
out (the request went to the dead server). :meth:`Bus.publish` retries such a publish with the
*same* ``Nats-Msg-Id`` until :attr:`Bus.publish_retry_for` runs out: a retry of a publish that
did land is dropped by the stream's duplicate window, so retrying never duplicates. A publish
without an id gets a random one for the duration of its retries for the same reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue
from opentelemetry import context as otel_context
from prometheus_client import Counter

from schemas import codec, limits, permissions, routing, subjects
from schemas.messages import DeadLetter
from services.runtime.jsack import position
from services.runtime.logging import get_logger
from services.runtime.metrics import RECONNECTS
from services.runtime.natsauth import credentials, server_list, tls_context
from services.runtime.puback import AckInbox, MsgIds
from services.runtime.settings import Settings
from services.runtime.tracing import extract, inject

log = get_logger(__name__)
T = TypeVar("T")

KV_BUCKETS = (
    subjects.KV_NODES,
    subjects.KV_ALLOCS,
    subjects.KV_REQUESTS,
    subjects.KV_JOBS,
    subjects.KV_NODE_LABELS,
    subjects.KV_CLAIMS,
)
DUPLICATE_WINDOW_S = 120.0
# JetStream's "no suitable peers for placement" (a replicated stream while a peer is down):
# provisioning waits for the peer, PLACEMENT_WAITS x PLACEMENT_WAIT_S at most.
NO_PLACEMENT = 10005
PLACEMENT_WAITS = 30
PLACEMENT_WAIT_S = 0.5
# How long Bus.close may drain before it closes without: room for nats-py's own bound on the
# subscriptions' drain (``drain_timeout``, 5 s, see connect) and a flush, and a third of
# Kubernetes' default 30 s grace period, which leaves the rest to the service's own stop.
CLOSE_TIMEOUT_S = 10.0
# Closing without a drain, and each wait for a cancelled drain to end: both are local work
# (nothing waits on the server), so a bound this short is only a guard.
CLOSE_STEP_S = 1.0
# nats-py's drain swallows the first cancellation (while its subscriptions drain) and goes on
# to flush: it is cancelled again, at most this many times.
DRAIN_CANCELS = 3
# One publish attempt: a stream acks in milliseconds, so a request that sat this long went to a
# server that died (or to a stream without a leader) and is retried rather than waited on.
PUBLISH_ATTEMPT_TIMEOUT_S = 2.0
# What a stream leader election may take before a publish gives up (well above the 4-7 s
# measured); far below the duplicate window, so every retry is still deduplicated.
PUBLISH_RETRY_S = 30.0
# "No stream answered" and "no answer in time": the transient faces of a leader election.
TRANSIENT_PUBLISH_ERRORS = (NoStreamResponseError, ServiceUnavailableError, nats.errors.TimeoutError)
# The same seen from a handler's KV calls, which also make plain requests (direct gets).
TRANSIENT_NATS_ERRORS = (*TRANSIENT_PUBLISH_ERRORS, nats.errors.NoRespondersError)
# Deliveries of one message whose handler raised (not Retry) before it goes to the DLQ.
MAX_HANDLER_ATTEMPTS = 8
# Deliveries of one message whose handler keeps asking to wait (Retry) before it is parked on
# the DLQ: a wait that long (at least minutes, with Retry's delays) is not going to end.
MAX_RETRY_DELIVERIES = 500
# Dead letters stored per source (a node, or a subject without one): a burst, then this many
# per second. A flood from one sender costs a counter increment per message beyond it, so it
# can neither fill the DLQ stream nor slow what other senders are waiting for.
DEAD_LETTER_BURST = 20
DEAD_LETTER_PER_S = 1.0
# Sources remembered by the dead-letter budget (oldest forgotten first).
DEAD_LETTER_SOURCES = 10_000
# The dead-letter stream keeps at most this much (oldest dropped first).
DLQ_MAX_BYTES = 256 * 1024 * 1024
# Messages kept per node-event subject (oldest dropped first): a flood on one node's subject
# can only push out that node's own messages, never another node's.
NODE_SUBJECT_MAX_MSGS = 10_000

DEAD_LETTERS = Counter(
    "tandem_dead_letters_total", "Messages refused and stored on the dead-letter subject", ["service", "why"]
)
DEAD_LETTERS_DROPPED = Counter(
    "tandem_dead_letters_dropped_total",
    "Refused messages not stored because their source exceeded its dead-letter budget",
    ["service"],
)
REDELIVERIES = Counter(
    "tandem_redeliveries_total", "Messages handed back for redelivery (nak)", ["service", "why"]
)
REDELIVERY_REASONS = ("retry", "handler_failed", "dead_letter_failed")
DEAD_LETTER_REASONS = ("oversized", "undecodable", "mismatch", "refused", "retry_exhausted", "handler_failed")


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


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


class ConnectError(Exception):
    """NATS refused this client for a reason retrying cannot mend (its TLS certificate is not
    trusted, or its credentials are wrong): the message says which setting to check."""


# Errors that mean "this client, as configured, will never get in": a TLS handshake that
# fails (untrusted or missing certificates) or an authorization refusal. Seen this many times
# in a row before the first connection (an untrusted server certificate: once), connecting
# gives up with ConnectError instead of trying forever behind a green liveness probe.
PERMANENT_CONNECT_ERRORS: tuple[type[Exception], ...] = (ssl.SSLError, nats.errors.AuthorizationError)
PERMANENT_CONNECT_STRIKES = 3


async def connect(settings: Settings, *, name: str | None = None) -> NATS:
    """Connect with unlimited reconnects; the client buffers publishes while reconnecting.

    With several servers in ``nats_url`` the client picks one and, when it goes away,
    reconnects to another (it also learns the cluster's other servers from the one it is on).
    A server that is down is waited for; one that refuses this client's certificate or
    credentials (:data:`PERMANENT_CONNECT_ERRORS`) ends the wait with :class:`ConnectError`.
    """
    strikes: list[Exception] = []
    refused = asyncio.Event()
    nc = _CoalescingClient()

    async def on_error(exc: Exception) -> None:
        log.warning("nats_error", error=repr(exc))
        if nc.is_connected or refused.is_set():
            return
        if _refuses_for_good(exc):
            strikes.append(exc)
            # An untrusted server certificate is reported once (nats-py then hangs on it).
            if isinstance(exc, ssl.SSLCertVerificationError) or len(strikes) >= PERMANENT_CONNECT_STRIKES:
                refused.set()

    async def on_disconnect() -> None:
        # Also called on a deliberate close; a real outage shows as nats_error / reconnects.
        log.info("nats_disconnected")

    async def on_reconnect() -> None:
        RECONNECTS.labels(settings.service).inc()
        log.info("nats_reconnected")

    async def on_closed() -> None:
        # With unlimited reconnects the client closes only when told to or when it gives up
        # for good (e.g. the server refused it); a service then has no way back but a restart.
        nc.closed_event.set()
        # Closed by Bus.close: last_error is then only the outage's last reconnect attempt,
        # which Bus.close has already reported in its one line.
        if nc.last_error is not None and not nc.closing:
            log.warning("nats_closed", error=repr(nc.last_error))
        else:
            log.info("nats_closed")

    RECONNECTS.labels(settings.service)  # shown from 0, before the first reconnect
    servers = server_list(settings.nats_url)
    opts: dict[str, Any] = credentials(settings)
    tls = tls_context(settings)
    if tls is not None:
        opts["tls"] = tls
    user = settings.nats_user or urllib.parse.urlsplit(servers[0]).username
    if settings.nats_token_file and settings.service in permissions.ROLES:
        # The auth callout names the user after the role (and node) the token proves.
        node = settings.node_name if settings.service == "nodeagent" else None
        user = permissions.user_name(settings.service, node)
    if user:
        # A user's replies come to its own inbox prefix, which only it may subscribe to
        # (schemas.permissions); with the shared _INBOX.> any client could read them.
        opts["inbox_prefix"] = permissions.inbox_prefix(user)
    connecting = asyncio.ensure_future(
        nc.connect(
            servers=servers,
            name=name or f"{settings.service}/{settings.instance}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]  # seconds; nats-py annotates int
            # A subscriber that never reads its queue must not hold shutdown for the 30 s default.
            drain_timeout=5,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            closed_cb=on_closed,
            **opts,
        )
    )
    gave_up = asyncio.ensure_future(refused.wait())
    try:
        await asyncio.wait({connecting, gave_up}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gave_up.cancel()
        if not connecting.done():  # refused for good (or this task was cancelled)
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await connecting
            with contextlib.suppress(Exception):
                await nc.close()
    if connecting.cancelled():
        raise ConnectError(_refusal_hint(strikes[-1] if strikes else None, settings))
    connecting.result()  # what connect raised, if it did
    return nc


def _refuses_for_good(exc: Exception) -> bool:
    # nats-py reports the server's "-ERR 'Authorization Violation'" during connect as a plain
    # nats.errors.Error with that text (AuthorizationError only in some paths).
    return isinstance(exc, PERMANENT_CONNECT_ERRORS) or (
        isinstance(exc, nats.errors.Error) and "authorization violation" in str(exc).lower()
    )


def _refusal_hint(exc: Exception | None, settings: Settings) -> str:
    # The servers as the message names them: without any user:password@ part.
    where = ", ".join(re.sub(r"//[^@/]*@", "//", u) for u in server_list(settings.nats_url))
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"NATS at {where}: the server's TLS certificate is not trusted ({exc.verify_message}); "
            "set nats_tls_ca to the CA that signed it"
        )
    if isinstance(exc, ssl.SSLError):
        return (
            f"NATS at {where}: the TLS handshake failed ({exc.reason or exc}); the server may want "
            "a client certificate (nats_tls_cert, nats_tls_key)"
        )
    return f"NATS at {where}: not authorized ({exc}); check the credentials (nats_creds, nats_user...)"


# What ``str.isspace`` calls whitespace among ASCII bytes: nats-py drops a header whose name
# holds any (a name is a token).
_SPACE_IN_NAME = re.compile(rb"[\t\n\x0b\x0c\r\x1c-\x1f ]")


class _CoalescingClient(NATS):
    """nats-py's client with two overrides, both checked against the library by
    tests/unit/test_bus_flusher.py so that an upgrade that moves what they rely on fails there:

    * a flusher that lets the event loop run once more before it writes, so the publishes and
      acks of the many handlers in flight go out in one socket write instead of one write per
      loop turn (a loopback write costs the sender tens of microseconds of kernel time;
      docs/benchmarks.md). It keeps the library's own loop and only adds the yield;
    * the header parser: the same result as the library's, which tests every character of
      every header name with a generator, in about half the time — every KV watch delivery and
      every request message carries a header block (docs/benchmarks.md, "Measurements behind
      the code").

    ``closed_event`` is set when the connection is closed for good (see :func:`connect`);
    ``closing`` once :meth:`Bus.close` began (a deliberate close, not a connection lost)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed_event = asyncio.Event()
        self.closing = False

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in raw.split(b"\r\n"):
            name, sep, value = line.partition(b":")
            if not sep:
                continue  # an empty line, or not a header
            name = name.strip()
            # Skipped, as the library does: a name that is not ASCII or holds whitespace.
            if not name.isascii() or _SPACE_IN_NAME.search(name) is not None:
                continue
            out[name.decode()] = value.strip().decode("utf-8", "replace")
        return out

    async def _flusher(self) -> None:
        assert self._transport, "Client.connect must be called first"
        assert self._flush_queue, "Client.connect must be called first"
        while True:
            if not self.is_connected or self.is_connecting:
                break
            future: asyncio.Future[None] = await self._flush_queue.get()
            try:
                # The coalescing: whatever the handlers made ready this turn joins the write.
                await asyncio.sleep(0)
                if self._pending_data_size > 0:
                    self._transport.writelines(self._pending[:])
                    self._pending = []
                    self._pending_data_size = 0
                    await self._transport.drain()  # type: ignore[no-untyped-call]
            except OSError as e:
                await self._error_cb(e)
                await self._process_op_err(e)
                break
            except (asyncio.CancelledError, RuntimeError, AttributeError):
                break  # RuntimeError: the event loop is closed
            finally:
                if not future.done():
                    future.set_result(None)


async def provision(js: JetStreamContext, *, replicas: int = 1, attempts: int = 3) -> None:
    """Create or update every stream and KV bucket; safe to run from every service at start.

    Every step is idempotent, so a JetStream API call that times out (a loaded server can take
    longer than the client's 5 s to create a file-backed stream) is simply tried again. So is a
    replicated stream or bucket that cannot be placed yet because a peer of the cluster is not
    up (err_code 10005: a cluster still forming, or a server restarting), for a while longer:
    it places once the peer is back."""
    placement_waits = 0
    attempt = 1
    while True:
        try:
            await _provision_once(js, replicas=replicas)
            return
        except nats.errors.TimeoutError:
            if attempt == attempts:
                raise
            log.warning("provision_retry", attempt=attempt)
            attempt += 1
        except APIError as exc:
            if exc.err_code != NO_PLACEMENT or placement_waits >= PLACEMENT_WAITS:
                raise
            placement_waits += 1
            log.warning("provision_waits_for_peers", error=exc.description, wait=placement_waits)
            await asyncio.sleep(PLACEMENT_WAIT_S)


async def _provision_once(js: JetStreamContext, *, replicas: int) -> None:
    for name, subjects_ in subjects.STREAM_SUBJECTS.items():
        cfg = api.StreamConfig(
            name=name,
            subjects=subjects_,
            duplicate_window=DUPLICATE_WINDOW_S,
            num_replicas=replicas,
            max_age=7 * 24 * 3600.0,
            max_msg_size=limits.MAX_MESSAGE_BYTES,
            **_stream_limits(name),
        )
        try:
            await js.stream_info(name)
            await js.update_stream(cfg)
        except NotFoundError:
            await js.add_stream(cfg)
    # Buckets allow direct gets: a direct get names the key in its subject
    # ($JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>), so NATS permissions can let a node
    # agent read its own allocation record and no other (schemas.permissions).
    for bucket in KV_BUCKETS:
        republish = _republish(bucket)
        try:
            kv = await js.key_value(bucket)
        except BucketNotFoundError:
            cfg_kv = api.KeyValueConfig(
                bucket=bucket,
                history=5,
                replicas=replicas,
                direct=True,
                republish=republish,
                max_value_size=limits.MAX_RECORD_BYTES,
            )
            await js.create_key_value(cfg_kv)
            continue
        info = await js.stream_info(subjects.kv_stream(bucket))
        current = info.config.republish
        wants_republish = republish is not None and (
            current is None or (current.src, current.dest) != (republish.src, republish.dest)
        )
        cfg = info.config
        if (
            not kv._direct
            or wants_republish
            or not cfg.allow_msg_ttl
            or cfg.max_msg_size != limits.MAX_RECORD_BYTES
        ):  # a bucket made by an older version
            await js.update_stream(
                dataclasses.replace(
                    cfg,
                    allow_direct=True,
                    republish=republish or current,
                    allow_msg_ttl=True,
                    max_msg_size=limits.MAX_RECORD_BYTES,
                )
            )


def _stream_limits(stream: str) -> dict[str, Any]:
    """Bounds that keep one sender's flood from costing anyone else (module constants)."""
    if stream == subjects.DLQ_STREAM:
        return {"max_bytes": DLQ_MAX_BYTES, "discard": api.DiscardPolicy.OLD}
    if stream == subjects.NODE_STREAM:
        return {"max_msgs_per_subject": NODE_SUBJECT_MAX_MSGS, "discard": api.DiscardPolicy.OLD}
    return {}


def _republish(bucket: str) -> api.RePublish | None:
    """Node allocation records are republished on ``tandem.allocs.<node>`` (schemas.subjects)."""
    if bucket != subjects.KV_ALLOCS:
        return None
    return api.RePublish(
        src=subjects.kv_subject(bucket), dest=subjects.NODE_ALLOCS_ALL, headers_only=False
    )


class Bus:
    """A service's connection: traced publishes, KV handles, consumers, dead letters."""

    def __init__(self, nc: NATS, *, service: str, settings: Settings) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        # JetStream publishes and their acknowledgements, without nats-py's per-request
        # machinery (services/runtime/puback.py), and cheap unique message ids.
        self.acks = AckInbox(nc)
        self.msg_ids = MsgIds()
        self.service = service
        self.settings = settings
        self._kv: dict[str, KeyValue] = {}
        self._subs: list[Any] = []
        self.publish_retry_for = PUBLISH_RETRY_S
        self._dead_letter_budget = _Budget(
            burst=DEAD_LETTER_BURST, per_s=DEAD_LETTER_PER_S, sources=DEAD_LETTER_SOURCES
        )
        # (stream, durable) of every consumer this bus runs: runtime.metrics polls their lag.
        self.consumers: set[tuple[str, str]] = set()
        # Shown from 0: increase() over a series born at 1 sees no increase.
        DEAD_LETTERS_DROPPED.labels(service)
        for why in DEAD_LETTER_REASONS:
            DEAD_LETTERS.labels(service, why)
        for why in REDELIVERY_REASONS:
            REDELIVERIES.labels(service, why)

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
        (see the module docstring, "Closing")."""
        if self.nc.is_closed:
            return
        if isinstance(self.nc, _CoalescingClient):
            self.nc.closing = True
        if not self.nc.is_connected:
            # Reconnecting (or still connecting): nats-py's drain would raise, and what it
            # would flush can only go to a server that is not there.
            log.warning("nats_drain_skipped", reason="NATS unreachable: closed without draining")
            await self._close_now()
            return
        draining = asyncio.ensure_future(self._drain())
        try:
            done, _ = await asyncio.wait({draining}, timeout=timeout)
        except asyncio.CancelledError:
            draining.cancel()  # held here: not left running behind a cancelled close
            raise
        if not done:
            await _cancel_drain(draining)
            log.warning("nats_drain_cut_short", reason=f"NATS did not answer the drain within {timeout:g}s")
        else:
            error = draining.exception()
            if error is None:
                return
            if not isinstance(error, nats.errors.Error | OSError):
                raise error
            # The outage began during the drain (reconnecting, a flush unanswered).
            log.warning("nats_drain_skipped", reason=f"NATS unreachable during the drain: {error!r}")
        await self._close_now()

    async def _drain(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await self.nc.drain()

    async def _close_now(self) -> None:
        """Close without draining: pending writes are dropped, the reconnect loop stops."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.close(), CLOSE_STEP_S)

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
        riding out a stream leader election (see the module docstring)."""
        hdrs = inject(headers)
        if msg_id:
            hdrs["Nats-Msg-Id"] = msg_id
        await self._js_publish(subject, codec.encode(message), hdrs)

    async def _js_publish(self, subject: str, data: bytes, headers: dict[str, str]) -> api.PubAck:
        # Retries must be deduplicable: a timed-out attempt may have been stored.
        headers.setdefault("Nats-Msg-Id", self.msg_ids.new("retry-"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.publish_retry_for
        delay = 0.1
        attempt = 1
        while True:
            try:
                return await self.acks.publish(
                    subject, data, headers=headers, timeout=PUBLISH_ATTEMPT_TIMEOUT_S
                )
            except TRANSIENT_PUBLISH_ERRORS as exc:
                if _cancelling():
                    raise asyncio.CancelledError from exc
                if loop.time() + delay > deadline:
                    log.warning("publish_gave_up", subject=subject, attempts=attempt, error=repr(exc))
                    raise
                log.info("publish_retry", subject=subject, attempt=attempt, error=repr(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
            attempt += 1

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
        first bytes and the digest of the payload (never all of it: a dead letter must stay
        far below the server's max payload, whatever arrived). Within the source's budget
        only (module constants); returns whether it was stored."""
        DEAD_LETTERS.labels(self.service, why).inc()
        if not self._dead_letter_budget.take(routing_source(subject)):
            DEAD_LETTERS_DROPPED.labels(self.service).inc()
            return False
        kept_headers = {k: v[:256] for k, v in list((headers or {}).items())[:32]}
        letter = DeadLetter(
            service=self.service,
            subject=subject[:512],
            error=error[: limits.TEXT],
            data=data[: limits.DEAD_LETTER_SAMPLE_BYTES],
            size=len(data),
            digest=limits.digest(data),
            headers=kept_headers,
        )
        log.warning("dead_letter", subject=subject, error=error[:500], size=len(data), why=why)
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
        round trip per message.
        """
        filters = [filter_subject] if isinstance(filter_subject, str) else list(filter_subject)
        config = api.ConsumerConfig(
            name=durable,
            durable_name=durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.settings.ack_wait,
            # Room for every message handed over or running on each of a few replicas.
            max_ack_pending=max(1000, (batch + concurrency) * 4),
            deliver_policy=api.DeliverPolicy.NEW if deliver_new else api.DeliverPolicy.ALL,
            **({"filter_subject": filters[0]} if len(filters) == 1 else {"filter_subjects": filters}),
        )
        await self._ensure_consumer(stream, config)
        self.consumers.add((stream, durable))
        puller = _Puller(self, stream=stream, durable=durable, batch=batch)
        await puller.open()
        gate = asyncio.Semaphore(concurrency)
        running: set[asyncio.Task[None]] = set()

        async def deliver(msg: Msg) -> None:
            try:
                await self._deliver(msg, decoder, handler, confirm_ack=confirm_acks)
            finally:
                gate.release()

        try:
            while stop is None or not stop.is_set():
                msg = await puller.next()
                if msg is None:
                    if puller.consumer_gone:
                        try:
                            await self._ensure_consumer(stream, config)
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

    async def _ensure_consumer(self, stream: str, config: api.ConsumerConfig) -> None:
        """Create the durable consumer, or bring an existing one to ``config``."""
        try:
            await self.js.add_consumer(stream, config)
        except ServiceUnavailableError:
            await asyncio.sleep(0.25)
            await self.js.add_consumer(stream, config)

    async def _ack(self, msg: Msg) -> None:
        """Confirmed ack that rides out a consumer leader election: the effect is committed,
        so a lost ack would only cost a redelivery after ack_wait; acking again is harmless."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.publish_retry_for
        delay = 0.1
        while True:
            try:
                await self.acks.ack(msg, timeout=PUBLISH_ATTEMPT_TIMEOUT_S)
                return
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
                if _cancelling():
                    raise asyncio.CancelledError from exc
                if loop.time() + delay > deadline:
                    raise
                log.info("ack_retry", subject=msg.subject, error=repr(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _handle_through_outage(
        self, msg: Msg, body: Any, delivery: Delivery, handler: Handler[Any]
    ) -> None:
        """Run the handler; while its KV reads/writes find a stream without a leader (a NATS
        server died, an election is on), run it again here rather than nak the message.

        NATS is at fault, not the message, so this never counts towards parking it on the
        dead-letter subject. And the message stays in hand: a nak sent during the election
        can be lost with the consumer's leader, which strands the message until ack_wait
        (seen in the fail-over test). The handler is idempotent, so running it again is safe;
        ``in_progress`` keeps the server from redelivering it meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.publish_retry_for
        delay = 0.25
        while True:
            try:
                await handler(body, delivery)
                return
            except TRANSIENT_NATS_ERRORS as exc:
                if _cancelling():
                    raise asyncio.CancelledError from exc
                if loop.time() + delay > deadline:
                    raise
                log.warning("handler_nats_unavailable", subject=msg.subject, error=repr(exc))
            with contextlib.suppress(Exception):
                await msg.in_progress()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _deliver(
        self,
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
        body, refused, why = self._check(msg.subject, msg.data, decoder)
        if refused is not None:
            await self._park(msg, error=refused, headers=headers, why=why)
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
            await self._handle_through_outage(msg, body, delivery, handler)
        except Refuse as exc:
            await self._park(msg, error=str(exc), headers=headers, why="refused")
            return
        except Retry as r:
            if delivery.num_delivered >= MAX_RETRY_DELIVERIES:
                error = f"still waiting after {delivery.num_delivered} deliveries: {r}"
                await self._park(msg, error=error, headers=headers, why="retry_exhausted")
                return
            log.info("redeliver", subject=msg.subject, reason=str(r), delay=r.delay)
            REDELIVERIES.labels(self.service, "retry").inc()
            await msg.nak(delay=r.delay)
            return
        except Exception as exc:
            log.error("handler_failed", subject=msg.subject, error=repr(exc), exc_info=True)
            if delivery.num_delivered >= MAX_HANDLER_ATTEMPTS:
                # A message that keeps breaking its handler is parked, not lost and not
                # retried forever (a poison message would otherwise starve the consumer).
                error = f"handler failed {delivery.num_delivered} times, last: {exc!r}"
                await self._park(msg, error=error, headers=headers, why="handler_failed")
                return
            REDELIVERIES.labels(self.service, "handler_failed").inc()
            await msg.nak(delay=min(0.5 * delivery.num_delivered, 10.0))
            return
        if confirm_ack:
            await self._ack(msg)
        else:
            await msg.ack()

    def _check(
        self, subject: str, data: bytes, decoder: msgspec.msgpack.Decoder[Any]
    ) -> tuple[Any, str | None, str]:
        """(decoded body, None, "") or (None, why refused, which check refused it)."""
        if len(data) > limits.MAX_MESSAGE_BYTES:
            return None, f"{len(data)} bytes, over the limit of {limits.MAX_MESSAGE_BYTES}", "oversized"
        try:
            body = decoder.decode(data)
        except codec.DecodeErrors as exc:
            return None, str(exc), "undecodable"
        refused = routing.refusal(subject, body)
        if refused is not None:
            return None, refused, "mismatch"
        return body, None, ""

    async def _park(self, msg: Msg, *, error: str, headers: dict[str, str], why: str) -> None:
        """Dead-letter a message and ack it. When even the dead letter cannot be stored (NATS
        is down), the message is handed back for later instead of being lost or crashing the
        consumer."""
        try:
            await self.dead_letter(subject=msg.subject, data=msg.data, error=error, headers=headers, why=why)
            await self._ack(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("dead_letter_failed", subject=msg.subject, error=repr(exc))
            REDELIVERIES.labels(self.service, "dead_letter_failed").inc()
            with contextlib.suppress(Exception):
                await msg.nak(delay=5.0)

    async def serve(
        self,
        subject: str,
        *,
        decoder: msgspec.msgpack.Decoder[Any],
        handler: Callable[[Any, Delivery], Awaitable[msgspec.Struct | None]],
        queue: str = "",
        error_reply: Callable[[str], msgspec.Struct] | None = None,
    ) -> None:
        """Core NATS subscription (request/reply or fire-and-forget) with the same checks as
        :meth:`consume`. A request that is refused or whose handler fails is answered with
        ``error_reply(reason)`` (when given), so the caller learns why at once instead of
        waiting for its timeout."""

        async def answer_error(msg: Msg, reason: str) -> None:
            if error_reply is not None and msg.reply:
                with contextlib.suppress(Exception):
                    await msg.respond(codec.encode(error_reply(reason)))

        async def on_msg(msg: Msg) -> None:
            headers = dict(msg.headers or {})
            body, refused, why = self._check(msg.subject, msg.data, decoder)
            if refused is not None:
                await answer_error(msg, f"refused: {refused}")
                with contextlib.suppress(Exception):
                    await self.dead_letter(
                        subject=msg.subject, data=msg.data, error=refused, headers=headers, why=why
                    )
                return
            delivery = Delivery(
                subject=msg.subject, headers=headers, num_delivered=1, context=extract(headers)
            )
            try:
                reply = await handler(body, delivery)
            except Exception as exc:
                log.error("handler_failed", subject=msg.subject, error=repr(exc), exc_info=True)
                await answer_error(msg, f"failed: {exc}")
                return
            if reply is not None and msg.reply:
                await msg.respond(codec.encode(reply))

        self._subs.append(await self.nc.subscribe(subject, queue=queue, cb=on_msg))


async def _cancel_drain(draining: asyncio.Future[None]) -> None:
    """Stop a drain that ran out of time; nats-py's drain catches the first cancellation
    (while its subscriptions drain) and goes on to flush, so it is cancelled again until it
    ends, a bounded number of times."""
    for _ in range(DRAIN_CANCELS):
        draining.cancel()
        done, _ = await asyncio.wait({draining}, timeout=CLOSE_STEP_S)
        if done:
            break
    if draining.done() and not draining.cancelled():
        draining.exception()  # retrieved: asyncio would log it as never retrieved


def routing_source(subject: str) -> str:
    """Who a subject's messages come from, for the dead-letter budget: the node for a node's
    subjects (only that node may publish there), else the subject."""
    _, node = routing.expected(subject)
    return f"node:{node}" if node is not None and subject.startswith(f"{subjects.ROOT}.node.") else subject


class _Budget:
    """Token buckets per source: ``burst`` at once, then ``per_s`` per second; at most
    ``sources`` remembered (the least recently seen forgotten first)."""

    def __init__(self, *, burst: int, per_s: float, sources: int) -> None:
        self.burst = burst
        self.per_s = per_s
        self.sources = sources
        self._tokens: dict[str, tuple[float, float]] = {}  # source → (tokens, at)

    def take(self, source: str) -> bool:
        now = asyncio.get_running_loop().time()
        tokens, at = self._tokens.pop(source, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.per_s)
        ok = tokens >= 1.0
        self._tokens[source] = (tokens - 1.0 if ok else tokens, now)  # re-inserted: most recent
        if len(self._tokens) > self.sources:
            del self._tokens[next(iter(self._tokens))]
        return ok


# Status codes the server answers a pull request with (no message body).
_STATUS_HEARTBEAT = "100"
_STATUS_NO_RESPONDERS = "503"
PULL_EXPIRES_S = 30.0
PULL_HEARTBEAT_S = 5.0


class _Puller:
    """The pull side of :meth:`Bus.consume`: keeps pull requests open for ``batch`` messages
    on a private inbox and hands messages over one at a time as they arrive.

    A pull request is a plain publish to ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>``
    with the inbox as reply subject; the server sends up to ``batch`` messages there, an
    idle heartbeat (status 100) every ``PULL_HEARTBEAT_S`` while it has nothing, and a status
    (408 expired, 409 leadership change / consumer deleted, with ``Nats-Pending-Messages``)
    when the request ends early. Missing heartbeats mean the request is gone (a server died,
    the consumer moved): a fresh one is sent."""

    def __init__(self, bus: Bus, *, stream: str, durable: str, batch: int) -> None:
        self.bus = bus
        self.batch = batch
        self.next_subject = f"{api.DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.outstanding = 0
        self.consumer_gone = False
        self._sub: Any = None
        self._inbox = ""
        self._arrived: asyncio.Queue[Msg] = asyncio.Queue()

    async def open(self) -> None:
        self._inbox = self.bus.nc.new_inbox()
        arrived = self._arrived

        async def queue(msg: Msg) -> None:
            arrived.put_nowait(msg)

        # A callback into a queue of our own rather than ``Subscription.next_msg``, which
        # makes a uuid4, a task and a wait_for for every message: a message already here is
        # taken without waiting (under load, almost all of them).
        self._sub = await self.bus.nc.subscribe(self._inbox, cb=queue)
        self.bus._subs.append(self._sub)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()

    async def _pull(self) -> None:
        want = self.batch - self.outstanding
        request = {
            "batch": want,
            "expires": int(PULL_EXPIRES_S * 1e9),
            "idle_heartbeat": int(PULL_HEARTBEAT_S * 1e9),
        }
        await self.bus.nc.publish(self.next_subject, json.dumps(request).encode(), reply=self._inbox)
        self.outstanding += want

    async def next(self) -> Msg | None:
        """The next message, or None after a status that ended a pull (the caller loops)."""
        self.consumer_gone = False
        if self.outstanding <= self.batch // 2:
            await self._pull()
        if self.bus.nc.is_closed:
            raise nats.errors.ConnectionClosedError
        try:
            msg = self._arrived.get_nowait()
        except asyncio.QueueEmpty:
            try:
                msg = await asyncio.wait_for(self._arrived.get(), PULL_HEARTBEAT_S * 2 + 1)
            except TimeoutError:
                if _cancelling():
                    raise asyncio.CancelledError from None
                self.outstanding = 0  # no heartbeat: the pull request is gone
                return None
        headers = msg.headers or {}
        status = headers.get(api.Header.STATUS) if not msg.data else None
        if status is None:
            self.outstanding = max(0, self.outstanding - 1)
            return msg
        if status == _STATUS_HEARTBEAT:
            return None
        if status == _STATUS_NO_RESPONDERS:
            # No consumer leader (an election is on) or no consumer at all.
            # Keep this subscription: messages the old leader already sent are still queued on
            # it, and a fresh one would strand them until ack_wait.
            log.info("consumer_unavailable", subject=self.next_subject)
            self.outstanding = 0
            await asyncio.sleep(0.25)
            return None
        pending = headers.get("Nats-Pending-Messages")
        self.outstanding = max(0, self.outstanding - int(pending)) if pending else 0
        description = headers.get(api.Header.DESCRIPTION, "")
        if "deleted" in description.lower():
            self.consumer_gone = True
        return None
