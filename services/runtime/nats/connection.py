"""The connection to NATS: opening it (reconnecting for ever, giving up only on a refusal no
retry mends) and closing it within a bound whatever state NATS is in.

:func:`connect` returns nats-py's client with two overrides (:class:`_CoalescingClient`): a
flusher that coalesces the writes of one event-loop turn, and a faster header parser.
Credentials and TLS come from :mod:`services.runtime.nats.auth`.

Closing: :func:`close_connection` (what :meth:`Bus.close <services.runtime.nats.bus.Bus.close>`
does) drains (what arrived is handled, what was published is flushed) then closes, within
:data:`CLOSE_TIMEOUT_S` whatever state NATS is in. During an outage the client is reconnecting
and nats-py's drain refuses (``ConnectionReconnectingError``); there is nothing to drain *to*
then, so the connection is closed at once with one ``nats_drain_skipped`` warning. A drain
that does not end in time (NATS half-up: the socket open, nothing answered) is cut short the
same way (``nats_drain_cut_short``). Either way the service exits 0 inside Kubernetes' grace
period: a pod deleted or rolled during an outage is not a crash. Nothing that matters is lost
by it: a JetStream publish counts as done only once its stream acked it (work cut off before
is redone by whoever takes it over), a delivery not acked is redelivered, and only core-NATS
messages still buffered (heartbeats: their loss is harmless) are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import urllib.parse
from collections.abc import Iterable
from typing import Any

import nats
from nats.aio.client import Client as NATS

from schemas import permissions
from services.runtime.nats.auth import credentials, server_list, tls_context
from services.runtime.observe.logging import get_logger
from services.runtime.observe.metrics import RECONNECTS
from services.runtime.settings import Settings

log = get_logger(__name__)

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


class ConnectError(Exception):
    """NATS refused this client for a reason retrying cannot mend (its TLS certificate is not
    trusted, or its credentials are wrong): the message says which setting to check."""


# Errors that mean "this client, as configured, will never get in": a TLS handshake that
# fails (untrusted or missing certificates) or an authorization refusal. Seen this many times
# in a row before the first connection (an untrusted server certificate: once), connecting
# gives up with ConnectError instead of trying forever behind a green liveness probe.
PERMANENT_CONNECT_ERRORS: tuple[type[Exception], ...] = (ssl.SSLError, nats.errors.AuthorizationError)
PERMANENT_CONNECT_STRIKES = 3

# How often the client pings its server (``Settings.nats_ping_interval`` unset). A server cut
# off the network (a partition, a switch port gone) closes nothing: the connection stays open
# and silent, and only unanswered pings tell. nats-py takes a connection for dead when a third
# ping is due with two unanswered, i.e. 2-3 intervals after the silence began; with its
# default (120 s) a service went on writing into the void for minutes while the other two
# servers had long elected new leaders (``tandem loadtest --partition-server-at``). A node
# agent pings far less often: there are thousands, each ping a TLS message both ways (every
# 5 s, 10,000 agents cost this machine's fleet and servers 15-30 % of a core at idle and
# quadrupled the p99 at 267 requests/s, docs/benchmarks.md), and its node is taken for lost
# after ``node_lost_after`` either way (its holds stay, nothing new is placed there).
PING_INTERVAL_S = 2.0
NODE_PING_INTERVAL_S = 30.0
MAX_OUTSTANDING_PINGS = 2


def ping_interval(settings: Settings) -> float:
    if settings.nats_ping_interval is not None:
        return settings.nats_ping_interval
    return NODE_PING_INTERVAL_S if settings.service == "nodeagent" else PING_INTERVAL_S


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
    opts = _connect_options(settings, servers)
    connecting = asyncio.ensure_future(
        nc.connect(
            servers=servers,
            name=name or f"{settings.service}/{settings.instance}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]  # seconds; nats-py annotates int
            ping_interval=ping_interval(settings),  # type: ignore[arg-type]  # seconds, as above
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
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


def _connect_options(settings: Settings, servers: list[str]) -> dict[str, Any]:
    """nats-py's options for who this client is: credentials, TLS and its inbox prefix."""
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
    return opts


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
    """nats-py's client with four overrides, checked against the library by
    tests/unit/test_bus_flusher.py so that an upgrade that moves what they rely on fails there:

    * a flusher that lets the event loop run once more before it writes, so the publishes and
      acks of the many handlers in flight go out in one socket write instead of one write per
      loop turn (a loopback write costs the sender tens of microseconds of kernel time;
      docs/benchmarks.md). It keeps the library's own loop and only adds the yield;
    * the header parser: the same result as the library's, which tests every character of
      every header name with a generator, in about half the time — every KV watch delivery and
      every request message carries a header block (docs/benchmarks.md, "Measurements behind
      the code");
    * the ping loop counts any message received since the last ping as the server's answer
      (its PONG can wait behind what it still has to send), and the reconnect after a
      connection was lost aborts the old socket before nats-py closes it.
      nats-py closes it gracefully and waits for that to end, and with a server that went
      silent (cut off the network) the close waits for what is still buffered to reach it —
      TLS's goodbye, the last writes — which it never does: the client stayed on the dead
      connection until the network came back, though its pings had told it long before
      (``tests/netns/test_nats_partition.py``). The abort loses nothing a graceful close would
      have delivered: what the socket held had no server to go to, and a JetStream publish
      among it is sent again when its ack does not come (same ``Nats-Msg-Id``).

    ``closed_event`` is set when the connection is closed for good (see :func:`connect`);
    ``closing`` once :func:`close_connection` began (a deliberate close, not a connection lost)."""

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

    async def _attempt_reconnect(self) -> None:
        _abort(self._transport)
        await super()._attempt_reconnect()

    async def _ping_interval(self) -> None:
        # The library's loop, but a message received since the last ping counts as the
        # server's answer: pings are frequent now (PING_INTERVAL_S), and a server's PONG waits
        # behind whatever it still has to send this client — a busy replica reading every
        # write of the fleet can be seconds behind. A server cut off sends nothing at all.
        seen = self.stats["in_msgs"]
        while True:
            await asyncio.sleep(self.options["ping_interval"])
            if not self.is_connected:
                continue
            if self.stats["in_msgs"] != seen:
                seen = self.stats["in_msgs"]
                self._pings_outstanding = 0
            try:
                self._pings_outstanding += 1
                if self._pings_outstanding > self.options["max_outstanding_pings"]:
                    await self._process_op_err(nats.errors.StaleConnectionError())
                    return
                await self._send_ping()
            except (asyncio.CancelledError, RuntimeError, AttributeError):
                break

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


