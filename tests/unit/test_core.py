"""Unit tests of the allocator core's behaviour on the built-in topologies and small trees."""

from __future__ import annotations

import msgspec
import pytest

from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, PodRef
from schemas.topology import Gpu, Nic, NodeTopology, NumaNode, PcieRoot, PcieSwitch, Socket
from services.allocator.core import (
    HOPPER_PARTITIONS,
    Cluster,
    InvalidRequest,
    Placement,
    Unschedulable,
    nvlink_partitions,
    pending_order,
)
from services.topology import load_topology


def req(rid: str = "r", gpus: int = 1, rdma: int = 1, **kw: object) -> AllocationRequest:
    return AllocationRequest(request_id=rid, pod=PodRef("ns", rid), gpus=gpus, rdma=rdma, **kw)  # type: ignore[arg-type]


def placed(result: Placement | Unschedulable) -> Placement:
    assert isinstance(result, Placement), getattr(result, "reason", result)
    return result


def two_switch_node() -> NodeTopology:
    """Switch A: gpu0 + mlx5_0; switch B: gpu1 + mlx5_1; both on one root."""
    return NodeTopology(
        name="two",
        sockets=[
            Socket(
                id=0,
                numa_nodes=[
                    NumaNode(
                        id=0,
                        roots=[
                            PcieRoot(
                                id="r0",
                                switches=[
                                    PcieSwitch(
                                        id="A", gpus=[Gpu(index=0, uuid="G0")], nics=[Nic(name="mlx5_0")]
                                    ),
                                    PcieSwitch(
                                        id="B", gpus=[Gpu(index=1, uuid="G1")], nics=[Nic(name="mlx5_1")]
                                    ),
                                ],
                            )
                        ],
                    )
                ],
            )
        ],
    ).validate()


def test_hopper_partitions_built_in_and_overridable() -> None:
    h100 = load_topology("dgx-h100")
    assert nvlink_partitions(h100) == [tuple(p) for p in HOPPER_PARTITIONS]
    no_table = msgspec.structs.replace(h100, nvlink_partitions=[])
    assert nvlink_partitions(no_table) == [tuple(p) for p in HOPPER_PARTITIONS]  # built-in table
    custom = msgspec.structs.replace(h100, nvlink_partitions=[[0, 1, 2, 3, 4, 5, 6, 7]])
    assert nvlink_partitions(custom) == [(0, 1, 2, 3, 4, 5, 6, 7)]
    # A PCIe box without NVLink has no partitions; gpu-only-8 (A100 NVSwitch) gets the table.
    assert nvlink_partitions(load_topology("pcie-4gpu-2nic")) == []


def test_two_gpu_request_takes_an_nvlink_pair_and_keeps_partitions_whole() -> None:
    c = Cluster()
    c.set_node("h", load_topology("dgx-h100"))
    p = placed(c.decide(req("a", 2, 2)))
    assert [g.index for g in p.gpus] == [0, 1]
    assert p.scope == "pcie-switch" and all(x.scope == "pcie-switch" for x in p.pairs)
    c.hold("h", "a", p.devices())
    q = placed(c.decide(req("b", 2, 2)))
    assert [g.index for g in q.gpus] == [2, 3]  # the other half of the 0-3 quad, not 4-5
    c.hold("h", "b", q.devices())
    four = placed(c.decide(req("c", 4, 4)))
    assert [g.index for g in four.gpus] == [4, 5, 6, 7]


def test_joint_choice_beats_gpus_first() -> None:
    c = Cluster()
    c.set_node("n", two_switch_node())
    c.hold("n", "other", ["mlx5_0"])  # gpu0's NIC is taken: gpu0 can only pair at root level
    p = placed(c.decide(req("x", 1, 1, scope="pcie-switch", policy="required")))
    assert [g.index for g in p.gpus] == [1] and [n.name for n in p.nics] == ["mlx5_1"]
    c.hold("n", "x", p.devices())
    refused = c.decide(req("y", 1, 1, scope="pcie-switch", policy="required"))
    assert isinstance(refused, Unschedulable)
    assert refused.counts == {"fewer than 1 free NICs": 1}
    preferred = c.decide(req("z", 1, 0))
    assert placed(preferred).gpus[0].index == 0


