"""The KV watch the services keep their read models with, against a real nats-server: the last
value of every key first, then every change; deletes, purges and the server's TTL markers as
``None``; ``ready`` once the initial values are in; a failing callback ends the watch. And the
paced read of every key's last value, and the one-pass read of every record resyncs use."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from nats.js.errors import NotFoundError

from schemas import codec
from schemas.messages import AllocatorHeartbeat
from services.runtime.kv.watch import RawChange, read_bucket, read_paced, watch_raw
from services.runtime.nats.bus import Bus
from tests.conftest import BusFactory
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

BUCKET = "test-kvwatch"


async def _bucket(bus: Bus) -> None:
    with contextlib.suppress(NotFoundError):
        await bus.js.delete_key_value(BUCKET)
    await bus.js.create_key_value(bucket=BUCKET, history=5)


@contextlib.asynccontextmanager
async def _watching(bus: Bus, on_change: RawChange) -> AsyncIterator[None]:
    """The watch running, its initial values in."""
    ready = asyncio.Event()
    task = asyncio.create_task(watch_raw(bus.js, BUCKET, on_change, ready=ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_last_value_of_each_key_then_every_change(bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    await _bucket(bus)
    kv = await bus.js.key_value(BUCKET)
    await kv.put("a", b"a1")
    await kv.put("a", b"a2")
    await kv.put("b", b"b1")
    await kv.put("gone", b"x")
    await kv.delete("gone")
    last_rev = await kv.put("c", b"c1")

    seen: list[tuple[str, bytes | None, int]] = []
    at_ready: list[tuple[str, bytes | None, int]] = []
    async with _watching(bus, lambda k, d, r: seen.append((k, d, r))):
        at_ready.extend(seen)
        # The initial values: the last of each key (a deleted key says so), nothing older.
        assert {k: d for k, d, _ in at_ready} == {"a": b"a2", "b": b"b1", "gone": None, "c": b"c1"}
        assert len(at_ready) == 4
        assert max(r for _, _, r in at_ready) == last_rev

        rev = await kv.put("b", b"b2")
        await kv.delete("a")
        await kv.purge("c")
        await wait_until(lambda: len(seen) == 7)
        assert seen[4:] == [("b", b"b2", rev), ("a", None, rev + 1), ("c", None, rev + 2)]


async def test_an_empty_bucket_is_ready_at_once(bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    await _bucket(bus)
    seen: list[str] = []
    async with _watching(bus, lambda k, d, r: seen.append(k)):
        assert seen == []
        kv = await bus.js.key_value(BUCKET)
        await kv.put("first", b"1")
        await wait_until(lambda: seen == ["first"])


async def test_server_markers_say_a_key_is_gone_unknown_ones_are_no_change(bus_factory: BusFactory) -> None:
    # nats-server 2.11 on places a marker when a value's TTL runs out; the watch sees it as a
    # stored message with a Nats-Marker-Reason header, which is what this publishes.
    bus = await bus_factory()
    await _bucket(bus)
    kv = await bus.js.key_value(BUCKET)
    seen: list[tuple[str, bytes | None]] = []
    async with _watching(bus, lambda k, d, r: seen.append((k, d))):
        await kv.put("expiring", b"v")
        await bus.js.publish(f"$KV.{BUCKET}.expiring", b"", headers={"Nats-Marker-Reason": "MaxAge"})
        await bus.js.publish(f"$KV.{BUCKET}.other", b"", headers={"Nats-Marker-Reason": "SomethingNew"})
        await kv.put("after", b"w")
        await wait_until(lambda: len(seen) == 3)
        assert seen == [("expiring", b"v"), ("expiring", None), ("after", b"w")]


async def test_a_failing_callback_ends_the_watch_with_its_error(bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    await _bucket(bus)
    kv = await bus.js.key_value(BUCKET)

    def on_change(key: str, data: bytes | None, revision: int) -> None:
        if key == "poison":
            raise ValueError(f"cannot take {key}")

    ready = asyncio.Event()
    task = asyncio.create_task(watch_raw(bus.js, BUCKET, on_change, ready=ready))
    await asyncio.wait_for(ready.wait(), 10)
    await kv.put("fine", b"1")
    await kv.put("poison", b"2")
    with pytest.raises(ValueError, match="cannot take poison"):
        await asyncio.wait_for(task, 10)


async def test_a_paced_read_gives_the_last_value_of_each_key_a_batch_at_a_time(
    bus_factory: BusFactory,
) -> None:
    bus = await bus_factory()
    await _bucket(bus)
    assert await read_paced(bus.js, BUCKET, batch=3, pause=0.0, timeout=0.5) == {}  # nothing yet
    kv = await bus.js.key_value(BUCKET)
    for i in range(10):
        await kv.put(f"k{i}", b"old")
    for i in range(0, 10, 2):
        await kv.put(f"k{i}", f"new{i}".encode())
    await kv.delete("k1")
    await kv.purge("k3")

    # 8 keys left, read 3 at a time: the last value of each, deleted and purged keys left out.
    got = await read_paced(bus.js, BUCKET, batch=3, pause=0.01, timeout=0.5)
    assert got == {
        f"k{i}": (f"new{i}".encode() if i % 2 == 0 else b"old") for i in range(10) if i not in (1, 3)
    }


async def test_read_bucket_decodes_every_record_and_leaves_out_the_gone_and_the_undecodable(
    bus_factory: BusFactory,
) -> None:
    """The resync read (the admission bridge's request and job records, the node labels): the
    last value of every key, decoded; deleted keys and a value that does not decode are left
    out. The server's early "nothing pending" is covered at nats-py's boundary in
    tests/unit/test_client_snapshot.py."""
    bus = await bus_factory()
    await _bucket(bus)
    assert await read_bucket(bus.js, BUCKET, codec.ALLOCATOR_HEARTBEAT) == {}  # never written to
    kv = await bus.js.key_value(BUCKET)
    for name in ("a", "b", "c"):
        await kv.put(name, codec.encode(AllocatorHeartbeat(instance=f"{name}-old")))
    await kv.put("a", codec.encode(AllocatorHeartbeat(instance="a-new")))
    await kv.delete("b")
    await kv.put("bad", b"\xc1 not msgpack")

    got = await read_bucket(bus.js, BUCKET, codec.ALLOCATOR_HEARTBEAT)
    assert {key: beat.instance for key, beat in got.items()} == {"a": "a-new", "c": "c-old"}
