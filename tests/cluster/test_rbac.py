"""Least privilege, as the real API server enforces it (issue "Meet the real platform", item 4).

Each component's identity is the token the cluster gives its running pod (TokenRequest, bound
to the pod, as kubelet projects it). The test first shows the token authenticates (a
SelfSubjectReview names the service account), then that the API server refuses what the chart
does not grant: the bridge may patch pods but not read Secrets, delete pods or touch nodes,
and the chart's ValidatingAdmissionPolicy stops it changing any pod that is not a gated
Tandem pod, or a Tandem pod's images; the components that need no API get nothing at all.
"""

from __future__ import annotations

from typing import Any

import pytest

from services.admission import names
from tests.cluster.release import NAMESPACE, RELEASE, Release, eventually
from tests.cluster.test_pod_life import make_namespace, pod_of, training_pod


def token_of(release: Release, component: str) -> str:
    (pod, *_) = release.pods[component]
    meta = pod.pod["metadata"]
    return release.cp.token(NAMESPACE, pod.pod["spec"]["serviceAccountName"], pod=(meta["name"], meta["uid"]))


def whoami(release: Release, token: str) -> str:
    status, body = release.cp.request_as(
        token,
        "POST",
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
    )
    assert status == 201, body
    return str(body["status"]["userInfo"]["username"])


def test_the_bridge_is_refused_what_the_chart_does_not_grant(release: Release) -> None:
    cp = release.cp
    token = token_of(release, "admission")
    assert whoami(release, token) == f"system:serviceaccount:{NAMESPACE}:{RELEASE}-admission"
    assert cp.request_as(token, "GET", "/api/v1/pods?limit=1")[0] == 200  # what it needs works
    refused = [
        ("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{RELEASE}-admission-tls", None),
        ("GET", "/api/v1/secrets", None),
        ("DELETE", "/api/v1/namespaces/default/pods/anything", None),
        ("PATCH", "/api/v1/nodes/gpu-0", {"metadata": {"labels": {"x": "y"}}}),
        ("POST", "/api/v1/namespaces/default/pods", training_pod("sneaky", gpus=1, nics=1)),
        ("PATCH", f"/api/v1/namespaces/{NAMESPACE}/configmaps/{RELEASE}-config", {"data": {"x": "y"}}),
    ]
    for method, path, body in refused:
        status, answer = cp.request_as(token, method, path, body)
        assert status == 403, (method, path, answer)
        assert answer["reason"] == "Forbidden", answer


def test_the_admission_policy_keeps_the_bridge_to_gated_tandem_pods(release: Release) -> None:
    cp = release.cp
    ns = make_namespace(cp)
    plain: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plain"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", plain)
    token = token_of(release, "admission")
    status, answer = cp.request_as(
        token, "PATCH", f"/api/v1/namespaces/{ns}/pods/plain", {"metadata": {"annotations": {"a": "b"}}}
    )
    assert status in (403, 422), answer
    assert "may only change pods labelled tandem.io/managed=true" in answer["message"], answer

    # A Tandem pod that is placed (gate gone): not the bridge's to change any more.
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", training_pod("placed", gpus=1, nics=1))
    eventually(lambda: pod_of(cp, ns, "placed")["status"].get("phase") == "Running", what="placed running")
    status, answer = cp.request_as(
        token, "PATCH", f"/api/v1/namespaces/{ns}/pods/placed", {"metadata": {"annotations": {"a": "b"}}}
    )
    assert status in (403, 422), answer
    assert "tandem.io/allocation scheduling gate" in answer["message"], answer
    release.empty_namespace(ns)


@pytest.mark.parametrize("component", ["allocator", "inventory", "nodeagent"])
def test_components_without_a_kubernetes_role_get_nothing(release: Release, component: str) -> None:
    cp = release.cp
    token = token_of(release, component)
    assert whoami(release, token) == f"system:serviceaccount:{NAMESPACE}:{RELEASE}-{component}"
    for path in ("/api/v1/pods?limit=1", f"/api/v1/namespaces/{NAMESPACE}/secrets", "/api/v1/nodes"):
        status, answer = cp.request_as(token, "GET", path)
        assert status == 403, (component, path, answer)


def test_the_gate_is_the_webhooks_to_add(release: Release) -> None:
    """The label and gate on a created pod are the webhook's answer, never the author's word:
    a pod created with the label but asking no devices keeps no gate (matchConditions skip it)."""
    cp = release.cp
    ns = make_namespace(cp)
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "labelled", "labels": {names.MANAGED: "true"}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    created = cp.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
    assert not created["spec"].get("schedulingGates")
    eventually(lambda: pod_of(cp, ns, "labelled")["status"].get("phase") == "Running", what="plain pod runs")
    assert release.requests_of(ns, "labelled") == []  # the bridge asked nothing for it
    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/labelled")