def test_required_scope_refusal_names_the_shortfall() -> None:
    c = Cluster()
    c.set_node("n", two_switch_node())
    c.hold("n", "nic0", ["mlx5_0"])
    c.hold("n", "gpu1", ["gpu1"])
    r = c.decide(req("q", 1, 1, scope="pcie-switch", policy="required"))
    assert isinstance(r, Unschedulable)
    assert r.counts == {"1 GPUs free but only 0 NICs under their PCIe switches": 1}
    assert r.reasons[0].code == "scope"
    ok = placed(c.decide(req("q", 1, 1, scope="pcie-root", policy="required")))
    assert ok.pairs[0].scope == "pcie-root" and ok.met
    pref = placed(c.decide(req("q", 1, 1, scope="pcie-switch", policy="preferred")))
    assert pref.pairs[0].scope == "pcie-root" and not pref.met


def test_reason_is_aggregated_over_nodes() -> None:
    c = Cluster()
    for i in range(3):
        c.set_node(f"full{i}", load_topology("dgx-h100"))
        c.hold(f"full{i}", "big", [f"gpu{k}" for k in range(6)])
    for i in range(2):
        c.set_node(f"bare{i}", load_topology("gpu-only-8"))
    r = c.decide(req("w", 4, 4))
    assert isinstance(r, Unschedulable)
    assert r.counts == {"fewer than 4 free GPUs": 3, "fewer than 4 free NICs": 2}
    assert r.reason.endswith("3 nodes: fewer than 4 free GPUs; 2 nodes: fewer than 4 free NICs")
    assert Cluster().decide(req()).reason == "no nodes"  # type: ignore[union-attr]


def test_unavailable_and_port_down_devices_are_never_used() -> None:
    c = Cluster()
    c.set_node("n", two_switch_node(), unavailable=["gpu0"])
    p = placed(c.decide(req("a", 1, 1)))
    assert p.gpus[0].index == 1
    c.set_unavailable("n", ["gpu0", "gpu1"])
    assert isinstance(c.decide(req("a", 1, 1)), Unschedulable)
    c.set_unavailable("n", [])  # recovered
    assert placed(c.decide(req("a", 2, 2))).devices() == ["gpu0", "gpu1", "mlx5_0", "mlx5_1"]
    topo = two_switch_node()
    topo.sockets[0].numa_nodes[0].roots[0].switches[0].nics[0].port_state = "down"
    c.set_node("n", topo)
    assert "mlx5_0" not in c.free_devices("n")
    assert isinstance(c.decide(req("b", 2, 2)), Unschedulable)


def test_device_classes_filter_gpus_and_nics_and_hand_out_vfs() -> None:
    classes = {
        "default": DeviceClass(),
        "h100": DeviceClass(gpu_models=["H100"], gpu_min_memory_mib=80000),
        "roce-vf": DeviceClass(nic_link_type="ethernet", nic_function="vf", scope="pcie-switch"),
        "ib-400": DeviceClass(nic_link_type="infiniband", nic_min_speed_gbps=400),
    }
    c = Cluster(device_classes=classes)
    c.set_node("a100", load_topology("dgx-a100"))
    c.set_node("pcie", load_topology("pcie-4gpu-2nic"))
    r = c.decide(req("x", 1, 0, device_class="h100"))
    assert isinstance(r, Unschedulable)
    assert r.counts == {"fewer than 1 free GPUs of class 'h100'": 2}
    vf = placed(c.decide(req("v", 2, 2, device_class="roce-vf")))
    assert vf.node == "pcie"
    assert all(n.vf is not None and n.pf in ("mlx5_0", "mlx5_1") and n.name != n.pf for n in vf.nics)
    assert {p.scope for p in vf.pairs} == {"pcie-switch"}
    c.hold(vf.node, "v", vf.devices())
    # A PF whose VFs are in use cannot be handed out whole.
    free = c.free_devices("pcie")
    assert "mlx5_0" not in free and any(n.name in free for n in vf.nics) is False
    ib = c.decide(req("i", 1, 1, device_class="ib-400"))
    assert isinstance(ib, Unschedulable) and "fewer than 1 free NICs of class 'ib-400'" in ib.counts
    with pytest.raises(InvalidRequest, match="unknown device class 'nope'"):
        c.decide(req("n", 1, 1, device_class="nope"))


