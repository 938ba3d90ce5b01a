"""The JetStream ceiling: what this server does with the simplest client code, measured in the
same run, on the same server, before the load starts.

* ``publish_per_s``: ``count`` async publishes of a request-sized payload (256 bytes) to a
  scratch stream, up to ``window`` unacknowledged at once, until the last ack;
* ``pull_ack_per_s``: the same messages fetched by a durable pull consumer in batches of 256
  and acked one by one (``ack``, fire-and-forget, flushed at the end).

The scratch stream (file storage, like Tandem's streams) is deleted afterwards. Its subject
lives under ``tandem.loadtest.`` — a subject ``schemas.subjects`` does not define, because no
service uses it; it overlaps no Tandem stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from schemas import subjects
from services.runtime.nats.provision import PLACEMENT_WAIT_S, PLACEMENT_WAITS, while_forming

PAYLOAD = b"x" * 256
FETCH_BATCH = 256
API_TRIES = 5
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Ceiling:
    publish_per_s: float | None
    pull_ack_per_s: float | None


async def measure(nc: NATS, *, count: int = 20_000, window: int = 1024, replicas: int = 1) -> Ceiling:
    """The two rates on a scratch stream of ``replicas`` (the run's streams': 3 in the
    production profile, so the ceiling includes their replication)."""
    if count <= 0:
        return Ceiling(None, None)
    js = nc.jetstream()
    token = uuid.uuid4().hex[:8]
    stream = f"LOADTEST_SCRATCH_{token}"
    subject = f"{subjects.ROOT}.loadtest.{token}"
    # The first JetStream call of the run: a cluster just reported healthy may still be
    # electing its meta leader (503), as the services' provisioning waits for it.
    cfg = api.StreamConfig(
        name=stream, subjects=[subject], storage=api.StorageType.FILE, num_replicas=replicas
    )
    await _patiently(lambda: js.add_stream(cfg))
    try:
        await _until_led(js, stream)
        publish = await _publish_rate(js, subject, count=count, window=window)
        pull = await _pull_ack_rate(nc, js, subject, stream=stream, count=count)
        return Ceiling(round(publish), round(pull))
    finally:
        with contextlib.suppress(NotFoundError, nats.errors.TimeoutError):
            await js.delete_stream(stream)


async def _patiently(call: Callable[[], Awaitable[T]]) -> T:
    """A JetStream API call made again while the cluster is still forming, or when it timed
    out: a cluster just reported healthy can leave its first requests unanswered for a while
    (one 10,000-node run of ~50 stopped here with "NATS did not answer in time"). Each call
    here is safe to repeat (the same stream, the same durable)."""
    for _ in range(API_TRIES - 1):
        try:
            return await while_forming(call, what="ceiling stream")
        except nats.errors.TimeoutError:
            await asyncio.sleep(PLACEMENT_WAIT_S)
    return await while_forming(call, what="ceiling stream")


async def _until_led(js: JetStreamContext, stream: str) -> None:
    """Return once ``stream`` has a leader. A replicated stream is created before its own
    group has elected one, and publishes meanwhile find no stream to answer them
    (``NoStreamResponseError``: two runs of ~40 at 3 servers stopped there)."""
    for _ in range(PLACEMENT_WAITS):
        info = await _patiently(lambda: js.stream_info(stream))
        if info.cluster is None or info.cluster.leader:
            return
        await asyncio.sleep(PLACEMENT_WAIT_S)
    raise TimeoutError(f"stream {stream} has no leader after {PLACEMENT_WAITS * PLACEMENT_WAIT_S:g} s")


async def _publish_rate(js: JetStreamContext, subject: str, *, count: int, window: int) -> float:
    slots = asyncio.Semaphore(window)
    futures: list[asyncio.Future[api.PubAck]] = []
    started = time.perf_counter()
    for _ in range(count):
        await slots.acquire()
        fut = await js.publish_async(subject, PAYLOAD)
        fut.add_done_callback(lambda _: slots.release())
        futures.append(fut)
    await asyncio.wait_for(asyncio.gather(*futures), 60)
    return count / (time.perf_counter() - started)


async def _pull_ack_rate(nc: NATS, js: JetStreamContext, subject: str, *, stream: str, count: int) -> float:
    durable = f"ceiling-{stream.lower()}"
    psub = await _patiently(lambda: js.pull_subscribe(subject, durable=durable, stream=stream))
    got = 0
    started = time.perf_counter()
    try:
        while got < count:
            try:
                msgs = await psub.fetch(min(FETCH_BATCH, count - got), timeout=5.0)
            except nats.errors.TimeoutError:
                break  # fewer messages than expected: measure what came
            for msg in msgs:
                await msg.ack()
            got += len(msgs)
        await nc.flush()
        return got / (time.perf_counter() - started)
    finally:
        with contextlib.suppress(Exception):
            await psub.unsubscribe()
