"""``AckInbox`` against a real nats-server: the answers and errors of nats-py's JetStream
publish, which ``Bus.publish``'s retries and ``RecordStore``'s compare-and-set rely on."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import nats.errors
import pytest
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError

from schemas import subjects
from services.runtime.nats.bus import Bus
from services.runtime.nats.puback import AckInbox, MsgIds
from services.runtime.process.tasks import Supervisor
from tests.conftest import BusFactory
from tests.waiting import wait_until
from tools.loadtest.publisher import AsyncPublisher

pytestmark = pytest.mark.integration

STREAM = "PUBACK_TEST"


async def fresh_stream(bus: Bus, name: str, subject: str) -> None:
    """Not a Tandem stream, so ``clean_jetstream`` leaves it: start each test from nothing."""
    with contextlib.suppress(NotFoundError):
        await bus.js.delete_stream(name)
    await bus.js.add_stream(name=name, subjects=[subject])


async def test_acks_duplicates_and_compare_and_set_errors_match_jetstream(bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    await fresh_stream(bus, STREAM, "puback.test.>")
    inbox = AckInbox(bus.nc)

    first = await inbox.publish("puback.test.a", b"1", headers={"Nats-Msg-Id": "m1"}, timeout=2)
    assert isinstance(first, api.PubAck) and first.stream == STREAM and first.seq == 1
    assert not first.duplicate
    again = await inbox.publish("puback.test.a", b"1", headers={"Nats-Msg-Id": "m1"}, timeout=2)
    assert again.seq == 1 and again.duplicate  # answered from the duplicate window

    expected = {api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE: "1"}
    second = await inbox.publish("puback.test.a", b"2", headers=expected, timeout=2)
    assert second.seq == 2
    with pytest.raises(APIError) as wrong:
        await inbox.publish("puback.test.a", b"3", headers=expected, timeout=2)
    assert wrong.value.err_code == 10071  # wrong last sequence: what RecordStore retries on
    info = await bus.js.stream_info(STREAM)
    assert info.state.messages == 2


async def test_no_stream_and_no_answer_raise_what_bus_publish_retries(bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    inbox = AckInbox(bus.nc)
    with pytest.raises(NoStreamResponseError):
        await inbox.publish("puback.nobody.listens", b"x", headers={}, timeout=2)

    heard: list[Msg] = []

    async def silent(msg: Msg) -> None:  # a subscriber that never answers
        heard.append(msg)

    await bus.nc.subscribe("puback.silent", cb=silent)
    with pytest.raises(nats.errors.TimeoutError):
        await inbox.publish("puback.silent", b"x", headers={}, timeout=0.2)
    assert len(heard) == 1 and heard[0].reply  # it was published, with a reply subject
    assert not inbox._waiting  # nothing left behind by the answers or the timeout


async def test_bus_publish_goes_through_the_inbox_and_is_deduplicated(bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    ack = await bus.publish_raw(subjects.ALLOC_FAILED, b"\x80", headers={"Nats-Msg-Id": "dup-1"})
    again = await bus.publish_raw(subjects.ALLOC_FAILED, b"\x80", headers={"Nats-Msg-Id": "dup-1"})
    assert again.seq == ack.seq and again.duplicate


def test_msg_ids_are_unique_within_and_across_processes() -> None:
    a, b = MsgIds(), MsgIds()
    ids = {a.new("x:") for _ in range(1000)} | {b.new("x:") for _ in range(1000)}
    assert len(ids) == 2000
    assert all(i.startswith("x:") for i in ids)


async def test_a_confirmed_ack_removes_the_message_from_the_consumer(bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    await fresh_stream(bus, STREAM + "_Q", "puback.queue")
    sent = await bus.js.publish("puback.queue", b"work")
    sub = await bus.js.pull_subscribe("puback.queue", durable="puback-worker", stream=STREAM + "_Q")
    [msg] = await sub.fetch(1, timeout=2)
    before = await bus.js.consumer_info(STREAM + "_Q", "puback-worker")
    assert before.num_ack_pending == 1
    await AckInbox(bus.nc).ack(msg, timeout=2)  # returns once the server has taken the ack
    after = await bus.js.consumer_info(STREAM + "_Q", "puback-worker")
    assert after.num_ack_pending == 0 and after.ack_floor.stream_seq == sent.seq


async def test_a_cancelled_request_leaves_nothing_once_its_timeout_passed(bus_factory: BusFactory) -> None:
    bus = await bus_factory()
    inbox = AckInbox(bus.nc)

    async def silent(msg: Msg) -> None:  # a subscriber that never answers
        del msg

    await bus.nc.subscribe("puback.never", cb=silent)
    task = asyncio.get_running_loop().create_task(inbox.request("puback.never", b"x", timeout=0.3))
    await wait_until(lambda: bool(inbox._waiting), timeout=5, what="the request sent")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await wait_until(lambda: not inbox._waiting, timeout=5, what="the cancelled request's entry gone")


async def test_async_publisher_stores_everything_once_and_resends_what_got_no_answer(
    bus_factory: BusFactory,
) -> None:
    """Many publishes in flight through the inbox; one whose answer does not come is sent
    again with its msg id, and the stream keeps it once."""
    bus = await bus_factory()
    await fresh_stream(bus, STREAM, "puback.test.>")
    publisher = AsyncPublisher(bus.acks, window=64, ack_timeout=0.5)
    real_send = bus.acks.send
    dropped: list[str] = []

    async def losing_first_answer(subject: str, payload: bytes = b"", **kw: Any) -> asyncio.Future[Msg]:
        future = await real_send(subject, payload, **kw)
        if kw["headers"]["Nats-Msg-Id"] != "p-7" or dropped:
            return future
        # Stored, but its answer is lost: the sender sees what the inbox's timer gives it.
        dropped.append(subject)
        lost: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda _: lost.set_exception(nats.errors.TimeoutError()))
        return lost

    bus.acks.send = losing_first_answer  # type: ignore[method-assign]
    tasks = Supervisor("publisher-test")
    tasks.spawn("publish", publisher.run)
    try:
        for i in range(500):
            publisher.submit(f"puback.test.{i % 7}", str(i).encode(), msg_id=f"p-{i}")
        assert await publisher.flush(timeout=20)
    finally:
        await tasks.aclose()
    info = await bus.js.stream_info(STREAM)
    assert info.state.messages == 500
    assert dropped == ["puback.test.0"]
    assert publisher.stats.acked == 500 and publisher.stats.failed == 0
    assert publisher.stats.retried == 1  # the re-send was answered from the duplicate window
