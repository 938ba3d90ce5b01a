"""JetStream publishes acknowledged through one inbox: the hot path of every write.

A JetStream publish is a NATS publish with a reply subject; the stream answers on it with a
``PubAck`` (``{"stream":..,"seq":..}``, or ``{"error":{..}}``). nats-py's
``JetStreamContext.publish`` goes through its generic request machinery for each one: a NUID
plus ``secrets.token_hex`` for the reply token, a future wrapped in ``asyncio.wait_for``
(a task and a timeout per publish), ``json.loads`` and a dataclass for the answer. Measured
with ``py-spy`` on the allocator under ``tandem loadtest`` (docs/benchmarks.md), that
machinery was about a tenth of the allocator's CPU — each placed and freed request makes seven
such publishes (claim, commit, assignment, releasing, freed, drop, Freed) and three confirmed
acks (``Msg.ack_sync``: the same request path) of the messages it consumed.

:class:`AckInbox` does the same protocol with less per message: one wildcard subscription
under the connection's inbox prefix (the user's own prefix when permissions name one, see
``schemas.permissions``), a counter for the reply token, one timer handle per publish instead
of ``wait_for``, and msgspec for the answer; :meth:`AckInbox.ack` sends the confirmed ack
the same way. It raises what nats-py's publish raises — so the retries of
:func:`services.runtime.nats.publish.publish_acked` and the compare-and-set error codes work
unchanged: ``NoStreamResponseError`` when no stream listens (status 503),
``nats.errors.TimeoutError`` when no answer came in time, and the ``APIError`` subclass of
the stream's error (``err_code`` 10071 for a wrong last sequence). After a reconnect nats-py
subscribes the inbox again; a reply lost in between times out and is retried, deduplicated by
its ``Nats-Msg-Id``.

:class:`MsgIds` makes those ids: a random prefix per process and a counter, unique across
processes and restarts like a UUID, at the cost of an integer increment.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import APIError, NoStreamResponseError

NO_RESPONDERS_STATUS = "503"


class _Reply(msgspec.Struct):
    """A stream's answer to a publish (the fields nats-py's ``PubAck`` keeps)."""

    stream: str = ""
    seq: int = 0
    domain: str | None = None
    duplicate: bool | None = None
    error: dict[str, Any] | None = None


_REPLY = msgspec.json.Decoder(_Reply)


class MsgIds:
    """Unique ``Nats-Msg-Id`` values: ``<prefix><random per process>-<counter>``."""

    def __init__(self) -> None:
        self._base = uuid.uuid4().hex[:16]
        self._next = itertools.count()

    def new(self, prefix: str = "") -> str:
        return f"{prefix}{self._base}-{next(self._next)}"


class AckInbox:
    """Requests answered on one inbox: JetStream publishes and their acknowledgements,
    confirmed acks of consumed messages (see the module)."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._prefix: str | None = None
        self._starting: asyncio.Future[str] | None = None
        # reply token → the future of its reply, and the timer that fails it when none comes
        self._waiting: dict[str, tuple[asyncio.Future[Msg], asyncio.TimerHandle]] = {}
        self._tokens = itertools.count()

    async def _start(self) -> str:
        if self._prefix is not None:
            return self._prefix
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_future()
            try:
                prefix = f"{self.nc._inbox_prefix.decode()}.{self.nc._nuid.next().decode()}."
                await self.nc.subscribe(prefix + "*", cb=self._on_reply)
            except BaseException as exc:
                self._starting.set_exception(exc)
                self._starting.exception()  # retrieved: other waiters re-raise it
                self._starting = None
                raise
            self._prefix = prefix
            self._starting.set_result(prefix)
            return prefix
        return await asyncio.shield(self._starting)

    async def send(
        self, subject: str, payload: bytes = b"", *, headers: dict[str, str] | None = None, timeout: float
    ) -> asyncio.Future[Msg]:
        """Send a request and return once it is sent, with the future of its reply: the reply
        message, or ``nats.errors.TimeoutError`` when none came within ``timeout``. For a
        sender that keeps many requests in flight without a task for each
        (:class:`tools.loadtest.publisher.AsyncPublisher`)."""
        prefix = await self._start()
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Msg] = loop.create_future()
        self._waiting[token] = (future, loop.call_later(timeout, self._expire, token))
        try:
            await self.nc.publish(subject, payload, reply=prefix + token, headers=headers)
        except BaseException:
            self._waiting.pop(token)[1].cancel()
            raise
        return future

    async def request(
        self, subject: str, payload: bytes = b"", *, headers: dict[str, str] | None = None, timeout: float
    ) -> Msg:
        """A core request answered on the inbox: the reply message, ``NoRespondersError``
        when nobody listens, ``nats.errors.TimeoutError`` when no answer came in time."""
        # A caller cancelled meanwhile cancels the future; its entry goes when its timer fires.
        reply = await (await self.send(subject, payload, headers=headers, timeout=timeout))
        if reply.headers and reply.headers.get(api.Header.STATUS) == NO_RESPONDERS_STATUS:
            raise nats.errors.NoRespondersError
        return reply

    async def publish(
        self, subject: str, payload: bytes, *, headers: dict[str, str], timeout: float
    ) -> api.PubAck:
        """A JetStream publish: the stream's ``PubAck``, or the errors nats-py raises."""
        return pub_ack(await (await self.send(subject, payload, headers=headers, timeout=timeout)))

    async def ack(self, msg: Msg, *, timeout: float) -> None:
        """A confirmed ack of a consumed JetStream message (what ``Msg.ack_sync`` sends: an
        empty body to its reply subject, answered by the consumer's leader)."""
        if not msg.reply:
            raise nats.errors.NotJSMessageError
        await self.request(msg.reply, b"", timeout=timeout)

    async def _on_reply(self, msg: Msg) -> None:
        assert self._prefix is not None
        waiting = self._waiting.pop(msg.subject[len(self._prefix) :], None)
        if waiting is None:
            return  # answered after its timeout
        future, timer = waiting
        timer.cancel()
        if not future.done():  # else: its caller was cancelled
            future.set_result(msg)

    def _expire(self, token: str) -> None:
        waiting = self._waiting.pop(token, None)
        if waiting is not None and not waiting[0].done():
            waiting[0].set_exception(nats.errors.TimeoutError())


def pub_ack(reply: Msg) -> api.PubAck:
    """The stream's answer to a JetStream publish, or the error nats-py raises for it:
    ``NoStreamResponseError`` when no stream listens, the ``APIError`` of the stream's error."""
    if reply.headers and reply.headers.get(api.Header.STATUS) == NO_RESPONDERS_STATUS:
        raise NoStreamResponseError
    try:
        answer = _REPLY.decode(reply.data)
    except msgspec.DecodeError as exc:
        raise APIError(description=f"undecodable publish acknowledgement: {exc}") from None
    if answer.error is not None:
        try:
            APIError.from_error(answer.error)  # raises the error's own subclass
        except APIError:
            raise
        except Exception as exc:  # an error object without the expected fields
            raise APIError(description=f"publish failed: {answer.error!r} ({exc!r})") from None
    return api.PubAck(stream=answer.stream, seq=answer.seq, domain=answer.domain, duplicate=answer.duplicate)