def test_invalid_requests() -> None:
    c = Cluster()
    with pytest.raises(InvalidRequest, match="per-gpu gives every GPU its own NIC, so it needs as many rdma"):
        c.decide(req("p", 2, 1, pairing="per-gpu"))
    with pytest.raises(InvalidRequest, match="gpus and rdma are both 0"):
        c.decide(req("p", 0, 0))
    with pytest.raises(InvalidRequest, match="node policy"):
        Cluster(node_policy="random")  # type: ignore[arg-type]
    assert c.normalise(req("p", 2, 1)).pairing == "shared"
    assert c.normalise(req("p", 2, 2)).pairing == "per-gpu"
    assert c.normalise(req("p", 0, 2)).pairing == "shared"


def test_node_selector_and_labels() -> None:
    c = Cluster()
    c.set_node("a", load_topology("dgx-h100"), labels={"pool": "train"})
    c.set_node("b", load_topology("dgx-h100"))
    p = placed(c.decide(req("s", 1, 1, node_selector={"pool": "train"})))
    assert p.node == "a"
    # Topology labels are merged in.
    assert placed(c.decide(req("t", 1, 1, node_selector={"tandem.io/nvlink": "nvswitch"}))).candidates == 2
    r = c.decide(req("u", 1, 1, node_selector={"pool": "infer"}))
    assert isinstance(r, Unschedulable) and r.counts == {"labels do not match the node selector": 2}


def test_binpack_and_spread() -> None:
    for policy, expect in (("binpack", "busy"), ("spread", "idle")):
        c = Cluster(node_policy=policy)  # type: ignore[arg-type]
        c.set_node("idle", load_topology("dgx-h100"))
        c.set_node("busy", load_topology("dgx-h100"))
        c.hold("busy", "x", ["gpu0", "gpu1", "mlx5_0", "mlx5_1"])
        assert placed(c.decide(req("r", 2, 2))).node == expect


def test_quality_before_binpack() -> None:
    c = Cluster()
    c.set_node("idle", load_topology("dgx-h100"))
    c.set_node("busy", load_topology("dgx-h100"))
    c.hold("idle", "one", ["gpu7"])  # not fresh any more
    # busy has 2 GPUs left whose NICs are taken: binpack alone would put the pair there.
    c.hold("busy", "x", ["gpu0", "gpu1", "gpu2", "gpu3", "gpu4", "gpu5", "mlx5_6", "mlx5_7"])
    p = placed(c.decide(req("r", 2, 2)))
    assert p.node == "idle" and p.scope == "pcie-switch"
    assert p.candidates == 2


def test_the_best_scope_first_unless_the_class_says_used_first() -> None:
    """A used node that can only pair across switches, and a free one with whole switches:
    by default the better scope (issue 26, item 8); a class with node_order "used-first"
    takes the used node (free servers stay whole for large aligned jobs); a required scope
    is met either way."""
    classes = {"default": DeviceClass(), "packed": DeviceClass(node_order="used-first")}
    c = Cluster(device_classes=classes)
    c.set_node("fresh", load_topology("dgx-h100"))
    c.set_node("busy", load_topology("dgx-h100"))
    c.hold("busy", "x", ["gpu0", "gpu1", "gpu2", "gpu3", "gpu4", "gpu5", "mlx5_6", "mlx5_7"])
    a = placed(c.decide(req("a", 2, 2)))
    assert a.node == "fresh" and a.met and a.scope == "pcie-switch"
    p = placed(c.decide(req("r", 2, 2, device_class="packed")))  # a used node, alignment missed
    assert p.node == "busy" and not p.met
    q = placed(c.decide(req("q", 2, 2, policy="required", device_class="packed")))
    assert q.node == "fresh" and q.met and q.scope == "pcie-switch"


