"""The runtime kit against a real nats-server: provisioning, traced publish, consume, DLQ."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from schemas import codec, limits, subjects
from schemas.messages import (
    AllocationRequest,
    DeadLetter,
    Heartbeat,
    InventoryQuery,
    InventoryReply,
    NodeRecord,
    PodRef,
    RequestRecord,
)
from services.runtime.kv.records import RecordStore, RecordTooLarge
from services.runtime.nats.bus import Bus, Delivery, Handler, Refuse, Retry, provision
from services.runtime.nats.deadletters import _Budget
from services.runtime.observe.tracing import setup_tracing, tracer
from tests.conftest import BusFactory
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


def _consume_requests(
    bus: Bus, durable: str, handler: Handler[AllocationRequest], **options: Any
) -> asyncio.Task[None]:
    """``bus.consume`` of the request subject under ``durable``, as a task."""
    return asyncio.create_task(
        bus.consume(
            stream=subjects.ALLOC_STREAM,
            durable=durable,
            filter_subject=subjects.ALLOC_REQUEST,
            decoder=codec.ALLOC_EVENT,
            handler=handler,
            **options,
        )
    )


async def test_provision_is_idempotent(bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    await provision(bus.js)
    await provision(bus.js)
    names = {s.config.name for s in await bus.js.streams_info()}
    assert set(subjects.STREAM_SUBJECTS) <= names


async def test_consume_decodes_acks_and_dead_letters_garbage(bus_factory: BusFactory) -> None:
    setup_tracing("test")
    bus = await bus_factory("allocator")
    got: list[tuple[AllocationRequest, Delivery]] = []
    stop = asyncio.Event()

    async def handler(msg: AllocationRequest, d: Delivery) -> None:
        got.append((msg, d))
        stop.set()

    with tracer("test").start_as_current_span("root") as span:
        trace_id = format(span.get_span_context().trace_id, "032x")
        await bus.js.publish(subjects.ALLOC_REQUEST, b"\xc1garbage")
        req = AllocationRequest(request_id="u1.1", pod=PodRef("ns", "p", "u1"), gpus=2, rdma=2)
        await bus.publish(subjects.ALLOC_REQUEST, req, msg_id="u1.1")
        await bus.publish(subjects.ALLOC_REQUEST, req, msg_id="u1.1")  # deduplicated by the server

    dlq = await bus.js.subscribe(subjects.dlq("allocator"), stream=subjects.DLQ_STREAM)
    task = _consume_requests(bus, "t", handler, stop=stop)
    await asyncio.wait_for(stop.wait(), 10)
    letter = codec.DEAD_LETTER.decode((await dlq.next_msg(timeout=5)).data)
    await asyncio.wait_for(task, 5)

    assert [m.request_id for m, _ in got] == ["u1.1"]
    assert got[0][1].headers["traceparent"].split("-")[1] == trace_id
    assert letter.data == b"\xc1garbage" and letter.subject == subjects.ALLOC_REQUEST
    assert "MessagePack" in letter.error or "invalid" in letter.error.lower()
    info = await bus.js.consumer_info(subjects.ALLOC_STREAM, "t")
    assert info.num_ack_pending == 0 and info.num_pending == 0


def test_undecodable_message_error_names_the_field() -> None:
    bad = codec.encode(
        {"kind": "alloc.request", "request_id": "x", "pod": {"namespace": "a", "name": "b"}, "gpus": -1}
    )
    with pytest.raises(msgspec.ValidationError, match=r"\$\.gpus"):
        codec.ALLOC_EVENT.decode(bad)


async def test_message_that_keeps_breaking_its_handler_is_parked_on_the_dlq(
    bus_factory: BusFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.runtime.nats import consume

    monkeypatch.setattr(consume, "MAX_HANDLER_ATTEMPTS", 3)
    bus = await bus_factory("allocator")
    attempts: list[int] = []
    stop = asyncio.Event()

    async def broken(msg: AllocationRequest, d: Delivery) -> None:
        attempts.append(d.num_delivered)
        raise RuntimeError("bug in the handler")

    dlq = await bus.js.subscribe(subjects.dlq("allocator"), stream=subjects.DLQ_STREAM)
    req = AllocationRequest(request_id="p.1", pod=PodRef("ns", "p", "p"), gpus=1)
    await bus.publish(subjects.ALLOC_REQUEST, req, msg_id="p.1")
    task = _consume_requests(bus, "poison", broken, stop=stop)
    letter = codec.DEAD_LETTER.decode((await dlq.next_msg(timeout=15)).data)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert attempts == [1, 2, 3]
    assert "failed 3 times" in letter.error and "bug in the handler" in letter.error
    assert codec.ALLOC_EVENT.decode(letter.data) == req
    await dlq.unsubscribe()


async def test_dead_letter_keeps_a_small_sample_with_size_and_digest(bus_factory: BusFactory) -> None:
    """Whatever arrives, its dead letter stays small (a whole 1 MB payload in a dead letter
    once exceeded the server's max payload and closed the service's connection for good)."""
    bus = await bus_factory("allocator")
    junk = b"\xc1" + bytes(range(256)) * 800  # ~200 KB that does not decode
    await bus.js.publish(subjects.ALLOC_REQUEST, junk)
    dlq = await bus.js.subscribe(subjects.dlq("allocator"), stream=subjects.DLQ_STREAM)
    stop = asyncio.Event()
    task = _consume_requests(bus, "junk", _never, stop=stop)
    raw = await dlq.next_msg(timeout=10)
    stop.set()
    await bus.js.publish(subjects.ALLOC_REQUEST, b"\xc1wake")  # let the consumer see stop
    await asyncio.wait_for(task, 15)
    letter = codec.DEAD_LETTER.decode(raw.data)
    assert len(raw.data) < limits.DEAD_LETTER_SAMPLE_BYTES + 2048
    assert letter.data == junk[: limits.DEAD_LETTER_SAMPLE_BYTES]
    assert letter.size == len(junk) and letter.digest == "sha256:" + hashlib.sha256(junk).hexdigest()
    assert bus.nc.is_connected


async def _never(msg: object, d: Delivery) -> None:
    raise AssertionError(f"handed over: {msg!r}")


async def _consume_until_parked(
    bus_factory: BusFactory, handler: Handler[AllocationRequest], durable: str
) -> DeadLetter:
    bus = await bus_factory("allocator")
    dlq = await bus.js.subscribe(subjects.dlq("allocator"), stream=subjects.DLQ_STREAM)
    req = AllocationRequest(request_id=f"{durable}.1", pod=PodRef("ns", "p", "p"), gpus=1)
    await bus.publish(subjects.ALLOC_REQUEST, req, msg_id=req.request_id)
    stop = asyncio.Event()
    task = _consume_requests(bus, durable, handler, stop=stop)
    letter = codec.DEAD_LETTER.decode((await dlq.next_msg(timeout=15)).data)
    stop.set()
    await asyncio.wait_for(task, 15)
    info = await bus.js.consumer_info(subjects.ALLOC_STREAM, durable)
    assert info.num_ack_pending == 0 and info.num_pending == 0  # acked: never delivered again
    await dlq.unsubscribe()
    return letter


async def test_a_wait_that_never_ends_is_parked_not_redelivered_forever(
    bus_factory: BusFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.runtime.nats import consume

    monkeypatch.setattr(consume, "MAX_RETRY_DELIVERIES", 3)
    waits: list[int] = []

    async def waiting(msg: AllocationRequest, d: Delivery) -> None:
        waits.append(d.num_delivered)
        raise Retry("the pod sandbox is not there yet", delay=0.05)

    letter = await _consume_until_parked(bus_factory, waiting, "waits")
    assert waits == [1, 2, 3]
    assert "still waiting after 3 deliveries" in letter.error and "sandbox" in letter.error


async def test_a_refused_message_is_parked_with_the_reason(bus_factory: BusFactory) -> None:
    async def refusing(msg: AllocationRequest, d: Delivery) -> None:
        raise Refuse(f"request id {msg.request_id} is already used by a different request")

    letter = await _consume_until_parked(bus_factory, refusing, "refuses")
    assert "already used by a different request" in letter.error


async def test_a_failed_request_handler_answers_with_the_reason(bus_factory: BusFactory) -> None:
    """A caller learns at once why its request failed instead of waiting for its timeout."""
    bus = await bus_factory("inventory")

    async def broken(q: InventoryQuery, d: Delivery) -> InventoryReply:
        raise RuntimeError("the records are not loaded")

    await bus.serve(
        subjects.QUERY_INVENTORY,
        decoder=codec.QUERY,
        handler=broken,
        error_reply=lambda reason: InventoryReply(error=reason),
    )
    reply = await bus.nc.request(subjects.QUERY_INVENTORY, codec.encode(InventoryQuery()), timeout=2)
    assert "the records are not loaded" in codec.REPLY.decode(reply.data).error
    wrong = await bus.nc.request(
        subjects.QUERY_INVENTORY, codec.encode(Heartbeat(node="n1", seq=1)), timeout=2
    )
    assert "refused" in codec.REPLY.decode(wrong.data).error


async def test_an_undecodable_record_is_dead_lettered(bus_factory: BusFactory) -> None:
    bus = await bus_factory("inventory")
    store: RecordStore[NodeRecord] = RecordStore(bus, subjects.KV_NODES, codec.NODE_RECORD)
    dlq = await bus.js.subscribe(subjects.dlq("inventory"), stream=subjects.DLQ_STREAM)
    assert not store.observe("n1", b"\xc1not a record", 7)
    letter = codec.DEAD_LETTER.decode((await dlq.next_msg(timeout=5)).data)
    assert letter.subject == subjects.kv_subject(subjects.KV_NODES, "n1")
    assert "record does not decode" in letter.error and letter.data == b"\xc1not a record"
    await store.aclose()


async def test_a_record_that_would_outgrow_its_bound_fails_only_its_own_mutation(
    bus_factory: BusFactory,
) -> None:
    bus = await bus_factory("allocator")
    store: RecordStore[RequestRecord] = RecordStore(
        bus, subjects.KV_REQUESTS, codec.REQUEST_RECORD, max_bytes=600
    )
    small = AllocationRequest(request_id="r.1", pod=PodRef("ns", "p"), gpus=1)
    big = msgspec.structs.replace(small, node_selector={f"k{i}": "v" * 60 for i in range(20)})

    def put(req: AllocationRequest) -> Callable[[RequestRecord | None], RequestRecord]:
        return lambda _: RequestRecord(request=req, state="pending")

    ok, too_big = store.update("r.1", put(small)), store.update("r.1", put(big))
    assert (await ok) is not None
    with pytest.raises(RecordTooLarge, match="over the limit of 600"):
        await too_big
    value, _ = await store.fetch("r.1")
    assert value is not None and value.request == small
    await store.aclose()


async def test_a_fetch_is_answered_by_the_leader_not_by_any_replica(bus_factory: BusFactory) -> None:
    """A re-read decides, e.g. that a ``Cleaned`` has nothing to free: it must be the latest
    record. Direct gets may be answered by a replica that is behind (``tandem chaos`` caught
    one after a server restart), so a fetch asks the stream leader (``STREAM.MSG.GET``) — and
    still sees the latest value, a delete and a key never written."""
    bus = await bus_factory("allocator")
    store: RecordStore[RequestRecord] = RecordStore(bus, subjects.KV_REQUESTS, codec.REQUEST_RECORD)
    api_calls: list[str] = []

    async def note(msg: Msg) -> None:
        api_calls.append(msg.subject)

    spy = await bus.nc.subscribe("$JS.API.>", cb=note)
    req = AllocationRequest(request_id="r.2", pod=PodRef("ns", "p"), gpus=1)
    first = await store.update(
        "r.2", lambda _: RequestRecord(request=req, state="pending"), assume_absent=True
    )
    later = await store.update("r.2", lambda cur: msgspec.structs.replace(cur, state="assigned", node="n1"))
    assert first is not None and later is not None
    value, revision = await store.fetch("r.2")
    assert value is not None and (value.state, value.node) == ("assigned", "n1") and revision > 0
    kv = await bus.kv(subjects.KV_REQUESTS)
    assert await kv.delete("r.2")
    gone, marker = await store.fetch("r.2")
    assert gone is None and marker > revision  # the delete marker's revision: a create CAS needs it
    assert await store.fetch("never.written") == (None, 0)
    await bus.nc.flush()
    await spy.unsubscribe()
    gets = [s for s in api_calls if ".GET." in s]
    assert gets and all(
        s == f"$JS.API.STREAM.MSG.GET.{subjects.kv_stream(subjects.KV_REQUESTS)}" for s in gets
    ), gets
    await store.aclose()


def test_the_dead_letter_budget_is_per_source() -> None:
    async def run() -> tuple[list[bool], list[bool]]:
        budget = _Budget(burst=3, per_s=0.0, sources=2)
        flood = [budget.take("node:a") for _ in range(10)]
        other = [budget.take("node:b") for _ in range(3)]
        return flood, other

    flood, other = asyncio.run(run())
    assert flood == [True] * 3 + [False] * 7
    assert other == [True] * 3  # a flood from a does not use up b's budget


async def test_a_replica_that_stops_handling_holds_no_more_than_one_pull_batch(
    bus_factory: BusFactory,
) -> None:
    """Allocator replicas share each durable consumer, and the server hands a message to a
    waiting pull. A replica that falls behind (blocked here) must not have taken more than one
    pull batch of messages into its own queue: the rest go to the replica that keeps up."""
    from services.allocator.service import PULL_BATCH

    slow, quick = await bus_factory("allocator"), await bus_factory("allocator")
    unblock = asyncio.Event()
    held: list[str] = []
    handled: list[str] = []

    async def blocked(msg: AllocationRequest, d: Delivery) -> None:
        held.append(msg.request_id)
        await unblock.wait()

    async def keeping_up(msg: AllocationRequest, d: Delivery) -> None:
        handled.append(msg.request_id)

    async def waiting_pulls() -> int:
        try:
            return (await slow.js.consumer_info(subjects.ALLOC_STREAM, "shared")).num_waiting or 0
        except NotFoundError:  # not created yet
            return 0

    # The slow replica's pull is the first one waiting at the server.
    tasks = [_consume_requests(slow, "shared", blocked, batch=PULL_BATCH)]
    await wait_until(lambda: _at_least(waiting_pulls, 1), what="the slow replica's pull")
    tasks.append(_consume_requests(quick, "shared", keeping_up, batch=PULL_BATCH))
    await wait_until(lambda: _at_least(waiting_pulls, 2), what="both replicas' pulls")
    total = 4 * PULL_BATCH
    try:
        for i in range(total):
            req = AllocationRequest(request_id=f"r{i}", pod=PodRef("ns", f"p{i}", f"u{i}"), gpus=1)
            await slow.publish(subjects.ALLOC_REQUEST, req, msg_id=req.request_id)
        await wait_until(lambda: len(handled) >= total - PULL_BATCH, what="the quick replica's share")
        assert held == ["r0"]  # the slow one is still in its first handler
        unblock.set()
        await wait_until(lambda: len(held) + len(handled) == total, what="every message handled once")
        assert sorted(held + handled) == sorted(f"r{i}" for i in range(total))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _at_least(count: Callable[[], Awaitable[int]], n: int) -> bool:
    return await count() >= n
