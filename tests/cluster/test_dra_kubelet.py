"""The node agent as the DRA kubelet plugin of driver ``tandem.io``, against the real control
plane and the chart's running node agents (issue "Tandem speaks DRA", item 4).

kwok plays every kubelet of the cluster except the DRA one, so a real grpcio client plays it
here, on the sockets the running agent of a node serves in that node's hostPath directories:
the plugin registry (``GetInfo``, ``NotifyRegistrationStatus``) and the DRA socket it names
(``NodePrepareResources``, ``NodeUnprepareResources``, ``NodeWatchResources``).

The test plays Tandem's bridge, in a namespace the running webhook skips (the running bridge
is tests/cluster/test_dra_bridge.py): a pod from a ResourceClaimTemplate waits behind the
test's gate, its allocation is put in Tandem's record of the node (KV ``tandem-allocs``,
request id ``<pod uid>.1``, as the bridge's request would be) and in the claim's status (the
rules of services.admission.draclaims, as test_dra_allocation.py writes it), the real
scheduler binds the pod there and reserves the claim for it. Then kubelet prepares the claim
(the agent reads it from the real API server and checks it against Tandem's record) and a
second claim whose status a user wrote by hand, naming a device Tandem never assigned and
reserved for the same pod: that one is refused. kubelet restarts — registers again through a
new client, prepares the already prepared claim again and gets the same answer — and
unprepares (the claim's CDI spec gone). The second test takes the running path instead: the
webhook, Tandem's bridge and allocator allocate the claim, and kubelet prepares it the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import nats
from nats.js.errors import KeyNotFoundError

from schemas import codec, subjects
from schemas.messages import AllocRecord, AssignedGpu, AssignedNic, Assignment, NodeAllocations, Pair, PodRef
from schemas.topology import locate
from services.admission.draclaims import PARAMETERS_API, PARAMETERS_KIND, Claim, allocations, pod_devices
from services.nodeagent.dra.cdi import spec_file_name
from services.nodeagent.dra.kubeletapi import dra_pb2 as dra
from services.nodeagent.dra.kubeletapi import dra_pb2_grpc as dra_grpc
from services.nodeagent.dra.kubeletapi import health_pb2 as health
from services.nodeagent.dra.kubeletapi import health_pb2_grpc as health_grpc
from services.nodeagent.dra.kubeletapi import pluginregistration_pb2 as reg
from services.nodeagent.dra.kubeletapi import pluginregistration_pb2_grpc as reg_grpc
from services.nodeagent.dra.slices import device_names
from services.topology import load_topology
from tests.cluster.release import Release, eventually
from tests.cluster.test_dra_bridge import template as bridge_template
from tests.cluster.test_dra_classes import claim_pod, unmanaged_namespace
from tests.cluster.test_pod_life import make_namespace, pod_of
from tests.waiting import wait_until

HOLD = "test.tandem.io/hold"
MERGE = "application/merge-patch+json"
REGISTRY = "/var/lib/kubelet/plugins_registry"


@contextlib.contextmanager
def short_dir(real: Path) -> Iterator[Path]:
    """``real`` through a short symlink: a unix socket's path must fit in 108 bytes, and the
    node's hostPath directory lies deep in the test's work directory."""
    with tempfile.TemporaryDirectory(prefix="dra") as tmp:
        link = Path(tmp) / "d"
        link.symlink_to(real)
        yield link


def update_record(url: str, node: str, *, add: Assignment | None = None, remove: str | None = None) -> None:
    """Put an allocation in (or take it out of) Tandem's record of ``node``, compare-and-set
    on the record's revision as the allocator writes it."""

    async def go() -> None:
        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().key_value(subjects.KV_ALLOCS)
            key = subjects.kv_key(node)
            try:
                entry = await kv.get(key)
                rec, revision = codec.NODE_ALLOCS.decode(entry.value or b""), entry.revision
            except KeyNotFoundError:
                rec, revision = NodeAllocations(node=node), 0
            allocs = {k: v for k, v in rec.allocations.items() if k != remove}
            if add is not None:
                allocs[add.request_id] = AllocRecord(assignment=add)
            await kv.update(key, codec.encode(NodeAllocations(node=node, allocations=allocs)), last=revision)
        finally:
            await nc.close()

    asyncio.run(go())


