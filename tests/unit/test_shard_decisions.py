"""Decisions of an allocator replica on its shard (services/allocator/replicas.py): its own shard
first, every node when its shard has no room — and then not the node the shard's owner takes
next, or the two replicas' commits meet on it."""

from __future__ import annotations

from schemas.messages import AllocationRequest, PodRef
from services.allocator.core import Cluster, Placement
from services.allocator.readmodel import HOSTNAME_LABEL
from services.allocator.replicas import decide_in_shard
from services.topology import load_topology


def req(rid: str, gpus: int, rdma: int) -> AllocationRequest:
    return AllocationRequest(request_id=rid, pod=PodRef("ns", rid), gpus=gpus, rdma=rdma)


def placed(result: object) -> Placement:
    assert isinstance(result, Placement), getattr(result, "reason", result)
    return result


def two_shards(per_shard: int) -> Cluster:
    """``per_shard`` identical empty servers in each of shards 0 and 1 (s0-*, s1-*)."""
    c = Cluster()
    topo = load_topology("dgx-h100")
    for shard in ("0", "1"):
        for i in range(per_shard):
            name = f"s{shard}-{i}"
            c.set_node(name, topo, labels={HOSTNAME_LABEL: name}, shard=shard)
    return c


def test_a_replica_decides_on_its_own_shard_first() -> None:
    c = two_shards(3)
    assert placed(decide_in_shard(c, req("a", 8, 8), "0")).node.startswith("s0-")
    assert placed(decide_in_shard(c, req("b", 8, 8), "1")).node.startswith("s1-")


def test_outside_its_shard_a_replica_takes_another_node_than_the_owner() -> None:
    c = two_shards(3)
    for i in range(3):  # shard 0 has no whole server left
        c.hold(f"s0-{i}", "full", placed(c.decide(req(f"f{i}", 8, 8))).devices())
    owner = placed(decide_in_shard(c, req("mine", 8, 8), "1"))
    guest = placed(decide_in_shard(c, req("theirs", 8, 8), "0"))
    assert owner.node.startswith("s1-") and guest.node.startswith("s1-")
    assert guest.node != owner.node
    # Equally good: the same devices and quality on another member of the same group.
    assert (guest.devices(), guest.quality) == (owner.devices(), owner.quality)


def test_the_last_of_equals_is_the_only_node_when_one_is_left() -> None:
    c = two_shards(2)
    for name in ("s0-0", "s0-1", "s1-0"):
        c.hold(name, "full", ["gpu0"])
    only = placed(c.decide(req("x", 8, 8)))
    assert only.node == "s1-1"
    assert placed(c.decide(req("x", 8, 8), last_of_equals=True)).node == "s1-1"


def test_a_replica_counts_the_decisions_that_fall_back_outside_its_shard() -> None:
    """``tandem_allocator_shard_fallbacks_total``: the decisions that looked at the other
    replicas' nodes (where their commits are in flight): what ``tandem loadtest`` reports per
    replica (``by_replica``) to tell commit conflicts between replicas from their cause."""
    from services.allocator import metrics
    from services.allocator.readmodel import ReadModel
    from services.allocator.replicas import Replicas

    model = ReadModel(two_shards(1))
    model.shard, model.shards = "0", 2
    replicas = Replicas(None, instance="allocator-0", model=model)  # type: ignore[arg-type]  # no bus: decisions only
    before = metrics.SHARD_FALLBACKS._value.get()
    assert placed(replicas.decide(req("a", 8, 8))).node == "s0-0"  # its own shard: no fallback
    assert metrics.SHARD_FALLBACKS._value.get() == before
    model.cluster.hold("s0-0", "full", ["gpu0"])
    assert placed(replicas.decide(req("b", 8, 8))).node == "s1-0"
    assert metrics.SHARD_FALLBACKS._value.get() == before + 1
    pinned = AllocationRequest(
        request_id="c", pod=PodRef("ns", "c"), gpus=1, node_selector={HOSTNAME_LABEL: "s1-0"}
    )
    placed(replicas.decide(pinned))  # pinned to another shard's node: asked for, not a fallback
    assert metrics.SHARD_FALLBACKS._value.get() == before + 1
