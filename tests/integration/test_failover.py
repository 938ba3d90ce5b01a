"""Tandem keeps allocating when the NATS server leading its allocation stream dies.

A three-server JetStream cluster (:class:`EmbeddedNatsCluster`), every stream and bucket
replicated three times, the whole system in-process (:class:`LocalStack`) with every
component on its own connection given all three URLs. While requests and releases stream in,
the server that leads ``TANDEM_ALLOC`` is SIGKILLed. Afterwards every request must have
exactly one placement (or be pending with an ``AllocationFailed``), no device may ever be
held twice, every release must end in ``Freed``, and every durable consumer must drain.

The recovery time (kill → first request published and placed after it) is printed, not
asserted beyond a generous bound: it is the cluster's election time, not Tandem's.

The last test kills the leader while ``tandem loadtest`` drives its own simulated fleet
against the same cluster, and reads the harness's verdict (from KV) on what was lost or held
twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import nats.errors
import pytest
from nats.aio.msg import Msg
from nats.js.errors import NoStreamResponseError, NotFoundError

from schemas import codec, subjects
from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    AllocRecord,
    Assignment,
    Cleaned,
    Freed,
    NodeAllocations,
    PodRef,
)
from services.client import TandemClient
from services.runtime.nats.bus import Bus
from services.runtime.process.embedded import EmbeddedNatsCluster
from tests.conftest import BusFactory, make_settings
from tests.integration.seams import before_commit
from tools.localstack import FleetEntry, LocalStack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

FLEET = [FleetEntry("dgx-h100", 1, "h100"), FleetEntry("pcie-4gpu-2nic", 2, "pcie")]  # 16 GPUs
REQUESTS = 40
KILL_AT = 14  # requests submitted before the kill
RELEASE_LAG = 8  # request i-8 is released right after request i is submitted
RECOVERY_BOUND_S = 30.0


@pytest.fixture
def cluster() -> Iterator[EmbeddedNatsCluster]:
    with EmbeddedNatsCluster() as c:
        yield c


@pytest.fixture
async def stack(cluster: EmbeddedNatsCluster) -> AsyncIterator[tuple[LocalStack, TandemClient, Bus]]:
    settings = make_settings(
        cluster.url, "test", heartbeat_interval=0.2, node_lost_after=3.0, stream_replicas=3
    )
    stack = LocalStack(settings, fleet=FLEET, retry_interval=0.3)
    observer = await Bus.open(msgspec.structs.replace(settings, service="observer"), provision_streams=False)
    try:
        await stack.start()
        await stack.wait_ready()
        client = await TandemClient(observer).start()
        yield stack, client, observer
        await client.close()
    finally:
        await stack.stop()
        await observer.close()


def request(i: int) -> AllocationRequest:
    gpus = 2 if i % 3 == 0 else 1
    return AllocationRequest(
        request_id=f"uid-fo{i}.1", pod=PodRef("ns", f"fo{i}", f"uid-fo{i}"), gpus=gpus, rdma=i % 2
    )


def overlaps(record: NodeAllocations) -> list[str]:
    """Devices that two allocations of one node record both hold."""
    seen: Counter[str] = Counter(d for r in record.allocations.values() for d in r.assignment.device_ids())
    return sorted(d for d, n in seen.items() if n > 1)


async def stream_messages(bus: Bus, stream: str) -> list[tuple[str, bytes]]:
    """Every message the stream still holds, in order (direct gets; streams here are small)."""
    info = await bus.js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        with contextlib.suppress(NotFoundError):
            raw = await bus.js.get_msg(stream, seq)
            out.append((raw.subject or "", raw.data or b""))
    return out


async def consumer_states(bus: Bus) -> str:
    """Where every durable consumer stands (for failure messages)."""
    out = []
    for stream in (subjects.ALLOC_STREAM, subjects.NODE_STREAM):
        for info in await bus.js.consumers_info(stream):
            out.append(
                f"{info.name}: pending={info.num_pending} ack_pending={info.num_ack_pending} "
                f"redelivered={info.num_redelivered} delivered={info.delivered} ack_floor={info.ack_floor} "
                f"leader={info.cluster.leader if info.cluster else None}"
            )
    return "\n".join(out)


async def eventually(predicate: object, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            if await predicate():  # type: ignore[operator]
                return
        except Exception as exc:  # the cluster may still be settling: keep polling
            last = exc
        await asyncio.sleep(0.1)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last error: {last!r})")


async def test_stream_leader_killed_mid_flow(
    cluster: EmbeddedNatsCluster, stack: tuple[LocalStack, TandemClient, Bus]
) -> None:
    _, client, observer = stack
    # Every write to the allocation records, as it goes by (core subscription on the KV subject).
    record_writes: list[NodeAllocations] = []

    async def on_record(msg: Msg) -> None:
        if msg.data:
            record_writes.append(codec.NODE_ALLOCS.decode(msg.data))

    watch = await observer.nc.subscribe(f"$KV.{subjects.KV_ALLOCS}.>", cb=on_record)

    reqs = [request(i) for i in range(REQUESTS)]
    released: list[str] = []
    t_kill = wall_kill = 0.0
    killed = -1
    publish_gap = 0.0  # the longest submit/release call (the publish that rode out the election)
    t0 = time.monotonic()
    for i, req in enumerate(reqs):
        if i == KILL_AT:
            leader = (await observer.js.stream_info(subjects.ALLOC_STREAM)).cluster
            assert leader is not None and leader.leader, "TANDEM_ALLOC has no cluster leader"
            killed = cluster.index_of(leader.leader)
            cluster.kill(killed)
            t_kill, wall_kill = time.monotonic(), time.time()
            print(f"\nkilled {leader.leader} (leader of {subjects.ALLOC_STREAM}) after {i} requests")
        ts = time.monotonic()
        await client.submit(req)
        if i >= RELEASE_LAG:
            old = reqs[i - RELEASE_LAG].request_id
            await client.release(old)
            released.append(old)
        publish_gap = max(publish_gap, time.monotonic() - ts)
        await asyncio.sleep(0.1)

    # Recovery: when the allocator acted on the first request submitted after the kill
    # (placed, pending, or, when its release overtook it in the backlog, cancelled).
    first_after = reqs[KILL_AT].request_id
    try:
        outcome = await client.wait_for(
            first_after, (Assignment, AllocationFailed, Freed), timeout=RECOVERY_BOUND_S
        )
    except TimeoutError:
        pytest.fail(f"{first_after} got no outcome; consumers: {await consumer_states(observer)}")
    decided = outcome.decided_at if isinstance(outcome, Assignment) else outcome.ts
    print(
        f"submitted {REQUESTS} requests in {time.monotonic() - t0:.1f}s, longest submit+release "
        f"{publish_gap:.2f}s; first request after the kill: {type(outcome).__name__} decided "
        f"{decided - wall_kill:.2f}s after the kill"
    )

    # Every released request ends in Freed; every other one is placed or pending.
    kept = [r.request_id for r in reqs if r.request_id not in released]
    for rid, kinds in [
        *((r, (Freed,)) for r in released),
        *((r, (Assignment, AllocationFailed)) for r in kept),
    ]:
        try:
            await client.wait_for(rid, kinds, timeout=RECOVERY_BOUND_S)
        except TimeoutError:
            record = await client.request_record(rid)
            pytest.fail(f"{rid}: no {kinds} (record {record}); {await consumer_states(observer)}")
    recovered_at = time.monotonic() - t_kill
    print(f"every request settled {recovered_at:.2f}s after the kill")
    assert recovered_at < RECOVERY_BOUND_S + 15

    for req in reqs:
        distinct = {
            (e.node, tuple(e.device_ids()))
            for e, _ in client.outcomes.get(req.request_id, [])
            if isinstance(e, Assignment)
        }
        assert len(distinct) <= 1, f"{req.request_id} placed twice: {distinct}"

    # Where each request stands (KV tandem-requests) agrees with what was published.
    async def request_states_settled() -> bool:
        for req in reqs:
            rec = await client.request_record(req.request_id)
            if req.request_id in released:
                want = {"freed", "cancelled"}
            elif client.assignment(req.request_id) is not None:
                want = {"assigned"}
            else:
                want = {"pending"}
            if rec is None or rec.state not in want:
                states[req.request_id] = rec.state if rec else None
                return False
        return True

    states: dict[str, str | None] = {}
    await eventually(request_states_settled, timeout=RECOVERY_BOUND_S, what=f"request records ({states})")

    # The allocation records: no device twice, no request twice, exactly the kept placements.
    async def records_settled() -> bool:
        placed = {rid for rid in kept if client.assignment(rid) is not None}
        held = Counter(rid for rec in await client.allocations() for rid in rec.allocations)
        return set(held) == placed

    await eventually(records_settled, timeout=RECOVERY_BOUND_S, what="allocation records = kept placements")
    final = await client.allocations()
    for rec in final:
        assert overlaps(rec) == [], f"{rec.node}: devices held twice {overlaps(rec)}"
        for rid, alloc in rec.allocations.items():
            a = client.assignment(rid)
            assert a is not None and a.node == rec.node and a.device_ids() == alloc.assignment.device_ids()
    ids = Counter(rid for rec in final for rid in rec.allocations)
    assert all(n == 1 for n in ids.values()), ids

    # Every stored revision of the records, and every write seen on the wire, is disjoint too.
    stored = [
        codec.NODE_ALLOCS.decode(data)
        for _, data in await stream_messages(observer, f"KV_{subjects.KV_ALLOCS}")
        if data
    ]
    for rec in [*stored, *record_writes]:
        assert overlaps(rec) == [], f"{rec.node} record held a device twice: {overlaps(rec)}"
    assert record_writes, "saw no allocation record writes at all"

    # The stream holds each assignment once (retried publishes were deduplicated).
    stored_assigned: Counter[str] = Counter()
    for subject, data in await stream_messages(observer, subjects.ALLOC_STREAM):
        if subject.startswith(subjects.alloc_assigned("").rstrip(".")):
            event = codec.ALLOC_EVENT.decode(data)
            assert isinstance(event, Assignment)
            stored_assigned[event.request_id] += 1
    assert stored_assigned and max(stored_assigned.values()) == 1, stored_assigned

    # Every durable consumer catches up: nothing pending, nothing waiting for an ack.
    async def drained() -> bool:
        for stream in (subjects.ALLOC_STREAM, subjects.NODE_STREAM):
            for info in await observer.js.consumers_info(stream):
                if info.config.durable_name and (info.num_pending or info.num_ack_pending):
                    return False
        return True

    await eventually(drained, timeout=RECOVERY_BOUND_S, what="durable consumers drained")
    await watch.unsubscribe()

    # The killed server comes back and catches up with every stream it replicates.
    t_restart = time.monotonic()
    await asyncio.to_thread(cluster.restart, killed)
    print(f"{cluster.server_names[killed]} restarted and current in {time.monotonic() - t_restart:.2f}s")

    async def rejoined() -> bool:
        info = (await observer.js.stream_info(subjects.ALLOC_STREAM)).cluster
        peers = {p.name: p.current for p in (info.replicas or [])} if info else {}
        return peers.get(cluster.server_names[killed]) is True

    await eventually(rejoined, timeout=RECOVERY_BOUND_S, what="restarted server a current replica again")


# -- the fixes the fail-over exposed, each pinned on a single server ---------------------------


@pytest.fixture
async def small_stack(nats_url: str, clean_jetstream: None) -> AsyncIterator[tuple[LocalStack, TandemClient]]:
    settings = make_settings(nats_url, "test", heartbeat_interval=0.2, node_lost_after=3.0)
    stack = LocalStack(settings, fleet=[FleetEntry("pcie-4gpu-2nic", 2, "pcie")], retry_interval=0.3)
    try:
        await stack.start()
        await stack.wait_ready()
        client = await TandemClient(stack.buses[0]).start()
        yield stack, client
        await client.close()
    finally:
        await stack.stop()


async def holders(client: TandemClient, request_id: str) -> list[str]:
    return [rec.node for rec in await client.allocations() if request_id in rec.allocations]


async def test_commit_whose_reply_was_lost_is_finished_not_redone(
    small_stack: tuple[LocalStack, TandemClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The allocation record write lands but its reply never comes (the server died after
    storing it): the redelivered request is neither placed again nor left "deciding"."""
    stack, client = small_stack
    acks = stack.allocators[0].bus.acks  # where the bus's JetStream publishes are answered
    real_publish = acks.publish
    lost: list[int] = []

    async def losing_reply(subject: str, *args: object, **kwargs: object) -> object:
        ack = await real_publish(subject, *args, **kwargs)  # type: ignore[arg-type]
        if subject.startswith(subjects.kv_subject(subjects.KV_ALLOCS, "")) and not lost:
            lost.append(ack.seq)  # stored, but the allocator never hears so
            raise nats.errors.TimeoutError
        return ack

    monkeypatch.setattr(acks, "publish", losing_reply)
    req = request(100)
    await client.submit(req)
    placed = await client.wait_for(req.request_id, (Assignment,), timeout=15)
    assert isinstance(placed, Assignment)
    assert lost, "the commit never went through the reply-losing write"

    async def finished() -> bool:
        record = await client.request_record(req.request_id)
        return record is not None and record.state == "assigned"

    await eventually(finished, timeout=10, what="request record marked assigned")
    assert await holders(client, req.request_id) == [placed.node]
    dlq = await stack.buses[0].js.stream_info(subjects.DLQ_STREAM)
    assert dlq.state.messages == 0  # a NATS hiccup is not a poison message


