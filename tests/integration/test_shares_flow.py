"""Shares of GPUs through the running system over a real nats-server.

Inventory, allocator and a simulated node agent in-process (tools.localstack), a device
class that allows sharing: two share requests land on one GPU, each assignment carries its
share and the class's sharing mode, the node's allocation record holds both (the commit lets
two shares of one GPU through), a whole-GPU request never gets that GPU, and releasing both
shares makes it whole-free again. Two replicas racing for one GPU's memory never overcommit it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, Assignment, Freed, PodRef
from services.allocator.core import Placement
from services.client import TandemClient
from tests.integration.dgx import one_dgx
from tests.integration.seams import before_commit
from tests.waiting import wait_until
from tools.localstack import LocalStack

pytestmark = pytest.mark.integration

CLASSES = {"default": DeviceClass(), "shared": DeviceClass(sharing="hami", max_shares_per_gpu=4)}


def request(name: str, gpus: int, **kw: object) -> AllocationRequest:
    return AllocationRequest(
        request_id=f"uid-{name}.1", pod=PodRef("ns", name, f"uid-{name}"), gpus=gpus, **kw
    )  # type: ignore[arg-type]


@pytest.fixture
async def stack(nats_url: str, clean_jetstream: None) -> AsyncIterator[tuple[LocalStack, TandemClient]]:
    async with one_dgx(nats_url, classes=CLASSES) as running:
        yield running


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


@pytest.fixture
async def two_replicas(
    nats_url: str, clean_jetstream: None
) -> AsyncIterator[tuple[LocalStack, TandemClient]]:
    async with one_dgx(nats_url, allocators=2, classes=CLASSES) as running:
        yield running


async def test_two_replicas_racing_for_one_gpus_memory_never_overcommit_it(
    two_replicas: tuple[LocalStack, TandemClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seven GPUs held whole, then two shares of 50 GiB each (an 80 GiB GPU takes one) decided
    by two replicas on the same view: both choose the eighth GPU; the commit that comes
    second must not add its share on top (the node's record, re-read after the lost
    compare-and-set, says the GPU's memory is taken), so that request is decided again and,
    with no GPU left that fits it, waits."""
    s, client = two_replicas
    a0, a1 = s.allocators
    big = request("big", 7)
    assert await a0.handle_request(big) == "assigned"
    await wait_until(lambda: big.request_id in a1.placed, what="the other replica seeing the big request")

    barrier = asyncio.Barrier(2)
    decided: list[Placement] = []

    async def hold_until_both_decided(_: AllocationRequest, placement: Placement) -> None:
        decided.append(placement)
        if len(decided) <= 2:
            await barrier.wait()  # both replicas now hold the same view of the node

    before_commit(monkeypatch, a0, hold_until_both_decided)
    before_commit(monkeypatch, a1, hold_until_both_decided)
    mem = 50 * 1024
    r0 = request("r0", 1, device_class="shared", gpu_memory_mib=mem)
    r1 = request("r1", 1, device_class="shared", gpu_memory_mib=mem)
    outcomes = await asyncio.gather(a0.handle_request(r0), a1.handle_request(r1))

    assert sorted(outcomes) == ["assigned", "pending"], outcomes
    assert decided[0].devices() == decided[1].devices()  # the same GPU, chosen twice
    record = (await client.allocations(["h100-0"]))[0]
    on_gpu: dict[str, int] = {}
    for rec in record.allocations.values():
        for dev, (m, _) in rec.assignment.shares().items():
            on_gpu[dev] = on_gpu.get(dev, 0) + m
    assert list(on_gpu.values()) == [mem]  # one share of 50 GiB, not 100 GiB on an 80 GiB GPU


@pytest.fixture
async def two_modes(nats_url: str, clean_jetstream: None) -> AsyncIterator[tuple[LocalStack, TandemClient]]:
    classes = {**CLASSES, "mps": DeviceClass(sharing="mps", max_shares_per_gpu=4)}
    async with one_dgx(nats_url, classes=classes) as running:
        yield running


async def test_hami_and_mps_shares_never_share_a_gpu(two_modes: tuple[LocalStack, TandemClient]) -> None:
    """The node agent limits a GPU's shares with HAMi-core or with its MPS daemon, not both:
    an MPS share goes to another GPU than a HAMi share's (binpack would have stacked it), and
    a second HAMi share still stacks on the first (seen with `tandem up`'s two share classes)."""
    _s, client = two_modes
    placed: dict[str, Assignment] = {}
    for name, device_class in (("h1", "shared"), ("m1", "mps"), ("h2", "shared"), ("m2", "mps")):
        req = request(name, 1, device_class=device_class, gpu_memory_mib=1024)
        await client.submit(req)
        got = await client.wait_for(req.request_id)
        assert isinstance(got, Assignment), got
        placed[name] = got
    gpu = {name: a.gpus[0].uuid for name, a in placed.items()}
    assert gpu["h1"] != gpu["m1"]
    assert gpu["h2"] == gpu["h1"] and gpu["m2"] == gpu["m1"]  # binpack, each within its mode
    assert {placed["m1"].sharing, placed["h1"].sharing} == {"mps", "hami"}
