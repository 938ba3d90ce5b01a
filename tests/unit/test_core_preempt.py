"""Priority preemption in the core (services/allocator/core/preempt.py): worked cases.

The exhaustive check over random clusters is tests/property/test_core_preemption.py; these
pin the order's parts one at a time on a DGX H100 (8 GPUs, 8 NICs, one GPU and one NIC per
PCIe switch)."""

from __future__ import annotations

import msgspec
import pytest

from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, PodRef
from services.allocator.core import Cluster, InvalidRequest, Placement, Unschedulable, preempt
from services.allocator.core.request import normalise
from services.topology import load_topology


def req(rid: str, gpus: int, rdma: int = 0, *, priority: int = 10, **kw: object) -> AllocationRequest:
    return AllocationRequest(
        request_id=rid,
        pod=PodRef("ns", rid),
        gpus=gpus,
        rdma=rdma,
        priority=priority,
        preemption="lower-priority",
        **kw,  # type: ignore[arg-type]
    )


def plan_for(cluster: Cluster, request: AllocationRequest) -> preempt.Preemption | None:
    """The core's preemption step for ``request``, on the request as the core resolves it."""
    return preempt.plan(cluster, cluster.normalise(request))


def full_node(holds: dict[str, tuple[list[int], int, bool]]) -> Cluster:
    """One DGX H100 whose GPUs ``holds`` takes: request id -> (GPU indexes, priority,
    preemptible)."""
    cluster = Cluster()
    cluster.set_node("n0", load_topology("dgx-h100"))
    for rid, (gpus, prio, ok) in holds.items():
        cluster.hold("n0", rid, [f"gpu{i}" for i in gpus], priority=prio, preemptible=ok)
    return cluster


def test_fewest_victims_first_even_if_of_higher_priority() -> None:
    cluster = full_node(
        {"a": ([0, 1], 5, True), "b": ([2], 0, True), "c": ([3], 0, True), "d": ([4, 5, 6, 7], 7, True)}
    )
    request = req("hi", 2)
    assert isinstance(cluster.decide(request), Unschedulable)
    plan = plan_for(cluster, request)
    assert plan is not None
    # One victim (a, priority 5) beats two of priority 0 (b and c).
    assert [v.request_id for v in plan.victims] == ["a"]
    assert {g.index for g in plan.placement.gpus} == {0, 1}


def test_lowest_priorities_among_sets_of_one_size() -> None:
    cluster = full_node({"a": ([0, 1], 3, True), "b": ([2, 3], 1, True), "c": ([4, 5, 6, 7], 2, True)})
    plan = plan_for(cluster, req("hi", 2))
    assert plan is not None and [v.request_id for v in plan.victims] == ["b"]
    assert plan.victims[0].priority == 1 and plan.victims[0].devices == ("gpu2", "gpu3")


def test_never_equal_or_higher_priority_nor_protected() -> None:
    cluster = full_node({"same": ([0, 1, 2, 3], 10, True), "claim": ([4, 5, 6, 7], 0, False)})
    assert plan_for(cluster, req("hi", 1)) is None
    # The protected hold stays protected at any priority; the lower one may go.
    cluster.hold("n0", "same", ["gpu0", "gpu1", "gpu2", "gpu3"], priority=9, preemptible=True)
    plan = plan_for(cluster, req("hi", 1))
    assert plan is not None and [v.request_id for v in plan.victims] == ["same"]


def test_alignment_decides_between_equal_sets() -> None:
    # Two victims of equal priority, each holding 1 GPU + its switch's NIC, the other NICs
    # held by a protected hold: evicting either frees an aligned pair; with a's GPU's NIC
    # held by the claim, only b's eviction gives a switch-aligned pair.
    cluster = Cluster()
    cluster.set_node("n0", load_topology("dgx-h100"))
    topo = cluster.topology("n0")
    nics = [n.name for n in topo.nics()]
    gpus = [g.id for g in topo.gpus()]
    cluster.hold("n0", "claim", [*gpus[2:], *nics[2:], nics[0]], preemptible=False)
    cluster.hold("n0", "a", [gpus[0]], priority=1, preemptible=True)
    cluster.hold("n0", "b", [gpus[1], nics[1]], priority=1, preemptible=True)
    plan = plan_for(cluster, req("hi", 1, 1, scope="pcie-switch", policy="preferred"))
    assert plan is not None and [v.request_id for v in plan.victims] == ["b"]
    assert plan.placement.pairs[0].scope == "pcie-switch"


def test_plan_changes_nothing_and_release_makes_it_fit() -> None:
    cluster = full_node({"a": ([0, 1, 2, 3], 0, True), "b": ([4, 5, 6, 7], 0, True)})
    request = req("hi", 4, 4, scope="pcie-switch", policy="required")
    plan = plan_for(cluster, request)
    assert plan is not None and len(plan.victims) == 1
    assert cluster.free_devices("n0") == [n.name for n in cluster.topology("n0").nics()]
    cluster.release("n0", plan.victims[0].request_id)
    placed = cluster.decide(request)
    assert isinstance(placed, Placement) and placed.devices() == plan.placement.devices()


def test_released_and_unknown_holds_are_no_victims() -> None:
    cluster = full_node({"a": ([0, 1, 2, 3, 4, 5, 6, 7], 0, True)})
    cluster.release("n0", "a")
    cluster.hold("n0", "a", [f"gpu{i}" for i in range(8)])  # held again, protected (default)
    assert plan_for(cluster, req("hi", 1)) is None
    assert cluster.preemptible() == {}


