"""Priority preemption through the running system over a real nats-server.

The real services (inventory, allocator, node agents with the simulated backend) run
in-process; the test plays the pod bridge's part: it reads the allocator's preemption plans
on ``tandem.alloc.preempt`` and releases the victims as a pod evicted through the Kubernetes
Eviction API would be (the bridge's own test, against the API emulator, is in
tests/integration/test_bridge.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from opentelemetry.context import Context
from prometheus_client import REGISTRY

from schemas import codec, subjects
from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, Assignment, Freed, PodRef, PreemptionPlan
from services.allocator.evictionplans import reservation_key
from services.client import TandemClient
from tests.conftest import BusFactory
from tests.integration.dgx import one_dgx
from tests.waiting import wait_until
from tools.localstack import LocalStack

pytestmark = pytest.mark.integration


def request(name: str, gpus: int, rdma: int = 0, **kw: object) -> AllocationRequest:
    return AllocationRequest(
        request_id=f"uid-{name}.1", pod=PodRef("ns", name, f"uid-{name}"), gpus=gpus, rdma=rdma, **kw
    )  # type: ignore[arg-type]


SHARED_CLASSES = {"default": DeviceClass(), "shared": DeviceClass(sharing="hami", max_shares_per_gpu=4)}


@pytest.fixture
async def stack(nats_url: str, clean_jetstream: None) -> AsyncIterator[tuple[LocalStack, TandemClient]]:
    async with one_dgx(nats_url) as running:
        yield running


async def test_high_priority_request_preempts_then_is_placed(
    stack: tuple[LocalStack, TandemClient], bus_factory: BusFactory
) -> None:
    st, client = stack
    allocator = st.allocators[0]
    observer = await bus_factory("observer")
    plans = await observer.nc.subscribe(subjects.ALLOC_PREEMPT)

    low = request("low", 4, 4, priority=0)
    other = request("other", 4, 4, priority=3)
    for r in (low, other):
        await client.submit(r)
        assert isinstance(await client.wait_for(r.request_id), Assignment)

    # Priority 5, may preempt, needs 4 aligned GPU/NIC pairs: the node is full, and evicting
    # the priority-0 allocation is enough.
    plans_before = REGISTRY.get_sample_value("tandem_allocator_preemptions_total") or 0.0
    hi = request("hi", 4, 4, priority=5, preemption="lower-priority", scope="pcie-switch", policy="required")
    await client.submit(hi)
    plan = codec.ALLOC_EVENT.decode((await plans.next_msg(timeout=10)).data)
    assert isinstance(plan, PreemptionPlan)
    assert plan.request_id == hi.request_id and plan.node == "h100-0" and plan.priority == 5
    assert [(v.request_id, v.pod.name, v.priority) for v in plan.victims] == [(low.request_id, "low", 0)]

    async def recorded() -> bool:
        rec = await client.request_record(hi.request_id)
        return rec is not None and rec.state == "pending" and rec.victims == [low.request_id]

    await wait_until(recorded, what="the preemption recorded on the request")
    assert (REGISTRY.get_sample_value("tandem_allocator_preemptions_total") or 0.0) - plans_before == 1
    rec = await client.request_record(hi.request_id)
    assert rec is not None and rec.preempt_node == "h100-0" and "preempting 1 allocation" in rec.reason

    # The request message handled again (a redelivery): no second plan, the recorded one is
    # published again (same message id) in case the first publish was lost.
    again = await allocator.handle_request(hi, context=Context())
    assert again == "pending"
    replay = codec.ALLOC_EVENT.decode((await plans.next_msg(timeout=10)).data)
    assert isinstance(replay, PreemptionPlan) and replay.victims == plan.victims

    # A request of even higher priority that may not preempt arrives meanwhile: the devices
    # freed by the eviction are kept for the preemptor, so it stays pending.
    rival = request("rival", 1, 1, priority=9)
    await client.submit(rival)

    # The eviction (what the bridge does for the victim's pod): release, cleanup, freed.
    low_devices = set(client.assignment(low.request_id).device_ids())  # type: ignore[union-attr]
    await client.release(low.request_id)
    assert isinstance(await client.wait_for(low.request_id, (Freed,)), Freed)

    placed = await client.wait_for(hi.request_id, (Assignment,), timeout=15)
    assert isinstance(placed, Assignment) and placed.node == "h100-0"
    assert set(placed.device_ids()) <= low_devices
    assert {p.scope for p in placed.pairs} == {"pcie-switch"}
    # Nothing else was evicted, the rival waits, and no device is held twice.
    assert (await client.holder(other.request_id)) is not None
    assert client.assignment(rival.request_id) is None
    allocs = (await client.allocations(["h100-0"]))[0]
    devices = [d for rec in allocs.allocations.values() for d in rec.assignment.device_ids()]
    assert len(devices) == len(set(devices)) == 16
    assert set(allocs.allocations) == {other.request_id, hi.request_id}

    # A request of lower or equal priority never evicts: "other" (3) is safe from priority 3.
    peer = request("peer", 4, 4, priority=3, preemption="lower-priority")
    await client.submit(peer)
    assert client.assignment(peer.request_id) is None
    await wait_until(lambda: client.request_record(peer.request_id), what="the peer's request record")
    peer_rec = await client.request_record(peer.request_id)
    assert peer_rec is not None and peer_rec.state == "pending" and peer_rec.victims == []
    await plans.unsubscribe()


@pytest.fixture
async def two_replicas(
    nats_url: str, clean_jetstream: None
) -> AsyncIterator[tuple[LocalStack, TandemClient]]:
    async with one_dgx(nats_url, allocators=2) as running:
        yield running


async def test_every_replica_keeps_the_preemptors_devices(
    two_replicas: tuple[LocalStack, TandemClient],
) -> None:
    """The record carries the reserved devices, so the replica that did not plan keeps them
    too, until the preemptor is placed; then both let them go."""
    st, client = two_replicas
    low = request("low", 8, 8, priority=0)
    await client.submit(low)
    assert isinstance(await client.wait_for(low.request_id), Assignment)
    hi = request("hi", 2, 2, priority=5, preemption="lower-priority", scope="pcie-switch", policy="required")
    await client.submit(hi)
    key = reservation_key(hi.request_id)

    def reserved_everywhere() -> bool:
        return all(key in a.cluster.holds("h100-0") for a in st.allocators)

    await wait_until(reserved_everywhere, what="both replicas reserving the preemptor's devices")
    rec = await client.request_record(hi.request_id)
    assert rec is not None and rec.victims == [low.request_id]
    devices = set(st.allocators[0].cluster.holds("h100-0")[key])
    assert devices == set(st.allocators[1].cluster.holds("h100-0")[key]) and len(devices) == 4

    await client.release(low.request_id)
    placed = await client.wait_for(hi.request_id, (Assignment,), timeout=15)
    assert isinstance(placed, Assignment) and set(placed.device_ids()) == devices
    await wait_until(
        lambda: not any(key in a.cluster.holds("h100-0") for a in st.allocators),
        what="the reservations dropped once the preemptor is placed",
    )


@pytest.fixture
async def shared_stack(
    nats_url: str, clean_jetstream: None
) -> AsyncIterator[tuple[LocalStack, TandemClient]]:
    async with one_dgx(nats_url, classes=SHARED_CLASSES) as running:
        yield running


async def test_a_whole_gpu_request_evicts_every_share_of_one_gpu(
    shared_stack: tuple[LocalStack, TandemClient], bus_factory: BusFactory
) -> None:
    """Seven GPUs held whole at a priority the preemptor may not touch, the eighth as two
    shares of priority 0: a one-GPU request of priority 5 evicts both shares, and the GPU,
    once they are freed, goes to it whole — not to a share request of higher priority that
    arrives meanwhile (the reservation keeps the GPU from shares too)."""
    _, client = shared_stack
    observer = await bus_factory("observer")
    plans = await observer.nc.subscribe(subjects.ALLOC_PREEMPT)

    big = request("big", 7, priority=9)
    await client.submit(big)
    assert isinstance(await client.wait_for(big.request_id), Assignment)
    shares = [
        request(f"share{i}", 1, device_class="shared", gpu_memory_mib=10240, gpu_cores_percent=25, priority=0)
        for i in range(2)
    ]
    for r in shares:
        await client.submit(r)
        assert isinstance(await client.wait_for(r.request_id), Assignment)
    shared_gpu = {client.assignment(r.request_id).device_ids()[0] for r in shares}  # type: ignore[union-attr]
    assert len(shared_gpu) == 1  # both on the one GPU left

    hi = request("hi", 1, priority=5, preemption="lower-priority")
    await client.submit(hi)
    plan = codec.ALLOC_EVENT.decode((await plans.next_msg(timeout=10)).data)
    assert isinstance(plan, PreemptionPlan) and plan.request_id == hi.request_id
    assert sorted(v.request_id for v in plan.victims) == sorted(r.request_id for r in shares)

    # A share request of higher priority, which may not preempt, waits: the GPU is reserved.
    rival = request("rival", 1, device_class="shared", gpu_memory_mib=1024, gpu_cores_percent=10, priority=9)
    await client.submit(rival)
    for r in shares:  # the evictions
        await client.release(r.request_id)
        assert isinstance(await client.wait_for(r.request_id, (Freed,)), Freed)

    placed = await client.wait_for(hi.request_id, (Assignment,), timeout=15)
    assert isinstance(placed, Assignment) and placed.device_ids() == sorted(shared_gpu)
    assert placed.gpus[0].memory_mib is None  # whole, not a share
    assert client.assignment(rival.request_id) is None
    allocs = (await client.allocations(["h100-0"]))[0]
    assert set(allocs.allocations) == {big.request_id, hi.request_id}
    await plans.unsubscribe()
