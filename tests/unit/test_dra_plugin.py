"""The node agent's DRA kubelet plugin (services.nodeagent.dra): what a claim may have on this
node, checked against Tandem's record (prepare.py), the claim's CDI spec (cdi.py), device
health for kubelet, and the gRPC conversation over real unix sockets with a real grpcio client
playing kubelet (the claims come from an in-memory stand-in for the API server here; against
the real API server and the chart's running agents: tests/cluster/test_dra_kubelet.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from schemas.messages import (
    AllocRecord,
    AssignedGpu,
    AssignedNic,
    Assignment,
    DeviceHealth,
    NodeAllocations,
    PodRef,
)
from schemas.topology import NodeTopology
from services.kube.errors import NotFound
from services.nodeagent.dra.cdi import claim_spec, spec_file_name
from services.nodeagent.dra.kubeletapi import dra_pb2 as dra
from services.nodeagent.dra.kubeletapi import dra_pb2_grpc as dra_grpc
from services.nodeagent.dra.kubeletapi import health_pb2 as health
from services.nodeagent.dra.kubeletapi import health_pb2_grpc as health_grpc
from services.nodeagent.dra.kubeletapi import pluginregistration_pb2 as reg
from services.nodeagent.dra.kubeletapi import pluginregistration_pb2_grpc as reg_grpc
from services.nodeagent.dra.plugin import (
    AgentView,
    KubeletPlugin,
    PluginPaths,
    device_health,
    plugin_from_settings,
)
from services.nodeagent.dra.prepare import PrepareError, check, claim_results, reserved_pods
from services.nodeagent.dra.slices import tandem_ids
from services.runtime.errors import SettingsError
from services.runtime.settings import Settings
from services.topology import load_topology
from tests.waiting import wait_until

Obj = dict[str, Any]
NODE = "gpu-node-1"
POD_UID = "7f0c1c9e-0000-4000-8000-000000000001"
CLAIM_UID = "c1a1m000-0000-4000-8000-000000000001"


@pytest.fixture(scope="module")
def topo() -> NodeTopology:
    return load_topology("dgx-h100")


def assignment(topo: NodeTopology, *, shared: bool = False, pod_uid: str = POD_UID) -> Assignment:
    gpus = topo.gpus()[:2]
    share = {"memory_mib": 20480, "cores_percent": 50} if shared else {}
    return Assignment(
        request_id=f"{pod_uid}.1",
        pod=PodRef(namespace="team", name="train", uid=pod_uid),
        node=NODE,
        gpus=[AssignedGpu(index=g.index, uuid=g.uuid, **share) for g in gpus],
        nics=[AssignedNic(name=n, pf=n) for n in ("mlx5_0", "mlx5_1")],
    )


def record(*assignments: Assignment, state: str = "assigned") -> NodeAllocations:
    return NodeAllocations(
        node=NODE,
        allocations={a.request_id: AllocRecord(assignment=a, state=state) for a in assignments},
    )


def claim(
    devices: list[str],
    *,
    uid: str = CLAIM_UID,
    pool: str = NODE,
    reserved: list[str] | None = None,
    share: bool = False,
) -> Obj:
    results = [
        {
            "request": "gpus" if d.startswith("gpu") else "nics",
            "driver": "tandem.io",
            "pool": pool,
            "device": d,
            **({"shareID": f"share-{d}"} if share and d.startswith("gpu") else {}),
        }
        for d in devices
    ]
    # Another driver's result in the same claim is not this plugin's business.
    results.append({"request": "other", "driver": "example.com", "pool": "x", "device": "y"})
    pods = [POD_UID] if reserved is None else reserved
    return {
        "metadata": {"namespace": "team", "name": "train-devices", "uid": uid},
        "status": {
            "allocation": {"devices": {"results": results}},
            "reservedFor": [{"resource": "pods", "name": "train", "uid": p} for p in pods],
        },
    }


def checked(topo: NodeTopology, obj: Obj, rec: NodeAllocations | None) -> list[Any]:
    results = claim_results(obj, node=NODE, uid=CLAIM_UID)
    return check(
        results,
        claim="ResourceClaim team/train-devices",
        pods=reserved_pods(obj),
        record=rec,
        names=tandem_ids(topo),
    )


UVERBS = {"mlx5_0": ["/dev/infiniband/uverbs0"], "mlx5_1": ["/dev/infiniband/uverbs1"]}


def test_a_claim_tandem_allocated_gets_the_nvidia_names_its_nics_device_nodes_and_one_env(
    topo: NodeTopology,
) -> None:
    a = assignment(topo)
    prepared = checked(topo, claim(["gpu0", "gpu1", "mlx5-0", "mlx5-1"]), record(a))
    assert [(p.result.device, p.device_id) for p in prepared] == [
        ("gpu0", "gpu0"),
        ("gpu1", "gpu1"),
        ("mlx5-0", "mlx5_0"),
        ("mlx5-1", "mlx5_1"),
    ]
    spec = claim_spec(CLAIM_UID, prepared, uverbs=UVERBS)
    u0, u1 = (g.uuid for g in a.gpus)
    assert spec.ids == [
        [f"nvidia.com/gpu={u0}", f"tandem.io/claim={CLAIM_UID}"],
        [f"nvidia.com/gpu={u1}"],
        [f"tandem.io/claim={CLAIM_UID}-mlx5-0"],
        [f"tandem.io/claim={CLAIM_UID}-mlx5-1"],
    ]
    assert spec.spec["kind"] == "tandem.io/claim"
    devices = {d["name"]: d["containerEdits"] for d in spec.spec["devices"]}
    assert devices[CLAIM_UID] == {
        "env": [f"NVIDIA_VISIBLE_DEVICES={u0},{u1}", "TANDEM_RDMA_DEVICES=mlx5_0,mlx5_1"]
    }
    assert devices[f"{CLAIM_UID}-mlx5-1"] == {
        "deviceNodes": [{"path": "/dev/infiniband/uverbs1"}, {"path": "/dev/infiniband/rdma_cm"}]
    }
    assert spec_file_name(CLAIM_UID) == f"tandem.io-claim_{CLAIM_UID}.json"


def test_a_share_carries_the_limits_tandem_decided(topo: NodeTopology) -> None:
    a = assignment(topo, shared=True)
    prepared = checked(topo, claim(["gpu0"], share=True), record(a))
    env = claim_spec(CLAIM_UID, prepared, uverbs={}).spec["devices"][0]["containerEdits"]["env"]
    assert env == [
        f"NVIDIA_VISIBLE_DEVICES={a.gpus[0].uuid}",
        "CUDA_DEVICE_MEMORY_LIMIT_0=20480m",
        "CUDA_DEVICE_SM_LIMIT=50",
    ]


@pytest.mark.parametrize(
    ("obj", "rec", "error"),
    [
        # A status written by hand naming a device Tandem did not assign to the pod.
        (claim(["gpu0", "gpu7"]), "own", "device 'gpu7' (request 'gpus') was not assigned by Tandem"),
        # Tandem's devices, but reserved for a pod Tandem gave nothing.
        (claim(["gpu0"], reserved=["someone-else"]), "own", "Tandem assigned no devices on gpu-node-1"),
        (claim(["gpu0"], reserved=[]), "own", "reserved for no pod"),
        (claim(["gpu0"]), "releasing", "Tandem assigned no devices"),
        (claim(["gpu0"]), None, "Tandem assigned no devices on this node"),
        (claim(["gpu0"], pool="gpu-node-2"), "own", "is of pool 'gpu-node-2', not of this node's pool"),
        (claim(["gpu0"], uid="other-uid"), "own", "the claim was replaced"),
        (claim(["gpu0"], share=True), "own", "a whole GPU in Tandem's assignment but allocated as a share"),
        (claim(["gpu0"]), "shared", "a share in Tandem's assignment but allocated whole"),
        (claim(["nvme0"]), "own", "device 'nvme0' (request 'nics') is not a device of gpu-node-1"),
        ({"metadata": {"uid": CLAIM_UID}, "status": {}}, "own", "not allocated"),
    ],
)
def test_what_tandem_did_not_assign_is_refused_naming_the_claim_and_device(
    topo: NodeTopology, obj: Obj, rec: str | None, error: str
) -> None:
    records = {
        "own": record(assignment(topo)),
        "releasing": record(assignment(topo), state="releasing"),
        "shared": record(assignment(topo, shared=True)),
        None: None,
    }
    with pytest.raises(PrepareError, match=error.replace("(", r"\(").replace(")", r"\)")):
        checked(topo, obj, records[rec])


def test_a_nic_without_a_verbs_device_is_refused(topo: NodeTopology) -> None:
    prepared = checked(topo, claim(["mlx5-0"]), record(assignment(topo)))
    with pytest.raises(PrepareError, match="mlx5_0 has no uverbs device"):
        claim_spec(CLAIM_UID, prepared, uverbs={})


def test_kubelet_sees_a_failed_device_unhealthy_and_a_cordoned_one_still_healthy(topo: NodeTopology) -> None:
    view = AgentView(
        topo,
        {
            "gpu1": DeviceHealth(healthy=False, reason="XID 79"),
            "mlx5_0": DeviceHealth(cordoned=True, reason="ops"),
        },
        None,
    )
    by_name = {d.device.device_name: d for d in device_health(view, node=NODE, now=100.0)}
    assert set(by_name) == set(tandem_ids(topo))
    assert (by_name["gpu1"].health, by_name["gpu1"].message) == (health.UNHEALTHY, "XID 79")
    assert (by_name["mlx5-0"].health, by_name["mlx5-0"].message) == (health.HEALTHY, "cordoned: ops")
    assert (by_name["gpu0"].health, by_name["gpu0"].device.pool_name) == (health.HEALTHY, NODE)
    assert by_name["gpu0"].health_check_timeout_seconds == 30


class MemoryClaims:
    """ResourceClaims by (namespace, name), as the API server would answer ``get``."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], Obj] = {}

    async def get_resource_claim(self, namespace: str, name: str) -> Obj:
        try:
            return self.claims[(namespace, name)]
        except KeyError:
            raise NotFound(f"resourceclaims {name!r} not found", status=404) from None


