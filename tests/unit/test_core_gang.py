"""Whole jobs in the core (core.gang): all-or-nothing, fabric tiers, NVLink domains, reasons."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from schemas.messages import JobRequest
from schemas.topology import NvlinkDomain
from services.allocator.core import Cluster, InvalidRequest
from services.allocator.core.gang import JobPlacement, JobUnschedulable, fabric_label, place_job
from services.topology import TopologyFileError, decode_topology, dump_topology, load_topology


def job(jid: str = "j", pods: int = 2, gpus: int = 8, rdma: int = 8, **kw: object) -> JobRequest:
    return JobRequest(
        job_id=jid, pods=pods, gpus=gpus, rdma=rdma, scope="pcie-switch", policy="required", **kw
    )  # type: ignore[arg-type]


def fleet(leaves: dict[str, int], *, spine: dict[str, str] | None = None, topo: str = "dgx-h100") -> Cluster:
    """``leaves``: leaf name -> node count; ``spine``: leaf -> spine block (default s0)."""
    c = Cluster()
    t = load_topology(topo)
    for leaf, count in leaves.items():
        for i in range(count):
            labels = {fabric_label("leaf"): leaf, fabric_label("spine"): (spine or {}).get(leaf, "s0")}
            c.set_node(f"{leaf}-n{i}", t, labels=labels)
    return c


def placed(res: JobPlacement | JobUnschedulable) -> JobPlacement:
    assert isinstance(res, JobPlacement), getattr(res, "reason", res)
    return res


def test_job_fits_in_one_leaf_when_one_leaf_can_take_it() -> None:
    c = fleet({"l1": 3, "l2": 5})
    p = placed(place_job(c, job(pods=4)))
    assert p.tier == "leaf" and p.block == "l2" and len(p.pods) == 4
    assert len(p.nodes()) == 4 and all(n.startswith("l2-") for n in p.nodes())
    assert all(pod.scope == "pcie-switch" and len(pod.gpus) == 8 for pod in p.pods)


def test_small_pods_share_one_node_before_spanning_a_leaf() -> None:
    c = fleet({"l1": 2})
    p = placed(place_job(c, job(pods=2, gpus=4, rdma=4)))
    assert p.tier == "node" and len(p.nodes()) == 1
    devices = [d for pod in p.pods for d in pod.devices()]
    assert len(devices) == len(set(devices)) == 16


def test_binpack_picks_the_leaf_the_job_fills_best() -> None:
    c = fleet({"big": 8, "small": 4})
    p = placed(place_job(c, job(pods=4)))
    assert p.block == "small"


def test_required_leaf_never_spans_a_spine_and_says_why() -> None:
    c = fleet({"l1": 3, "l2": 5})
    res = place_job(c, job(pods=8, fabric="leaf", fabric_policy="required"))
    assert isinstance(res, JobUnschedulable)
    assert "8 pods of 8+8" in res.reason and "no leaf can take 8; at most 5 (in leaf l2)" in res.reason
    assert res.best == 5 and res.capacity == 8
    # Preferred falls back to one spine.
    p = placed(place_job(c, job(pods=8, fabric="leaf")))
    assert p.tier == "spine" and len(p.nodes()) == 8


def test_job_larger_than_the_cluster_is_refused_whole() -> None:
    c = fleet({"l1": 2}, spine={"l1": "s0"})
    res = place_job(c, job(pods=3))
    assert isinstance(res, JobUnschedulable) and "the cluster can take only 2" in res.reason


def test_spanning_spines_reports_cluster_tier() -> None:
    c = fleet({"l1": 2, "l2": 2}, spine={"l1": "s0", "l2": "s1"})
    p = placed(place_job(c, job(pods=3)))
    assert p.tier == "cluster" and p.block == ""


def test_held_devices_are_not_offered_again() -> None:
    c = fleet({"l1": 4})
    j1 = job("a", pods=3)
    p = placed(place_job(c, j1))
    for node, pid, devs in p.holds(j1):
        c.hold(node, pid, devs)
    res = place_job(c, job("b", pods=2))
    assert isinstance(res, JobUnschedulable) and res.capacity == 1
    assert placed(place_job(c, job("c", pods=1))).nodes() == [n for n in c.nodes() if n not in p.nodes()]


def test_no_node_can_take_one_pod_gives_the_per_node_reason() -> None:
    c = fleet({"l1": 2})
    res = place_job(c, job(pods=2, gpus=9, rdma=9))
    assert isinstance(res, JobUnschedulable) and "no node can take 9 GPUs + 9 NICs" in res.reason


def test_unknown_fabric_tier_is_an_invalid_request() -> None:
    c = fleet({"l1": 2})
    with pytest.raises(InvalidRequest, match="unknown fabric tier 'rack'"):
        place_job(c, job(fabric="rack"))


def test_nvlink_domain_required_and_preferred() -> None:
    c = Cluster()
    t = load_topology("dgx-h100")
    for i in range(4):
        dom = NvlinkDomain(cluster_uuid="c1", clique_id=1 if i < 2 else 2)
        c.set_node(f"n{i}", msgspec.structs.replace(t, nvlink_domain=dom), labels={fabric_label("leaf"): "l"})
    c.set_node("plain", t, labels={fabric_label("leaf"): "l"})
    p = placed(place_job(c, job(pods=2, nvlink_domain="required")))
    assert p.nvlink_domain == "c1/1" and p.nodes() == ["n0", "n1"]
    res = place_job(c, job(pods=3, nvlink_domain="required"))
    assert isinstance(res, JobUnschedulable) and "NVLink domain" in res.reason
    q = placed(place_job(c, job(pods=3, nvlink_domain="preferred")))
    assert q.nvlink_domain is None and q.tier == "leaf"


def test_nvlink_domain_and_fabric_labels_in_a_topology_file(tmp_path: Path) -> None:
    base = load_topology("dgx-h100")
    labels = {**base.labels, "tandem.io/fabric-leaf": "leaf-3", "tandem.io/fabric-spine": "spine-1"}
    text = dump_topology(base)
    extra = "nvlink_domain: {cluster_uuid: 7d2f1c4e-0b5a-4e8e-9a51-3c6f0d2b8a10, clique_id: 3}\n"
    (tmp_path / "t.yaml").write_text(extra + dump_topology(msgspec.structs.replace(base, labels=labels)))
    topo = load_topology(tmp_path / "t.yaml")
    assert topo.nvlink_domain == NvlinkDomain(
        cluster_uuid="7d2f1c4e-0b5a-4e8e-9a51-3c6f0d2b8a10", clique_id=3
    )
    assert topo.labels["tandem.io/fabric-leaf"] == "leaf-3"
    assert load_topology_text(dump_topology(topo)) == topo
    c = Cluster()
    c.set_node("a", topo)
    c.set_node("b", topo)
    p = placed(place_job(c, job(pods=2, nvlink_domain="required", fabric="leaf", fabric_policy="required")))
    assert (p.tier, p.block, p.nvlink_domain) == ("leaf", "leaf-3", "7d2f1c4e-0b5a-4e8e-9a51-3c6f0d2b8a10/3")
    (tmp_path / "bad.yaml").write_text("nvlink_domain: {cluster_uuid: 'x y', clique_id: -1}\n" + text)
    with pytest.raises(TopologyFileError, match="nvlink_domain"):
        load_topology(tmp_path / "bad.yaml")


def load_topology_text(text: str) -> object:
    return decode_topology(text, fmt="yaml")


def test_job_request_on_the_wire() -> None:
    j = job("train", pods=8, fabric="leaf", fabric_policy="required", nvlink_domain="preferred")
    wire = msgspec.msgpack.encode(j)
    back = msgspec.msgpack.decode(wire, type=JobRequest)
    assert back == j and msgspec.to_builtins(j)["kind"] == "job.request"
    t = j.template()
    assert (t.request_id, t.gpus, t.rdma, t.scope, t.policy) == ("train", 8, 8, "pcie-switch", "required")
    assert [j.pod_id(i) for i in (0, 7)] == ["train/0", "train/7"]
    old = msgspec.msgpack.decode(
        msgspec.msgpack.encode({"kind": "job.request", "job_id": "a", "pods": 2, "gpus": 1, "later": 1}),
        type=JobRequest,
    )
    assert (old.fabric, old.fabric_policy, old.nvlink_domain, old.rdma) == (None, "preferred", None, 0)
    for bad in ({"pods": 1025}, {"pods": 0}, {"fabric": "Leaf!"}, {"nvlink_domain": "maybe"}):
        data = {"kind": "job.request", "job_id": "a", "pods": 2, "gpus": 1, **bad}
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(data, JobRequest)


def test_fabric_tiers_setting() -> None:
    from services.runtime.errors import SettingsError
    from services.runtime.settings import load_settings

    assert load_settings("allocator", environ={}).fabric_tiers == ["leaf", "spine"]
    env = {"TANDEM_FABRIC_TIERS": "[leaf, spine, pod, zone]"}
    assert load_settings("allocator", environ=env).fabric_tiers == ["leaf", "spine", "pod", "zone"]
    with pytest.raises(SettingsError, match="fabric_tiers"):
        load_settings("allocator", environ={"TANDEM_FABRIC_TIERS": "[Leaf Switch]"})
