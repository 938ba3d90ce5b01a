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
from services.cli.ops import age, build_rows, compact, without_id


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
    assert row.asks() == "1 GPU shares (20480 MiB, 25 %) + 0 NICs"
    assert row.as_dict(0.0)["shares"] == {"gpu4": {"memory_mib": 20480, "cores_percent": 25}}
    whole = build_rows({}, [NodeAllocations(node="n1", allocations={"a.1": held("a.1")})])[0]
    assert "shares" not in whole.as_dict(0.0) and whole.asks() == "1 GPUs + 1 NICs"
