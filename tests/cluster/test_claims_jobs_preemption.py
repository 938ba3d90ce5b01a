"""DeviceClaims, whole jobs and preemption through the real API (issue "Meet the real platform",
item 2).

* A DeviceClaim is created (the CRD's schema and CEL checked by the API server), held (its
  status subresource written by the bridge, its finalizer added), used by a pod that gets
  exactly its devices, and deleted: the finalizer holds it until Tandem released it.
* A whole job of two 8-GPU pods is placed across both nodes at once, each pod bound by the
  scheduler to the node Tandem chose for it.
* A pod of higher priority allowed to preempt evicts a lower-priority pod through the real
  Eviction API: first refused by a PodDisruptionBudget (the preemptor's Event says so), then,
  once the budget allows it, evicted, its devices cleaned and freed, and the preemptor placed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from services.admission import jobwatch, names
from tests.cluster.controlplane import ControlPlane
from tests.cluster.release import Release, eventually
from tests.cluster.test_pod_life import make_namespace, pod_of, training_pod

CLAIMS = "/apis/tandem.io/v1alpha1/namespaces/{ns}/deviceclaims"


@pytest.fixture
def ns(release: Release) -> Iterator[str]:
    """A namespace of the test's own; whatever the test left there is deleted and freed after."""
    name = make_namespace(release.cp)
    yield name
    for claim in release.cp.request("GET", CLAIMS.format(ns=name))["items"]:
        release.cp.request("DELETE", CLAIMS.format(ns=name) + "/" + claim["metadata"]["name"])
    release.empty_namespace(name)


def running(cp: ControlPlane, ns: str, name: str) -> dict[str, Any] | None:
    pod = pod_of(cp, ns, name)
    return pod if pod["status"].get("phase") == "Running" else None


def test_a_device_claim_is_held_used_and_released_through_its_finalizer(release: Release, ns: str) -> None:
    cp = release.cp
    claim = {
        "apiVersion": "tandem.io/v1alpha1",
        "kind": "DeviceClaim",
        "metadata": {"name": "team-pool"},
        "spec": {"gpus": 2, "rdma": 2, "scope": "pcie-switch", "policy": "required"},
    }
    cp.request("POST", CLAIMS.format(ns=ns), claim)

    def allocated() -> dict[str, Any] | None:
        obj = cp.request("GET", CLAIMS.format(ns=ns) + "/team-pool")
        return obj if obj.get("status", {}).get("phase") == "Allocated" else None

    held = eventually(allocated, what="the claim allocated")
    assert names.CLAIM_FINALIZER in held["metadata"]["finalizers"]
    devices = set(held["status"]["devices"])
    assert len(devices) == 4

    user = training_pod("notebook", gpus=2, nics=2, annotations={names.CLAIM: "team-pool"})
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", user)
    pod = eventually(lambda: running(cp, ns, "notebook"), what="the claim's pod running")
    assignment = json.loads(pod["metadata"]["annotations"][names.ASSIGNMENT])
    assert pod["spec"]["nodeName"] == held["status"]["node"] == assignment["node"]
    got = {f"gpu{g['index']}" for g in assignment["gpus"]} | {n["name"] for n in assignment["nics"]}
    assert got == devices  # exactly the claim's devices

    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/notebook")
    cp.request("DELETE", CLAIMS.format(ns=ns) + "/team-pool")
    # The finalizer keeps the claim until Tandem has released it (after the node's cleanup).
    eventually(
        lambda: not cp.request("GET", CLAIMS.format(ns=ns))["items"], timeout=90, what="the claim gone"
    )
    eventually(lambda: not release.live_requests_in(ns), what="the claim's devices freed")


def test_a_whole_job_is_placed_across_nodes_at_once(release: Release, ns: str) -> None:
    cp = release.cp
    nodes = len(release.nodes)
    for i in range(nodes):
        pod = training_pod(f"worker-{i}", gpus=8, nics=8, annotations={jobwatch.JOB_SIZE: str(nodes)})
        pod["metadata"]["labels"] = {jobwatch.JOB: "allreduce"}
        cp.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
    placed = [
        eventually(lambda i=i: running(cp, ns, f"worker-{i}"), what=f"worker-{i}") for i in range(nodes)
    ]
    on = [p["spec"]["nodeName"] for p in placed]
    assert sorted(on) == sorted(release.nodes)  # one 8-GPU pod per node: the whole fleet
    for p in placed:
        assert p["spec"]["nodeName"] == json.loads(p["metadata"]["annotations"][names.ASSIGNMENT])["node"]


def test_preemption_evicts_through_the_eviction_api_and_respects_the_pdb(release: Release, ns: str) -> None:
    cp = release.cp
    for i in range(len(release.nodes)):
        low = training_pod(f"low-{i}", gpus=8, nics=8, annotations={names.PRIORITY: "-10"})
        low["metadata"]["labels"] = {"app": "low"}
        cp.request("POST", f"/api/v1/namespaces/{ns}/pods", low)
    for i in range(len(release.nodes)):
        eventually(lambda i=i: running(cp, ns, f"low-{i}"), what=f"low-{i} running")
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "low"},
        # An integer minAvailable: bare pods have no controller whose scale a maxUnavailable
        # could be measured against (the disruption controller would allow nothing at all).
        "spec": {"minAvailable": len(release.nodes), "selector": {"matchLabels": {"app": "low"}}},
    }
    cp.request("POST", f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", pdb)

    def allowed() -> int | None:
        status = cp.request("GET", f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/low").get(
            "status", {}
        )
        return status.get("disruptionsAllowed") if status.get("observedGeneration") else None

    eventually(lambda: allowed() == 0, what="the disruption controller allows no eviction")
    urgent = training_pod(
        "urgent", gpus=8, nics=8, annotations={names.PRIORITY: "50", names.PREEMPTION: "lower-priority"}
    )
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", urgent)

    def blocked() -> dict[str, Any] | None:
        events = cp.request("GET", f"/api/v1/namespaces/{ns}/events?fieldSelector=involvedObject.name=urgent")
        return next(
            (e for e in events["items"] if e["reason"] == names.EVENT_REASON_PREEMPTION_BLOCKED), None
        )

    event = eventually(blocked, timeout=60, what="a PreemptionBlocked event while the PDB forbids eviction")
    assert "disruption budget" in event["message"].lower(), event["message"]
    assert all(running(cp, ns, f"low-{i}") for i in range(len(release.nodes)))  # nobody evicted

    cp.request(
        "PATCH",
        f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/low",
        {"spec": {"minAvailable": len(release.nodes) - 1}},
        content_type="application/merge-patch+json",
    )
    eventually(lambda: allowed() == 1, what="the budget allows one eviction")
    placed = eventually(lambda: running(cp, ns, "urgent"), timeout=120, what="the preemptor placed")
    left = cp.request("GET", f"/api/v1/namespaces/{ns}/pods?labelSelector=app=low")["items"]
    assert len(left) == len(release.nodes) - 1  # exactly one victim, evicted through the API
    victims = [
        r
        for i in range(len(release.nodes))
        for r in release.requests_of(ns, f"low-{i}")
        if r.state == "freed"
    ]
    assert len(victims) == 1 and victims[0].node == placed["spec"]["nodeName"]
