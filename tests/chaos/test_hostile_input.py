"""Hostile input with each component's real least-privilege credentials (issue 9's findings).

A real nats-server whose only users are the ones ``tandem nats-config`` generates; the
inventory, the allocator and two node agents run as their own users (tests/secured.py). The
attacker holds one node agent's credentials — or the admission user's, which may publish
requests and releases — and sends what those permissions allow: messages naming the other
node, clocks a year ahead, reports for allocations it does not hold, messages of the wrong kind
for their subject, floods of junk and oversized payloads. Each must be refused or
dead-lettered with the reason, and the system must go on serving: every test ends by placing
(and freeing) a valid request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import msgspec
import nats.js.errors
import pytest
import structlog.testing
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError
from prometheus_client import REGISTRY

from schemas import codec, subjects
from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    Assignment,
    Cleaned,
    Freed,
    HealthEvent,
    Heartbeat,
    NodeInventory,
    PodRef,
    Release,
)
from tests.secured import (
    NODES,
    Intruder,
    Secured,
    Stack,
    connect_as,
    connect_user,
    secured_server,
    start_stack,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

LOST_AFTER = 2.0
FINISHED_TTL = 2.0


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    with secured_server(tmp_path_factory.mktemp("nats-hostile")) as server:
        yield server


@pytest.fixture(scope="module")
async def stack(secured: Secured) -> AsyncIterator[Stack]:
    s = await start_stack(
        secured, lost_after=LOST_AFTER, allocator_options={"finished_request_ttl": FINISHED_TTL}
    )
    yield s
    await s.close()


@pytest.fixture
async def intruder(secured: Secured, stack: Stack) -> AsyncIterator[Intruder]:
    """Node A's agent credentials in an attacker's hands."""
    intruder = await connect_as(secured, NODES[0])
    yield intruder
    await intruder.nc.close()


@pytest.fixture
async def admission(secured: Secured, stack: Stack) -> AsyncIterator[NATS]:
    """The admission user's credentials (it may publish requests and releases)."""
    nc = await connect_user(secured, "admission")
    yield nc
    await nc.close()


def dead_letters(service: str, why: str) -> float:
    return REGISTRY.get_sample_value("tandem_dead_letters_total", {"service": service, "why": why}) or 0.0


async def refused(service: str, why: str, *, before: float, count: int = 1) -> None:
    """Wait until ``service`` dead-lettered ``count`` more messages for ``why``."""
    await wait_until(
        lambda: dead_letters(service, why) >= before + count,
        what=f"{count} dead letter(s) of {service} ({why})",
    )


_serial = iter(range(1, 1_000_000))


def request(*, gpus: int = 1, node: str | None = None, **kw: object) -> AllocationRequest:
    n = next(_serial)
    selector = {"kubernetes.io/hostname": node} if node else {}
    return AllocationRequest(
        request_id=f"uid-h{n}.1",
        pod=PodRef("ns", f"p{n}", f"uid-h{n}"),
        gpus=gpus,
        node_selector=selector,
        **kw,
    )


async def place(stack: Stack, req: AllocationRequest) -> Assignment:
    """Submit and wait for the assignment. A request may go pending first and be placed by a
    retry: with LOST_AFTER this short, a loaded machine can delay a heartbeat enough for the
    inventory to call a node lost for a moment, and the system serving means placing it then."""
    await stack.client.submit(req)
    assigned = await stack.client.wait_for(req.request_id, (Assignment,), timeout=30)
    assert isinstance(assigned, Assignment), assigned
    return assigned


async def place_and_free(stack: Stack, *, node: str | None = None) -> None:
    """The system still serves: a valid request is placed, applied, released and freed."""
    req = request(node=node)
    assigned = await place(stack, req)
    await wait_until(lambda: req.request_id in stack.appliers[assigned.node].applied, what="the apply")
    await stack.client.release(req.request_id)
    freed = await stack.client.wait_for(req.request_id, (Freed,))
    assert isinstance(freed, Freed) and freed.node == assigned.node


def generation_of(stack: Stack, node: str) -> int | None:
    """The generation of ``node``'s record as the inventory holds it."""
    known = stack.inventory.records.cached(node)
    return known[0].generation if known is not None and known[0] is not None else None


def held(stack: Stack, node: str) -> dict[str, str]:
    known = stack.allocator.node_allocs.cached(node)
    record = known[0] if known is not None else None
    return {rid: rec.state for rid, rec in record.allocations.items()} if record else {}


