"""The allocator's scrape-time gauges (services/allocator/metrics.py AllocatorState): the
per-node series only up to ``node_metrics_max`` nodes, the cluster totals always, and a scrape
looks only at the nodes whose records changed and renders only their lines again.

The allocator is stood in for by the few attributes the collector reads (its read model's
node records, the nodes it marked changed and its count of lost nodes, the allocation records,
pending requests): it has no core, so a scrape that read the core would fail here."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from schemas.messages import AllocRecord, AssignedGpu, Assignment, NodeAllocations, NodeRecord, PodRef
from services.allocator import metrics
from services.allocator.__main__ import Replica
from services.runtime.observe.metrics import exposition
from services.topology import load_topology

TOPO = load_topology("dgx-h100")


def allocator(n: int) -> Any:
    nodes = {f"n{i}": NodeRecord(node=f"n{i}", topology=TOPO) for i in range(n)}
    changed = set(nodes)  # what ReadModel.follow_changes hands the collector
    held = AllocRecord(
        assignment=Assignment(
            request_id="r", pod=PodRef("ns", "r"), node="n0", gpus=[AssignedGpu(index=0, uuid="u")]
        )
    )
    allocs = {"n0": (NodeAllocations(node="n0", allocations={"r": held}), 1)}
    return SimpleNamespace(
        model=SimpleNamespace(nodes=nodes, changed=changed, follow_changes=lambda: changed, lost=0),
        allocs=allocs,
        book=SimpleNamespace(pending={}),
    )


def samples(state: metrics.AllocatorState, name: str) -> dict[tuple[str, ...], float]:
    """One scrape of ``state`` as Prometheus reads it: the served text, parsed."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(state)
    text = exposition(registry).decode()
    return {
        tuple(s.labels.values()): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def counted_nodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The nodes whose counts the collector computes from now on, in order."""
    calls: list[str] = []
    real = metrics.node_device_states

    def counting(record: NodeRecord, allocs: NodeAllocations | None) -> dict[tuple[str, str], int]:
        calls.append(record.node)
        return real(record, allocs)

    monkeypatch.setattr(metrics, "node_device_states", counting)
    return calls


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
    calls = counted_nodes(monkeypatch)
    samples(state, "tandem_node_devices")
    samples(state, "tandem_node_devices")
    assert sorted(calls) == ["n0", "n1", "n2"]  # the second scrape read them all from the cache
    a.model.nodes["n1"] = NodeRecord(node="n1", topology=TOPO)  # a new record: n1 again
    del a.model.nodes["n2"]
    a.model.changed |= {"n1", "n2"}  # as the read model marks them
    calls.clear()
    assert samples(state, "tandem_node_devices")["n1", "gpu", "free"] == 8
    assert calls == ["n1"] and set(state._counts) == {"n0", "n1"}


class Walked(dict[str, NodeRecord]):
    """The read model's node records, counting every walk over them."""

    walks = 0

    def __iter__(self) -> Any:
        self.walks += 1
        return super().__iter__()

    def keys(self) -> Any:
        self.walks += 1
        return super().keys()

    def values(self) -> Any:
        self.walks += 1
        return super().values()

    def items(self) -> Any:
        self.walks += 1
        return super().items()


def test_a_scrape_of_a_large_fleet_looks_only_at_the_nodes_that_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``node_metrics_max`` a scrape renders no per-node series and reads no unchanged
    node: the cluster sums move by the changed nodes' differences, and stay right."""
    a = allocator(2000)
    state = metrics.AllocatorState(a, node_metrics_max=1000)
    assert samples(state, "tandem_cluster_devices")["gpu", "allocated"] == 1  # the first scrape: all
    calls = counted_nodes(monkeypatch)
    a.model.nodes = Walked(a.model.nodes)
    held = a.allocs["n0"][0].allocations["r"]
    a.allocs["n7"] = (NodeAllocations(node="n7", allocations={"q": held}), 1)  # a second hold, on n7
    a.model.nodes["n9"] = NodeRecord(node="n9", topology=TOPO, status="lost")  # n9 lost: not counted
    a.model.lost = 1
    a.model.changed |= {"n7", "n9"}
    cluster = samples(state, "tandem_cluster_devices")
    assert sorted(calls) == ["n7", "n9"] and a.model.nodes.walks == 0
    assert cluster["gpu", "allocated"] == 2
    statuses = samples(state, "tandem_allocator_nodes")
    assert statuses[("ready",)] == 1999 and statuses[("lost",)] == 1
    del a.allocs["n0"]  # n0's hold released
    a.model.changed.add("n0")
    assert samples(state, "tandem_cluster_devices")["gpu", "allocated"] == 1


def test_a_scrape_renders_again_only_the_lines_of_the_nodes_that_changed() -> None:
    a = allocator(3)
    state = metrics.AllocatorState(a)
    first = samples(state, "tandem_node_devices")
    assert first["n0", "gpu", "allocated"] == 1 and len(first) == 3 * 8
    rendered = dict(state._lines)
    a.allocs["n1"] = a.allocs.pop("n0")  # the hold moved from n0 to n1
    a.model.changed |= {"n0", "n1"}
    second = samples(state, "tandem_node_devices")
    assert second["n0", "gpu", "allocated"] == 0 and second["n1", "gpu", "allocated"] == 1
    assert state._lines["n2"] is rendered["n2"]  # unchanged: the same bytes, not formatted again
    assert state._lines["n0"] != rendered["n0"]


def test_cluster_totals_are_the_sums_of_the_node_counts() -> None:
    state = metrics.AllocatorState(allocator(3))
    cluster = samples(state, "tandem_cluster_devices")
    assert cluster["gpu", "total"] == 24 and cluster["gpu", "free"] == 23
    assert cluster["nic", "total"] == 24 and cluster["nic", "free"] == 24
    per_node = samples(state, "tandem_node_devices")
    for kind in ("gpu", "nic"):
        for st in ("free", "allocated", "unhealthy", "cordoned"):
            assert cluster[kind, st] == sum(v for (_, k, s), v in per_node.items() if (k, s) == (kind, st))


def test_a_node_name_is_escaped_in_its_label() -> None:
    a = allocator(1)
    odd = 'a"b\\c'
    a.model.nodes = {odd: NodeRecord(node=odd, topology=TOPO)}
    a.model.changed.clear()
    a.model.changed.add(odd)
    state = metrics.AllocatorState(a)
    assert samples(state, "tandem_node_devices")[odd, "gpu", "free"] == 8


async def test_a_replica_counts_its_nodes_as_it_starts_not_at_the_first_scrape() -> None:
    a = allocator(3)
    started: list[str] = []

    class Started:
        async def start(self) -> None:
            started.append("allocator")

        async def stop(self) -> None:
            started.append("stopped")

    state = metrics.AllocatorState(a)
    replica = Replica(Started(), state)  # type: ignore[arg-type]
    assert not state._counts
    await replica.start()
    assert started == ["allocator"] and set(state._counts) == {"n0", "n1", "n2"}
    assert not a.model.changed  # the first scrape has nothing left to count
    await replica.stop()
    assert started == ["allocator", "stopped"]
