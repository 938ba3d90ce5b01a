"""Two allocator replicas over a real nats-server: a request whose replica has no room in its
own shard is handed to the replica that owns the node it would take, which places it there
(services/allocator/placer.py, "hand over"); a replica handed a request its shard cannot take
answers ``no_room`` and records nothing; when the owner is gone the sender places it itself.

Five DGX H100s: ``h100-0`` to ``h100-3`` hash to shard 0 (``allocator-0``), ``h100-4`` to
shard 1 (``allocator-1``)."""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator

import pytest
from nats.aio.msg import Msg
from opentelemetry import trace as trace_api

from schemas import codec, subjects
from schemas.messages import AllocationRequest, Assignment, ForwardReply, PodRef
from services.allocator import metrics
from services.allocator.readmodel import HOSTNAME_LABEL
from services.allocator.service import Allocator
from services.client import TandemClient
from services.runtime.nats.bus import Retry
from tests.integration.dgx import one_dgx
from tests.waiting import wait_until
from tools.localstack import LocalStack

pytestmark = pytest.mark.integration

SHARD_0 = [f"h100-{i}" for i in range(4)]
SHARD_1 = "h100-4"


def forwards(outcome: str) -> float:
    return metrics.FORWARDS.labels(outcome)._value.get()


def request(name: str, *, gpus: int, node: str | None = None) -> AllocationRequest:
    return AllocationRequest(
        request_id=f"uid-{name}.1",
        pod=PodRef("ns", name, f"uid-{name}"),
        gpus=gpus,
        node_selector={HOSTNAME_LABEL: node} if node else {},
    )


@pytest.fixture
async def two_replicas(
    nats_url: str, clean_jetstream: None
) -> AsyncIterator[tuple[LocalStack, TandemClient, Allocator, Allocator]]:
    assert {zlib.crc32(n.encode()) % 2 for n in SHARD_0} == {0} and zlib.crc32(SHARD_1.encode()) % 2 == 1
    async with one_dgx(nats_url, allocators=2, nodes=5) as (stack, client):
        a, b = stack.allocators
        await wait_until(
            lambda: a.replicas.owner(SHARD_1) == b.instance and b.replicas.owner(SHARD_0[0]) == a.instance,
            what="the replicas split the nodes",
        )
        # Shard 0 full: a whole node pinned to each of its nodes (whichever replica gets a
        # request, the node's owner places it).
        for node in SHARD_0:
            req = request(f"fill-{node}", gpus=8, node=node)
            await client.submit(req)
            got = await client.wait_for(req.request_id)
            assert isinstance(got, Assignment) and got.node == node, got
        await wait_until(
            lambda: all(f"uid-fill-{n}.1" in a.placed for n in SHARD_0), what="a sees shard 0 full"
        )
        # A replica that handed a fill over holds it until the owner's answer arrives.
        await wait_until(lambda: not a.placer.in_hand and not b.placer.in_hand, what="nothing in hand")
        yield stack, client, a, b


async def test_a_request_beyond_its_shard_is_placed_by_the_owner_of_the_node(
    two_replicas: tuple[LocalStack, TandemClient, Allocator, Allocator],
) -> None:
    _, client, a, b = two_replicas
    taken, conflicts = forwards("taken"), metrics.COMMIT_CONFLICTS._value.get()
    req = request("beyond", gpus=2)
    assert await a.placer.place(req, origin="message") == "assigned"
    got = await client.wait_for(req.request_id)
    assert isinstance(got, Assignment)
    assert got.node == SHARD_1 and got.allocator == b.instance  # placed by the node's owner
    assert forwards("taken") == taken + 1
    assert metrics.COMMIT_CONFLICTS._value.get() == conflicts


async def test_a_replica_handed_a_request_its_shard_cannot_take_answers_no_room(
    two_replicas: tuple[LocalStack, TandemClient, Allocator, Allocator],
) -> None:
    _, _, a, b = two_replicas
    # a's shard is full and b's node has room: handed to a, the request is decided on a's
    # shard only, not on b's node, and a records nothing (the sender decides).
    req = request("nothing-here", gpus=2)
    assert await a.placer.place(req, origin="forwarded") == "no_room"
    assert req.request_id not in a.book.pending and req.request_id not in a.placed
    assert b.placer.busy(req.request_id) is False


