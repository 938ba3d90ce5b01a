"""Nodes the allocator cannot use, through the running system over a real nats-server.

Two faults found by fault-injection probes (issue 27):

* a node whose allocation record is full (many small shares pinned to it) made every request
  that landed there fail for good — unpinned ones too, while another node was empty. Now the
  node is skipped until an allocation leaves its record: an unpinned request goes to the other
  node, a request pinned to the full node waits (pending, naming the full record) and is
  placed once a release makes room;
* the pending reason of a request pinned to a lost node counted only the nodes the core knows
  ("3 nodes: labels do not match the node selector"), sending its author to check a selector
  that was right. Now lost nodes and nodes with devices out of service are named.

The record limit is lowered for the test (``RecordStore.max_bytes``) so a few dozen shares
fill it, not the thousand the production limit takes; the code paths are the same.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from schemas.config import DeviceClass
from schemas.messages import AllocationFailed, AllocationRequest, Assignment, Freed, PodRef
from services.client import TandemClient
from tests.integration.dgx import one_dgx
from tests.waiting import wait_until
from tools.localstack import LocalStack

pytestmark = pytest.mark.integration

CLASSES = {"default": DeviceClass(), "tiny": DeviceClass(sharing="hami", max_shares_per_gpu=1000)}
RECORD_LIMIT = 12_000  # bytes; the production limit is limits.MAX_RECORD_BYTES (512 KiB)


def request(name: str, *, gpus: int = 1, node: str | None = None, **kw: object) -> AllocationRequest:
    # Long names, as the probe's tenant used, make each allocation take more of the record.
    pod = PodRef("tenant-with-a-rather-long-namespace-name", name, f"uid-{name}")
    selector = {"kubernetes.io/hostname": node} if node else {}
    return AllocationRequest(request_id=f"uid-{name}.1", pod=pod, gpus=gpus, node_selector=selector, **kw)  # type: ignore[arg-type]


def share(name: str, *, node: str | None = None) -> AllocationRequest:
    return request(name, node=node, device_class="tiny", gpu_memory_mib=1)


@pytest.fixture
async def two_nodes(nats_url: str, clean_jetstream: None) -> AsyncIterator[tuple[LocalStack, TandemClient]]:
    async with one_dgx(nats_url, classes=CLASSES, nodes=2) as running:
        yield running


async def test_a_full_node_record_fails_no_request_while_other_nodes_have_room(
    two_nodes: tuple[LocalStack, TandemClient],
) -> None:
    s, client = two_nodes
    for allocator in s.allocators:
        allocator.node_allocs.max_bytes = RECORD_LIMIT

    # Fill h100-0's record with pinned shares until one does not fit in it.
    held: list[Assignment] = []
    waiting: tuple[AllocationRequest, AllocationFailed] | None = None
    for i in range(200):
        req = share(f"filler-{i:03d}-{'x' * 40}", node="h100-0")
        await client.submit(req)
        got = await client.wait_for(req.request_id)
        if not isinstance(got, Assignment):
            assert isinstance(got, AllocationFailed), got
            waiting = req, got
            break
        assert got.node == "h100-0"
        held.append(got)
    assert waiting is not None and len(held) > 5, "the record never filled"

    # An unpinned share would binpack onto h100-0's shared GPU: it goes to h100-1 instead.
    free = share("unpinned")
    await client.submit(free)
    got = await client.wait_for(free.request_id)
    assert isinstance(got, Assignment), got
    assert got.node == "h100-1"

    # The pinned request that did not fit is pending, not rejected (the record may have room
    # later), and says why.
    pinned, said = waiting
    assert said.retrying, said
    assert "h100-0 (its allocation record is full" in said.reason, said.reason
    assert "h100-0" in s.allocators[0].model.full

    # A release on h100-0 makes room: the pinned request waiting for it is placed there.
    await client.release(held[0].request_id)
    assert isinstance(await client.wait_for(held[0].request_id, kinds=(Freed,)), Freed)
    placed = await client.wait_for(pinned.request_id, kinds=(Assignment,), timeout=15)
    assert isinstance(placed, Assignment) and placed.node == "h100-0"


async def test_a_pending_reason_names_the_lost_node(two_nodes: tuple[LocalStack, TandemClient]) -> None:
    s, client = two_nodes
    allocator = s.allocators[0]
    s.backends["h100-1"].inject("gpu3", healthy=False, reason="XID 79")  # see the last line

    # h100-0's agent stops: a pod pinned to h100-0 hears that the node is lost, not only
    # that the other nodes' labels do not match its selector.
    await s.agents["h100-0"].stop()
    await wait_until(lambda: allocator.nodes["h100-0"].status == "lost", timeout=10, what="h100-0 lost")
    pinned = request("pinned", node="h100-0")
    await client.submit(pinned)
    pending = await client.wait_for(pinned.request_id)
    assert isinstance(pending, AllocationFailed), pending
    assert "h100-0 (lost: its node agent stopped reporting)" in pending.reason, pending.reason
    assert "labels do not match the node selector" in pending.reason  # what the core counted
    # The broken GPU of h100-1 is not named to a pod that could never go there.
    assert "h100-1" not in pending.reason


async def test_a_pending_reason_names_the_devices_out_of_service(
    two_nodes: tuple[LocalStack, TandemClient],
) -> None:
    """The core counts nodes with broken devices ("1 of them with unhealthy or cordoned
    devices"); the reason also says which node and which devices."""
    s, client = two_nodes
    allocator = s.allocators[0]
    s.backends["h100-1"].inject("gpu3", healthy=False, reason="XID 79")
    await wait_until(
        lambda: "gpu3" in allocator.nodes["h100-1"].unavailable(), what="gpu3 reported unhealthy"
    )
    eight = request("eight", gpus=8, node="h100-1")
    await client.submit(eight)
    refused = await client.wait_for(eight.request_id)
    assert isinstance(refused, AllocationFailed), refused
    assert "devices out of service on h100-1 (gpu3 unhealthy)" in refused.reason, refused.reason
