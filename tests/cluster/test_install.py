"""The chart's secure default, ``helm install``ed into the real API server (item 1).

Default values: bundled NATS (StatefulSet, PVCs, PDB), TLS, the auth callout with its
pre-install hook, NetworkPolicies, the admission ValidatingAdmissionPolicy, RBAC. The API server
must accept every object; the hook Job's container really runs (with its ServiceAccount's token
and the Role the hook grants) and writes the callout's Secret before Helm goes on; the callout's
identity may review tokens and nothing more, and the real TokenReview accepts a node agent's
token only for the ``tandem-nats`` audience. And it runs: the three NATS servers of the
StatefulSet (claims bound to volumes provisioned here) form a JetStream cluster over TLS
routes, the callout admits a component by the TokenReview of its projected token, the
component's streams get the chart's replication, and a token for another audience is refused.

The release lives beside the plain one of the other modules (a second namespace and name); its
webhook would refuse Tandem pods (no endpoints), so this module creates none and uninstalls it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import nats
import pytest

from services.authcallout.service import Denied, Reviewer
from services.kube.client import KubeClient
from tests.cluster.controlplane import ControlPlane
from tests.cluster.kubelet import RunningPod
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


# --- the secure default running -------------------------------------------------------------
NATS = f"{FULL}-nats"
SERVICE_NAME = f"{NATS}.{NAMESPACE}.svc"  # the name in every component's nats_url


def _bind_claims(cp: ControlPlane, count: int) -> None:
    """A PersistentVolume for each server's claim, bound to it, as an operator provisions
    volumes statically where no provisioner runs; the controller-manager binds them."""
    for i in range(count):
        claim = f"data-{NATS}-{i}"
        pvc = eventually(
            lambda c=claim: get(cp, f"/api/v1/namespaces/{NAMESPACE}/persistentvolumeclaims/{c}"),
            what=f"claim {claim}",
        )
        cp.request(
            "POST",
            "/api/v1/persistentvolumes",
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": f"{NAMESPACE}-{claim}"},
                "spec": {
                    "capacity": {"storage": pvc["spec"]["resources"]["requests"]["storage"]},
                    "accessModes": ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "hostPath": {"path": f"/var/lib/tandem-tests/{claim}"},  # the kubelet's own dir here
                    "claimRef": {"namespace": NAMESPACE, "name": claim},
                },
            },
        )
    for i in range(count):
        eventually(
            lambda i=i: (
                get(cp, f"/api/v1/namespaces/{NAMESPACE}/persistentvolumeclaims/data-{NATS}-{i}")[
                    "status"
                ].get("phase")
                == "Bound"
            ),
            what=f"claim data-{NATS}-{i} bound",
        )


def _monitor(ip: str, path: str) -> dict[str, Any]:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
        f"http://{ip}:8222{path}", timeout=5
    ) as resp:
        return dict(json.loads(resp.read()))


async def _connect(ip: str, *, token: str, ca: bytes) -> Any:
    """A NATS client at one server's address, checking its certificate for the Service's
    name as a pod does (the test process has no cluster DNS)."""
    ctx = ssl.create_default_context(cadata=ca.decode())
    return await nats.connect(
        servers=[f"tls://{ip}:4222"],
        tls=ctx,
        tls_hostname=SERVICE_NAME,
        token=token,
        allow_reconnect=False,
        connect_timeout=5,
    )


def test_the_secure_default_runs_a_tls_jetstream_cluster_behind_the_auth_callout(
    secure: dict[str, Any], release: Release
) -> None:
    """The chart's defaults running, not only accepted: three NATS servers form a JetStream
    cluster over TLS routes (each finds the others by its StatefulSet DNS name), the auth
    callout admits a component by the real TokenReview of its projected token, the component
    makes its streams with the chart's replication, and a token for another audience is
    refused at connect."""
    cp, kubelet = release.cp, release.kubelet
    installed = Release(cp=cp, nats=release.nats, kubelet=kubelet, namespace=NAMESPACE, name=NAME)
    started: list[RunningPod] = []
    try:
        _bind_claims(cp, 3)
        servers = [kubelet.run(p) for p in installed.workload_pods("nats", count=3)]
        started += servers
        kubelet.resolve(SERVICE_NAME, servers[0].ip)  # DNS + kube-proxy: one server behind the name
        for s in servers:
            s.wait_ready(timeout=60)

        def cluster_formed() -> bool:
            views = [_monitor(s.ip, "/jsz").get("meta_cluster") or {} for s in servers]
            return all(v.get("cluster_size") == 3 and v.get("leader") for v in views)

        eventually(cluster_formed, timeout=60, what="a JetStream cluster of 3 with a leader")
        for s in servers:
            routes = _monitor(s.ip, "/routez")["routes"]
            assert len({r["remote_name"] for r in routes}) == 2, routes
            varz = _monitor(s.ip, "/varz")
            # Clients and routes only over TLS, routes verifying the other server's certificate.
            assert varz["tls_required"] and varz["cluster"]["tls_required"] and varz["cluster"]["tls_verify"]

        callouts = installed.start("authcallout", count=2)
        started += callouts
        for c in callouts:
            c.wait_ready(timeout=60)
        (inventory,) = installed.start("inventory", count=1)
        started.append(inventory)
        inventory.wait_ready(timeout=90)  # connected through the callout, streams made

        streams = _monitor(servers[0].ip, "/jsz?accounts=true&streams=true&config=true")
        configs = [
            s["config"]
            for account in streams.get("account_details", [])
            for s in account.get("stream_detail", [])
        ]
        assert configs, streams
        assert {c["num_replicas"] for c in configs} == {3}, [(c["name"], c["num_replicas"]) for c in configs]

        ca = base64.b64decode(get(cp, f"/api/v1/namespaces/{NAMESPACE}/secrets/{NATS}-tls")["data"]["ca.crt"])
        pod = (inventory.name, inventory.pod["metadata"]["uid"])
        good = cp.token(NAMESPACE, f"{FULL}-inventory", audiences=["tandem-nats"], pod=pod)
        wrong = cp.token(NAMESPACE, f"{FULL}-inventory", pod=pod)  # the API server's audience

        async def connects(token: str) -> str:
            try:
                nc = await _connect(servers[0].ip, token=token, ca=ca)
            except Exception as exc:  # what the server said is the result
                return f"refused: {exc!r}"
            await nc.close()
            return "connected"

        assert asyncio.run(connects(good)) == "connected"
        refused = asyncio.run(connects(wrong))
        assert refused.startswith("refused") and "uthorization" in refused, refused
    except BaseException:
        print("\n".join(f"--- {p.name} (rc={p.popen.poll()})\n{p.tail()}" for p in started))
        raise
    finally:
        for p in reversed(started):
            p.stop()
