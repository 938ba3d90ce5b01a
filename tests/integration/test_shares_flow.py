"""Shares of GPUs through the running system over a real nats-server.

Inventory, allocator and a simulated node agent in-process (services.localstack), a device
class that allows sharing: two share requests land on one GPU, each assignment carries its
share and the class's sharing mode, the node's allocation record holds both (the commit lets
two shares of one GPU through), a whole-GPU request never gets that GPU, and releasing both
shares makes it whole-free again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, Assignment, Freed, PodRef
from services.client import TandemClient
from services.localstack import FleetEntry, LocalStack
from tests.conftest import make_settings
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

CLASSES = {"default": DeviceClass(), "shared": DeviceClass(sharing="hami", max_shares_per_gpu=4)}


def request(name: str, gpus: int, **kw: object) -> AllocationRequest:
    return AllocationRequest(
        request_id=f"uid-{name}.1", pod=PodRef("ns", name, f"uid-{name}"), gpus=gpus, **kw
    )  # type: ignore[arg-type]


@pytest.fixture
async def stack(nats_url: str, clean_jetstream: None) -> AsyncIterator[tuple[LocalStack, TandemClient]]:
    settings = make_settings(
        nats_url, "test", heartbeat_interval=0.2, node_lost_after=1.0, device_classes=CLASSES
    )
    s = LocalStack(settings, fleet=[FleetEntry("dgx-h100", 1, "h100")], retry_interval=0.3)
    await s.start()
    await s.wait_ready()
    client = await TandemClient(s.buses[0]).start()
    yield s, client
    await client.close()
    await s.stop()


async def test_two_shares_on_one_gpu_then_whole_again(stack: tuple[LocalStack, TandemClient]) -> None:
    s, client = stack
    assignments: list[Assignment] = []
    for name, mem, cores in (("a", 20480, 25), ("b", 30720, 50)):
        req = request(name, 1, device_class="shared", gpu_memory_mib=mem, gpu_cores_percent=cores)
        await client.submit(req)
        got = await client.wait_for(req.request_id)
        assert isinstance(got, Assignment), got
        assert [(g.memory_mib, g.cores_percent) for g in got.gpus] == [(mem, cores)]
        assert got.sharing == "hami" and got.shares() == {f"gpu{got.gpus[0].index}": (mem, cores)}
        assignments.append(got)
    a, b = assignments
    assert a.gpus[0].uuid == b.gpus[0].uuid  # binpack: the second share fills the first GPU
    shared = f"gpu{a.gpus[0].index}"

    # The allocator's read model holds both shares; the GPU is not whole-free.
    model = s.allocators[0].model.cluster
    await wait_until(lambda: len(model.shares("h100-0")) == 2, what="both shares in the read model")
    assert model.gpu_shares("h100-0")[shared] == (20480 + 30720, 75, 2)

    # A whole-GPU request for all 8 GPUs cannot have the shared one; 7 it can.
    eight = request("eight", 8)
    await client.submit(eight)
    refused = await client.wait_for(eight.request_id)
    assert not isinstance(refused, Assignment)
    await client.release(eight.request_id)
    seven = request("seven", 7)
    await client.submit(seven)
    whole = await client.wait_for(seven.request_id)
    assert isinstance(whole, Assignment) and shared not in whole.device_ids()
    assert all(g.memory_mib is None and g.cores_percent is None for g in whole.gpus)

    # Both shares released (and cleaned): the GPU is whole-free again.
    for x in (a, b):
        await client.release(x.request_id)
        assert isinstance(await client.wait_for(x.request_id, kinds=(Freed,)), Freed)
    await wait_until(lambda: shared in model.free_devices("h100-0"), what="the GPU whole-free again")
    assert model.gpu_shares("h100-0") == {}
