"""The whole event flow over a real nats-server (issue 2 "Done when").

Each test runs the real services (inventory, allocator, node agents with the simulated
backend) in-process, each on its own NATS connection, against the session's nats-server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
from prometheus_client import REGISTRY

from schemas import codec, subjects
from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    Applied,
    Assignment,
    Cleaned,
    Freed,
    PodRef,
    RequestRecord,
)
from services.allocator.core import Placement
from services.client import TandemClient
from services.runtime.observe import tracing
from tests.conftest import BusFactory, make_settings
from tests.integration.seams import before_commit
from tests.waiting import wait_until
from tools.localstack import FleetEntry, LocalStack

pytestmark = pytest.mark.integration


def request(name: str, gpus: int, rdma: int = 0, **kw: object) -> AllocationRequest:
    return AllocationRequest(
        request_id=f"uid-{name}.1", pod=PodRef("ns", name, f"uid-{name}"), gpus=gpus, rdma=rdma, **kw
    )  # type: ignore[arg-type]


@pytest.fixture
async def stack_factory(nats_url: str, clean_jetstream: None) -> AsyncIterator[object]:
    stacks: list[LocalStack] = []
    clients: list[TandemClient] = []

    async def make(fleet: list[FleetEntry], *, allocators: int = 1) -> tuple[LocalStack, TandemClient]:
        settings = make_settings(nats_url, "test", heartbeat_interval=0.2, node_lost_after=1.0)
        stack = LocalStack(settings, fleet=fleet, allocators=allocators, retry_interval=0.3)
        stacks.append(stack)
        await stack.start()
        await stack.wait_ready()
        client = await TandemClient(stack.buses[0]).start()
        clients.append(client)
        return stack, client

    yield make
    for c in clients:
        await c.close()
    for s in stacks:
        await s.stop()


async def test_request_assigned_applied_released_cleaned_freed(
    stack_factory, bus_factory: BusFactory
) -> None:  # type: ignore[no-untyped-def]
    stack, client = await stack_factory([FleetEntry("dgx-h100", 1, "h100")])
    observer = await bus_factory("observer")
    applied = await observer.nc.subscribe(subjects.node_applied("h100-0"))
    cleaned = await observer.nc.subscribe(subjects.node_cleaned("h100-0"))

    req = request("train", 2, 2, scope="pcie-switch", policy="required")
    await client.submit(req)
    a = await client.wait_for(req.request_id)
    assert isinstance(a, Assignment), a
    assert a.node == "h100-0" and len(a.gpus) == 2 and len(a.nics) == 2
    assert {p.scope for p in a.pairs} == {"pcie-switch"}
    assert len({p.nic for p in a.pairs}) == 2  # per-gpu pairing: each GPU its own NIC

    ap = codec.NODE_EVENT.decode((await applied.next_msg(timeout=5)).data)
    assert isinstance(ap, Applied) and ap.ok and ap.request_id == req.request_id
    assert stack.appliers["h100-0"].applied[req.request_id] == a
    allocs = (await client.allocations(["h100-0"]))[0]
    assert allocs.allocations[req.request_id].state == "assigned"  # applied is an event only
    assert allocs.used() == set(a.device_ids())

    await client.release(req.request_id)
    cl = codec.NODE_EVENT.decode((await cleaned.next_msg(timeout=5)).data)
    assert isinstance(cl, Cleaned) and cl.ok and sorted(cl.devices) == sorted(a.device_ids())
    freed = await client.wait_for(req.request_id, (Freed,))
    assert isinstance(freed, Freed) and freed.node == "h100-0"
    assert (await client.allocations(["h100-0"]))[0].allocations == {}
    assert req.request_id not in stack.appliers["h100-0"].applied

    # The freed devices are allocatable again: an 8-GPU request now fits the whole board.
    big = request("big", 8, 8, scope="pcie-switch", policy="required")
    await client.submit(big)
    assert isinstance(await client.wait_for(big.request_id), Assignment)
    await applied.unsubscribe()
    await cleaned.unsubscribe()


async def test_two_allocators_racing_on_one_node_never_share_a_device(  # type: ignore[no-untyped-def]
    stack_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack, _ = await stack_factory([FleetEntry("dgx-h100", 1, "h100")], allocators=2)
    a0, a1 = stack.allocators
    barrier = asyncio.Barrier(2)
    decided: list[Placement] = []

    async def hold_until_both_decided(_: AllocationRequest, placement: Placement) -> None:
        decided.append(placement)
        if len(decided) <= 2:
            await barrier.wait()  # both replicas now hold the same stale view of the node

    before_commit(monkeypatch, a0, hold_until_both_decided)
    before_commit(monkeypatch, a1, hold_until_both_decided)
    r0, r1 = request("r0", 4, 4), request("r1", 4, 4)
    outcomes = await asyncio.gather(a0.handle_request(r0), a1.handle_request(r1))

    assert outcomes == ["assigned", "assigned"]
    # Both decided on the same view, so both first chose the same devices ...
    assert set(decided[0].devices()) == set(decided[1].devices())
    # ... one commit lost the compare-and-set, re-read the record and decided again.
    assert len(decided) == 3
    record = (await TandemClient(stack.buses[0]).allocations(["h100-0"]))[0]
    held = [set(r.assignment.device_ids()) for r in record.allocations.values()]
    assert len(held) == 2 and not held[0] & held[1]
    assert len(held[0] | held[1]) == 16  # 8 GPUs + 8 NICs, each exactly once


async def test_redelivered_request_is_not_allocated_twice(stack_factory) -> None:  # type: ignore[no-untyped-def]
    stack, client = await stack_factory([FleetEntry("dgx-h100", 1, "h100")])
    req = request("once", 2, 2)
    await client.submit(req)
    first = await client.wait_for(req.request_id)
    assert isinstance(first, Assignment)

    # A redelivery past the dedup window: same request, different Nats-Msg-Id.
    await stack.buses[0].publish(subjects.ALLOC_REQUEST, req, msg_id="redelivered-1")
    # And the same message handled again directly (as after an ack that never arrived).
    assert await stack.allocators[0].handle_request(req) == "duplicate"
    await asyncio.sleep(0.5)

    record = (await client.allocations(["h100-0"]))[0]
    assert list(record.allocations) == [req.request_id]
    assignments = [e for e, _ in client.outcomes[req.request_id] if isinstance(e, Assignment)]
    assert all(a.device_ids() == first.device_ids() for a in assignments)
    info = await stack.buses[0].js.consumer_info(subjects.ALLOC_STREAM, subjects.CONSUMER_ALLOCATOR_REQUESTS)
    assert info.num_pending == 0 and info.num_ack_pending == 0


async def test_garbage_goes_to_dead_letter_and_service_keeps_serving(
    stack_factory, bus_factory: BusFactory
) -> None:  # type: ignore[no-untyped-def]
    _, client = await stack_factory([FleetEntry("pcie-4gpu-2nic", 1, "pcie")])
    observer = await bus_factory("observer")
    dlq = await observer.nc.subscribe(subjects.dlq("allocator"))
    await observer.js.publish(subjects.ALLOC_REQUEST, b"\x00\xffnot msgpack at all")
    bad_field = codec.encode(
        {"kind": "alloc.request", "request_id": "x.1", "pod": {"namespace": "a", "name": "b"}, "gpus": "two"}
    )
    await observer.js.publish(subjects.ALLOC_REQUEST, bad_field)

    # The allocator handles messages concurrently: the two letters may come in either order.
    got = [codec.DEAD_LETTER.decode((await dlq.next_msg(timeout=5)).data) for _ in range(2)]
    letters = {letter.data: letter for letter in got}
    garbage = letters[b"\x00\xffnot msgpack at all"]
    assert garbage.subject == subjects.ALLOC_REQUEST
    assert "$.gpus" in letters[bad_field].error and "int" in letters[bad_field].error
    await dlq.unsubscribe()
    parked = await client.dead_letters()
    assert sorted(d.data for d in parked) == sorted([b"\x00\xffnot msgpack at all", bad_field])

    req = request("after-garbage", 1, 1)
    await client.submit(req)
    assert isinstance(await client.wait_for(req.request_id), Assignment)


async def test_silent_node_gets_nothing_until_heartbeats_resume(stack_factory) -> None:  # type: ignore[no-untyped-def]
    stack, client = await stack_factory([FleetEntry("pcie-4gpu-2nic", 1, "pcie")])
    allocator = stack.allocators[0]
    stack.agents["pcie-0"].heartbeats_paused = True
    await wait_until(lambda: allocator.nodes["pcie-0"].status == "lost", what="node marked lost")

    req = request("waits", 1, 0)
    await client.submit(req)
    failed = await client.wait_for(req.request_id)
    assert isinstance(failed, AllocationFailed)
    assert client.assignment(req.request_id) is None

    stack.agents["pcie-0"].heartbeats_paused = False
    placed = await client.wait_for(req.request_id, (Assignment,))
    assert isinstance(placed, Assignment) and placed.node == "pcie-0"
    assert allocator.nodes["pcie-0"].status == "ready"


async def test_failed_gpu_is_skipped_and_returns_after_recovery(stack_factory) -> None:  # type: ignore[no-untyped-def]
    stack, client = await stack_factory([FleetEntry("pcie-4gpu-2nic", 1, "pcie")])
    ev = await client.command("pcie-0", "gpu2", "fail", reason="XID 79")
    assert not ev.healthy and ev.reason == "XID 79"
    # The failure reaches the allocator through inventory and KV; a request racing it could
    # still get the GPU (eventual consistency), which is not what this test is about.
    await wait_until(lambda: "gpu2" in stack.allocators[0].nodes["pcie-0"].unavailable(), what="failure seen")
    req = request("all4", 4, 0)
    await client.submit(req)
    failed = await client.wait_for(req.request_id)
    assert isinstance(failed, AllocationFailed) and failed.reason

    await client.command("pcie-0", "gpu2", "recover")
    placed = await client.wait_for(req.request_id, (Assignment,))
    assert isinstance(placed, Assignment) and sorted(g.index for g in placed.gpus) == [0, 1, 2, 3]
    node = (await client.nodes("pcie-0"))[0]
    assert node.health["gpu2"].healthy


async def test_unverified_cleanup_keeps_devices_held(stack_factory) -> None:  # type: ignore[no-untyped-def]
    stack, client = await stack_factory([FleetEntry("pcie-4gpu-2nic", 1, "pcie")])
    req = request("leaky", 1, 0)
    await client.submit(req)
    a = await client.wait_for(req.request_id)
    assert isinstance(a, Assignment)
    gpu = a.gpus[0].index
    stack.backends["pcie-0"].processes[gpu] = [4242]  # a process left behind on the GPU

    await client.release(req.request_id)
    await wait_until(
        lambda: not stack.agents["pcie-0"].health.state[f"gpu{gpu}"].healthy, what="GPU marked unhealthy"
    )
    await asyncio.sleep(0.3)
    assert req.request_id in (await client.allocations(["pcie-0"]))[0].allocations
    assert "4242" in stack.agents["pcie-0"].health.state[f"gpu{gpu}"].reason
    assert not any(isinstance(e, Freed) for e, _ in client.outcomes.get(req.request_id, []))


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def test_unverified_cleanup_is_retried_until_verified_with_one_reason_per_device(
    stack_factory,
) -> None:  # type: ignore[no-untyped-def]
    """Issue 9 finding 7: Cleaned(ok=False) held the devices with nothing that ever tried the
    cleanup again, and every device got the first problem's reason. Now each device carries its
    own problem, the agent retries with back-off, and a verified retry frees the devices."""
    stack, client = await stack_factory([FleetEntry("pcie-4gpu-2nic", 1, "pcie")])
    agent = stack.agents["pcie-0"]
    failures_before = metric("tandem_nodeagent_cleanup_failures_total")
    req = request("leaky2", 2, 0)
    await client.submit(req)
    a = await client.wait_for(req.request_id)
    assert isinstance(a, Assignment)
    g1, g2 = (g.index for g in a.gpus)
    stack.backends["pcie-0"].processes.update({g1: [4242], g2: [5353]})

    await client.release(req.request_id)
    await wait_until(lambda: req.request_id in agent.unverified, what="cleanup reported unverified")
    assert agent.health.state[f"gpu{g1}"].reason == "cleanup failed: compute processes [4242] still running"
    assert agent.health.state[f"gpu{g2}"].reason == "cleanup failed: compute processes [5353] still running"
    assert metric("tandem_nodeagent_cleanups_unverified") >= 1
    # Retried (1 s after the failure), still leaky: still held, still counted.
    await wait_until(lambda: agent.unverified[req.request_id].attempts >= 2, what="a retry", timeout=5)
    assert metric("tandem_nodeagent_cleanup_failures_total") - failures_before >= 2
    assert req.request_id in (await client.allocations(["pcie-0"]))[0].allocations

    stack.backends["pcie-0"].processes.clear()  # the processes finally exit
    freed = await client.wait_for(req.request_id, (Freed,), timeout=10)
    assert isinstance(freed, Freed) and freed.node == "pcie-0"
    assert req.request_id not in agent.unverified
    assert (await client.allocations(["pcie-0"]))[0].allocations == {}


async def test_device_still_broken_after_its_clean_period_stays_out_of_service(
    stack_factory,
) -> None:  # type: ignore[no-untyped-def]
    """Issue 9 finding 7: recovery after the clean period probes the device first."""
    stack, client = await stack_factory([FleetEntry("pcie-4gpu-2nic", 1, "pcie")])
    agent, backend = stack.agents["pcie-0"], stack.backends["pcie-0"]
    agent.health.clean_period = 0.5
    backend.inject("gpu1", healthy=False, reason="GPU is lost (fallen off the bus)")
    await wait_until(lambda: not agent.health.state["gpu1"].healthy, what="GPU failed")
    failed_at = agent.health.state["gpu1"].since
    await wait_until(lambda: agent.health.state["gpu1"].since > failed_at + 0.5, what="a probe", timeout=5)
    assert not agent.health.state["gpu1"].healthy  # still lost: not "clean for 0.5s"
    # An operator's recover cannot bring back a device that is still lost either.
    ev = await client.command("pcie-0", "gpu1", "recover")
    assert not ev.healthy and ev.reason == "GPU is lost (fallen off the bus)"

    backend.broken.clear()  # back (NVML reports no recovery; the probe finds it readable)
    await wait_until(lambda: agent.health.state["gpu1"].healthy, what="recovery", timeout=5)
    assert agent.health.state["gpu1"].reason == "clean for 0.5s"

    async def inventory_sees_recovery() -> bool:  # the recovery was published: the record says so too
        return (await client.nodes("pcie-0"))[0].health["gpu1"].healthy

    await wait_until(inventory_sees_recovery, timeout=5, what="the inventory to see gpu1 recover")


async def test_cleanup_report_that_could_not_be_published_is_made_again(stack_factory) -> None:  # type: ignore[no-untyped-def]
    """The agent follows its record: when its Cleaned cannot be published (NATS gave up), the
    record is handed over again and the cleanup reported again, so the devices are freed."""
    stack, client = await stack_factory([FleetEntry("pcie-4gpu-2nic", 1, "pcie")])
    agent = stack.agents["pcie-0"]
    real_publish = agent.bus.publish
    failed: list[str] = []

    async def publish_failing_once(subject: str, message: object, **kw: object) -> None:
        if subject == subjects.node_cleaned("pcie-0") and not failed:
            failed.append(subject)
            raise TimeoutError("no stream answered")  # what a publish that gave up raises
        await real_publish(subject, message, **kw)  # type: ignore[arg-type]

    agent.bus.publish = publish_failing_once  # type: ignore[method-assign]
    req = request("report-again", 1, 0)
    await client.submit(req)
    assert isinstance(await client.wait_for(req.request_id), Assignment)
    await client.release(req.request_id)
    freed = await client.wait_for(req.request_id, (Freed,), timeout=15)
    assert failed and isinstance(freed, Freed) and freed.node == "pcie-0"
    assert (await client.allocations(["pcie-0"]))[0].allocations == {}


def test_assignment_round_trips_through_msgpack() -> None:
    a = Assignment(request_id="u.1", pod=PodRef("n", "p", "u"), node="n1", gpus=[])
    assert codec.ALLOC_EVENT.decode(codec.encode(a)) == a
    assert msgspec.json.decode(codec.to_json(a))["kind"] == "alloc.assigned"


async def test_request_abandoned_mid_decision_by_a_crashed_replica_is_placed(stack_factory) -> None:  # type: ignore[no-untyped-def]
    stack, client = await stack_factory([FleetEntry("pcie-4gpu-2nic", 1, "pcie")])
    allocator = stack.allocators[0]
    allocator.claim_timeout = 1.0
    req = request("orphan", 1, 1)
    # What a replica that crashed between its claim and its commit leaves behind.
    orphan = RequestRecord(request=req, state="deciding", owner="allocator-dead", updated_at=time.time() - 5)
    kv = await stack.buses[0].kv(subjects.KV_REQUESTS)
    await kv.put(req.request_id, codec.encode(orphan))

    placed = await client.wait_for(req.request_id, (Assignment,))
    assert isinstance(placed, Assignment) and placed.allocator == "allocator-0"
    record = await client.request_record(req.request_id)
    assert record is not None and record.state == "assigned" and record.node == "pcie-0"


async def test_request_that_can_never_be_valid_is_rejected_once_not_redelivered(stack_factory) -> None:  # type: ignore[no-untyped-def]
    stack, client = await stack_factory([FleetEntry("pcie-4gpu-2nic", 1, "pcie")])
    req = request("typo", 1, 0, device_class="h100-ib-typo")
    await client.submit(req)
    failed = await client.wait_for(req.request_id)
    assert isinstance(failed, AllocationFailed) and not failed.retrying
    assert "h100-ib-typo" in failed.reason
    record = await client.request_record(req.request_id)
    assert record is not None and record.state == "rejected"
    await asyncio.sleep(0.3)
    info = await stack.buses[0].js.consumer_info(subjects.ALLOC_STREAM, subjects.CONSUMER_ALLOCATOR_REQUESTS)
    assert info.num_pending == 0 and info.num_ack_pending == 0 and info.num_redelivered == 0


async def test_the_assigned_event_is_in_the_requests_trace(stack_factory) -> None:  # type: ignore[no-untyped-def]
    """The bridge's bind is a child of what the assigned event carries: without the request's
    trace on it, every pod's bind was a root span of a trace of its own (seen in the real
    Jaeger, tests/cluster/test_traces.py)."""
    _, client = await stack_factory([FleetEntry("dgx-h100", 1, "h100")])
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    req = request("traced", 1, 1)
    with tracing.within(tracing.context_from_traceparent(f"00-{trace_id}-00f067aa0ba902b7-01")):
        await client.submit(req)
    assert isinstance(await client.wait_for(req.request_id), Assignment)
    traceparent = client.headers_of(req.request_id, Assignment).get("traceparent", "")
    assert traceparent.split("-")[1:2] == [trace_id], traceparent