@pytest.fixture
async def running(
    tmp_path: Path, topo: NodeTopology
) -> AsyncIterator[tuple[KubeletPlugin, MemoryClaims, list[AgentView]]]:
    api = MemoryClaims()
    views = [AgentView(topo, {}, record(assignment(topo)))]
    paths = PluginPaths(
        registry_dir=str(tmp_path / "registry"),
        plugin_dir=str(tmp_path / "plugins" / "tandem.io"),
        cdi_dir=str(tmp_path / "cdi"),
    )
    plugin = KubeletPlugin(
        api,
        node=NODE,
        view=lambda: views[-1],
        uverbs=lambda n: UVERBS.get(n, []),
        paths=paths,
        poll_interval=0.05,
        health_refresh=30.0,
    )
    task = asyncio.create_task(plugin.run())
    await wait_until(lambda: paths.registration_socket.exists() and paths.dra_socket.exists(), what="sockets")
    yield plugin, api, views
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def register(plugin: KubeletPlugin) -> reg.PluginInfo:
    """What kubelet's plugin watcher does with a socket it finds in its registry."""
    async with grpc.aio.insecure_channel(f"unix://{plugin.paths.registration_socket}") as ch:
        stub = reg_grpc.RegistrationStub(ch)
        info: reg.PluginInfo = await stub.GetInfo(reg.InfoRequest(), timeout=5)
        await stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=5)
    return info