def test_among_equal_alignment_a_used_node_before_a_fresh_one() -> None:
    c = Cluster()
    c.set_node("fresh", load_topology("dgx-h100"))
    c.set_node("busy", load_topology("dgx-h100"))
    c.hold("busy", "x", ["gpu0", "mlx5_0"])
    assert placed(c.decide(req("r", 2, 2))).node == "busy"


def test_on_an_empty_mixed_fleet_the_default_takes_the_aligned_server() -> None:
    """Issue 26, item 8: 2 GPUs + 2 NICs on an empty cluster. The default takes the DGX, both
    pairs on their switches; a class with node_order used-first opens the smallest server (a
    PCIe box, one pair across its root), keeping the DGX whole for large aligned jobs."""
    classes = {"default": DeviceClass(), "packed": DeviceClass(node_order="used-first")}
    c = Cluster(device_classes=classes)
    c.set_node("pcie-0", load_topology("pcie-4gpu-2nic"))
    c.set_node("h100-0", load_topology("dgx-h100"))
    a = placed(c.decide(req("a", 2, 2)))
    assert a.node == "h100-0" and a.scope == "pcie-switch"
    p = placed(c.decide(req("r", 2, 2, device_class="packed")))
    assert p.node == "pcie-0" and p.scope == "pcie-root"


def test_gpu_only_request_goes_where_no_nic_is_wasted() -> None:
    c = Cluster()
    c.set_node("dgx", load_topology("dgx-h100"))
    c.set_node("gpus", load_topology("gpu-only-8"))
    for name in ("dgx", "gpus"):
        c.hold(name, "w", ["gpu0"])
    assert placed(c.decide(req("g", 2, 0))).node == "gpus"
    assert placed(c.decide(req("n", 0, 1))).node == "dgx"


def test_holds_survive_set_node_and_are_idempotent() -> None:
    c = Cluster()
    c.hold("late", "early", ["gpu0"])  # a hold for a node not known yet
    c.set_node("late", load_topology("dgx-h100"))
    assert "gpu0" not in c.free_devices("late")
    c.hold("late", "early", ["gpu0"])
    c.set_node("late", load_topology("dgx-h100"), unavailable=["gpu1"])
    assert not {"gpu0", "gpu1"} & set(c.free_devices("late"))
    c.release("late", "early")
    c.release("late", "early")
    assert "gpu0" in c.free_devices("late")
    c.remove_node("late")
    assert c.nodes() == []
    assert isinstance(c.decide(req()), Unschedulable)


def test_decide_does_not_change_state() -> None:
    c = Cluster()
    c.set_node("n", load_topology("dgx-a100"))
    first = placed(c.decide(req("a", 4, 4)))
    assert placed(c.decide(req("a", 4, 4))).devices() == first.devices()
    assert len(c.free_devices("n")) == 8 + 10 + 8


def test_shared_and_nic_only_and_gpu_only() -> None:
    c = Cluster()
    c.set_node("n", load_topology("dgx-h100"))
    shared = placed(c.decide(req("s", 4, 2, scope="pcie-switch", policy="required")))
    assert len(shared.pairs) == 4 and {p.scope for p in shared.pairs} == {"pcie-switch"}
    assert len({p.nic for p in shared.pairs}) == 2
    nic_only = placed(c.decide(req("n", 0, 2)))
    assert nic_only.gpus == [] and len(nic_only.nics) == 2 and nic_only.pairs == []
    gpu_only = placed(c.decide(req("g", 8, 0)))
    assert len(gpu_only.gpus) == 8 and gpu_only.scope == "node"


def test_pending_order() -> None:
    a = req("a")
    a.priority, a.created_at = 0, 1.0
    b = req("b")
    b.priority, b.created_at = 5, 3.0
    d = req("d")
    d.priority, d.created_at = 5, 2.0
    assert [r.request_id for r in pending_order([a, b, d])] == ["d", "b", "a"]


