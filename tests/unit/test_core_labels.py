"""Labels and node selectors in the core's index, in the allocator service's configuration:
every node labelled with its ``kubernetes.io/hostname``, some requests pinned to one node.

What must hold: a label unique per node does not split the fleet into one group per node; a
pinned request is decided on its node (or says why not) and leaves no per-selector state; a
selector matching many nodes groups the fleet by its key once; memory stays bounded whatever
the stream of selectors and request shapes.
"""

from __future__ import annotations

import pytest

from schemas.messages import AllocationRequest, PodRef
from services.allocator.core import Cluster, InvalidRequest, Placement, Unschedulable
from services.topology import load_topology

HOST = "kubernetes.io/hostname"


def req(rid: str, gpus: int = 1, rdma: int = 1, **kw: object) -> AllocationRequest:
    return AllocationRequest(request_id=rid, pod=PodRef("ns", rid), gpus=gpus, rdma=rdma, **kw)  # type: ignore[arg-type]


def placed(result: Placement | Unschedulable) -> Placement:
    assert isinstance(result, Placement), getattr(result, "reason", result)
    return result


def fleet(n: int, *, pinned_max: int | None = None, pools: int = 0) -> Cluster:
    c = Cluster() if pinned_max is None else Cluster(pinned_max=pinned_max)
    topo = load_topology("dgx-h100")
    for i in range(n):
        labels = {HOST: f"n{i}"}
        if pools:
            labels["pool"] = f"p{i % pools}"
        c.set_node(f"n{i}", topo, labels=labels)
    return c


def test_hostname_labels_do_not_split_groups() -> None:
    c = fleet(50)
    assert c.group_count() == 1
    assert c.cache_stats()["hardware_ids"] == 1
    assert c.labels("n7")[HOST] == "n7"  # kept on the node, only not a grouping key
    p = placed(c.decide(req("a", 8, 8)))
    c.hold(p.node, "a", p.devices())
    assert c.group_count() == 2  # one busy node, 49 free: two groups, not fifty


def test_pinned_request_lands_on_its_node_or_says_why() -> None:
    c = fleet(50)
    p = placed(c.decide(req("a", 2, 2, node_selector={HOST: "n7"})))
    assert p.node == "n7" and p.candidates == 1
    assert {x.scope for x in p.pairs} == {"pcie-switch"}
    c.hold("n7", "all", [f"gpu{i}" for i in range(8)])
    full = c.decide(req("b", 1, 1, node_selector={HOST: "n7"}))
    assert isinstance(full, Unschedulable)
    assert full.counts == {"labels do not match the node selector": 49, "fewer than 1 free GPUs": 1}
    unknown = c.decide(req("c", 1, 1, node_selector={HOST: "gone"}))
    assert isinstance(unknown, Unschedulable)
    assert unknown.counts == {"labels do not match the node selector": 50}
    # Every pair of the selector must match: n8 is not in pool "x".
    both = c.decide(req("d", 1, 1, node_selector={HOST: "n8", "pool": "x"}))
    assert isinstance(both, Unschedulable) and both.counts == {"labels do not match the node selector": 50}
    # A node that goes away and comes back is found again under its label.
    c.remove_node("n8")
    assert isinstance(c.decide(req("e", 1, 1, node_selector={HOST: "n8"})), Unschedulable)
    c.set_node("n8", load_topology("dgx-h100"), labels={HOST: "n8", "pool": "x"})
    assert placed(c.decide(req("f", 1, 1, node_selector={HOST: "n8", "pool": "x"}))).node == "n8"


def test_pinned_refusal_says_when_failed_devices_are_part_of_why() -> None:
    c = fleet(5)
    c.set_unavailable("n2", ["gpu0"])
    c.hold("n2", "x", [f"gpu{i}" for i in range(1, 8)])
    out = c.decide(req("a", 1, 1, node_selector={HOST: "n2"}))
    assert isinstance(out, Unschedulable)
    assert "1 node: fewer than 1 free GPUs (1 of them with unhealthy or cordoned devices)" in out.reason


def test_pinned_decisions_keep_no_state_per_selector() -> None:
    c = fleet(300)
    before = c.cache_stats()
    for i in range(2000):
        node = f"n{(i * 7) % 300}"
        p = placed(c.decide(req(f"r{i}", 1, 1, node_selector={HOST: node})))
        assert p.node == node
    after = c.cache_stats()
    assert after["signatures"] == before["signatures"] == 0
    assert after["grouping_labels"] == 0 and after["groups"] == 1
    assert after["evaluations"] <= 1  # one node state, one request shape: one search


def test_selector_matching_many_nodes_groups_by_its_key_once() -> None:
    c = fleet(40, pinned_max=8, pools=2)
    assert c.group_count() == 1
    p = placed(c.decide(req("a", 1, 1, node_selector={"pool": "p1"})))
    assert c.labels(p.node)["pool"] == "p1"
    assert c.grouping_labels() == frozenset({"pool"})
    assert c.group_count() == 2  # split by pool, not by hostname
    c.hold(p.node, "a", p.devices())
    # The held node is the fullest of pool p1: binpack goes back to it.
    q = placed(c.decide(req("b", 1, 1, node_selector={"pool": "p1"})))
    assert q.node == p.node
    # A pinned request after the regroup still resolves directly and adds no grouping key.
    assert placed(c.decide(req("c", 1, 1, node_selector={HOST: "n3"}))).node == "n3"
    assert c.grouping_labels() == frozenset({"pool"})
    refused = c.decide(req("d", 1, 1, node_selector={"pool": "nope"}))
    assert isinstance(refused, Unschedulable)
    assert refused.counts == {"labels do not match the node selector": 40}