def used_devices(url: str, node: str) -> set[str]:
    """The devices Tandem's record of ``node`` holds now."""

    async def go() -> set[str]:
        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().key_value(subjects.KV_ALLOCS)
            try:
                entry = await kv.get(subjects.kv_key(node))
            except KeyNotFoundError:
                return set()
            return codec.NODE_ALLOCS.decode(entry.value or b"").used()
        finally:
            await nc.close()

    return asyncio.run(go())


def pod_with_claim(release: Release, ns: str) -> tuple[str, dict[str, Any]]:
    """A gated pod of a template for 2 GPUs + 2 NICs of Tandem's classes; its uid and claim."""
    cp = release.cp
    path = f"/apis/resource.k8s.io/v1/namespaces/{ns}"
    parameters = {"apiVersion": PARAMETERS_API, "kind": PARAMETERS_KIND, "scope": "pcie-switch"}
    requests = [
        {"name": "gpus", "exactly": {"deviceClassName": "gpu.tandem.io", "count": 2}},
        {"name": "nics", "exactly": {"deviceClassName": "nic.tandem.io", "count": 2}},
    ]
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "pairs"},
        "spec": {
            "spec": {
                "devices": {
                    "requests": requests,
                    "config": [{"opaque": {"driver": "tandem.io", "parameters": parameters}}],
                }
            }
        },
    }
    cp.request("POST", f"{path}/resourceclaimtemplates", template)
    pod = claim_pod("dra-kubelet", "pairs")
    pod["spec"]["schedulingGates"] = [{"name": HOLD}]
    made = cp.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
    eventually(lambda: cp.request("GET", f"{path}/resourceclaims")["items"], what="the pod's claim made")
    (claim,) = cp.request("GET", f"{path}/resourceclaims")["items"]
    return made["metadata"]["uid"], claim


def tandems_answer(node: str, pod: PodRef, used: set[str]) -> Assignment:
    """Two free GPUs of the node, each with a free NIC under its own PCIe switch."""
    topo = load_topology("dgx-h100")
    where = {loc.device.id: loc.switch for loc in locate(topo)}
    pairs: list[tuple[int, str]] = []
    for g in topo.gpus():
        nic = next(
            (
                n.name
                for n in topo.nics()
                if where[n.id] == where[g.id] and n.name not in used | {p for _, p in pairs}
            ),
            None,
        )
        if g.id not in used and nic is not None and len(pairs) < 2:
            pairs.append((g.index, nic))
    gpus = {g.index: g for g in topo.gpus()}
    return Assignment(
        request_id=f"{pod.uid}.1",
        pod=pod,
        node=node,
        gpus=[AssignedGpu(index=i, uuid=gpus[i].uuid) for i, _ in pairs],
        nics=[AssignedNic(name=n, pf=n) for _, n in pairs],
        pairs=[Pair(gpu=i, nic=n, scope="pcie-switch") for i, n in pairs],
    )


async def play_kubelet(registry: Path, plugins: Path, asked: list[dra.Claim]) -> dict[str, Any]:
    """One kubelet's life with the plugin: register, prepare, watch health once."""
    async with grpc.aio.insecure_channel(f"unix://{registry / 'tandem.io-reg.sock'}") as ch:
        stub = reg_grpc.RegistrationStub(ch)
        info = await stub.GetInfo(reg.InfoRequest(), timeout=10)
        await stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=10)
    # The endpoint is the path kubelet opens on the node: here, under the node's directory.
    endpoint = plugins / Path(info.endpoint).relative_to("/var/lib/kubelet/plugins")
    async with grpc.aio.insecure_channel(f"unix://{endpoint}") as ch:
        prepared = await dra_grpc.DRAPluginStub(ch).NodePrepareResources(
            dra.NodePrepareResourcesRequest(claims=asked), timeout=30
        )
        stream = health_grpc.DRAResourceHealthStub(ch).NodeWatchResources(health.NodeWatchResourcesRequest())
        first = await stream.read()
        stream.cancel()
    return {"info": info, "prepared": prepared, "health": first, "endpoint": endpoint}


