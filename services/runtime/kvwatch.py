"""Watch a JetStream KV bucket and hand each change to a callback.

Services keep their read models (the allocator's cluster view, the inventory's node table)
current this way instead of polling. The initial state is delivered first; ``ready`` is set
once it has been, so a service can wait for a complete view before deciding anything.

:func:`read_bucket` reads every record once (a resync that needs no watch).

:func:`watch_raw` hands over the value's bytes, for a reader that decodes only what it has not
seen (:meth:`~services.runtime.records.RecordStore.observe`); :func:`watch_bucket` decodes
each value first. Values that fail to decode are logged and skipped (the writer is the bug,
not the reader).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import msgspec
from nats.js.errors import KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from schemas import codec
from services.runtime.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")

OnChange = Callable[[str, T | None, int], object]
RawChange = Callable[[str, bytes | None, int], object]


async def watch_raw(kv: KeyValue, on_change: RawChange, *, ready: asyncio.Event | None = None) -> None:
    """Run until cancelled; ``on_change(key, bytes_or_None_when_deleted, revision)``."""
    watcher = await kv.watchall()
    try:
        async for entry in watcher:
            if entry is None:  # end of the initial values
                if ready is not None:
                    ready.set()
                continue
            data = entry.value if entry.operation is None and entry.value else None
            on_change(entry.key, data, entry.revision or 0)
    finally:
        await watcher.stop()  # type: ignore[no-untyped-call]


async def watch_bucket(
    kv: KeyValue,
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
                log.error("kv_decode_failed", bucket=kv._name, key=key, error=str(exc))
                return
        on_change(key, value, revision)

    await watch_raw(kv, decoded, ready=ready)


async def read_bucket(kv: KeyValue, decoder: msgspec.msgpack.Decoder[T]) -> dict[str, T]:
    """Every record of the bucket now, decoded (a key deleted meanwhile or a value that does
    not decode is skipped, the latter logged)."""
    try:
        keys = await kv.keys()
    except NoKeysError:  # nats-py's answer for an empty bucket
        return {}
    out: dict[str, T] = {}
    for key in keys:
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            continue
        if entry.value is None:
            continue
        try:
            out[key] = decoder.decode(entry.value)
        except codec.DecodeErrors as exc:
            log.warning("bad_record", bucket=kv._name, key=key, error=str(exc))
    return out
