"""Preemption and jobs for pods asking through DRA ResourceClaims, against the real control plane
(issue "Tandem speaks DRA", item 3: "a whole job's claims, preemption ... keep their meaning").

* A pod of higher priority whose claim asks ``preemption: lower-priority`` (the claim's
  ``AllocationParameters``) finds the fleet full of lower-priority DRA pods: Tandem evicts one
  of them through the real Eviction API; the victim's claim (made from a template) is deleted
  with its pod, released, cleaned and freed, and the preemptor's claim is allocated on the
  devices it freed, the preemptor bound there by kube-scheduler.
* A victim whose devices a claim shared by two pods holds is both pods: each is evicted, and
  the claim is deallocated after the second, its devices freed for the preemptor.
* A pod of a Tandem job that names a ResourceClaim of Tandem's classes (one pods share) is
  refused when it is created, with the reason: a job's pods are placed each with claims of its
  own (a job through templates: tests/cluster/test_dra_jobs.py).
"""

from __future__ import annotations

import urllib.error
from collections.abc import Iterator
from typing import Any

import pytest

from services.admission import jobwatch, names
from services.admission.draclaims import PARAMETERS_API, PARAMETERS_KIND
from tests.cluster.release import Release, eventually
from tests.cluster.test_dra_bridge import claims_in, own_namespace
from tests.cluster.test_dra_classes import claim_pod
from tests.cluster.test_pod_life import pod_of

TEMPLATES = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates"


def whole_node(name: str, **parameters: str) -> dict[str, Any]:
    """A template for a whole node of the test fleet: 8 GPUs and 8 NICs."""
    params = {"apiVersion": PARAMETERS_API, "kind": PARAMETERS_KIND, **parameters}
    requests = [
        {"name": "gpus", "exactly": {"deviceClassName": "gpu.tandem.io", "count": 8}},
        {"name": "nics", "exactly": {"deviceClassName": "nic.tandem.io", "count": 8}},
    ]
    devices = {"requests": requests, "config": [{"opaque": {"driver": "tandem.io", "parameters": params}}]}
    return {"metadata": {"name": name}, "spec": {"spec": {"devices": devices}}}


def dra_pod(name: str, template: str, *, priority: int) -> dict[str, Any]:
    pod = claim_pod(name, template)
    pod["metadata"]["annotations"] = {names.PRIORITY: str(priority)}
    return pod


@pytest.fixture
def ns(release: Release) -> Iterator[str]:
    yield from own_namespace(release)


def bound(release: Release, ns: str, name: str) -> str | None:
    node = pod_of(release.cp, ns, name)["spec"].get("nodeName")
    return str(node) if node else None


def preempt_with_urgent(release: Release, ns: str) -> str:
    """Create the high-priority pod ``urgent`` (template ``urgent``); the node it is bound to."""
    release.cp.request("POST", f"/api/v1/namespaces/{ns}/pods", dra_pod("urgent", "urgent", priority=50))
    try:
        return eventually(lambda: bound(release, ns, "urgent"), timeout=120, what="the preemptor bound")
    except BaseException:
        print(release.logs(), claims_in(release.cp, ns))
        raise


