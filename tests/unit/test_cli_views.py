"""What `tandem requests` and friends show, from records alone (no NATS)."""

from __future__ import annotations

from schemas.messages import (
    AllocationRequest,
    AllocRecord,
    AssignedGpu,
    AssignedNic,
    Assignment,
    NodeAllocations,
    PodRef,
    RequestRecord,
)
from tools.cli.request_rows import build_rows
from tools.cli.views import age, compact, without_id


def request(rid: str, *, created: float) -> AllocationRequest:
    return AllocationRequest(
        request_id=rid, pod=PodRef("team", rid.split(".")[0]), gpus=1, rdma=1, created_at=created
    )


def held(rid: str, state: str = "assigned") -> AllocRecord:
    assignment = Assignment(
        request_id=rid,
        pod=PodRef("team", rid.split(".")[0]),
        node="n1",
        gpus=[AssignedGpu(index=3, uuid="GPU-3")],
        nics=[AssignedNic(name="mlx5_1", pf="mlx5_1")],
        scope="pcie-switch",
    )
    return AllocRecord(assignment=assignment, state=state, traceparent=f"00-{'ab' * 16}-{'cd' * 8}-01")  # type: ignore[arg-type]


def test_states_come_from_the_node_record_first() -> None:
    records = {
        "p.1": RequestRecord(
            request=request("p.1", created=1.0), state="pending", reason="no node can take 1 GPUs"
        ),
        "c.1": RequestRecord(request=request("c.1", created=2.0), state="assigned", node="n1"),  # claim only
        "a.1": RequestRecord(request=request("a.1", created=3.0), state="assigned", node="n1"),
        "r.1": RequestRecord(request=request("r.1", created=4.0), state="assigned", node="n1"),
        "f.1": RequestRecord(request=request("f.1", created=5.0), state="freed", node="n1"),
        "x.1": RequestRecord(
            request=request("x.1", created=6.0), state="rejected", reason="request x.1: bad"
        ),
    }
    allocs = [
        NodeAllocations(
            node="n1", allocations={"a.1": held("a.1", "applied"), "r.1": held("r.1", "releasing")}
        )
    ]
    rows = {r.request_id: r for r in build_rows(records, allocs)}
    assert [r.request_id for r in build_rows(records, allocs)] == ["p.1", "c.1", "a.1", "r.1", "f.1", "x.1"]
    assert {rid: r.state for rid, r in rows.items()} == {
        "p.1": "pending",
        "c.1": "deciding",
        "a.1": "applied",
        "r.1": "releasing",
        "f.1": "freed",
        "x.1": "rejected",
    }
    assert rows["a.1"].devices == ["gpu3", "mlx5_1"] and rows["a.1"].node == "n1"
    assert rows["a.1"].trace_id == "ab" * 16
    assert rows["r.1"].reason == "waiting for the node to verify its cleanup"
    assert rows["x.1"].reason == "bad"
    assert rows["f.1"].node == "n1" and rows["f.1"].devices == []


def test_short_forms() -> None:
    assert compact(["gpu0", "gpu1", "gpu2", "gpu3", "gpu6", "mlx5_1", "mlx5_0"]) == "gpu0-3,6 mlx5_0,1"
    assert compact(["gpu0", "gpu1", "eth"]) == "gpu0,1 eth"
    assert compact([]) == ""
    assert [age(s) for s in (0, 59, 60, 7199, 7200, 2 * 86400 + 5)] == ["0s", "59s", "1m", "119m", "2h", "2d"]
    assert without_id("request r.1: unknown device class", "r.1") == "unknown device class"
    assert without_id("request r.2: x", "r.1") == "request r.2: x"


def test_shared_gpus_show_their_share() -> None:
    assignment = Assignment(
        request_id="s.1",
        pod=PodRef("team", "s"),
        node="n1",
        gpus=[AssignedGpu(index=4, uuid="GPU-4", memory_mib=20480, cores_percent=25)],
        sharing="hami",
    )
    allocs = [NodeAllocations(node="n1", allocations={"s.1": AllocRecord(assignment=assignment)})]
    (row,) = build_rows({}, allocs)
    assert row.shares == {"gpu4": (20480, 25)}
    assert row.asks() == "1 GPU share (20480 MiB, 25 % of each GPU) + 0 NICs"
    assert row.as_dict(0.0)["shares"] == {"gpu4": {"memory_mib": 20480, "cores_percent": 25}}
    whole = build_rows({}, [NodeAllocations(node="n1", allocations={"a.1": held("a.1")})])[0]
    assert "shares" not in whole.as_dict(0.0) and whole.asks() == "1 GPU + 1 NIC"


def test_a_shared_gpu_lists_every_holder_with_its_share() -> None:
    """`device list` (and `status --devices`, `topology show --live`): a GPU with two shares has
    two holders, each with its size; the assignment tables show a share's size by its GPU."""
    from schemas.messages import AssignedMig, NodeRecord
    from services.topology import load_topology
    from tools.cli.devices import device_state_text, device_states
    from tools.cli.views import assignment_rows

    def share(rid: str, mem: int | None, cores: int | None) -> AllocRecord:
        gpu = AssignedGpu(index=2, uuid="GPU-2", memory_mib=mem, cores_percent=cores)
        return AllocRecord(
            assignment=Assignment(request_id=rid, pod=PodRef("inf", rid[0]), node="n1", gpus=[gpu])
        )

    mig = AssignedGpu(
        index=1, uuid="GPU-1", mig=AssignedMig(profile="1g.10gb", uuid="MIG-1", device="gpu1-mig9-0")
    )
    allocs = NodeAllocations(
        node="n1",
        allocations={
            "b.1": share("b.1", 10240, 50),
            "a.1": share("a.1", 20480, None),
            "m.1": AllocRecord(
                assignment=Assignment(request_id="m.1", pod=PodRef("inf", "m"), node="n1", gpus=[mig])
            ),
            "w.1": held("w.1"),
        },
    )
    record = NodeRecord(node="n1", topology=load_topology("pcie-4gpu-2nic"))
    states = {d["device"]: d for d in device_states(record, allocs)}
    gpu2 = states["gpu2"]
    assert gpu2["state"] == "shared" and gpu2["pod"] == "inf/a"
    assert gpu2["holders"] == [
        {"pod": "inf/a", "request_id": "a.1", "memory_mib": 20480, "cores_percent": 0},
        {"pod": "inf/b", "request_id": "b.1", "memory_mib": 10240, "cores_percent": 50},
    ]
    assert device_state_text(gpu2) == "shared by inf/a (20480 MiB), inf/b (10240 MiB, 50 %)"
    assert device_state_text(states["gpu1"]) == "used by inf/m (MIG 1g.10gb gpu1-mig9-0)"
    assert device_state_text(states["gpu3"]) == "used by team/w" and states["gpu3"]["state"] == "used"
    assert states["gpu0"]["state"] == "free" and states["gpu0"]["holders"] == []
    rows = assignment_rows([allocs.allocations["b.1"].assignment, allocs.allocations["w.1"].assignment])
    assert rows == [["inf/b", "n1", "2 (10240 MiB, 50 %)", "-", "-"], ["team/w", "n1", "3", "-", "-"]]
