"""The allocation cannot be bypassed (issue "Meet the real platform", item 3), as the real API
server enforces it with the chart's guard policy (a ValidatingAdmissionPolicy whose CEL the API
server compiles and runs).

Every write below is made as the cluster admin (system:masters), whom RBAC never stops: the
policy still does. A pod's owner cannot remove Tandem's scheduling gate, change the assignment
annotation or drop the managed label; a pod asking for tandem.io/* devices cannot be created in
a namespace the webhook skips. The last line of defence, on the node, is the device plugin's
refusal of device sets no assignment names (tests/unit/test_deviceplugin.py, a real gRPC
client playing kubelet).
"""

from __future__ import annotations

import json
import urllib.error
import uuid
from typing import Any

import pytest

from services.admission import names
from tests.cluster.controlplane import ControlPlane
from tests.cluster.release import Release, eventually
from tests.cluster.test_pod_life import make_namespace, pod_of, training_pod


def refused(
    cp: ControlPlane, method: str, path: str, body: Any, *, ctype: str = "application/merge-patch+json"
) -> str:
    with pytest.raises(urllib.error.HTTPError) as err:
        cp.request(method, path, body, content_type=ctype)
    answer = json.loads(err.value.read())
    assert err.value.code in (403, 422), answer
    return str(answer["message"])


def test_the_owner_cannot_remove_the_gate_of_a_pending_pod(release: Release) -> None:
    cp = release.cp
    ns = make_namespace(cp)
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", training_pod("greedy", gpus=16, nics=0))
    eventually(lambda: release.requests_of(ns, "greedy"), what="greedy requested")
    why = refused(cp, "PATCH", f"/api/v1/namespaces/{ns}/pods/greedy", {"spec": {"schedulingGates": None}})
    assert "only Tandem removes the tandem.io/allocation scheduling gate" in why, why
    pod = pod_of(cp, ns, "greedy")
    assert {"name": names.GATE} in pod["spec"]["schedulingGates"] and not pod["spec"].get("nodeName")
    why = refused(
        cp, "PATCH", f"/api/v1/namespaces/{ns}/pods/greedy", {"metadata": {"labels": {names.MANAGED: None}}}
    )
    assert "tandem.io/managed" in why, why
    release.empty_namespace(ns)


def test_the_assignment_of_a_running_pod_cannot_be_edited(release: Release) -> None:
    cp = release.cp
    ns = make_namespace(cp)
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", training_pod("honest", gpus=1, nics=1))
    running = eventually(
        lambda: (p := pod_of(cp, ns, "honest"))["status"].get("phase") == "Running" and p,
        what="honest running",
    )
    forged = json.loads(running["metadata"]["annotations"][names.ASSIGNMENT])
    forged["gpus"] = forged["gpus"] * 2
    why = refused(
        cp,
        "PATCH",
        f"/api/v1/namespaces/{ns}/pods/honest",
        {"metadata": {"annotations": {names.ASSIGNMENT: json.dumps(forged)}}},
    )
    assert "tandem.io/assignment" in why, why
    # Anything else on the pod is still the owner's.
    cp.request(
        "PATCH",
        f"/api/v1/namespaces/{ns}/pods/honest",
        {"metadata": {"annotations": {"team": "vision"}}},
        content_type="application/merge-patch+json",
    )
    release.empty_namespace(ns)


def test_a_namespace_the_webhook_skips_cannot_start_a_device_pod(release: Release) -> None:
    cp = release.cp
    ns = f"optout-{uuid.uuid4().hex[:6]}"
    cp.request(
        "POST",
        "/api/v1/namespaces",
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": ns, "labels": {names.NAMESPACE_OPT_OUT: names.NAMESPACE_OPT_OUT_VALUE}},
        },
    )
    why = refused(
        cp,
        "POST",
        f"/api/v1/namespaces/{ns}/pods",
        training_pod("sideways", gpus=2, nics=2),
        ctype="application/json",
    )
    assert "did not pass Tandem's admission webhook" in why and ns in why, why
    # A pod there that asks no Tandem devices is none of Tandem's business.
    plain = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plain"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", plain)
    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/plain")
