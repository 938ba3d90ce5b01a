"""The runtime kit against a real nats-server: provisioning, traced publish, consume, DLQ."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from schemas import codec, subjects
from schemas.messages import AllocationRequest, PodRef
from services.runtime.bus import Delivery, provision
from services.runtime.tracing import setup_tracing, tracer
from tests.conftest import BusFactory

pytestmark = pytest.mark.integration


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
    task = asyncio.create_task(
        bus.consume(
            stream=subjects.ALLOC_STREAM,
            durable="t",
            filter_subject=subjects.ALLOC_REQUEST,
            decoder=codec.ALLOC_EVENT,
            handler=handler,
            stop=stop,
        )
    )
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
    from services.runtime import bus as bus_module

    monkeypatch.setattr(bus_module, "MAX_HANDLER_ATTEMPTS", 3)
    bus = await bus_factory("allocator")
    attempts: list[int] = []
    stop = asyncio.Event()

    async def broken(msg: AllocationRequest, d: Delivery) -> None:
        attempts.append(d.num_delivered)
        raise RuntimeError("bug in the handler")

    dlq = await bus.js.subscribe(subjects.dlq("allocator"), stream=subjects.DLQ_STREAM)
    req = AllocationRequest(request_id="p.1", pod=PodRef("ns", "p", "p"), gpus=1)
    await bus.publish(subjects.ALLOC_REQUEST, req, msg_id="p.1")
    task = asyncio.create_task(
        bus.consume(
            stream=subjects.ALLOC_STREAM,
            durable="poison",
            filter_subject=subjects.ALLOC_REQUEST,
            decoder=codec.ALLOC_EVENT,
            handler=broken,
            stop=stop,
        )
    )
    letter = codec.DEAD_LETTER.decode((await dlq.next_msg(timeout=15)).data)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert attempts == [1, 2, 3]
    assert "failed 3 times" in letter.error and "bug in the handler" in letter.error
    assert codec.ALLOC_EVENT.decode(letter.data) == req
    await dlq.unsubscribe()
