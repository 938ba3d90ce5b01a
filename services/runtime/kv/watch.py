"""Watch a JetStream KV bucket and hand each change to a callback.

Services keep their read models (the allocator's cluster view, the inventory's node table)
current this way instead of polling. The initial state is delivered first; ``ready`` is set
once it has been, so a service can wait for a complete view before deciding anything.

:func:`read_bucket` reads every record once (a resync that needs no watch), complete even
when the server says early that nothing is pending; :func:`read_paced` reads the last value of
every key a batch at a time.

:func:`watch_raw` hands over the value's bytes, for a reader that decodes only what it has not
seen (:meth:`~services.runtime.kv.records.RecordStore.observe`); :func:`watch_bucket` decodes
each value first. Values that fail to decode are logged and skipped (the writer is the bug,
not the reader).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TypeVar

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from schemas import codec, subjects
from services.runtime.kv.read import last_raw_values
from services.runtime.nats.jsack import position
from services.runtime.observe.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")

# Headers of KV deliveries (nats-py's names for them are not public).
KV_OPERATION = "KV-Operation"
MARKER_REASON = "Nats-Marker-Reason"
# nats-py's value for its watchers: the server drops the consumer after 5 minutes without a
# subscriber (a watcher that died with its connection).
WATCH_INACTIVE_THRESHOLD_S = 5 * 60

# A paced read's consumer outlives its unsubscribe (nats-py leaves it to the server): gone this
# long after its last fetch rather than the watchers' five minutes, each read making a new one.
PACED_INACTIVE_S = 30.0

OnChange = Callable[[str, T | None, int], object]
RawChange = Callable[[str, bytes | None, int], object]


# A key is gone when its delivery says an operation (``KV-Operation``: a delete or purge), or
# — nats-server 2.11 on — is a marker the server placed when a value's TTL ran out or it was
# purged or removed; markers of other kinds are not changes (as nats-py's watcher has it).
_GONE_MARKERS = frozenset({"MaxAge", "Purge", "Remove"})
_NO_HEADERS: dict[str, str] = {}


def kv_change(msg: Msg, prefix: str) -> tuple[str, bytes | None] | None:
    """What one delivery of a KV stream says: ``(key, value)``, value None when the key is gone;
    None when it is no change (a marker of a kind not listed above). ``prefix``: the bucket's
    subject prefix (``subjects.kv_subject(bucket, "")``)."""
    headers = msg.headers or _NO_HEADERS
    operation = headers.get(KV_OPERATION)
    marker = headers.get(MARKER_REASON) if operation is None else None
    if marker is not None and marker not in _GONE_MARKERS:
        return None
    gone = operation is not None or marker is not None or not msg.data
    return msg.subject[len(prefix) :], None if gone else msg.data


async def watch_raw(
    js: JetStreamContext, bucket: str, on_change: RawChange, *, ready: asyncio.Event | None = None
) -> None:
    """Run until cancelled; ``on_change(key, bytes_or_None_when_deleted, revision)``.

    The same ordered consumer as nats-py's ``KeyValue.watchall`` (the last value of each key,
    then every change; nats-py recreates it after a gap), but each delivery goes straight to
    ``on_change`` from the subscription's callback. The library's watcher builds an entry
    object per change and hands it through a queue to an iterating task, which costs more CPU
    per change (docs/benchmarks.md, "Measurements behind the code"). An exception from
    ``on_change`` ends the watch with it (the service's supervisor starts it again: a fresh
    watch, so a resync)."""
    prefix = subjects.kv_subject(bucket, "")
    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def deliver(msg: Msg) -> None:
        if failed.done():
            return
        where = position(msg.reply)
        change = kv_change(msg, prefix)
        if change is not None:
            try:
                on_change(change[0], change[1], where.stream_seq)
            except Exception as exc:
                failed.set_exception(exc)
                return
        if ready is not None and where.pending == 0:
            ready.set()  # the initial values are in (and every later change with nothing behind)

    sub = await js.subscribe(
        subjects.kv_subject(bucket),
        stream=subjects.kv_stream(bucket),
        cb=deliver,
        ordered_consumer=True,
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        inactive_threshold=WATCH_INACTIVE_THRESHOLD_S,
    )
    try:
        info = await sub.consumer_info()
        if ready is not None and info.num_pending == 0 and sub.delivered == 0:
            ready.set()  # an empty bucket: no delivery will say so
        await failed
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def watch_bucket(
    js: JetStreamContext,
    bucket: str,
    decoder: msgspec.msgpack.Decoder[T],
    on_change: OnChange[T],
    *,
    ready: asyncio.Event | None = None,
) -> None:
    """Run until cancelled; ``on_change(key, value_or_None_when_deleted, revision)``."""

    def decoded(key: str, data: bytes | None, revision: int) -> None:
        value: T | None = None
        if data is not None:
            try:
                value = decoder.decode(data)
            except codec.DecodeErrors as exc:
                log.error("kv_decode_failed", bucket=bucket, key=key, error=str(exc))
                return
        on_change(key, value, revision)

    await watch_raw(js, bucket, decoded, ready=ready)


async def read_paced(
    js: JetStreamContext, bucket: str, *, batch: int, pause: float, timeout: float = 5.0
) -> dict[str, bytes]:
    """The last value of every key of ``bucket`` (deleted keys left out), ``batch`` deliveries
    at a time with ``pause`` seconds between: for a reader that must not take the server and
    the CPU in one burst (the load harness's checks while it measures latency).

    An ephemeral pull consumer delivering the last value of each key (in stream order), read
    until it has delivered the stream's last sequence as it was before it started, or a later
    one (every key's last value then is at or before it, or was rewritten since; the same end
    as :func:`services.runtime.kv.read.last_raw_values`), or has nothing more to deliver. The
    keys are read over some time, not at one moment: each value is whole, the set of them is
    not one instant's. Under load the server hands over less than a batch per fetch, and 5,000 keys
    took up to 4 s."""
    stream = subjects.kv_stream(bucket)
    prefix = subjects.kv_subject(bucket, "")
    last = (await js.stream_info(stream)).state.last_seq
    if last == 0:
        return {}  # never written to
    sub = await js.pull_subscribe(
        subjects.kv_subject(bucket),
        stream=stream,
        config=api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=api.AckPolicy.NONE,
            inactive_threshold=PACED_INACTIVE_S,
        ),
    )
    out: dict[str, bytes] = {}
    try:
        while True:
            try:
                msgs = await sub.fetch(batch, timeout=timeout)
            except nats.errors.TimeoutError:
                return out  # nothing more within the timeout: every key is in
            seen = 0
            for msg in msgs:
                change = kv_change(msg, prefix)
                if change is not None:
                    key, value = change
                    if value is None:
                        out.pop(key, None)
                    else:
                        out[key] = value
                seen = position(msg.reply).stream_seq
            if seen >= last:
                return out
            await asyncio.sleep(pause)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def read_bucket(js: JetStreamContext, bucket: str, decoder: msgspec.msgpack.Decoder[T]) -> dict[str, T]:
    """Every record of ``bucket`` now, decoded; one that does not decode is logged and left
    out. One consumer for the whole bucket (not a get per key), read to the end even when the
    server says early that nothing is pending (:mod:`services.runtime.kv.read`)."""
    out: dict[str, T] = {}
    for key, data in (await last_raw_values(js, await js.key_value(bucket), bucket)).items():
        try:
            out[key] = decoder.decode(data)
        except codec.DecodeErrors as exc:
            log.warning("bad_record", bucket=bucket, key=key, error=str(exc))
    return out
