"""Many JetStream publishes in flight from one connection, retried until stored.

``submit`` only queues (it never blocks the caller, so a callback can publish without waiting
for a round trip); :meth:`AsyncPublisher.run` sends the queue through the connection's
:class:`~services.runtime.nats.puback.AckInbox` (the services' own publish path: a counter token
and a timer per publish, msgspec for the answer; nats-py's ``publish_async`` made a NUID and a
random token and parsed JSON for each, a fifth of the simulated fleet's CPU) keeping at most
``window`` publishes unacknowledged, and re-sends a publish whose ack failed or did not come
within ``ack_timeout`` — with the same ``Nats-Msg-Id``, so the stream's duplicate window drops
a re-send of one that was stored after all — with a growing pause, for up to ``RETRY_FOR_S``
(a stream leader election answers "no responders" for seconds). ``flush`` waits until
everything queued is acknowledged.

Run :meth:`AsyncPublisher.run` under a :class:`~services.runtime.process.tasks.Supervisor`. This is
the harness's and the simulated fleet's own sender: the services publish one awaited message
at a time through :class:`~services.runtime.nats.bus.Bus`, which is one of the costs the harness
measures.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from services.runtime.nats.puback import AckInbox, pub_ack

# A publish is re-sent, with a growing pause, until it is stored or this long has passed since
# its first attempt: a stream without a leader (a NATS server died) answers "no responders"
# at once for the seconds an election takes, so a count of attempts would run out in one.
RETRY_FOR_S = 60.0


@dataclass(slots=True)
class _Item:
    subject: str
    payload: bytes
    headers: dict[str, str]
    attempts: int = 0
    sent_at: float = 0.0
    first_at: float = 0.0
    not_before: float = 0.0


@dataclass(slots=True)
class PublisherStats:
    submitted: int = 0
    acked: int = 0
    retried: int = 0
    failed: int = 0
    last_error: str = ""


@dataclass
class AsyncPublisher:
    acks: AckInbox
    window: int = 1024
    ack_timeout: float = 5.0
    stats: PublisherStats = field(default_factory=PublisherStats)

    def __post_init__(self) -> None:
        self._queue: deque[_Item] = deque()
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(self.window)
        self._in_flight: dict[asyncio.Future[Msg], _Item] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def submit(
        self, subject: str, payload: bytes, *, msg_id: str, headers: dict[str, str] | None = None
    ) -> None:
        """Queue one publish; ``headers`` (e.g. ``traceparent``) ride along with the msg id."""
        self.stats.submitted += 1
        self._queue.append(_Item(subject, payload, {**(headers or {}), "Nats-Msg-Id": msg_id}))
        self._idle.clear()
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._queue) + len(self._in_flight)

    async def run(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._slots.acquire()
            if not self._queue:  # drained while we waited for a slot
                self._slots.release()
                continue
            item = self._queue[0]
            pause = item.not_before - time.monotonic()
            if pause > 0:  # a re-send waiting out its back-off (retries queue at the end)
                self._slots.release()
                await asyncio.sleep(min(pause, 0.1))
                continue
            self._queue.popleft()
            item.attempts += 1
            item.sent_at = time.monotonic()
            item.first_at = item.first_at or item.sent_at
            try:
                fut = await self.acks.send(
                    item.subject, item.payload, headers=item.headers, timeout=self.ack_timeout
                )
            except Exception as exc:  # not connected: queue it again
                self._slots.release()
                self._retry(item, exc)
                await asyncio.sleep(0.05)
                continue
            self._in_flight[fut] = item
            fut.add_done_callback(self._done)

    def _done(self, fut: asyncio.Future[Msg]) -> None:
        item = self._in_flight.pop(fut, None)
        self._slots.release()
        if item is None:
            return
        try:
            if fut.cancelled():  # only when the loop shuts down
                raise TimeoutError("publish abandoned")
            pub_ack(fut.result())  # the stream's answer, or its error
        except Exception as exc:  # no ack within ack_timeout, no stream, a stream error
            self._retry(item, exc)
        else:
            self.stats.acked += 1
        self._check_idle()

    def _retry(self, item: _Item, exc: BaseException) -> None:
        self.stats.last_error = repr(exc)
        now = time.monotonic()
        if now - item.first_at >= RETRY_FOR_S:
            self.stats.failed += 1
            self._check_idle()
            return
        self.stats.retried += 1
        item.not_before = now + min(0.05 * 2 ** min(item.attempts, 5), 1.0)
        self._queue.append(item)
        self._wake.set()

    def _check_idle(self) -> None:
        if not self._queue and not self._in_flight:
            self._idle.set()

    async def flush(self, *, timeout: float) -> bool:
        """Until every submitted publish is acknowledged (or given up); False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