def test_a_dra_pod_of_higher_priority_preempts_through_the_eviction_api(release: Release, ns: str) -> None:
    cp = release.cp
    cp.request("POST", TEMPLATES.format(ns=ns), whole_node("low"))
    cp.request("POST", TEMPLATES.format(ns=ns), whole_node("urgent", preemption="lower-priority"))
    lows = [f"low-{i}" for i in range(len(release.nodes))]
    for name in lows:
        cp.request("POST", f"/api/v1/namespaces/{ns}/pods", dra_pod(name, "low", priority=-10))
    placed = {name: eventually(lambda n=name: bound(release, ns, n), what=f"{name} bound") for name in lows}
    assert sorted(placed.values()) == sorted(release.nodes)  # the fleet is full

    node = preempt_with_urgent(release, ns)
    pods = cp.request("GET", f"/api/v1/namespaces/{ns}/pods")["items"]
    left = [p["metadata"]["name"] for p in pods if p["metadata"]["name"].startswith("low-")]
    (victim,) = set(lows) - set(left)  # exactly one victim, on the node the preemptor got
    assert placed[victim] == node
    assert [r.state for r in release.requests_of(ns, victim)] == ["freed"]
    events = cp.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    assert any(
        e["reason"] == names.EVENT_REASON_PREEMPTED and e["involvedObject"]["name"] == victim for e in events
    ), [e["reason"] for e in events]

    # The preemptor's claim is Tandem's allocation on the victim's devices, reserved for it.
    urgent_uid = pod_of(cp, ns, "urgent")["metadata"]["uid"]
    (claim,) = [c for c in claims_in(cp, ns) if c["metadata"]["annotations"].get(names.DRA_POD) == "urgent"]
    assert claim["metadata"]["annotations"][names.DRA_REQUEST] == f"{urgent_uid}.1"
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == 16 and {r["pool"] for r in results} == {node}
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["urgent"]
    (record,) = release.requests_of(ns, "urgent")
    assert (record.state, record.node) == ("assigned", node)


def test_a_victim_holding_a_shared_claim_is_every_pod_using_it(release: Release, ns: str) -> None:
    """The devices of a claim shared by two pods come back only once neither uses it: both are
    evicted, the claim (not deleted) is deallocated after the second, and the preemptor gets
    its devices."""
    cp = release.cp
    cp.request("POST", TEMPLATES.format(ns=ns), whole_node("urgent", preemption="lower-priority"))
    shared = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "shared"}}
    shared["spec"] = whole_node("unused")["spec"]["spec"]
    cp.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims", shared)
    for name in ("team-a", "team-b"):  # the lowest priority: the victim the allocator picks
        pod = dra_pod(name, "unused", priority=-20)
        pod["spec"]["resourceClaims"] = [{"name": "devices", "resourceClaimName": "shared"}]
        cp.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
    others = [f"low-{i}" for i in range(len(release.nodes) - 1)]
    cp.request("POST", TEMPLATES.format(ns=ns), whole_node("low"))
    for name in others:
        cp.request("POST", f"/api/v1/namespaces/{ns}/pods", dra_pod(name, "low", priority=-10))
    placed = {
        n: eventually(lambda n=n: bound(release, ns, n), what=f"{n} bound")
        for n in ("team-a", "team-b", *others)
    }
    assert placed["team-a"] == placed["team-b"]

    node = preempt_with_urgent(release, ns)
    assert node == placed["team-a"]
    names_left = {p["metadata"]["name"] for p in cp.request("GET", f"/api/v1/namespaces/{ns}/pods")["items"]}
    assert names_left == {"urgent", *others}  # both pods of the shared claim evicted, nobody else
    claim = cp.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/shared")
    assert "allocation" not in claim["status"] and not claim["metadata"].get("finalizers")
    holder = [r for n in ("team-a", "team-b") for r in release.requests_of(ns, n)]
    assert [r.state for r in holder] == ["freed"]


def test_a_tandem_job_pod_naming_a_shared_claim_is_refused_when_created(release: Release, ns: str) -> None:
    """A job's pods are placed together (tests/cluster/test_dra_jobs.py), each with claims of its
    own: a job pod naming a ResourceClaim of Tandem's classes (which pods share) is refused."""
    cp = release.cp
    shared = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "shared"}}
    shared["spec"] = whole_node("unused")["spec"]["spec"]
    cp.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims", shared)
    pod = claim_pod("worker-0", "unused")
    pod["spec"]["resourceClaims"] = [{"name": "devices", "resourceClaimName": "shared"}]
    pod["metadata"]["labels"] = {jobwatch.JOB: "allreduce"}
    pod["metadata"]["annotations"] = {jobwatch.JOB_SIZE: "2"}
    with pytest.raises(urllib.error.HTTPError) as refused:
        cp.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
    message = refused.value.read().decode()
    assert refused.value.code == 403
    assert f"job 'job/allreduce' and names ResourceClaim {ns}/shared" in message, message