def test_the_request_s_preemption_overrides_its_class_s() -> None:
    classes = {"default": DeviceClass(), "urgent": DeviceClass(preemption="lower-priority")}
    plain = AllocationRequest(request_id="x", pod=PodRef("ns", "x"), gpus=1)
    assert normalise(plain, classes).preempt_below is None
    urgent = AllocationRequest(request_id="x", pod=PodRef("ns", "x"), gpus=1, device_class="urgent")
    assert normalise(urgent, classes).preempt_below == 0
    never = AllocationRequest(
        request_id="x", pod=PodRef("ns", "x"), gpus=1, device_class="urgent", preemption="never"
    )
    assert normalise(never, classes).preempt_below is None
    # A share request never preempts, whatever it asks (its room would be part of a GPU).
    share = AllocationRequest(
        request_id="x", pod=PodRef("ns", "x"), gpus=1, gpu_memory_mib=1024, preemption="lower-priority"
    )
    assert normalise(share, {"default": DeviceClass(sharing="hami")}).preempt_below is None
    with pytest.raises(InvalidRequest, match="unknown device class 'nope'"):
        normalise(
            AllocationRequest(request_id="x", pod=PodRef("ns", "x"), gpus=1, device_class="nope"), classes
        )


def test_the_failed_decision_carries_the_resolved_request() -> None:
    # The PostFilter works on what the decision resolved: the class's preemption default and
    # the request's priority, without resolving the request again.
    classes = {"default": DeviceClass(), "urgent": DeviceClass(preemption="lower-priority")}
    cluster = Cluster(device_classes=classes)
    cluster.set_node("n0", load_topology("dgx-h100"))
    cluster.hold("n0", "low", [f"gpu{i}" for i in range(8)], priority=1, preemptible=True)
    request = AllocationRequest(
        request_id="hi", pod=PodRef("ns", "hi"), gpus=2, device_class="urgent", priority=7
    )
    why = cluster.decide(request)
    assert isinstance(why, Unschedulable)
    assert why.spec.preempt_below == 7 and why.spec.device_class == "urgent"
    plan = preempt.plan(cluster, why.spec)
    assert plan is not None and [v.request_id for v in plan.victims] == ["low"]
    plain = cluster.decide(msgspec.structs.replace(request, device_class="default"))
    assert isinstance(plain, Unschedulable) and plain.spec.preempt_below is None
    assert preempt.plan(cluster, plain.spec) is None  # may not preempt: no plan


def shared_gpu(cluster: Cluster, gpu: int, shares: dict[str, tuple[int, bool]]) -> None:
    """Hold ``gpu`` of n0 as shares: request id -> (priority, preemptible)."""
    for rid, (prio, ok) in shares.items():
        cluster.hold(
            "n0", rid, [f"gpu{gpu}"], priority=prio, preemptible=ok, shares={f"gpu{gpu}": (8192, 25)}
        )


def test_every_share_of_a_gpu_is_evicted_to_free_it_whole() -> None:
    cluster = full_node({"rest": ([0, 1, 2, 3, 4, 5, 6], 20, True)})
    shared_gpu(cluster, 7, {"s1": (0, True), "s2": (1, True), "s3": (0, True)})
    plan = plan_for(cluster, req("hi", 1))
    assert plan is not None
    assert sorted(v.request_id for v in plan.victims) == ["s1", "s2", "s3"]
    assert all(v.devices == ("gpu7",) for v in plan.victims)
    assert [g.index for g in plan.placement.gpus] == [7]
    for v in plan.victims:
        cluster.release("n0", v.request_id)
    assert isinstance(cluster.decide(req("hi", 1)), Placement)


def test_a_share_that_may_not_go_keeps_its_gpu() -> None:
    cluster = full_node({"rest": ([0, 1, 2, 3, 4, 5, 6], 20, True)})
    shared_gpu(cluster, 7, {"s1": (0, True), "claim": (0, False)})
    assert plan_for(cluster, req("hi", 1)) is None
    shared_gpu(cluster, 7, {"claim": (10, True)})  # of the preemptor's priority: as protected
    assert plan_for(cluster, req("hi", 1)) is None


def test_one_whole_victim_beats_a_gpu_of_shares() -> None:
    cluster = full_node({"rest": ([0, 1, 2, 3, 4, 5], 20, True), "whole": ([6], 5, True)})
    shared_gpu(cluster, 7, {"s1": (0, True), "s2": (0, True)})
    plan = plan_for(cluster, req("hi", 1))
    assert plan is not None and [v.request_id for v in plan.victims] == ["whole"]


def test_many_shares_per_gpu_are_searched_by_gpu_not_by_every_set() -> None:
    # 8 GPUs with 8 shares each: 64 eligible holds, whose sets of 16 number ~5e14; by GPU
    # there are 8 units, so the plan for 2 GPUs is found at once: every share of two GPUs.
    cluster = Cluster()
    cluster.set_node("n0", load_topology("dgx-h100"))
    for g in range(8):
        shared_gpu(cluster, g, {f"g{g}s{k}": (g % 2, True) for k in range(8)})
    plan = plan_for(cluster, req("hi", 2))
    assert plan is not None and len(plan.victims) == 16
    # The lowest priorities first: two GPUs whose shares are all of priority 0.
    assert {v.priority for v in plan.victims} == {0}
    assert len({v.devices for v in plan.victims}) == 2