async def test_kubelet_registers_prepares_unprepares_and_registers_again(
    running: tuple[KubeletPlugin, MemoryClaims, list[AgentView]],
) -> None:
    plugin, api, _ = running
    info = await register(plugin)
    assert (info.type, info.name, list(info.supported_versions)) == (
        "DRAPlugin",
        "tandem.io",
        ["v1.DRAPlugin"],
    )
    assert info.endpoint == str(plugin.paths.dra_socket)
    assert plugin.registrations == [(True, "")]

    api.claims[("team", "train-devices")] = claim(["gpu0", "mlx5-0"])
    forged = claim(["gpu5"], uid="forged-uid")
    forged["metadata"]["name"] = "forged"
    api.claims[("team", "forged")] = forged
    asked = [
        dra.Claim(namespace="team", name="train-devices", uid=CLAIM_UID),
        dra.Claim(namespace="team", name="forged", uid="forged-uid"),
        dra.Claim(namespace="team", name="gone", uid="gone-uid"),
    ]
    spec = Path(plugin.paths.cdi_dir) / spec_file_name(CLAIM_UID)
    async with grpc.aio.insecure_channel(f"unix://{info.endpoint}") as ch:
        stub = dra_grpc.DRAPluginStub(ch)
        first = await stub.NodePrepareResources(dra.NodePrepareResourcesRequest(claims=asked), timeout=5)
        mine = first.claims[CLAIM_UID]
        assert mine.error == ""
        assert [
            (d.request_names[0], d.pool_name, d.device_name, d.HasField("share_id")) for d in mine.devices
        ] == [("gpus", NODE, "gpu0", False), ("nics", NODE, "mlx5-0", False)]
        assert mine.devices[1].cdi_device_ids == [f"tandem.io/claim={CLAIM_UID}-mlx5-0"]
        assert "'gpu5' (request 'gpus') was not assigned by Tandem" in first.claims["forged-uid"].error
        assert "ResourceClaim team/gone: not found" in first.claims["gone-uid"].error
        written = json.loads(spec.read_text())
        assert {d["name"] for d in written["devices"]} == {CLAIM_UID, f"{CLAIM_UID}-mlx5-0"}
        assert not (Path(plugin.paths.cdi_dir) / spec_file_name("forged-uid")).exists()

        # kubelet restarted: its plugin watcher finds the socket again and registers anew,
        # then prepares the claim it already had prepared: the same answer.
        assert (await register(plugin)).endpoint == info.endpoint
        again = await stub.NodePrepareResources(dra.NodePrepareResourcesRequest(claims=asked[:1]), timeout=5)
        assert again.claims[CLAIM_UID] == mine and json.loads(spec.read_text()) == written

        done = await stub.NodeUnprepareResources(
            dra.NodeUnprepareResourcesRequest(claims=asked[:2]), timeout=5
        )
        assert {uid: r.error for uid, r in done.claims.items()} == {CLAIM_UID: "", "forged-uid": ""}
        assert not spec.exists()
        repeat = await stub.NodeUnprepareResources(
            dra.NodeUnprepareResourcesRequest(claims=asked[:1]), timeout=5
        )
        assert repeat.claims[CLAIM_UID].error == ""

    # Someone wiped kubelet's registry: the plugin serves its socket there again.
    plugin.paths.registration_socket.unlink()
    await wait_until(plugin.paths.registration_socket.exists, what="registration socket served again")
    assert (await register(plugin)).name == "tandem.io"