async def test_request_placed_while_deciding_is_not_placed_again(
    small_stack: tuple[LocalStack, TandemClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between decide and commit the request shows up in another node's record (our earlier,
    reply-lost commit arriving through the watch): the allocator must not commit it twice."""
    stack, client = small_stack
    allocator = stack.allocators[0]
    req = request(101)
    landed: list[str] = []

    async def earlier_commit_arrives(r: AllocationRequest, decision: object) -> None:
        if landed:
            return
        other = next(n for n in ("pcie-0", "pcie-1") if n != decision.node)  # type: ignore[attr-defined]
        earlier = Assignment(request_id=r.request_id, pod=r.pod, node=other, gpus=[])
        rec = NodeAllocations(node=other, allocations={r.request_id: AllocRecord(assignment=earlier)})
        kv = await stack.buses[0].kv(subjects.KV_ALLOCS)
        await kv.put(subjects.kv_key(other), codec.encode(rec))
        landed.append(other)
        await eventually(
            lambda: asyncio.sleep(0, r.request_id in allocator.placed), timeout=5, what="watch delivery"
        )

    before_commit(monkeypatch, allocator, earlier_commit_arrives)
    assert await allocator.handle_request(req) == "duplicate"
    assert await holders(client, req.request_id) == landed
    record = await client.request_record(req.request_id)
    assert record is not None and record.state == "assigned" and record.node == landed[0]


async def test_publish_retries_until_its_deadline_then_raises(bus_factory: BusFactory) -> None:
    bus = await bus_factory("test")
    bus.publish_retry_for = 0.6
    t0 = time.monotonic()
    with pytest.raises(NoStreamResponseError):  # no stream takes this subject: no responders
        await bus.publish("tandem-test.nowhere", PodRef("ns", "p"), msg_id="x")
    assert 0.3 <= time.monotonic() - t0 < 5.0


async def test_release_that_waited_for_the_decision_frees_the_placement(
    small_stack: tuple[LocalStack, TandemClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release sent before the assignment was known (to ``_unplaced``) is handled while the
    request is still being decided (both queued behind a fail-over): it must free the
    placement once it is committed, not find "assigned" and drop the release."""
    stack, client = small_stack
    allocator = stack.allocators[0]
    req = request(102)
    released: list[bool] = []

    async def release_arrives_mid_decision(r: AllocationRequest, _: object) -> None:
        if not released:
            released.append(True)
            await client.release(r.request_id)  # no assignment seen yet: goes to _unplaced
            await asyncio.sleep(0.5)  # the allocator's release handler now waits for the lock

    before_commit(monkeypatch, allocator, release_arrives_mid_decision)
    await client.submit(req)
    assert isinstance(await client.wait_for(req.request_id, (Assignment,)), Assignment)
    freed = await client.wait_for(req.request_id, (Freed,), timeout=10)
    assert isinstance(freed, Freed) and freed.node in ("pcie-0", "pcie-1") and freed.devices
    assert await holders(client, req.request_id) == []
    record = await client.request_record(req.request_id)
    assert record is not None and record.state == "freed"


async def test_a_crash_between_freeing_and_dropping_leaves_nothing_to_place_again(
    small_stack: tuple[LocalStack, TandemClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Freeing is two writes: the request record says ``freed``, the node record drops the
    allocation. A crash between them (simulated: the second write fails once, so the
    ``Cleaned`` is redelivered) must still end with the request freed and held by no node.
    In the other order the redelivered ``Cleaned`` found nothing to drop and the request
    stayed ``assigned`` with no node holding it, which a restarted replica takes for an
    abandoned claim and places again although its pod is gone."""
    stack, client = small_stack
    allocator = stack.allocators[0]
    seen = {"active": False, "writes": 0, "crashed": False}
    real_on_cleaned = allocator.frees.on_cleaned

    async def on_cleaned(cleaned: Cleaned, delivery: object) -> None:
        seen["active"], seen["writes"] = True, 0
        try:
            await real_on_cleaned(cleaned, delivery)  # type: ignore[arg-type]
        finally:
            seen["active"] = False

    def crash_at_second_write(real: Any) -> Any:
        async def write(*args: Any, **kwargs: Any) -> Any:
            if seen["active"]:
                seen["writes"] += 1
                if seen["writes"] == 2 and not seen["crashed"]:
                    seen["crashed"] = True
                    raise RuntimeError("killed between the two writes")
            return await real(*args, **kwargs)

        return write

    monkeypatch.setattr(allocator.frees, "on_cleaned", on_cleaned)
    monkeypatch.setattr(allocator.book, "freed", crash_at_second_write(allocator.book.freed))
    monkeypatch.setattr(allocator.node_allocs, "update", crash_at_second_write(allocator.node_allocs.update))
    req = request(103)
    await client.submit(req)
    assert isinstance(await client.wait_for(req.request_id, (Assignment,)), Assignment)
    await client.release(req.request_id)
    freed = await client.wait_for(req.request_id, (Freed,), timeout=20)
    assert isinstance(freed, Freed) and seen["crashed"]
    assert await holders(client, req.request_id) == []
    record = await client.request_record(req.request_id)
    assert record is not None and record.state == "freed", record


async def test_a_late_repair_of_the_request_record_never_undoes_its_release(
    small_stack: tuple[LocalStack, TandemClient],
) -> None:
    """A replica that republishes a committed assignment also makes the request record say
    ``assigned`` (its own write may have been lost). If the request was released and freed
    meanwhile, that repair must leave ``freed`` alone: written anyway, it is a claim no node
    holds, which another replica takes over and places again (``tandem chaos`` found it:
    the repair lost its compare-and-set race to the ``freed`` write, re-read, overwrote it)."""
    stack, client = small_stack
    allocator = stack.allocators[0]
    req = request(104)
    await client.submit(req)
    placed = await client.wait_for(req.request_id, (Assignment,))
    assert isinstance(placed, Assignment)
    await client.release(req.request_id)
    assert isinstance(await client.wait_for(req.request_id, (Freed,), timeout=10), Freed)
    await allocator.book.mark_assigned(req, node=placed.node)  # the late repair
    record = await client.request_record(req.request_id)
    assert record is not None and record.state == "freed", record
    assert await holders(client, req.request_id) == []


@pytest.mark.timeout(180)
async def test_stream_leader_killed_under_the_load_harness(
    cluster: EmbeddedNatsCluster, stack: tuple[LocalStack, TandemClient, Bus]
) -> None:
    """The same kill, with ``tandem loadtest`` driving its own fleet against the cluster (its
    invariants read from KV: nothing lost, no device or request held twice)."""
    _, _, observer = stack
    assigned: list[str] = []

    async def on_assigned(msg: Msg) -> None:
        assigned.append(msg.subject)

    watch = await observer.nc.subscribe(subjects.ALLOC_ASSIGNED_ALL, cb=on_assigned)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["TANDEM_HEARTBEAT_INTERVAL"] = "0.5"  # the in-process inventory calls a node lost after 3 s
    harness = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tools.cli.main",
        "loadtest",
        "--nats",
        cluster.url,
        "--no-services",
        "--nodes",
        "12",
        "--requests",
        "400",
        "--rate",
        "25",
        "--util",
        "0.6",
        "--ceiling-msgs",
        "0",
        "--drain",
        "60",
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    assert harness.stderr is not None and harness.stdout is not None
    progress: list[str] = []

    async def read_until(marker: str) -> None:
        assert harness.stderr is not None
        while marker not in (line := (await harness.stderr.readline()).decode()):
            if not line:
                pytest.fail("loadtest ended before its load began:\n" + "".join(progress))
            progress.append(line)

    await asyncio.wait_for(read_until("load:"), 60)
    await eventually(
        lambda: asyncio.sleep(0, len(assigned) >= 100), timeout=60, what="100 harness requests placed"
    )
    await watch.unsubscribe()
    leader = (await observer.js.stream_info(subjects.ALLOC_STREAM)).cluster
    assert leader is not None and leader.leader, "TANDEM_ALLOC has no cluster leader"
    cluster.kill(cluster.index_of(leader.leader))
    print(f"\nkilled {leader.leader} (leader of {subjects.ALLOC_STREAM}) under the harness's load")

    stdout, stderr = await asyncio.wait_for(harness.communicate(), 150)
    progress.append(stderr.decode())
    assert stdout.strip(), "no JSON line:\n" + "".join(progress)
    report = json.loads(stdout.decode().strip().splitlines()[-1])
    print(json.dumps(report))
    assert report["lost"] == 0 and report["double_held"] == 0 and report["double_placed"] == 0, report
    assert report["assigned"] > 300 and report["drained"], report
    assert harness.returncode == 0, "".join(progress)
