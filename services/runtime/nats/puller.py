"""The pull protocol of a durable consumer, without nats-py's ``fetch``: pull requests kept
open on a private inbox, topped up as messages arrive, renewed when their heartbeats stop.

nats-py's ``fetch`` waits for its whole batch or its timeout; :class:`Puller` hands each
message over the moment it is stored, which is what :func:`~services.runtime.nats.consume.run_consumer`
needs to keep latency low and a stream leader election survivable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api

from services.runtime.nats.publish import cancelling
from services.runtime.observe.logging import get_logger

log = get_logger(__name__)

# Status codes the server answers a pull request with (no message body).
_STATUS_HEARTBEAT = "100"
_STATUS_NO_RESPONDERS = "503"
PULL_EXPIRES_S = 30.0
PULL_HEARTBEAT_S = 5.0


class Puller:
    """The pull side of :func:`~services.runtime.nats.consume.run_consumer`: keeps pull
    requests open for ``batch`` messages on a private inbox and hands messages over one at a
    time as they arrive.

    A pull request is a plain publish to ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>``
    with the inbox as reply subject; the server sends up to ``batch`` messages there, an
    idle heartbeat (status 100) every ``PULL_HEARTBEAT_S`` while it has nothing, and a status
    (408 expired, 409 leadership change / consumer deleted, with ``Nats-Pending-Messages``)
    when the request ends early. Missing heartbeats mean the request is gone (a server died,
    the consumer moved): a fresh one is sent."""

    def __init__(self, nc: NATS, subscriptions: list[Any], *, stream: str, durable: str, batch: int) -> None:
        self._nc = nc
        self._subscriptions = subscriptions  # the bus's: unsubscribed when it closes
        self.batch = batch
        self.next_subject = f"{api.DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.outstanding = 0
        self.consumer_gone = False
        self._sub: Any = None
        self._inbox = ""
        self._arrived: asyncio.Queue[Msg] = asyncio.Queue()

    async def open(self) -> None:
        self._inbox = self._nc.new_inbox()
        arrived = self._arrived

        async def queue(msg: Msg) -> None:
            arrived.put_nowait(msg)

        # A callback into a queue of our own rather than ``Subscription.next_msg``, which
        # makes a uuid4, a task and a wait_for for every message: a message already here is
        # taken without waiting (under load, almost all of them).
        self._sub = await self._nc.subscribe(self._inbox, cb=queue)
        self._subscriptions.append(self._sub)

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
        await self._nc.publish(self.next_subject, json.dumps(request).encode(), reply=self._inbox)
        self.outstanding += want

    async def next(self) -> Msg | None:
        """The next message, or None after a status that ended a pull (the caller loops)."""
        self.consumer_gone = False
        if self.outstanding <= self.batch // 2:
            await self._pull()
        if self._nc.is_closed:
            raise nats.errors.ConnectionClosedError
        try:
            msg = self._arrived.get_nowait()
        except asyncio.QueueEmpty:
            try:
                msg = await asyncio.wait_for(self._arrived.get(), PULL_HEARTBEAT_S * 2 + 1)
            except TimeoutError:
                if cancelling():
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
