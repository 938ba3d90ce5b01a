"""A pod's life through the real control plane (issue "Meet the real platform", items 1-2).

The chart is installed with the Helm SDK; every replica of every component runs as a local
process with the chart's settings and its ServiceAccount's real token. A pod created through
the API is sent by the API server itself to the webhook (over the Service's endpoints, TLS
checked against the chart's caBundle), gated, requested by the bridge, decided by the
allocator, ungated with its node affinity, bound by the real kube-scheduler to the node Tandem
chose, run by kwok; deleted, it is released, cleaned up by the node agent and freed.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

from services.admission import names
from tests.cluster.controlplane import ControlPlane
from tests.cluster.release import NAMESPACE, RELEASE, Release, eventually


def make_namespace(cp: ControlPlane) -> str:
    ns = f"team-{uuid.uuid4().hex[:6]}"
    cp.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
    )
    return ns


def training_pod(
    name: str, *, gpus: int, nics: int, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    limits = {names.RESOURCE_GPU: str(gpus), names.RESOURCE_RDMA: str(nics)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "containers": [
                {
                    "name": "train",
                    "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                    "resources": {"limits": limits},
                }
            ],
        },
    }


def pod_of(cp: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    return dict(cp.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}"))


def fill_every_node(release: Release, ns: str) -> None:
    """Pods ``fill-0``... holding every GPU of every node, running."""
    cp = release.cp
    for i in range(len(release.nodes)):
        cp.request("POST", f"/api/v1/namespaces/{ns}/pods", training_pod(f"fill-{i}", gpus=8, nics=8))
    for i in range(len(release.nodes)):
        eventually(
            lambda i=i: pod_of(cp, ns, f"fill-{i}")["status"].get("phase") == "Running",
            what=f"fill-{i} running",
        )


def test_the_api_server_accepted_every_object_of_the_release(release: Release) -> None:
    cp = release.cp
    hook = cp.request(
        "GET", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{RELEASE}-admission"
    )
    secret = cp.request("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{RELEASE}-admission-tls")
    (webhook,) = hook["webhooks"]
    assert base64.b64decode(webhook["clientConfig"]["caBundle"]) == base64.b64decode(secret["data"]["ca.crt"])
    crd = cp.request("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/deviceclaims.tandem.io")
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions.get("Established") == "True" and conditions.get("NamesAccepted") == "True"
    # The admission policy's CEL, compiled and type-checked by the API server's own controller.
    policy = eventually(
        lambda: (
            (
                p := cp.request(
                    "GET",
                    f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{RELEASE}-admission-pods",
                )
            )
            .get("status", {})
            .get("typeChecking")
            is not None
            and p
        ),
        what="the policy type-checked",
    )
    assert policy["status"]["typeChecking"].get("expressionWarnings") in (None, []), policy["status"]


def test_a_pod_is_admitted_placed_bound_run_and_freed(release: Release) -> None:
    cp = release.cp
    ns = make_namespace(cp)
    created = cp.request("POST", f"/api/v1/namespaces/{ns}/pods", training_pod("trainer", gpus=2, nics=2))

    # What the API server stored is what our webhook answered: gate, label, trace context.
    assert {"name": names.GATE} in created["spec"].get("schedulingGates", []), created["spec"]
    assert created["metadata"]["labels"].get(names.MANAGED) == "true"
    assert names.TRACEPARENT in created["metadata"]["annotations"]

    def running() -> dict[str, Any] | None:
        pod = pod_of(cp, ns, "trainer")
        return pod if pod["status"].get("phase") == "Running" else None

    pod = eventually(running, what="the pod running")
    assignment = json.loads(pod["metadata"]["annotations"][names.ASSIGNMENT])
    # The real scheduler bound it to the node Tandem chose, once the gate was gone.
    assert pod["spec"]["nodeName"] == assignment["node"]
    assert not pod["spec"].get("schedulingGates")
    assert len(assignment["gpus"]) == 2 and len(assignment["nics"]) == 2
    assert assignment["scope"] == "pcie-switch"  # dgx-h100: every GPU has a NIC under its switch
    (record,) = release.requests_of(ns, "trainer")
    assert record.state == "assigned" and record.node == assignment["node"]

    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/trainer")
    freed = eventually(
        lambda: [r for r in release.requests_of(ns, "trainer") if r.state == "freed"],
        what="the allocation freed after cleanup",
    )
    assert freed[0].node == assignment["node"]


def test_a_pod_that_cannot_be_placed_waits_and_is_placed_when_room_appears(release: Release) -> None:
    cp = release.cp
    ns = make_namespace(cp)
    fill_every_node(release, ns)
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", training_pod("waiter", gpus=4, nics=4))

    def failed_event() -> dict[str, Any] | None:
        events = cp.request("GET", f"/api/v1/namespaces/{ns}/events?fieldSelector=involvedObject.name=waiter")
        return next((e for e in events["items"] if e["reason"] == names.EVENT_REASON_FAILED), None)

    event = eventually(failed_event, what="an AllocationFailed event on the waiting pod")
    assert "4 GPUs" in event["message"] or "GPU" in event["message"], event["message"]
    waiting = pod_of(cp, ns, "waiter")
    assert {"name": names.GATE} in waiting["spec"]["schedulingGates"]  # never reached the scheduler
    assert not waiting["spec"].get("nodeName")

    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/fill-0")
    pod = eventually(
        lambda: (p := pod_of(cp, ns, "waiter"))["status"].get("phase") == "Running" and p,
        what="the waiting pod placed once room appeared",
    )
    assert pod["spec"]["nodeName"] == json.loads(pod["metadata"]["annotations"][names.ASSIGNMENT])["node"]
    release.empty_namespace(ns)