async def kubelet_restarts(
    registry: Path, plugins: Path, asked: list[dra.Claim], *, cdi: Path
) -> tuple[dict[str, Any], dict[str, Any], dra.NodeUnprepareResourcesResponse]:
    """kubelet prepares the claims, restarts (a new client registers and prepares the first
    claim again), then unprepares them; what it saw each time, the claim's CDI spec with it."""
    seen: list[dict[str, Any]] = []

    async def prepared() -> bool:
        # kubelet retries a claim whose preparation failed: the agent may not have read the
        # record the test wrote yet.
        seen.append(await play_kubelet(registry, plugins, asked))
        return not seen[-1]["prepared"].claims[asked[0].uid].error

    await wait_until(prepared, timeout=60, what="the claim prepared", poll=0.2)
    first = {**seen[-1], "spec": json.loads(await asyncio.to_thread(cdi.read_text))}
    again = await play_kubelet(registry, plugins, asked[:1])
    again["spec"] = json.loads(await asyncio.to_thread(cdi.read_text))
    return first, again, await unprepare(again["endpoint"], asked)


async def unprepare(endpoint: Path, asked: list[dra.Claim]) -> dra.NodeUnprepareResourcesResponse:
    async with grpc.aio.insecure_channel(f"unix://{endpoint}") as ch:
        answer: dra.NodeUnprepareResourcesResponse = await dra_grpc.DRAPluginStub(ch).NodeUnprepareResources(
            dra.NodeUnprepareResourcesRequest(claims=asked), timeout=30
        )
    return answer


def test_kubelet_prepares_only_what_tandem_assigned_and_again_after_it_restarts(release: Release) -> None:
    cp = release.cp
    ns = unmanaged_namespace(cp)  # the test plays Tandem's bridge: the running one stays out
    path = f"/apis/resource.k8s.io/v1/namespaces/{ns}"
    uid, made = pod_with_claim(release, ns)
    meta = made["metadata"]
    node = sorted(release.nodes)[0]
    assignment = tandems_answer(
        node, PodRef(namespace=ns, name="dra-kubelet", uid=uid), used_devices(release.nats.url, node)
    )
    update_record(release.nats.url, node, add=assignment)
    try:
        devices = pod_devices([Claim(ns, meta["name"], meta["uid"], made["spec"])], default_class="default")
        assert devices is not None
        topo_names = device_names(load_topology("dgx-h100"))
        allocation = allocations(
            devices, assignment, names=topo_names, at=datetime.datetime.now(datetime.UTC)
        )
        cp.request(
            "PATCH",
            f"{path}/resourceclaims/{meta['name']}/status",
            {"status": {"allocation": allocation[meta["name"]]}},
            content_type=MERGE,
        )
        cp.request(
            "PATCH",
            f"/api/v1/namespaces/{ns}/pods/dra-kubelet",
            {"spec": {"schedulingGates": None}},
            content_type=MERGE,
        )
        eventually(
            lambda: pod_of(cp, ns, "dra-kubelet")["spec"].get("nodeName") == node, what=f"bound to {node}"
        )
        eventually(
            lambda: cp.request("GET", f"{path}/resourceclaims/{meta['name']}")["status"].get("reservedFor"),
            what="the claim reserved for the pod",
        )

        # A user writes a claim's status by hand: a GPU Tandem never assigned, for the same pod.
        stolen = next(f"gpu{i}" for i in range(8) if f"gpu{i}" not in {g.device_id for g in assignment.gpus})
        forged = cp.request(
            "POST",
            f"{path}/resourceclaims",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": "forged"},
                "spec": {
                    "devices": {
                        "requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.tandem.io"}}]
                    }
                },
            },
        )
        selector = allocation[meta["name"]]["nodeSelector"]
        cp.request(
            "PATCH",
            f"{path}/resourceclaims/forged/status",
            {
                "status": {
                    "allocation": {
                        "devices": {
                            "results": [
                                {"request": "gpus", "driver": "tandem.io", "pool": node, "device": stolen}
                            ]
                        },
                        "nodeSelector": selector,
                    },
                    "reservedFor": [{"resource": "pods", "name": "dra-kubelet", "uid": uid}],
                }
            },
            content_type=MERGE,
        )
        asked = [
            dra.Claim(namespace=ns, name=meta["name"], uid=meta["uid"]),
            dra.Claim(namespace=ns, name="forged", uid=forged["metadata"]["uid"]),
        ]
        node_dir = release.kubelet.workdir / "nodes" / node
        cdi = node_dir / "var/run/cdi" / spec_file_name(meta["uid"])
        with (
            short_dir(node_dir / REGISTRY.lstrip("/")) as registry,
            short_dir(node_dir / "var/lib/kubelet/plugins") as plugins,
        ):
            first, again, done = asyncio.run(kubelet_restarts(registry, plugins, asked, cdi=cdi))
        info = first["info"]
        assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == (
            "DRAPlugin",
            "tandem.io",
            "/var/lib/kubelet/plugins/tandem.io/dra.sock",
            ["v1.DRAPlugin"],
        )
        mine = first["prepared"].claims[meta["uid"]]
        results = allocation[meta["name"]]["devices"]["results"]
        assert sorted((d.request_names[0], d.pool_name, d.device_name) for d in mine.devices) == sorted(
            (r["request"], node, r["device"]) for r in results
        )
        by_device = {d.device_name: list(d.cdi_device_ids) for d in mine.devices}
        for g in assignment.gpus:
            assert f"nvidia.com/gpu={g.uuid}" in by_device[f"gpu{g.index}"]
        for n in assignment.nics:
            assert by_device[topo_names[n.name]] == [f"tandem.io/claim={meta['uid']}-{topo_names[n.name]}"]
        env = next(d for d in first["spec"]["devices"] if d["name"] == meta["uid"])["containerEdits"]["env"]
        assert f"NVIDIA_VISIBLE_DEVICES={','.join(g.uuid for g in assignment.gpus)}" in env
        refused = first["prepared"].claims[forged["metadata"]["uid"]]
        assert not refused.devices
        assert f"device '{stolen}' (request 'gpus') was not assigned by Tandem" in refused.error
        assert not (node_dir / "var/run/cdi" / spec_file_name(forged["metadata"]["uid"])).exists()
        assert {d.device.device_name for d in first["health"].devices} == set(topo_names.values())
        assert {d.device.pool_name for d in first["health"].devices} == {node}

        # kubelet restarted: a new client registered again and prepared the prepared claim again.
        assert again["info"] == info
        assert again["prepared"].claims[meta["uid"]] == mine
        assert again["spec"] == first["spec"]
        assert {k: v.error for k, v in done.claims.items()} == {c.uid: "" for c in asked}
        assert not cdi.exists()
    finally:
        update_record(release.nats.url, node, remove=assignment.request_id)
        cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/dra-kubelet")
    eventually(
        lambda: (
            [
                c
                for c in cp.request("GET", f"{path}/resourceclaims")["items"]
                if c["metadata"]["name"] != "forged"
            ]
            == []
        ),
        what="the pod's claim gone with its pod",
    )
    assert os.path.exists(node_dir / REGISTRY.lstrip("/") / "tandem.io-reg.sock")


