"""MIG instances through the running system over a real nats-server.

Inventory, allocator and a simulated node agent in-process (tools.localstack) on the
documented DGX H100 whose GPUs 0-3 are in MIG mode (docs/examples/mig/dgx-h100-mig.yaml): a
``mig_profile`` request is assigned existing instances with NICs on their GPUs' PCIe switches,
the assignment names each instance (profile, MIG- UUID, device id), the node's allocation
record holds the instances, a second request gets other instances, a whole-GPU request never
gets a MIG-mode GPU, and releasing frees the instances again (after the agent's cleanup).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from schemas.messages import AllocationRequest, Assignment, Freed, PodRef
from services.client import TandemClient
from tests.conftest import make_settings
from tests.waiting import wait_until
from tools.localstack import FleetEntry, LocalStack

pytestmark = pytest.mark.integration

MIG_NODE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "mig" / "dgx-h100-mig.yaml"


def request(name: str, gpus: int, **kw: object) -> AllocationRequest:
    return AllocationRequest(
        request_id=f"uid-{name}.1", pod=PodRef("ns", name, f"uid-{name}"), gpus=gpus, **kw
    )  # type: ignore[arg-type]


@pytest.fixture
async def stack(nats_url: str, clean_jetstream: None) -> AsyncIterator[tuple[LocalStack, TandemClient]]:
    settings = make_settings(nats_url, "test", heartbeat_interval=0.2, node_lost_after=1.0)
    s = LocalStack(settings, fleet=[FleetEntry(str(MIG_NODE), 1, "mig")], retry_interval=0.3)
    await s.start()
    await s.wait_ready()
    client = await TandemClient(s.buses[0]).start()
    yield s, client
    await client.close()
    await s.stop()


async def test_mig_instances_assigned_held_and_freed(stack: tuple[LocalStack, TandemClient]) -> None:
    s, client = stack
    first = request("a", 2, rdma=2, mig_profile="1g.10gb", policy="required")
    await client.submit(first)
    a = await client.wait_for(first.request_id)
    assert isinstance(a, Assignment), a
    assert all(g.mig is not None and g.mig.profile == "1g.10gb" for g in a.gpus)
    assert all(g.mig.uuid.startswith("MIG-") for g in a.gpus if g.mig is not None)
    assert {p.scope for p in a.pairs} == {"pcie-switch"}
    mine = a.device_ids()
    assert all("-mig" in d for d in mine[:2]) and len(set(mine)) == 4

    # The read model holds the instances (not their GPUs) and counts them out.
    model = s.allocators[0].model.cluster
    await wait_until(lambda: first.request_id in model.holds("mig-0"), what="the hold in the read model")
    assert set(model.holds("mig-0")[first.request_id]) == set(mine)
    assert not set(mine[:2]) & set(model.mig_instances("mig-0").get("1g.10gb", []))

    second = request("b", 1, mig_profile="1g.10gb")
    await client.submit(second)
    b = await client.wait_for(second.request_id)
    assert isinstance(b, Assignment) and b.gpus[0].mig is not None
    assert b.gpus[0].mig.device not in mine

    # Whole GPUs: only the 4 GPUs not in MIG mode exist for them.
    five = request("five", 5)
    await client.submit(five)
    assert not isinstance(await client.wait_for(five.request_id), Assignment)
    await client.release(five.request_id)
    four = request("four", 4)
    await client.submit(four)
    whole = await client.wait_for(four.request_id)
    assert isinstance(whole, Assignment)
    assert sorted(g.index for g in whole.gpus) == [4, 5, 6, 7] and all(g.mig is None for g in whole.gpus)

    # Released and cleaned: the instances are free again.
    await client.release(first.request_id)
    assert isinstance(await client.wait_for(first.request_id, kinds=(Freed,)), Freed)
    await wait_until(
        lambda: set(mine[:2]) <= set(model.mig_instances("mig-0").get("1g.10gb", [])),
        what="the instances free again",
    )


async def test_mig_cleanup_checks_the_gpu_once_its_last_instance_leaves(
    stack: tuple[LocalStack, TandemClient],
) -> None:
    """Instances of one GPU in use by two pods: the first to leave cannot require the GPU to be
    empty (the other's processes run there), so it is freed; the last is checked like a whole
    GPU: a process left behind keeps it held, unverified, until the process is gone."""
    s, client = stack
    one = request("one", 1, mig_profile="1g.10gb")
    two = request("two", 1, mig_profile="1g.10gb")
    got = []
    for r in (one, two):
        await client.submit(r)
        a = await client.wait_for(r.request_id)
        assert isinstance(a, Assignment) and a.gpus[0].mig is not None
        got.append(a)
    # Best fit, then binpack: both on GPU 1 (two 1g.10gb instances; GPUs 0 and 2 have seven).
    assert [a.gpus[0].index for a in got] == [1, 1]
    gpu = 1
    agent = s.agents["mig-0"]
    s.backends["mig-0"].processes[gpu] = [4242]  # the second pod's server, still running

    await client.release(one.request_id)
    assert isinstance(await client.wait_for(one.request_id, kinds=(Freed,)), Freed)

    await client.release(two.request_id)  # the last instance: now the process is left behind
    await wait_until(lambda: two.request_id in agent.unverified, what="cleanup reported unverified")
    assert two.request_id in (await client.allocations(["mig-0"]))[0].allocations
    s.backends["mig-0"].processes[gpu] = []
    assert isinstance(await client.wait_for(two.request_id, kinds=(Freed,), timeout=10), Freed)
