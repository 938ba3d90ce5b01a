"""The chart's secure default, ``helm install``ed into the real API server (item 1).

Default values: bundled NATS (StatefulSet, PVCs, PDB), TLS, the auth callout with its
pre-install hook, NetworkPolicies, the admission ValidatingAdmissionPolicy, RBAC. The API server
must accept every object; the hook Job's container really runs (with its ServiceAccount's token
and the Role the hook grants) and writes the callout's Secret before Helm goes on; the callout's
identity may review tokens and nothing more, and the real TokenReview accepts a node agent's
token only for the ``tandem-nats`` audience.

The release lives beside the plain one of the other modules (a second namespace and name); its
webhook would refuse Tandem pods (no endpoints), so this module creates none and uninstalls it.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from services.admission.kube import KubeClient
from services.authcallout.service import Denied, Reviewer
from tests.cluster.controlplane import ControlPlane
from tests.cluster.release import Release, eventually, install, uninstall

NAME, NAMESPACE = "secure", "tandem-secure"
FULL = f"{NAME}-tandem"  # the chart names objects <release>-tandem-<part> unless the release says tandem
# Beside the plain release on the same nodes: its node agents need a host port of their own.
VALUES = {"metrics": {"nodeagentPort": 9466}}


@pytest.fixture(scope="module")
def secure(release: Release) -> Iterator[dict[str, Any]]:
    """The default install; ``release`` first, so GPU nodes exist for the DaemonSet."""
    cp = release.cp
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["release"] = install(cp, VALUES, name=NAME, namespace=NAMESPACE)
        except BaseException as exc:  # reported by the test thread
            done["error"] = exc

    helm = threading.Thread(target=run, name="helm-install")
    helm.start()
    hook_pod = _hook_pod(cp)
    ran = release.kubelet.run_to_completion(hook_pod)
    helm.join(180)
    assert not helm.is_alive(), "helm install did not return"
    if "error" in done:
        raise AssertionError(f"helm install failed: {done['error']}\nhook:\n{ran.tail()}")
    assert ran.popen.returncode == 0, ran.tail()
    try:
        yield done
    finally:
        uninstall(cp, name=NAME, namespace=NAMESPACE)


def _hook_pod(cp: ControlPlane) -> dict[str, Any]:
    selector = f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component=nats-auth-hook"

    def bound() -> dict[str, Any] | None:
        items = cp.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={selector}")["items"]
        return next((p for p in items if p["spec"].get("nodeName")), None)

    return dict(eventually(bound, timeout=120, what="the nats-auth hook's pod bound"))


def get(cp: ControlPlane, path: str) -> dict[str, Any]:
    return dict(cp.request("GET", path))


def test_every_object_of_the_secure_default_is_accepted(secure: dict[str, Any], release: Release) -> None:
    cp = release.cp
    ns = f"/api/v1/namespaces/{NAMESPACE}"
    apps = f"/apis/apps/v1/namespaces/{NAMESPACE}"
    assert get(cp, f"{apps}/statefulsets/{FULL}-nats")["spec"]["replicas"] == 3
    for component in ("admission", "allocator", "inventory", "authcallout"):
        assert get(cp, f"{apps}/deployments/{FULL}-{component}")
        assert get(cp, f"/apis/policy/v1/namespaces/{NAMESPACE}/poddisruptionbudgets/{FULL}-{component}")
    assert get(cp, f"{apps}/daemonsets/{FULL}-nodeagent")
    policies = cp.request("GET", f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies")[
        "items"
    ]
    assert {p["metadata"]["name"] for p in policies} >= {f"{FULL}-default-deny", f"{FULL}-admission-webhook"}
    assert get(cp, f"{ns}/secrets/{FULL}-nats-tls")["data"]["ca.crt"]
    # The hook ran for real: the Secret it writes (not part of the release) is there, with
    # the NATS server configuration and the callout's keys.
    auth = get(cp, f"{ns}/secrets/{FULL}-nats-auth")["data"]
    assert {"server.conf", "issuer.nk", "auth.nk"} <= set(auth)
    assert b"auth_callout" in base64.b64decode(auth["server.conf"])
    # Hook objects go once the hook succeeded (hook-delete-policy hook-succeeded).
    jobs = cp.request("GET", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs")["items"]
    assert not [j for j in jobs if j["metadata"]["name"] == f"{FULL}-nats-auth-hook"]


def callout_token(cp: ControlPlane) -> str:
    return cp.token(NAMESPACE, f"{FULL}-authcallout")


def test_the_callout_may_review_tokens_and_nothing_else(secure: dict[str, Any], release: Release) -> None:
    cp = release.cp
    token = callout_token(cp)
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": "x"}}
    status, _ = cp.request_as(token, "POST", "/apis/authentication.k8s.io/v1/tokenreviews", review)
    assert status == 201
    for method, path in [
        ("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{FULL}-nats-auth"),
        ("GET", "/api/v1/secrets"),
        ("GET", "/api/v1/pods"),  # its pod read is limited to the release namespace
        ("GET", "/api/v1/nodes"),
    ]:
        status, answer = cp.request_as(token, method, path)
        assert status == 403, (path, answer)


def test_the_real_token_review_holds_node_agents_to_the_nats_audience(
    secure: dict[str, Any], release: Release
) -> None:
    cp = release.cp
    agent = eventually(lambda: _node_agent_pod(cp), timeout=60, what="a node agent pod on a node")
    bound = (agent["metadata"]["name"], agent["metadata"]["uid"])
    for_nats = cp.token(NAMESPACE, f"{FULL}-nodeagent", audiences=["tandem-nats"], pod=bound)
    for_api = cp.token(NAMESPACE, f"{FULL}-nodeagent", pod=bound)  # the API server's audience

    async def identify() -> tuple[Any, str]:
        kube = await KubeClient.connect(kubeconfig=str(cp.kubeconfig_for_token(callout_token(cp), "callout")))
        try:
            reviewer = Reviewer(
                kube,
                namespace=NAMESPACE,
                identities={f"{FULL}-{c}": c for c in ("allocator", "inventory", "admission", "nodeagent")},
                audiences=["tandem-nats"],
            )
            identity = await reviewer.identify(for_nats)
            with pytest.raises(Denied) as refused:
                await reviewer.identify(for_api)
            return identity, str(refused.value)
        finally:
            await kube.close()

    identity, why = asyncio.run(identify())
    assert (identity.role, identity.node) == ("nodeagent", agent["spec"]["nodeName"])
    assert "token not accepted" in why, why


def _node_agent_pod(cp: ControlPlane) -> dict[str, Any] | None:
    selector = f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component=nodeagent"
    items = cp.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={selector}")["items"]
    return next((p for p in items if p["spec"].get("nodeName")), None)