async def test_when_the_owner_is_gone_the_replica_places_the_request_itself(
    two_replicas: tuple[LocalStack, TandemClient, Allocator, Allocator],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, client, a, _ = two_replicas
    gone = forwards("gone")
    assert await a.placer.hand_over(request("x", gpus=1), "allocator-gone", trace_api.INVALID_SPAN) is None
    assert forwards("gone") == gone + 1  # no responders: at once, not after the timeout

    monkeypatch.setattr(a.replicas, "owner", lambda node: "allocator-gone")
    req = request("orphan", gpus=2)
    assert await a.placer.place(req, origin="message") == "assigned"
    got = await client.wait_for(req.request_id)
    assert isinstance(got, Assignment) and got.node == SHARD_1 and got.allocator == a.instance
    assert forwards("gone") == gone + 2


async def test_when_the_owner_has_no_room_the_request_waits_instead_of_racing_the_owner(
    two_replicas: tuple[LocalStack, TandemClient, Allocator, Allocator],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The owner sees its own decisions in flight, which the sender's view of its nodes lacks:
    with two replicas, its "no room" and the sender's full shard mean no room anywhere."""
    _, _, a, _ = two_replicas
    asked: list[str] = []

    async def no_room(req: AllocationRequest, owner: str, span: object) -> str:
        asked.append(owner)
        return "no_room"

    monkeypatch.setattr(a.placer, "hand_over", no_room)
    req = request("crowded", gpus=2)
    assert await a.placer.place(req, origin="message") == "pending"
    assert asked == ["allocator-1"]  # asked once
    assert req.request_id in a.book.pending and req.request_id not in a.placed


async def test_a_pending_request_is_placed_by_the_pass_of_the_replica_owning_the_node(
    two_replicas: tuple[LocalStack, TandemClient, Allocator, Allocator],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, client, a, b = two_replicas
    fill = request("fill-b", gpus=8, node=SHARD_1)
    await client.submit(fill)
    assert isinstance(await client.wait_for(fill.request_id), Assignment)
    waiting = request("waiting", gpus=2)
    await client.submit(waiting)
    await wait_until(lambda: waiting.request_id in a.book.pending, what="pending: no room anywhere")

    async def no_pass() -> int:
        return 0

    monkeypatch.setattr(b.retries, "retry_pending", no_pass)  # b's passes held back for now
    await client.release(fill.request_id)
    await wait_until(lambda: fill.request_id not in a.placed, what="a sees b's node free")
    conflicts = metrics.COMMIT_CONFLICTS._value.get()
    assert await a.retries.retry_pending() == 0  # the room is on b's node: left to b
    assert waiting.request_id in a.book.pending and not a.placer.busy(waiting.request_id)
    monkeypatch.undo()  # b's next pass (every 0.3 s here) places it
    got = await client.wait_for(waiting.request_id, kinds=(Assignment,))
    assert isinstance(got, Assignment) and got.node == SHARD_1 and got.allocator == b.instance
    assert metrics.COMMIT_CONFLICTS._value.get() == conflicts


async def test_an_owner_that_took_the_request_but_did_not_answer_leaves_it_to_a_redelivery(
    two_replicas: tuple[LocalStack, TandemClient, Allocator, Allocator],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error on the owner's side (or no answer in time): the owner may have claimed or
    placed the request, so the sender must not place it too; its message comes back later."""
    stack, _, a, _ = two_replicas
    nc = stack.buses[0].nc

    async def answer(msg: Msg) -> None:  # an owner whose claim an election cut short
        await msg.respond(codec.encode(ForwardReply(error="nats: timeout")))

    sub = await nc.subscribe(subjects.allocator_forward("allocator-slow"), cb=answer)
    await nc.flush()
    monkeypatch.setattr(a.replicas, "owner", lambda node: "allocator-slow")
    req = request("unanswered", gpus=2)
    unanswered = forwards("unanswered")
    try:
        with pytest.raises(Retry, match="handed to allocator-slow: nats: timeout"):
            await a.placer.place(req, origin="message")
    finally:
        await sub.unsubscribe()
    assert forwards("unanswered") == unanswered + 1
    assert req.request_id not in a.placed and req.request_id not in a.book.pending
