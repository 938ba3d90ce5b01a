"""Tandem's DeviceClasses select Tandem's devices for the real kube-scheduler (issue "Tandem
speaks DRA", item 2, and the baseline of its side-by-side benchmark).

With the chart's DeviceClasses (``dra.enabled``) and the node agents' ResourceSlices, a pod
that asks through the standard API — a ResourceClaimTemplate for 2 GPUs and 2 NICs whose
devices must share a PCIe switch (``matchAttribute: tandem.io/pcieSwitch``) — is allocated
by kube-scheduler alone: the resourceclaim controller makes the claim, the scheduler picks
devices from one node's pool and binds the pod there. The classes' CEL is compiled by the
real API server and evaluated by the real scheduler; the allocation must name only devices
of the class asked, on the pod's node, under one switch.
"""

from __future__ import annotations

from typing import Any

from services.admission import names
from tests.cluster.controlplane import ControlPlane
from tests.cluster.release import Release, eventually
from tests.cluster.test_pod_life import make_namespace, pod_of

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def claim_template(name: str, *, gpus: int, nics: int, match: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {"name": "gpus", "exactly": {"deviceClassName": "gpu.tandem.io", "count": gpus}},
                        {"name": "nics", "exactly": {"deviceClassName": "nic.tandem.io", "count": nics}},
                    ],
                    "constraints": [{"requests": ["gpus", "nics"], "matchAttribute": match}],
                }
            }
        },
    }


def unmanaged_namespace(cp: ControlPlane) -> str:
    """A namespace Tandem's webhook skips (``tandem.io/admission=disabled``): its DRA pods are
    the scheduler's alone, as on a cluster without Tandem's bridge."""
    ns = make_namespace(cp)
    cp.request(
        "PATCH",
        f"/api/v1/namespaces/{ns}",
        {"metadata": {"labels": {names.NAMESPACE_OPT_OUT: names.NAMESPACE_OPT_OUT_VALUE}}},
        content_type="application/merge-patch+json",
    )
    return ns


def claim_pod(name: str, template: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "resourceClaims": [{"name": "devices", "resourceClaimTemplateName": template}],
            "containers": [
                {
                    "name": "train",
                    "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                    "resources": {"claims": [{"name": "devices"}]},
                }
            ],
        },
    }


def test_the_scheduler_alone_allocates_tandems_devices_through_its_classes(release: Release) -> None:
    cp = release.cp
    classes = cp.request("GET", "/apis/resource.k8s.io/v1/deviceclasses")["items"]
    assert {"gpu.tandem.io", "nic.tandem.io", "nic-vf.tandem.io", "mig.tandem.io"} <= {
        c["metadata"]["name"] for c in classes
    }
    ns = unmanaged_namespace(cp)  # Tandem's webhook would refuse matchAttribute (Tandem pairs by scope)
    path = f"/apis/resource.k8s.io/v1/namespaces/{ns}"
    cp.request(
        "POST",
        f"{path}/resourceclaimtemplates",
        claim_template("pair", gpus=2, nics=2, match="tandem.io/pcieSwitch"),
    )
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", claim_pod("dra-pair", "pair"))
    eventually(lambda: pod_of(cp, ns, "dra-pair")["spec"].get("nodeName"), what="the pod bound")
    node = pod_of(cp, ns, "dra-pair")["spec"]["nodeName"]

    (claim,) = cp.request("GET", f"{path}/resourceclaims")["items"]
    results = claim["status"]["allocation"]["devices"]["results"]
    assert sorted(r["request"] for r in results) == ["gpus", "gpus", "nics", "nics"]
    assert {(r["driver"], r["pool"]) for r in results} == {("tandem.io", node)}
    devices = {
        d["name"]: d
        for s in cp.request("GET", f"{SLICES}?fieldSelector=spec.nodeName%3D{node}")["items"]
        for d in s["spec"]["devices"]
    }
    kinds = {r["request"]: set() for r in results}
    switches = set()
    for r in results:
        attrs = devices[r["device"]]["attributes"]
        kinds[r["request"]].add(attrs["type"]["string"])
        switches.add(attrs["pcieSwitch"]["string"])
    assert kinds == {"gpus": {"gpu"}, "nics": {"nic"}}
    assert len(switches) == 1, switches
    assert release.requests_of(ns, "dra-pair") == []  # Tandem was not asked: the scheduler's own pick
    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/dra-pair")
    eventually(
        lambda: not cp.request("GET", f"{path}/resourceclaims")["items"], what="the claim gone with its pod"
    )