def test_direct_and_grouped_selector_paths_choose_alike() -> None:
    """The same fleet state decided with every selector through the groups (pinned_max=0)
    and with every selector on its nodes directly: the same node and devices."""
    direct, grouped = fleet(12, pools=3), fleet(12, pinned_max=0, pools=3)
    for c in (direct, grouped):
        c.hold("n4", "x", ["gpu0", "gpu1", "mlx5_0", "mlx5_1"])
        c.hold("n7", "y", ["gpu0", "gpu1", "gpu2", "gpu3", "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"])
        c.set_unavailable("n1", ["gpu6"])
    for i, (g, r, selector) in enumerate(
        [
            (2, 2, {"pool": "p1"}),
            (4, 4, {"pool": "p1"}),
            (1, 0, {"pool": "p1"}),
            (8, 8, {"pool": "p1"}),
            (2, 2, {HOST: "n4"}),
            (8, 8, {HOST: "n4"}),
            (4, 4, {"pool": "p0", HOST: "n6"}),
        ]
    ):
        a = direct.decide(req(f"r{i}", g, r, node_selector=selector))
        b = grouped.decide(req(f"r{i}", g, r, node_selector=selector))
        assert type(a) is type(b)
        if isinstance(a, Placement):
            assert isinstance(b, Placement)
            assert (a.node, a.devices(), a.quality) == (b.node, b.devices(), b.quality)
        else:
            assert isinstance(b, Unschedulable)
            assert a.counts == b.counts
    assert direct.grouping_labels() == frozenset()
    assert grouped.grouping_labels() == frozenset({"pool", HOST})


def test_signature_states_stay_within_their_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.allocator.core.cluster as cluster_mod

    monkeypatch.setattr(cluster_mod, "_SIG_RECORDS", 40)
    c = fleet(30, pools=3)
    c.hold("n0", "x", ["gpu0"])
    for i in range(30):
        c.hold(f"n{i}", "y", [f"gpu{i % 8}"])  # many groups
    for g in range(1, 9):
        for r in range(0, 9):
            c.decide(req(f"r{g}-{r}", g, r, scope="numa"))
            stats = c.cache_stats()
            # Within the budget, or a single (the current) signature over it.
            assert stats["signature_records"] <= 40 or stats["signatures"] == 1
    assert c.cache_stats()["signatures"] <= 5  # of the 72 request shapes decided


def test_pinned_max_must_not_be_negative() -> None:
    with pytest.raises(InvalidRequest, match="pinned_max"):
        Cluster(pinned_max=-1)


def test_memoized_selector_matches_stay_bounded_and_follow_a_regroup(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.allocator.core.cluster as cluster_mod

    monkeypatch.setattr(cluster_mod, "_SELECTOR_MATCH_MAX", 3)
    c = fleet(24, pinned_max=0, pools=4)
    for i in range(12):
        pool = f"p{i % 4}"
        p = placed(c.decide(req(f"r{i}", 1, 1, node_selector={"pool": pool})))
        assert c.labels(p.node)["pool"] == pool
        assert c.cache_stats()["selector_matches"] <= 3
    # A new grouping key renumbers the hardware ids: a memo kept across it would answer for
    # other labels. The nodes come back in the opposite order, racks split the pools, and each
    # selector still lands on its own nodes.
    monkeypatch.setattr(cluster_mod, "_SELECTOR_MATCH_MAX", 1000)
    c = fleet(24, pinned_max=0, pools=4)
    for i in range(4):
        placed(c.decide(req(f"u{i}", 1, 1, node_selector={"pool": f"p{i}"})))
    for i in range(24):
        c.remove_node(f"n{i}")
    for i in reversed(range(24)):
        labels = {HOST: f"n{i}", "pool": f"p{i % 4}", "rack": f"k{i % 3}"}
        c.set_node(f"n{i}", load_topology("dgx-h100"), labels=labels)
    # n23 (pool p3), the fullest node, is the first of the new hardware ids.
    c.hold("n23", "big", [f"gpu{g}" for g in range(6)])
    for i, (pool, rack) in enumerate([("p1", "k2"), ("p2", "k0"), ("p0", "k2"), ("p3", "k1")]):
        p = placed(c.decide(req(f"s{i}", 1, 1, node_selector={"pool": pool, "rack": rack})))
        assert (c.labels(p.node)["pool"], c.labels(p.node)["rack"]) == (pool, rack)
    for i in range(4):
        p = placed(c.decide(req(f"t{i}", 1, 1, node_selector={"pool": f"p{i}"})))
        assert c.labels(p.node)["pool"] == f"p{i}"
