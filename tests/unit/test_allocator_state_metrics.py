"""The allocator's scrape-time gauges (services/allocator/metrics.py AllocatorState): the
per-node series only up to ``node_metrics_max`` nodes (a scrape renders them on the event loop),
the cluster totals always, and a node's counts computed again only when its records changed.

The allocator is stood in for by the few attributes the collector reads (its read model's
node records, the allocation records, pending requests, the core's totals)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from schemas.messages import AllocRecord, AssignedGpu, Assignment, NodeAllocations, NodeRecord, PodRef
from services.allocator import metrics
from services.topology import load_topology

TOPO = load_topology("dgx-h100")


def allocator(n: int) -> Any:
    nodes = {f"n{i}": NodeRecord(node=f"n{i}", topology=TOPO) for i in range(n)}
    held = AllocRecord(
        assignment=Assignment(
            request_id="r", pod=PodRef("ns", "r"), node="n0", gpus=[AssignedGpu(index=0, uuid="u")]
        )
    )
    allocs = {"n0": (NodeAllocations(node="n0", allocations={"r": held}), 1)}
    totals = {"gpus": 8 * n, "free_gpus": 8 * n - 1, "nics": 8 * n, "free_nics": 8 * n}
    return SimpleNamespace(
        model=SimpleNamespace(nodes=nodes, catch_up=lambda: None),
        allocs=allocs,
        book=SimpleNamespace(pending={}),
        cluster=SimpleNamespace(totals=lambda: totals),
    )


def samples(state: metrics.AllocatorState, name: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(s.labels.values()): s.value
        for family in state.collect()
        for s in family.samples
        if s.name == name
    }


@pytest.mark.parametrize(("nodes", "per_node"), [(3, True), (4, False)])
def test_per_node_series_only_up_to_the_limit_cluster_totals_always(nodes: int, per_node: bool) -> None:
    state = metrics.AllocatorState(allocator(nodes), node_metrics_max=3)
    mine = samples(state, "tandem_node_devices")
    assert bool(mine) is per_node
    if per_node:
        assert mine["n0", "gpu", "allocated"] == 1 and mine["n1", "gpu", "free"] == 8
    assert samples(state, "tandem_cluster_devices")["gpu", "allocated"] == 1


def test_a_nodes_counts_are_computed_again_only_when_its_records_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = allocator(3)
    state = metrics.AllocatorState(a)
    calls: list[str] = []
    real = metrics.node_device_states

    def counting(record: NodeRecord, allocs: NodeAllocations | None) -> dict[tuple[str, str], int]:
        calls.append(record.node)
        return real(record, allocs)

    monkeypatch.setattr(metrics, "node_device_states", counting)
    samples(state, "tandem_node_devices")
    samples(state, "tandem_node_devices")
    assert sorted(calls) == ["n0", "n1", "n2"]  # the second scrape read them all from the cache
    a.model.nodes["n1"] = NodeRecord(node="n1", topology=TOPO)  # a new record: n1 again
    del a.model.nodes["n2"]
    calls.clear()
    assert samples(state, "tandem_node_devices")["n1", "gpu", "free"] == 8
    assert calls == ["n1"] and set(state._counts) == {"n0", "n1"}
