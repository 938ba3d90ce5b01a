"""Tandem's allocation of a pod's claims, as the real control plane takes it (issue "Tandem
speaks DRA", item 3, the write path).

A pod asks through the standard API — a ResourceClaimTemplate for 2 GPUs + 2 NICs of
Tandem's classes with Tandem's AllocationParameters — and waits behind a scheduling gate (the
test's, standing in for the webhook's, in a namespace the running webhook skips; the running
path is test_dra_bridge.py). The real resourceclaim controller makes its claim;
Tandem's rules (services.admission.draclaims) read it as one request and write the claim's
``status.allocation`` for an assignment on one node, each GPU with the NIC of its own PCIe
switch; the real API server validates that write; once the gate is gone the real
kube-scheduler sees the allocated claim, reserves it for the pod and binds the pod to exactly
that node. Deleting the pod ends the claim.
"""

from __future__ import annotations

import datetime

from schemas.messages import AssignedGpu, AssignedNic, Assignment, Pair, PodRef
from schemas.topology import Nic, locate
from services.admission.draclaims import PARAMETERS_API, PARAMETERS_KIND, Claim, allocations, pod_devices
from services.nodeagent.dra.slices import device_names
from services.topology import load_topology
from tests.cluster.release import Release, eventually
from tests.cluster.test_dra_classes import claim_pod, unmanaged_namespace
from tests.cluster.test_pod_life import pod_of

HOLD = "test.tandem.io/hold"


def test_the_scheduler_binds_a_pod_whose_claims_tandem_allocated_to_tandems_node(release: Release) -> None:
    cp = release.cp
    ns = unmanaged_namespace(cp)  # the test plays Tandem's bridge: the running one stays out
    path = f"/apis/resource.k8s.io/v1/namespaces/{ns}"
    parameters = {"apiVersion": PARAMETERS_API, "kind": PARAMETERS_KIND, "scope": "pcie-switch"}
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "pairs"},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {"name": "gpus", "exactly": {"deviceClassName": "gpu.tandem.io", "count": 2}},
                        {"name": "nics", "exactly": {"deviceClassName": "nic.tandem.io", "count": 2}},
                    ],
                    "config": [{"opaque": {"driver": "tandem.io", "parameters": parameters}}],
                }
            }
        },
    }
    cp.request("POST", f"{path}/resourceclaimtemplates", template)
    pod = claim_pod("dra-tandem", "pairs")
    pod["spec"]["schedulingGates"] = [{"name": HOLD}]
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
    eventually(lambda: cp.request("GET", f"{path}/resourceclaims")["items"], what="the pod's claim made")
    (made,) = cp.request("GET", f"{path}/resourceclaims")["items"]
    meta = made["metadata"]
    devices = pod_devices([Claim(ns, meta["name"], meta["uid"], made["spec"])], default_class="default")
    assert devices is not None and (devices.ask.gpus, devices.ask.rdma, devices.ask.scope) == (
        2,
        2,
        "pcie-switch",
    )

    # Tandem's answer for the last node: gpu0 and gpu1, each with the NIC on its own switch.
    node = sorted(release.nodes)[-1]
    topo = load_topology("dgx-h100")
    where = {loc.device.id: loc.switch for loc in locate(topo)}
    gpus = [g for g in topo.gpus() if g.index in (0, 1)]
    nic_of: dict[int, Nic] = {}
    for g in gpus:
        nic_of[g.index] = next(
            n for n in topo.nics() if where[n.id] == where[g.id] and n not in nic_of.values()
        )
    assignment = Assignment(
        request_id=f"{meta['uid']}.1",
        pod=PodRef(namespace=ns, name="dra-tandem"),
        node=node,
        gpus=[AssignedGpu(index=g.index, uuid=g.uuid) for g in gpus],
        nics=[AssignedNic(name=n.name, pf=n.name) for n in nic_of.values()],
        pairs=[Pair(gpu=i, nic=n.name, scope="pcie-switch") for i, n in nic_of.items()],
    )
    allocation = allocations(
        devices, assignment, names=device_names(topo), at=datetime.datetime.now(datetime.UTC)
    )[meta["name"]]
    written = cp.request(
        "PATCH",
        f"{path}/resourceclaims/{meta['name']}/status",
        {"status": {"allocation": allocation}},
        content_type="application/merge-patch+json",
    )
    assert written["status"]["allocation"]["devices"]["results"] == allocation["devices"]["results"]

    cp.request(
        "PATCH",
        f"/api/v1/namespaces/{ns}/pods/dra-tandem",
        {"spec": {"schedulingGates": None}},
        content_type="application/merge-patch+json",
    )
    eventually(lambda: pod_of(cp, ns, "dra-tandem")["spec"].get("nodeName") == node, what=f"bound to {node}")
    claim = cp.request("GET", f"{path}/resourceclaims/{meta['name']}")
    assert [r["name"] for r in claim["status"].get("reservedFor", [])] == ["dra-tandem"]
    assert sorted(
        (r["request"], r["device"]) for r in claim["status"]["allocation"]["devices"]["results"]
    ) == sorted(
        [("gpus", "gpu0"), ("gpus", "gpu1")] + [("nics", n.name.replace("_", "-")) for n in nic_of.values()]
    )

    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/dra-tandem")
    eventually(
        lambda: not cp.request("GET", f"{path}/resourceclaims")["items"], what="the claim gone with its pod"
    )