async def test_the_health_stream_sends_every_device_and_again_when_one_fails(
    running: tuple[KubeletPlugin, MemoryClaims, list[AgentView]], topo: NodeTopology
) -> None:
    plugin, _, views = running
    async with grpc.aio.insecure_channel(f"unix://{plugin.paths.dra_socket}") as ch:
        stub = health_grpc.DRAResourceHealthStub(ch)
        stream = stub.NodeWatchResources(health.NodeWatchResourcesRequest())
        first = await stream.read()
        assert {d.device.device_name for d in first.devices} == set(tandem_ids(topo))
        assert all(d.health == health.HEALTHY for d in first.devices)
        views.append(views[-1]._replace(health={"gpu3": DeviceHealth(healthy=False, reason="GPU is lost")}))
        plugin.changed()
        second = await stream.read()
        bad = [(d.device.device_name, d.message) for d in second.devices if d.health == health.UNHEALTHY]
        assert bad == [("gpu3", "GPU is lost")]
        stream.cancel()


def test_the_plugin_is_on_only_with_the_slices_and_bad_paths_are_named(topo: NodeTopology) -> None:
    def view() -> AgentView:
        return AgentView(topo, {}, None)

    off = Settings(node_name=NODE, dra_slices=True)
    assert plugin_from_settings(off, MemoryClaims(), view=view, uverbs=lambda n: []) is None
    with pytest.raises(SettingsError, match="dra_plugin needs dra_slices"):
        plugin_from_settings(Settings(node_name=NODE, dra_plugin=True), None, view=view, uverbs=lambda n: [])
    bad = Settings(node_name=NODE, dra_slices=True, dra_plugin=True, dra_plugin_paths={"cdi": "/x"})
    with pytest.raises(SettingsError, match=r"dra_plugin_paths: .*cdi"):
        plugin_from_settings(bad, MemoryClaims(), view=view, uverbs=lambda n: [])
    on = Settings(node_name=NODE, dra_slices=True, dra_plugin=True, dra_plugin_paths={"cdi_dir": "/run/cdi"})
    plugin = plugin_from_settings(on, MemoryClaims(), view=view, uverbs=lambda n: [])
    assert plugin is not None and plugin.paths.cdi_dir == "/run/cdi" and plugin.node == NODE