def test_kubelet_prepares_the_claim_tandems_running_bridge_allocated(release: Release) -> None:
    """The whole running path: the webhook gates the pod, Tandem's bridge and allocator write
    the record and the claim's allocation, the scheduler binds and reserves, and the node
    agent of that node prepares the claim for kubelet."""
    cp = release.cp
    ns = make_namespace(cp)
    path = f"/apis/resource.k8s.io/v1/namespaces/{ns}"
    cp.request("POST", f"{path}/resourceclaimtemplates", bridge_template("pair", gpus=1, nics=1))
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", claim_pod("dra-run", "pair"))
    node = eventually(lambda: pod_of(cp, ns, "dra-run")["spec"].get("nodeName"), what="the pod bound")
    claim = eventually(
        lambda: next(
            (
                c
                for c in cp.request("GET", f"{path}/resourceclaims")["items"]
                if c["status"].get("reservedFor")
            ),
            None,
        ),
        what="the claim reserved for the pod",
    )
    meta = claim["metadata"]
    asked = [dra.Claim(namespace=ns, name=meta["name"], uid=meta["uid"])]
    node_dir = release.kubelet.workdir / "nodes" / node
    cdi = node_dir / "var/run/cdi" / spec_file_name(meta["uid"])
    with (
        short_dir(node_dir / REGISTRY.lstrip("/")) as registry,
        short_dir(node_dir / "var/lib/kubelet/plugins") as plugins,
    ):
        first, again, done = asyncio.run(kubelet_restarts(registry, plugins, asked, cdi=cdi))
    mine = first["prepared"].claims[meta["uid"]]
    assert sorted((d.request_names[0], d.pool_name, d.device_name) for d in mine.devices) == sorted(
        (r["request"], node, r["device"]) for r in claim["status"]["allocation"]["devices"]["results"]
    )
    assert again["prepared"].claims[meta["uid"]] == mine
    assert done.claims[meta["uid"]].error == "" and not cdi.exists()
    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/dra-run")
    eventually(lambda: not cp.request("GET", f"{path}/resourceclaims")["items"], what="the claim gone")