def test_change_log_compaction_and_stale_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.allocator.core.cluster as cluster_mod

    monkeypatch.setattr(cluster_mod, "_LOG_MAX", 40)
    c = Cluster()
    for i in range(6):
        c.set_node(f"n{i}", load_topology("dgx-h100"))
    rare = req("rare", 8, 8, policy="required")
    assert placed(c.decide(rare)).candidates == 6
    for step in range(200):  # churn: far more log entries than _LOG_MAX
        p = placed(c.decide(req(f"s{step}", 1, 1)))
        c.hold(p.node, f"s{step}", p.devices())
        if step % 5:
            c.release(p.node, f"s{step}")
    assert len(c._whole.log) <= 40
    fresh = Cluster()
    for name in c.nodes():
        fresh.set_node(name, load_topology("dgx-h100"))
        for rid, devs in c.holds(name).items():
            fresh.hold(name, rid, devs)
    for r in (rare, req("x", 2, 2), req("y", 4, 0)):
        got, again = c.decide(r), fresh.decide(r)
        assert type(got) is type(again)
        if isinstance(got, Placement):
            assert isinstance(again, Placement)
            assert got.quality == again.quality and got.candidates == again.candidates
        else:
            assert isinstance(again, Unschedulable)
            assert got.counts == again.counts


def _reserve_cluster(reserve: float | None) -> Cluster:
    """h100: NUMA 1 free (4 aligned pairs, a whole 4+4 unit); pcie: only root-level pairs left."""
    c = Cluster() if reserve is None else Cluster(reserve=reserve)
    c.set_node("h100", load_topology("dgx-h100"))
    c.hold("h100", "x", ["gpu0", "gpu1", "gpu2", "gpu3", "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"])
    c.set_node("pcie", load_topology("pcie-4gpu-2nic"))
    c.hold("pcie", "y", ["gpu0", "mlx5_0"])
    return c


def test_reserve_pressure_trades_a_small_jobs_alignment_for_large_aligned_capacity() -> None:
    # No node can take the largest aligned job (8 GPUs + 8 NICs on switches): with a reserve
    # of one such node, a preferred 1+1 takes a root-level pair on the PCIe box instead of
    # breaking the h100's whole 4+4 unit.
    p = placed(_reserve_cluster(1.0).decide(req("a", 1, 1)))
    assert p.node == "pcie" and p.pairs[0].scope == "pcie-root" and not p.met
    # Without the reserve (or with the default share, which needs 50 such servers to hold one
    # in reserve) alignment comes first.
    for reserve in (0.0, None):
        q = placed(_reserve_cluster(reserve).decide(req("a", 1, 1)))
        assert q.node == "h100" and q.pairs[0].scope == "pcie-switch"
    # A required request is never placed below its scope, pressure or not.
    r = placed(_reserve_cluster(1.0).decide(req("r", 1, 1, policy="required")))
    assert r.node == "h100" and r.met


def test_reserve_pressure_ends_when_a_node_can_take_the_largest_job_again() -> None:
    c = _reserve_cluster(0.5)  # two servers can take 8+8 when free: a reserve of one
    c.set_node("spare", load_topology("dgx-h100"))  # whole: the reserve is met
    p = placed(c.decide(req("a", 1, 1)))
    assert p.node == "h100" and p.pairs[0].scope == "pcie-switch"  # and "spare" stays whole
    c.hold("spare", "z", ["gpu7"])  # no node can take 8+8 now: pressure
    # The broken server has 7 aligned pairs left (a 4+4 unit plus a partial one): a pair from
    # it costs no 4+4 capacity, one from "h100" would break its only 4+4 unit.
    q = placed(c.decide(req("a", 1, 1)))
    assert q.node == "spare" and q.pairs[0].scope == "pcie-switch"
    c.release("spare", "z")
    assert placed(c.decide(req("a", 1, 1))).node == "h100"
    with pytest.raises(InvalidRequest, match="reserve"):
        Cluster(reserve=1.5)


