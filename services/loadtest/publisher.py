"""Many JetStream publishes in flight from one connection, retried until stored.

``submit`` only queues (it never blocks the caller, so a callback can publish without waiting
for a round trip); :meth:`AsyncPublisher.run` sends the queue with ``js.publish_async`` keeping
at most ``window`` publishes unacknowledged, and re-sends a publish whose ack failed or did not
come within ``ack_timeout`` — with the same ``Nats-Msg-Id``, so the stream's duplicate window
drops a re-send of one that was stored after all — with a growing pause, for up to
``RETRY_FOR_S`` (a stream leader election answers "no responders" for seconds). ``flush``
waits until everything queued is acknowledged.

Run it under a :class:`~services.runtime.tasks.Supervisor` (``run`` and ``reap`` are the two
loops). This is the harness's and the simulated fleet's own sender: the services publish one
awaited message at a time through :class:`~services.runtime.bus.Bus`, which is one of the
costs the harness measures.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from nats.js import JetStreamContext
from nats.js.api import PubAck

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
    js: JetStreamContext
    window: int = 1024
    ack_timeout: float = 5.0
    stats: PublisherStats = field(default_factory=PublisherStats)

    def __post_init__(self) -> None:
        self._queue: deque[_Item] = deque()
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(self.window)
        self._in_flight: dict[asyncio.Future[PubAck], _Item] = {}
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
                fut = await self.js.publish_async(item.subject, item.payload, headers=item.headers)
            except Exception as exc:  # not connected, too many stalled: queue it again
                self._slots.release()
                self._retry(item, exc)
                await asyncio.sleep(0.05)
                continue
            self._in_flight[fut] = item
            fut.add_done_callback(self._done)

    def _done(self, fut: asyncio.Future[PubAck]) -> None:
        item = self._in_flight.pop(fut, None)
        self._slots.release()
        if item is None:
            return
        if fut.cancelled():
            self._retry(item, TimeoutError(f"no ack within {self.ack_timeout}s"))
        elif (exc := fut.exception()) is not None:
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

    async def reap(self) -> None:
        """Give up waiting for acks older than ``ack_timeout`` (their publish is re-sent)."""
        while True:
            await asyncio.sleep(min(1.0, self.ack_timeout / 2))
            deadline = time.monotonic() - self.ack_timeout
            for fut, item in list(self._in_flight.items()):
                if item.sent_at < deadline and not fut.done():
                    fut.cancel()

    async def flush(self, *, timeout: float) -> bool:
        """Until every submitted publish is acknowledged (or given up); False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
