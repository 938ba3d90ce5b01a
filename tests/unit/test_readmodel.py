"""The allocator's read model takes node allocation records as they arrive from a watch.

A write changes one allocation of a node's record and carries the others unchanged:
:class:`schemas.codec.NodeAllocsDecoder` decodes only the changed ones (the others are the
objects of the record before), and :meth:`ReadModel.on_allocs` holds again only what changed.
Both must give exactly what decoding and holding everything again gives.
"""

from __future__ import annotations

import msgspec
import pytest

from schemas import codec
from schemas.messages import (
    AllocationRequest,
    AllocRecord,
    AssignedGpu,
    AssignedNic,
    Assignment,
    NodeAllocations,
    NodeRecord,
    PodRef,
)
from services.allocator import commits
from services.allocator.core import Cluster, Unschedulable
from services.allocator.readmodel import ReadModel, reservation_key, shard_of
from services.allocator.replicas import decide_in_shard
from services.topology import load_topology


def alloc(
    rid: str, gpus: list[int], *, node: str = "n1", priority: int = 0, preemptible: bool = True
) -> AllocRecord:
    assignment = Assignment(
        request_id=rid,
        pod=PodRef(namespace="ml", name=rid),
        node=node,
        gpus=[
            AssignedGpu(index=g, uuid=f"GPU-{node}-{g}", pci_bus_id=f"0000:{16 + g:02x}:00.0") for g in gpus
        ],
        nics=[
            AssignedNic(name=f"mlx5_{g}", pf=f"mlx5_{g}", mtu=9000, addresses=["10.0.0.1/24"]) for g in gpus
        ],
    )
    return AllocRecord(assignment=assignment, priority=priority, preemptible=preemptible)


def record(*allocs: AllocRecord, node: str = "n1") -> NodeAllocations:
    return NodeAllocations(node=node, allocations={a.assignment.request_id: a for a in allocs})


def test_decoder_gives_what_the_plain_decoder_gives_and_keeps_unchanged_allocations() -> None:
    decoder = codec.NodeAllocsDecoder()
    first = record(alloc("r1", [0]), alloc("r2", [1, 2]))
    got = decoder.decode(codec.encode(first))
    assert got == codec.NODE_ALLOCS.decode(codec.encode(first)) == first

    # The next write moves r2 to releasing and adds r3; r1 is carried as it was.
    second = commits.set_state("r2", "releasing", only_from=frozenset({"assigned"}))(first)
    assert second is not None
    second = commits.add_allocation("n1", "r3", alloc("r3", [3]))(second)
    assert second is not None
    again = decoder.decode(codec.encode(second))
    assert again == codec.NODE_ALLOCS.decode(codec.encode(second)) == second
    assert again.allocations["r1"] is got.allocations["r1"]
    assert again.allocations["r2"] is not got.allocations["r2"]
    assert again.allocations["r2"].state == "releasing"

    # Another node whose allocation has the same bytes is decoded on its own.
    other = decoder.decode(codec.encode(record(alloc("r1", [0]), node="n2")))
    assert other.node == "n2"
    assert other.allocations["r1"] is not got.allocations["r1"]

    # A record that holds nothing is forgotten: the next one is decoded whole.
    assert decoder.decode(codec.encode(NodeAllocations(node="n1"))) == NodeAllocations(node="n1")
    fresh = decoder.decode(codec.encode(first))
    assert fresh.allocations["r1"] is not got.allocations["r1"]


@pytest.mark.parametrize(
    "value",
    [
        {"node": "n1", "allocations": {"r1": 3}},
        {"node": "n1", "allocations": {"r1": {"assignment": 1}}},
        {"node": "n1", "allocations": {"r1": {"assignment": {"request_id": "r1"}}}},
        {"node": "n1", "allocations": {"r1": {"state": "exploded", "assignment": {}}}},
        {"node": 7, "allocations": {}},
        {"allocations": {}},
        [1, 2],
    ],
)
def test_decoder_errors_say_what_the_plain_decoder_says(value: object) -> None:
    data = msgspec.msgpack.encode(value)
    with pytest.raises(codec.DecodeErrors) as plain:
        codec.NODE_ALLOCS.decode(data)
    with pytest.raises(codec.DecodeErrors) as delta:
        codec.NodeAllocsDecoder().decode(data)
    assert type(delta.value) is type(plain.value)
    assert str(delta.value) == str(plain.value)