def _abort(transport: object) -> None:
    """Drop the socket under nats-py's transport at once (no goodbye, nothing flushed)."""
    for name in ("_io_writer", "_bare_io_writer"):  # TLS on top of TCP, and the TCP one
        writer = getattr(transport, name, None)
        if isinstance(writer, asyncio.StreamWriter):
            writer.transport.abort()


async def close_connection(
    nc: NATS, subscriptions: Iterable[Any], *, timeout: float = CLOSE_TIMEOUT_S
) -> None:
    """Drain, then close; without the drain during an outage or past ``timeout``.

    Never raises for the state NATS is in, and returns within about ``timeout`` seconds (see
    the module docstring). ``subscriptions`` are unsubscribed first, when the drain begins."""
    if nc.is_closed:
        return
    if isinstance(nc, _CoalescingClient):
        nc.closing = True
    if not nc.is_connected:
        # Reconnecting (or still connecting): nats-py's drain would raise, and what it
        # would flush can only go to a server that is not there.
        log.warning("nats_drain_skipped", reason="NATS unreachable: closed without draining")
        await _close_now(nc)
        return
    draining = asyncio.ensure_future(_drain(nc, subscriptions))
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
    await _close_now(nc)


async def _drain(nc: NATS, subscriptions: Iterable[Any]) -> None:
    for sub in subscriptions:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    await nc.drain()


async def _close_now(nc: NATS) -> None:
    """Close without draining: pending writes are dropped, the reconnect loop stops."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), CLOSE_STEP_S)


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