async def js_publish(nc: NATS, subject: str, message: object) -> None:
    await nc.jetstream().publish(subject, codec.encode(message))


# -- finding 2: the subject, not the body, says which node is speaking ----------------------------


async def test_a_node_cannot_speak_for_another_node(stack: Stack, intruder: Intruder) -> None:
    a, b = NODES
    victim_run = await place(stack, request(gpus=2, node=b))
    rid = victim_run.request_id
    await wait_until(lambda: rid in stack.appliers[b].applied, what="the victim's apply")
    b_record = stack.inventory.records.cached(b)
    assert b_record is not None and b_record[0] is not None
    b_before = b_record[0]

    # Cleaned for B's running request, sent on A's own subject (all it may publish on).
    before = dead_letters("allocator", "mismatch")
    await js_publish(intruder.nc, subjects.node_cleaned(a), Cleaned(request_id=rid, node=b, devices=["gpu0"]))
    await refused("allocator", "mismatch", before=before)
    assert rid in held(stack, b)
    assert (await stack.client.request_record(rid)).state == "assigned"  # type: ignore[union-attr]

    # B's inventory replaced, dated a year ahead; a HealthEvent failing B's GPU.
    before = dead_letters("inventory", "mismatch")
    year_ahead = time.time() + 365 * 24 * 3600
    forged = NodeInventory(node=b, topology=b_before.topology, generation=10**6, ts=year_ahead)
    await js_publish(intruder.nc, subjects.node_inventory(a), forged)
    await js_publish(intruder.nc, subjects.node_health(a), HealthEvent(node=b, device="gpu0", healthy=False))
    await refused("inventory", "mismatch", before=before, count=2)
    b_after = stack.inventory.records.cached(b)
    assert b_after is not None and b_after[0] is not None
    assert b_after[0].generation == b_before.generation and "gpu0" not in b_after[0].unavailable()

    await stack.client.release(rid)
    assert isinstance(await stack.client.wait_for(rid, (Freed,)), Freed)
    await place_and_free(stack, node=b)


async def test_a_snapshot_dated_ahead_does_not_hide_the_ones_after_it(
    stack: Stack, intruder: Intruder
) -> None:
    """Its own node, its own subject, a clock a year ahead: the genuine agent's next snapshot
    still replaces it (ordered by the server's sequence, not the sender's clock)."""
    a = NODES[0]
    agent = stack.agents[a]
    assert agent.topology is not None
    ahead = NodeInventory(node=a, topology=agent.topology, generation=10**6, ts=time.time() + 365 * 24 * 3600)
    await js_publish(intruder.nc, subjects.node_inventory(a), ahead)
    await wait_until(lambda: generation_of(stack, a) == 10**6, what="the snapshot dated ahead")
    await agent.publish_inventory()  # the genuine agent, with its honest clock
    await wait_until(lambda: generation_of(stack, a) == agent.generation, what="the honest snapshot")
    await place_and_free(stack, node=a)


async def test_heartbeats_naming_another_node_do_not_keep_it_alive(stack: Stack, intruder: Intruder) -> None:
    a, b = NODES
    forged = codec.encode(Heartbeat(node=b, seq=1))

    async def beat_in_bs_name() -> None:
        while True:  # at an agent's cadence
            await intruder.nc.publish(subjects.node_heartbeat(a), forged)
            await asyncio.sleep(0.1)

    stack.agents[b].heartbeats_paused = True  # B goes silent ...
    forger = asyncio.create_task(beat_in_bs_name())  # ... while A beats in B's name
    try:
        await wait_until(
            lambda: stack.inventory.status.get(b) == "lost", timeout=LOST_AFTER * 5, what="B lost"
        )
        assert stack.inventory.status.get(a) == "ready"
    finally:
        forger.cancel()
        stack.agents[b].heartbeats_paused = False
    await wait_until(lambda: stack.allocator.nodes[b].status == "ready", what="B ready again")
    await place_and_free(stack, node=b)


# -- finding 3: no false "freed" -------------------------------------------------------------------