def test_reserve_follows_the_fleet_as_nodes_arrive_and_leave() -> None:
    c = _reserve_cluster(0.5)  # one server able to take 8+8: a 50 % reserve holds none of it
    assert placed(c.decide(req("a", 1, 1))).node == "h100"
    c.set_node("busy", load_topology("dgx-h100"))  # now two: a reserve of one, and none free
    c.hold("busy", "all", [f"gpu{i}" for i in range(8)])
    p = placed(c.decide(req("a", 1, 1)))
    assert p.node == "pcie" and p.pairs[0].scope == "pcie-root"
    c.remove_node("busy")
    assert placed(c.decide(req("a", 1, 1))).node == "h100"


def test_refusal_says_when_failed_devices_are_part_of_why() -> None:
    cluster = Cluster()
    topo = load_topology("pcie-4gpu-2nic")
    cluster.set_node("sick", topo, unavailable=["gpu2"])
    cluster.set_node("busy", topo)
    cluster.hold("busy", "other", ["gpu0"])
    out = cluster.decide(req("all4", gpus=4, rdma=0))
    assert isinstance(out, Unschedulable)
    assert "2 nodes: fewer than 4 free GPUs (1 of them with unhealthy or cordoned devices)" in out.reason
    cluster.set_unavailable("sick", [])
    cluster.hold("sick", "x", ["gpu3"])
    out = cluster.decide(req("all4b", gpus=4, rdma=0))
    assert isinstance(out, Unschedulable) and "unhealthy" not in out.reason


def test_scope_reason_says_why_a_preferred_scope_was_missed() -> None:
    """A class with node order used-first: on an empty mixed cluster a 2+2 request takes the
    smallest free server, a PCIe box pairing across its root complex, while a DGX could pair
    both on their switches; the reason names that server and the class option. The default
    (alignment-first) goes to the DGX and meets the scope: no reason. When no node could do
    better, the reason says why no node could: the refusals of the scope required."""
    c = Cluster(device_classes={"default": DeviceClass(), "packed": DeviceClass(node_order="used-first")})
    c.set_node("pcie-0", load_topology("pcie-4gpu-2nic"))
    c.set_node("h100-0", load_topology("dgx-h100"))
    r = req("r", 2, 2, device_class="packed")
    p = placed(c.decide(r))
    assert (p.node, p.scope, p.met) == ("pcie-0", "pcie-root", False)
    why = c.scope_reason(p)
    assert why.startswith("pcie-switch pairs were possible on h100-0, a server not in use"), why
    assert "the class 'packed' places on servers in use" in why and "(node_order: used-first)" in why
    a = req("a", 2, 2)
    q = placed(c.decide(a))
    assert (q.node, q.met) == ("h100-0", True) and c.scope_reason(q) == ""
    # Only PCIe boxes, one of them nearly full: nothing could pair at pcie-switch, and why.
    for order in ("alignment-first", "used-first"):
        only = Cluster(device_classes={"default": DeviceClass(node_order=order)})
        only.set_node("pcie-0", load_topology("pcie-4gpu-2nic"))
        only.set_node("pcie-1", load_topology("pcie-4gpu-2nic"))
        only.hold("pcie-1", "x", ["gpu0", "gpu1", "gpu2"])
        p = placed(only.decide(a))
        assert (p.node, p.scope) == ("pcie-0", "pcie-root")
        assert only.scope_reason(p) == (
            "no node could pair at pcie-switch now (1 node: 2 GPUs free but only 1 NICs under "
            "their PCIe switches; 1 node: fewer than 2 free GPUs)"
        ), order


def test_scope_reason_names_a_better_node_of_another_replicas_shard() -> None:
    """Alignment-first, but an allocator replica takes a node of its own shard while one can
    take the request (services/allocator/replicas.py): a weaker scope, and the note says so."""
    c = Cluster()
    c.set_node("pcie-0", load_topology("pcie-4gpu-2nic"), shard="0")
    c.set_node("h100-0", load_topology("dgx-h100"), shard="1")
    r = req("r", 2, 2)
    p = placed(c.decide(r, prefer_shard="0"))
    assert (p.node, p.scope) == ("pcie-0", "pcie-root")
    assert c.scope_reason(p).startswith(
        "pcie-switch pairs were possible on h100-0, a node another allocator replica places on first"
    )