def test_decoder_rejects_garbage_after_a_good_record() -> None:
    decoder = codec.NodeAllocsDecoder()
    decoder.decode(codec.encode(record(alloc("r1", [0]))))
    with pytest.raises(codec.DecodeErrors):
        decoder.decode(b"\xc1 not msgpack")


def model_with_node() -> ReadModel:
    model = ReadModel(Cluster())
    model.on_node_record("n1", NodeRecord(node="n1", topology=load_topology("dgx-h100")))
    return model


def held(model: ReadModel) -> dict[str, frozenset[str]]:
    return model.cluster.holds("n1")


def victims(model: ReadModel) -> set[str]:
    return set(model.cluster.preemptible().get("n1", {}))


def test_each_write_holds_what_the_record_says() -> None:
    model = model_with_node()
    decoder = codec.NodeAllocsDecoder()

    def arrive(rec: NodeAllocations, revision: int) -> None:
        model.on_allocs("n1", decoder.decode(codec.encode(rec)), revision)

    first = record(alloc("r1", [0], priority=1), alloc("r2", [1, 2]), alloc("claim", [3], preemptible=False))
    arrive(first, 1)
    assert held(model) == {
        "r1": frozenset({"gpu0", "mlx5_0"}),
        "r2": frozenset({"gpu1", "gpu2", "mlx5_1", "mlx5_2"}),
        "claim": frozenset({"gpu3", "mlx5_3"}),
    }
    assert victims(model) == {"r1", "r2"}
    assert model.placed == {"r1": "n1", "r2": "n1", "claim": "n1"}

    # r2 being released is no victim any more; r1 and the claim stay as they were.
    releasing = commits.set_state("r2", "releasing", only_from=frozenset({"assigned"}))(first)
    assert releasing is not None
    arrive(releasing, 2)
    assert victims(model) == {"r1"}
    assert set(held(model)) == {"r1", "r2", "claim"}

    # Dropped: its devices are free again and capacity may have grown.
    model.capacity.clear()
    dropped = commits.drop_allocation("r2")(releasing)
    assert dropped is not None
    arrive(dropped, 3)
    assert set(held(model)) == {"r1", "claim"}
    assert "r2" not in model.placed
    assert model.capacity.is_set()


def test_a_decision_in_flight_turns_into_the_records_hold() -> None:
    model = model_with_node()
    base = record(alloc("r1", [0]))
    model.on_allocs("n1", base, 1)

    # r2 is decided and its commit in flight: held, and never a victim meanwhile.
    model.hold_tentative("n1", "r2", ["gpu4", "mlx5_4"])
    assert held(model)["r2"] == frozenset({"gpu4", "mlx5_4"})
    assert victims(model) == {"r1"}

    # Another write lands first (it does not hold r2 yet): the tentative hold stays.
    other = commits.add_allocation("n1", "r3", alloc("r3", [5]))(base)
    assert other is not None
    model.on_allocs("n1", other, 2)
    assert set(held(model)) == {"r1", "r2", "r3"}

    # The commit lands with other devices than the decision (re-decided after a conflict):
    # the record's hold replaces the tentative one, although r1 and r3 are the same objects.
    committed = commits.add_allocation("n1", "r2", alloc("r2", [6]))(other)
    assert committed is not None
    model.on_allocs("n1", committed, 3)
    assert held(model)["r2"] == frozenset({"gpu6", "mlx5_6"})
    assert victims(model) == {"r1", "r2", "r3"}

    # A tentative hold for a request the record holds already is replaced by the record's
    # hold on the next write, though that write carries the very same allocation object.
    model.hold_tentative("n1", "r1", ["gpu7"])
    model.on_allocs("n1", committed, 4)
    assert held(model)["r1"] == frozenset({"gpu0", "mlx5_0"})


def test_a_reservation_survives_writes_that_do_not_hold_it() -> None:
    model = model_with_node()
    model.reserve("n1", "reservation:p1", ["gpu7", "mlx5_7"])
    model.on_allocs("n1", record(alloc("r1", [0])), 1)
    model.on_allocs("n1", NodeAllocations(node="n1"), 2)
    assert set(held(model)) == {"reservation:p1"}