async def test_reports_for_allocations_a_node_does_not_hold_change_nothing(
    stack: Stack, intruder: Intruder, admission: NATS
) -> None:
    a, b = NODES
    # A request that cannot fit anywhere (8 GPUs on 4-GPU nodes) stays pending.
    pending = request(gpus=8)
    await stack.client.submit(pending)
    assert isinstance(await stack.client.wait_for(pending.request_id), AllocationFailed)
    running = await place(stack, request(gpus=1, node=a))

    with structlog.testing.capture_logs() as logs:
        for rid, ok in ((pending.request_id, True), (running.request_id, False), (running.request_id, True)):
            await js_publish(intruder.nc, subjects.node_cleaned(a), Cleaned(request_id=rid, node=a, ok=ok))
        await wait_until(
            lambda: sum(1 for e in logs if e.get("event") == "cleaned_ignored") >= 3, what="3 reports ignored"
        )
    record = await stack.client.request_record(pending.request_id)
    assert record is not None and record.state == "pending"
    running_record = await stack.client.request_record(running.request_id)
    assert running_record is not None and running_record.state == "assigned"
    assert running.request_id in held(stack, a) and held(stack, a)[running.request_id] != "releasing"

    # A release sent to the wrong node's subject frees the request where it really is.
    wrong = Release(request_id=running.request_id, pod=running.pod, node=b)
    await js_publish(admission, subjects.alloc_release(b), wrong)
    freed = await stack.client.wait_for(running.request_id, (Freed,))
    assert isinstance(freed, Freed) and freed.node == a
    assert running.request_id not in held(stack, a)
    await stack.client.release(pending.request_id)
    await place_and_free(stack)


# -- finding 4: the kind must be the subject's -------------------------------------------------------


async def test_a_message_of_the_wrong_kind_for_its_subject_is_refused(stack: Stack, admission: NATS) -> None:
    a = NODES[0]
    running = await place(stack, request(gpus=1, node=a))
    before = dead_letters("allocator", "mismatch")
    forged = Assignment(
        request_id="uid-forged.1", pod=PodRef("ns", "forged"), node=a, gpus=[], allocator="attacker"
    )
    await js_publish(admission, subjects.alloc_release(a), forged)  # an assignment on a release subject
    await js_publish(
        admission, subjects.ALLOC_REQUEST, Release(request_id=running.request_id, pod=running.pod)
    )
    await refused("allocator", "mismatch", before=before, count=2)
    assert "uid-forged.1" not in held(stack, a)
    assert held(stack, a).get(running.request_id) in ("assigned", "applied")
    await stack.client.release(running.request_id)
    assert isinstance(await stack.client.wait_for(running.request_id, (Freed,)), Freed)
    await place_and_free(stack)


# -- finding 5: floods --------------------------------------------------------------------------------


async def test_a_junk_flood_from_one_node_does_not_flap_the_others(stack: Stack, intruder: Intruder) -> None:
    a, b = NODES
    letters_before = dead_letters("inventory", "undecodable")
    dropped_before = dropped("inventory")
    watch = asyncio.Event()
    flapped: list[str] = []

    async def watch_b() -> None:
        while not watch.is_set():
            if stack.inventory.status.get(b) != "ready":
                flapped.append(str(stack.inventory.status.get(b)))
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch_b())
    for i in range(20_000):  # junk on A's heartbeat subject (core NATS): taken from the subject
        await intruder.nc.publish(subjects.node_heartbeat(a), b"\xc1junk%d" % i)
    await intruder.nc.flush()
    js = intruder.nc.jetstream()
    for i in range(500):  # junk on A's inventory subject (JetStream): refused, mostly uncounted
        await js.publish(subjects.node_inventory(a), b"\xc1junk%d" % i)
    await wait_until(
        lambda: dead_letters("inventory", "undecodable") >= letters_before + 500,
        timeout=30,
        what="the 500 junk inventories refused",
    )
    # B's first heartbeat sent after the flood has been taken: the flood's backlog is behind it,
    # so had it held B's heartbeats back past LOST_AFTER, B would have been marked lost by now.
    flood_end = time.time()
    await wait_until(
        lambda: stack.inventory.last_seen.get(b, 0.0) > flood_end, what="B's heartbeat after the flood"
    )
    watch.set()
    await watcher
    assert flapped == []
    assert dead_letters("inventory", "undecodable") == letters_before + 500  # heartbeats: none
    assert dropped("inventory") - dropped_before >= 500 - 100  # a burst is stored, the rest counted
    info = await stack.inventory.bus.js.stream_info(subjects.DLQ_STREAM)
    assert info.state.messages < 100
    await place_and_free(stack, node=b)


def dropped(service: str) -> float:
    return REGISTRY.get_sample_value("tandem_dead_letters_dropped_total", {"service": service}) or 0.0


