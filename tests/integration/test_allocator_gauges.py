"""The allocator's scrape-time gauges on a real read model, over a real nats-server.

A scrape looks only at the nodes the read model marked changed (services/allocator/metrics.py);
this follows the cluster sums and the node statuses through an assignment, a lost node and a
release, so a change the read model failed to mark would show as a stale gauge here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from schemas.messages import AllocationRequest, Assignment, Freed, PodRef
from services.allocator.metrics import AllocatorState
from services.client import TandemClient
from tests.integration.dgx import one_dgx
from tests.waiting import wait_until
from tools.localstack import LocalStack

pytestmark = pytest.mark.integration


def gauges(state: AllocatorState) -> dict[tuple[str, ...], float]:
    return {
        (s.name, *s.labels.values()): s.value
        for family in state.collect()
        for s in family.samples
        if s.name in ("tandem_cluster_devices", "tandem_allocator_nodes")
    }


@pytest.fixture
async def two_nodes(nats_url: str, clean_jetstream: None) -> AsyncIterator[tuple[LocalStack, TandemClient]]:
    async with one_dgx(nats_url, nodes=2) as running:
        yield running


async def test_the_gauges_follow_assignments_lost_nodes_and_releases(
    two_nodes: tuple[LocalStack, TandemClient],
) -> None:
    s, client = two_nodes
    allocator = s.allocators[0]
    state = AllocatorState(allocator)
    first = gauges(state)
    assert first["tandem_cluster_devices", "gpu", "total"] == 16
    assert first["tandem_cluster_devices", "gpu", "allocated"] == 0
    assert first["tandem_allocator_nodes", "ready"] == 2

    req = AllocationRequest(request_id="uid-g.1", pod=PodRef("ns", "g", "uid-g"), gpus=3, rdma=3)
    await client.submit(req)
    got = await client.wait_for(req.request_id)
    assert isinstance(got, Assignment), got
    await wait_until(
        lambda: gauges(state)["tandem_cluster_devices", "gpu", "allocated"] == 3, what="3 GPUs allocated"
    )
    assert gauges(state)["tandem_cluster_devices", "nic", "allocated"] == 3

    other = next(n for n in s.agents if n != got.node)
    await s.agents[other].stop()
    await wait_until(
        lambda: gauges(state)["tandem_allocator_nodes", "lost"] == 1, timeout=10, what="a node lost"
    )
    assert gauges(state)["tandem_allocator_nodes", "ready"] == 1

    await client.release(req.request_id)
    assert isinstance(await client.wait_for(req.request_id, kinds=(Freed,)), Freed)
    await wait_until(
        lambda: gauges(state)["tandem_cluster_devices", "gpu", "allocated"] == 0, what="released"
    )