def test_a_preemptors_reservation_is_lent_to_its_own_decision_only() -> None:
    """The devices kept for a preemptor are held under a key no request has; its own decision
    gets them lent (the placement pipeline's decide stage) and they come back unless it took
    them; a new plan replaces the old reservation."""
    model = model_with_node()
    model.reserve_for("p1", "n1", ["gpu7", "mlx5_7"])
    key = reservation_key("p1")
    assert held(model) == {key: frozenset({"gpu7", "mlx5_7"})}
    model.lend("p1")
    assert held(model) == {}
    model.keep("p1", taken=False)  # still not placed: kept again
    assert held(model) == {key: frozenset({"gpu7", "mlx5_7"})}
    model.reserve_for("p1", "n1", ["gpu6"])  # a new plan instead of the old one
    assert held(model) == {key: frozenset({"gpu6"})}
    model.lend("p1")
    model.keep("p1", taken=True)  # placed on them: the reservation is over
    assert held(model) == {} and model.reservations == {}
    assert not model.unreserve_for("p1")
    model.lend("nobody")  # a request without a reservation: nothing happens
    model.keep("nobody", taken=False)
    assert held(model) == {}


def two_replica_model(shard: str) -> tuple[ReadModel, str, str]:
    """A model of replica ``shard`` of two, with one node in each shard: (model, own, other)."""
    model = ReadModel(Cluster())
    model.set_shards(2, shard)
    names = [f"n{i}" for i in range(1, 40)]
    own = next(n for n in names if shard_of(n, 2) == shard)
    other = next(n for n in names if shard_of(n, 2) != shard)
    for name in (own, other):
        model.on_node_record(name, NodeRecord(node=name, topology=load_topology("dgx-h100")))
    return model, own, other


def test_another_shards_holds_wait_until_something_looks_beyond_the_own_shard() -> None:
    model, own, other = two_replica_model("0")
    model.on_allocs(own, record(alloc("mine", [0], node=own), node=own), 1)
    model.on_allocs(other, record(alloc("theirs", [1], node=other), node=other), 2)
    # Its own shard at once; the other's record is known (placed) but not held in the core yet.
    assert set(model.cluster.holds(own)) == {"mine"}
    assert model.cluster.holds(other) == {}
    assert model.placed == {"mine": own, "theirs": other}
    # A later write of the other node supersedes the deferred one; its drop still says capacity.
    model.capacity.clear()
    model.on_allocs(other, record(alloc("later", [2], node=other), node=other), 3)
    assert model.capacity.is_set() and model.placed == {"mine": own, "later": other}

    # A decision outside the shard catches up first, and sees the other node as it is.
    calls: list[str] = []

    def catch_up() -> None:
        calls.append("catch_up")
        model.catch_up()

    full = AllocationRequest(request_id="big", pod=PodRef("ns", "big"), gpus=8, rdma=8)
    model.hold_tentative(own, "filler", [f"gpu{g}" for g in range(1, 8)])  # own shard full
    decision = decide_in_shard(model.cluster, full, "0", catch_up=catch_up)
    assert calls == ["catch_up"]
    assert set(model.cluster.holds(other)) == {"later"}
    # Seen as it was (empty), the other node would have taken it; gpu2 is held there.
    assert isinstance(decision, Unschedulable), decision

    # A node with a decision of this replica in flight is applied at once.
    model.hold_tentative(other, "guest", ["gpu5"])
    model.on_allocs(
        other, record(alloc("later", [2], node=other), alloc("x", [3], node=other), node=other), 4
    )
    assert set(model.cluster.holds(other)) == {"later", "x", "guest"}


def test_a_change_of_shards_applies_what_was_deferred() -> None:
    model, _, other = two_replica_model("0")
    model.on_allocs(other, record(alloc("theirs", [1], node=other), node=other), 1)
    assert model.cluster.holds(other) == {}
    model.set_shards(1)  # the other replica is gone: every node is this one's now
    assert set(model.cluster.holds(other)) == {"theirs"}
    model.on_allocs(other, record(node=other), 2)
    assert model.cluster.holds(other) == {}
