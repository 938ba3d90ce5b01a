"""The real API server takes Tandem's ResourceSlices (issue "Tandem speaks DRA", item 1).

Every built-in topology and every vendored ``nvidia-smi topo -m`` capture becomes the slices a
node agent would publish (services.nodeagent.dra.slices), with one device unhealthy so the
taint path is validated too; the real kube-apiserver of ``make cluster-test`` must create
them (its own validation of ``resource.k8s.io/v1``: names, attribute names and values,
capacity quantities, taints, the device limits per slice), give back what was written, and
take the next generation without the taint as an update.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from schemas.messages import DeviceHealth
from schemas.topology import NodeTopology
from services.kube.client import KubeClient
from services.nodeagent.dra.publisher import SlicePublisher, comparable_devices
from services.nodeagent.dra.slices import DRIVER, TAINT_UNHEALTHY, resource_slices
from services.topology import builtin_names, import_nvidia_smi, load_topology
from tests.cluster.controlplane import ControlPlane

MATRICES = Path(__file__).resolve().parents[1] / "unit" / "test_topology_matrices"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def _topologies() -> list[tuple[str, NodeTopology]]:
    out = [(name, load_topology(name)) for name in builtin_names()]
    for path in sorted(MATRICES.glob("*.txt")):
        result = import_nvidia_smi(path.read_text(), name="node-a", source=path)
        out.append((path.stem, result.topology))
    return out


def _node_name(label: str) -> str:
    return "dra-" + "".join(c if c.isalnum() else "-" for c in label.lower()).strip("-")[:40]


@pytest.mark.parametrize(("label", "topology"), _topologies(), ids=[n for n, _ in _topologies()])
def test_the_api_server_takes_a_nodes_slices_and_their_next_generation(
    control_plane: ControlPlane, label: str, topology: NodeTopology
) -> None:
    cp = control_plane
    node = _node_name(label)
    first_gpu = topology.gpus()[0].id if topology.gpus() else None
    sick = {first_gpu: DeviceHealth(healthy=False, reason="xid 79")} if first_gpu else {}
    slices = resource_slices(topology, node=node, generation=1, health=sick)
    created: list[dict[str, Any]] = [cp.request("POST", SLICES, s) for s in slices]
    try:
        for want, got in zip(slices, created, strict=True):
            assert _same_devices(got, want), (label, got["spec"]["devices"])
            assert got["spec"]["pool"] == want["spec"]["pool"]
        if first_gpu:
            listed = {d["name"]: d for s in created for d in s["spec"]["devices"]}
            tainted = [d for d in listed.values() if d.get("taints")]
            assert tainted and all(t["key"] == TAINT_UNHEALTHY for d in tainted for t in d["taints"])

        # The device recovers: the next generation, without the taint, replaces the slices in place.
        again = resource_slices(topology, node=node, generation=2, health={})
        for s, old in zip(again, created, strict=False):
            s["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
            updated = cp.request("PUT", f"{SLICES}/{s['metadata']['name']}", s)
            assert updated["spec"]["pool"]["generation"] == 2
            assert not any(d.get("taints") for d in updated["spec"]["devices"])
    finally:
        for s in slices:
            cp.request("DELETE", f"{SLICES}/{s['metadata']['name']}")


def _same_devices(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """Equal up to what the server fills in (a taint's timeAdded) or writes canonically (a
    quantity: ``81920Mi`` comes back as ``80Gi``)."""
    return comparable_devices(got["spec"]["devices"]) == comparable_devices(want["spec"]["devices"])


async def test_the_publisher_writes_a_pool_only_when_it_changes_and_survives_a_restart(
    control_plane: ControlPlane,
) -> None:
    """The node agent's publisher against the real API: the first publish creates the pool, the
    same devices again write nothing (also from a restarted agent, which continues the
    generation), a health change replaces the slices with the next generation, a slice changed
    behind its back (409) is read again and rewritten, and a pool that shrinks loses the
    slices it no longer needs."""
    node = "dra-publisher"
    kube = await KubeClient.connect(kubeconfig=str(control_plane.admin_kubeconfig))
    try:
        pub = SlicePublisher(kube, node=node)
        topo = load_topology("dgx-h100")
        assert await pub.publish(topo, {}) is True
        assert await pub.publish(topo, {}) is False
        (held,) = await kube.list_resource_slices(node=node, driver=DRIVER)
        assert held["spec"]["pool"]["generation"] == 1 and len(held["spec"]["devices"]) == 16

        restarted = SlicePublisher(kube, node=node)
        assert await restarted.publish(topo, {}) is False and restarted.writes == 0

        sick = {"gpu2": DeviceHealth(healthy=False, reason="xid 79")}
        assert await restarted.publish(topo, sick) is True
        (held,) = await kube.list_resource_slices(node=node, driver=DRIVER)
        assert held["spec"]["pool"]["generation"] == 2
        gpu2 = next(d for d in held["spec"]["devices"] if d["name"] == "gpu2")
        assert [t["key"] for t in gpu2["taints"]] == [TAINT_UNHEALTHY]

        # Someone else writes the slice: the publisher's resourceVersion is stale (409).
        held["metadata"]["labels"]["touched"] = "yes"
        control_plane.request("PUT", f"{SLICES}/{held['metadata']['name']}", held)
        assert await restarted.publish(topo, {}) is True
        (held,) = await kube.list_resource_slices(node=node, driver=DRIVER)
        assert held["spec"]["pool"]["generation"] == 3
        assert not any(d.get("taints") for d in held["spec"]["devices"])

        big = _many_nics(150)
        assert await restarted.publish(big, sick) is True
        assert len(await kube.list_resource_slices(node=node, driver=DRIVER)) == 3
        assert await restarted.publish(topo, {}) is True
        (held,) = await kube.list_resource_slices(node=node, driver=DRIVER)
        assert held["spec"]["pool"] == {"name": node, "generation": 5, "resourceSliceCount": 1}
    finally:
        for s in await kube.list_resource_slices(node=node, driver=DRIVER):
            await kube.delete_resource_slice(s["metadata"]["name"])
        await kube.close()


def _many_nics(count: int) -> NodeTopology:
    doc = msgspec.to_builtins(load_topology("gpu-only-8"))
    doc["sockets"][0]["numa_nodes"][0]["roots"][0]["nics"] = [{"name": f"mlx5_{i}"} for i in range(count)]
    return msgspec.convert(doc, NodeTopology).validate()