# -- findings 1 and 6: sizes, duplicates, records that outgrow a message ---------------------------------


async def test_oversized_and_unbounded_input_is_refused_small(
    secured: Secured, stack: Stack, intruder: Intruder, admission: NATS
) -> None:
    a = NODES[0]
    # ~900 KB on the node's own inventory subject: the stream refuses it outright.
    with pytest.raises(nats.js.errors.APIError, match=r"(?i)size"):
        await intruder.nc.jetstream().publish(subjects.node_inventory(a), b"x" * 900_000)
    # A query of 300 KB (core NATS): answered at once with the reason, not left to time out.
    cli = await connect_user(secured, "cli")
    reply = await cli.request(subjects.QUERY_INVENTORY, b"\x00" * 300_000, timeout=5)
    await cli.close()
    answer = codec.REPLY.decode(reply.data)
    assert "over the limit" in answer.error
    assert len(await stack.client.nodes()) == len(NODES)

    # A pod name of 10 KB: refused by its bound (Kubernetes allows 253), nothing recorded.
    before = dead_letters("allocator", "undecodable")
    long_name = request()
    raw = msgspec.msgpack.encode(
        {**msgspec.to_builtins(long_name), "pod": {"namespace": "ns", "name": "n" * 10_000}}
    )
    await admission.jetstream().publish(subjects.ALLOC_REQUEST, raw)
    await refused("allocator", "undecodable", before=before)
    assert await stack.client.request_record(long_name.request_id) is None

    # The same request id again with different content: refused with the reason.
    first = request(gpus=1, node=a)
    assigned = await place(stack, first)
    before = dead_letters("allocator", "refused")
    with structlog.testing.capture_logs() as logs:
        changed = msgspec.structs.replace(first, gpus=2)
        await admission.jetstream().publish(subjects.ALLOC_REQUEST, codec.encode(changed))
        await refused("allocator", "refused", before=before)
    assert any("already used by a different request" in str(e.get("error")) for e in logs)
    assert held(stack, a)[first.request_id] == "assigned"
    assert len(held_devices(stack, a, first.request_id)) == len(assigned.device_ids())

    # A node record that would outgrow its bound: a request only that node can take waits,
    # saying why (not rejected: releases make room; not left deciding), and is placed when an
    # allocation leaves the record (docs/reliability.md, "Faults found by fault-injection probes").
    store = stack.allocator.node_allocs
    known = store.cached(a)
    assert known is not None and known[0] is not None
    saved = store.max_bytes
    store.max_bytes = len(codec.encode(known[0])) + 100
    try:
        big = request(gpus=1, node=a)
        await stack.client.submit(big)
        failed = await stack.client.wait_for(big.request_id)
    finally:
        store.max_bytes = saved
    assert isinstance(failed, AllocationFailed) and failed.retrying, failed
    assert f"{a} (its allocation record is full" in failed.reason, failed.reason
    record = await stack.client.request_record(big.request_id)
    assert record is not None and record.state == "pending"

    await stack.client.release(first.request_id)
    assert isinstance(await stack.client.wait_for(first.request_id, (Freed,)), Freed)
    assert isinstance(await stack.client.wait_for(big.request_id, (Assignment,), timeout=15), Assignment)
    await stack.client.release(big.request_id)
    assert isinstance(await stack.client.wait_for(big.request_id, (Freed,)), Freed)
    await place_and_free(stack, node=a)


def held_devices(stack: Stack, node: str, request_id: str) -> list[str]:
    known = stack.allocator.node_allocs.cached(node)
    assert known is not None and known[0] is not None
    return known[0].allocations[request_id].assignment.device_ids()


async def test_finished_request_records_expire(stack: Stack) -> None:
    req = request()
    await place(stack, req)
    await stack.client.release(req.request_id)
    assert isinstance(await stack.client.wait_for(req.request_id, (Freed,)), Freed)
    record = await stack.client.request_record(req.request_id)
    assert record is not None and record.state == "freed"
    kv = await stack.client.bus.kv(subjects.KV_REQUESTS)
    entry = await kv.get(subjects.kv_key(req.request_id))
    assert entry.revision is not None

    async def expired() -> bool:
        return await stack.client.request_record(req.request_id) is None

    await wait_until(expired, timeout=FINISHED_TTL + 10, what="the finished record to expire")
    with pytest.raises(KeyNotFoundError):  # gone, not back at an older revision
        await kv.get(subjects.kv_key(req.request_id))
