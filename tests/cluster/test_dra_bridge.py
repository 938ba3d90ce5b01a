"""Tandem's running DRA path against the real control plane (issue "Tandem speaks DRA", item 3).

A pod author writes only the standard API: a ResourceClaimTemplate of Tandem's classes and a
pod that names it. The chart's webhook gates the pod, the real resourceclaim controller makes
its claim, Tandem's bridge resolves the claim into one request for the allocator, writes the
claim's allocation (each GPU with the NIC under its own PCIe switch) with Tandem's finalizer
and removes the gate; the real kube-scheduler then binds the pod to exactly that node. Deleting
the pod deletes the claim, which Tandem holds until the node agent's verified cleanup has freed
its devices. A claim that cannot be satisfied is never silent, and one that Tandem would not
honour is refused when the pod is created. Only Tandem's identity writes a claim's
allocation, and only with Tandem's devices.
"""

from __future__ import annotations

import urllib.error
from collections.abc import Iterator
from typing import Any

import pytest

from schemas.topology import locate
from services.admission import drapods, names
from services.admission.draclaims import PARAMETERS_API, PARAMETERS_KIND
from services.nodeagent.dra.slices import tandem_ids
from services.topology import load_topology
from tests.cluster.controlplane import ControlPlane
from tests.cluster.release import Release, eventually
from tests.cluster.test_dra_classes import claim_pod, unmanaged_namespace
from tests.cluster.test_pod_life import make_namespace, pod_of
from tests.cluster.test_rbac import token_of


def template(name: str, *, gpus: int, nics: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    parameters = {"apiVersion": PARAMETERS_API, "kind": PARAMETERS_KIND, "scope": "pcie-switch"}
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
                    "config": [{"opaque": {"driver": "tandem.io", "parameters": parameters}}],
                    **(extra or {}),
                }
            }
        },
    }


def claims_in(cp: ControlPlane, ns: str) -> list[dict[str, Any]]:
    return list(cp.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims")["items"])


def unmanaged_claim(cp: ControlPlane) -> tuple[str, str]:
    """A claim ``one`` for GPUs of Tandem's class in a namespace the running bridge leaves alone
    (so a test writes its status itself); its namespace and the claims' path."""
    ns = unmanaged_namespace(cp)
    path = f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "one"}}
    body["spec"] = {
        "devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.tandem.io"}}]}
    }
    cp.request("POST", path, body)
    return ns, path


def own_namespace(release: Release) -> Iterator[str]:
    """A namespace of a test's own, Tandem-managed; its pods and claims deleted and their devices
    freed after (the body of the DRA tests' ``ns`` fixtures)."""
    name = make_namespace(release.cp)
    yield name
    release.empty_namespace(name)
    release.cp.request("DELETE", f"/apis/resource.k8s.io/v1/namespaces/{name}/resourceclaims")
    eventually(lambda: not claims_in(release.cp, name), timeout=90, what="the namespace's claims gone")


def events_on(cp: ControlPlane, ns: str, kind: str, reason: str) -> list[dict[str, Any]]:
    items = cp.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    return [e for e in items if e["involvedObject"]["kind"] == kind and e["reason"] == reason]


def test_tandem_allocates_a_pods_claims_and_the_scheduler_binds_it_there(release: Release) -> None:
    cp = release.cp
    ns = make_namespace(cp)
    cp.request(
        "POST",
        f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates",
        template("pairs", gpus=2, nics=2),
    )
    created = cp.request("POST", f"/api/v1/namespaces/{ns}/pods", claim_pod("dra-pod", "pairs"))
    # The webhook gated and labelled it: the scheduler does not see it before Tandem decides.
    assert {"name": names.GATE} in created["spec"]["schedulingGates"]
    assert created["metadata"]["labels"][names.MANAGED] == "true"

    try:
        node = eventually(lambda: pod_of(cp, ns, "dra-pod")["spec"].get("nodeName"), what="the pod bound")
    except BaseException:
        print(release.logs(), claims_in(cp, ns), pod_of(cp, ns, "dra-pod"))  # what the bridge did
        raise
    pod = pod_of(cp, ns, "dra-pod")
    assert names.GATE not in [g["name"] for g in pod["spec"].get("schedulingGates") or []]
    (claim,) = claims_in(cp, ns)
    assert names.DRA_FINALIZER in claim["metadata"]["finalizers"]
    rid = f"{pod['metadata']['uid']}.1"
    assert claim["metadata"]["annotations"][names.DRA_REQUEST] == rid
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["dra-pod"]
    (record,) = release.requests_of(ns, "dra-pod")
    assert (record.request.request_id, record.state, record.node) == (rid, "assigned", node)

    # Every GPU has a NIC of its own under the same PCIe switch: Tandem's pairing, not the
    # scheduler's first fit.
    results = claim["status"]["allocation"]["devices"]["results"]
    assert {(r["driver"], r["pool"]) for r in results} == {("tandem.io", node)}
    topo = load_topology("dgx-h100")
    switch = {loc.device.id: loc.switch for loc in locate(topo)}
    ids = tandem_ids(topo)
    gpus = [switch[ids[r["device"]]] for r in results if r["request"] == "gpus"]
    nics = [switch[ids[r["device"]]] for r in results if r["request"] == "nics"]
    assert len(gpus) == 2 and sorted(gpus) == sorted(nics)

    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/dra-pod")
    eventually(lambda: not claims_in(cp, ns), what="the claim gone once its devices are clean")
    freed = eventually(
        lambda: [r for r in release.requests_of(ns, "dra-pod") if r.state == "freed"],
        what="the request freed",
    )
    assert freed[0].node == node


def test_an_unsatisfiable_claim_says_why_on_the_pod_and_on_the_claim(release: Release) -> None:
    cp = release.cp
    ns = make_namespace(cp)
    cp.request(
        "POST",
        f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates",
        template("huge", gpus=16, nics=16),
    )
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", claim_pod("too-big", "huge"))
    (on_pod,) = eventually(
        lambda: events_on(cp, ns, "Pod", names.EVENT_REASON_FAILED), what="an Event on the pod"
    )
    (on_claim,) = eventually(
        lambda: events_on(cp, ns, "ResourceClaim", names.EVENT_REASON_FAILED), what="an Event on the claim"
    )
    assert on_pod["type"] == on_claim["type"] == "Warning"
    assert on_claim["message"] == on_pod["message"] != "", on_claim
    assert not pod_of(cp, ns, "too-big")["spec"].get("nodeName")
    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/too-big")
    eventually(lambda: not claims_in(cp, ns), what="the claim gone with its pod")


def test_a_template_tandem_would_not_honour_is_refused_when_the_pod_is_created(release: Release) -> None:
    cp = release.cp
    ns = make_namespace(cp)
    constrained = template(
        "aligned", gpus=2, nics=2, extra={"constraints": [{"matchAttribute": "tandem.io/pcieSwitch"}]}
    )
    cp.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates", constrained)
    with pytest.raises(urllib.error.HTTPError) as refused:
        cp.request("POST", f"/api/v1/namespaces/{ns}/pods", claim_pod("aligned", "aligned"))
    message = refused.value.read().decode()
    assert refused.value.code == 403
    assert f"ResourceClaimTemplate {ns}/aligned spec.devices.constraints" in message, message
    assert "write scope" in message
    # A pod using a DeviceClaim gets its devices that way only.
    templates = f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates"
    cp.request("POST", templates, template("pairs", gpus=1, nics=1))
    both = claim_pod("both", "pairs")
    both["metadata"].setdefault("annotations", {})["tandem.io/claim"] = "reserved"
    with pytest.raises(urllib.error.HTTPError) as refused:
        cp.request("POST", f"/api/v1/namespaces/{ns}/pods", both)
    message = refused.value.read().decode()
    assert refused.value.code == 403 and "uses DeviceClaim 'reserved'" in message, message


def test_only_tandems_identity_allocates_a_claim_and_only_with_tandems_devices(release: Release) -> None:
    """Item 5: the admission account may write a claim's allocation only of driver tandem.io
    (the chart's policy); a user with the namespace's ``edit`` role may not write it at all, and
    one granted ``resourceclaims/status`` still lacks ``resourceclaims/binding``."""
    cp = release.cp
    ns, path = unmanaged_claim(cp)
    node = sorted(release.nodes)[0]

    def allocation(driver: str) -> dict[str, Any]:
        result = {"request": "gpus", "driver": driver, "pool": node, "device": "gpu7"}
        term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        stamp = "2026-12-03T20:00:00Z"
        alloc = {"devices": {"results": [result]}, "nodeSelector": {"nodeSelectorTerms": [term]}}
        return {"status": {"allocation": {**alloc, "allocationTimestamp": stamp}}}

    tandem = token_of(release, "admission")
    status, answer = cp.request_as(tandem, "PATCH", f"{path}/one/status", allocation("gpu.example.com"))
    assert status == 403 and "only devices of driver tandem.io" in answer["message"], answer
    status, answer = cp.request_as(tandem, "PATCH", f"{path}/one/status", allocation("tandem.io"))
    assert status == 200, answer
    status, answer = cp.request_as(tandem, "PATCH", f"{path}/one/status", {"status": {"allocation": None}})
    assert status == 200 and "allocation" not in answer.get("status", {}), answer

    def user(name: str, role: dict[str, Any]) -> str:
        cp.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": name}})
        binding = {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", **role},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
        }
        cp.request("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", binding)
        return cp.token(ns, name)

    editor = user("editor", {"kind": "ClusterRole", "name": "edit"})
    status, answer = eventually(
        lambda: (r := cp.request_as(editor, "GET", f"{path}/one"))[0] == 200 and r, what="the role bound"
    )
    status, answer = cp.request_as(editor, "PATCH", f"{path}/one/status", allocation("tandem.io"))
    assert status == 403 and "resourceclaims/status" in answer["message"], answer
    writer_role = {
        "metadata": {"name": "status-writer"},
        "rules": [
            {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/status"], "verbs": ["patch"]}
        ],
    }
    cp.request("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", writer_role)
    writer = user("writer", {"kind": "Role", "name": "status-writer"})
    status, answer = eventually(
        lambda: (
            (r := cp.request_as(writer, "PATCH", f"{path}/one/status", allocation("tandem.io")))[0] != 403
            and r
        ),
        what="the status role bound",
    )
    assert status == 422 and "resourceclaims/binding" in answer["message"], answer
    cp.request("DELETE", f"{path}/one")


def test_a_claim_deleted_while_the_bridge_is_away_is_released_when_it_is_back(release: Release) -> None:
    """Restart safety: the state is in the claims (finalizer, request) and the request records.
    The pod is deleted while every admission replica is stopped: its claim waits, held; the
    restarted bridge finds it deleted, releases its request and lets it go once freed."""
    cp = release.cp
    ns = make_namespace(cp)
    cp.request(
        "POST",
        f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates",
        template("pairs", gpus=1, nics=1),
    )
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", claim_pod("dra-pod", "pairs"))
    eventually(lambda: pod_of(cp, ns, "dra-pod")["spec"].get("nodeName"), what="the pod bound")
    stopped = release.pods.pop("admission")
    try:
        for p in stopped:
            p.stop()
        cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/dra-pod")
        (held,) = eventually(
            lambda: [c for c in claims_in(cp, ns) if c["metadata"].get("deletionTimestamp")],
            what="the claim deleted, held by Tandem's finalizer",
        )
        assert names.DRA_FINALIZER in held["metadata"]["finalizers"]
        (record,) = release.requests_of(ns, "dra-pod")
        assert record.state == "assigned"  # nothing released while the bridge is away
    finally:
        release.pods["admission"] = [release.kubelet.run(p.pod) for p in stopped]
        release.serve_webhook()
    eventually(lambda: not claims_in(cp, ns), timeout=90, what="the claim gone once its devices are freed")
    assert [r.state for r in release.requests_of(ns, "dra-pod")] == ["freed"]


def test_a_shared_claim_is_allocated_once_and_released_after_its_last_pod(release: Release) -> None:
    """A claim named by several pods keeps its devices while any of them uses it; after the last
    one ends, Tandem deallocates it (release → verified cleanup → freed, as kube-scheduler's own
    allocator deallocates a claim whose reservedFor empties), and a pod naming it afterwards
    gets it allocated anew."""
    cp = release.cp
    ns = make_namespace(cp)
    path = f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
    shared = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "shared"}}
    shared["spec"] = template("unused", gpus=1, nics=1)["spec"]["spec"]
    cp.request("POST", path, shared)

    def start(name: str) -> str:
        pod = claim_pod(name, "unused")
        pod["spec"]["resourceClaims"] = [{"name": "devices", "resourceClaimName": "shared"}]
        cp.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
        return str(eventually(lambda: pod_of(cp, ns, name)["spec"].get("nodeName"), what=f"{name} bound"))

    nodes = {name: start(name) for name in ("first", "second")}
    claim = cp.request("GET", f"{path}/shared")
    assert len(set(nodes.values())) == 1 and len(claim["status"]["allocation"]["devices"]["results"]) == 2
    assert sorted(r["name"] for r in claim["status"]["reservedFor"]) == ["first", "second"]
    holder = claim["metadata"]["annotations"][names.DRA_POD]
    other = next(n for n in nodes if n != holder)
    requests = {n: release.requests_of(ns, n) for n in ("first", "second")}
    assert [r.state for r in requests[holder]] == ["assigned"]  # one request, by one pod
    assert requests[other] == []

    # The pod whose request holds the devices ends first: the other still uses them.
    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{holder}")
    eventually(
        lambda: (
            [r["name"] for r in cp.request("GET", f"{path}/shared")["status"].get("reservedFor") or []]
            == [other]
        ),
        what=f"reserved for {other} alone",
    )
    # The bridge has seen both the holder's end and the claim reserved for the other pod alone:
    # the moment a wrong release would have been made.
    eventually(
        lambda: release.logged(
            "admission", "dra_shared_claim_in_use", claim=f"{ns}/shared", reserved_for=1, users=1
        ),
        what="the bridge keeping the claim for the last pod",
    )
    claim = cp.request("GET", f"{path}/shared")
    assert claim["status"].get("allocation") and names.DRA_FINALIZER in claim["metadata"]["finalizers"]
    assert [r.state for r in release.requests_of(ns, holder)] == ["assigned"]

    # The last pod ends: released, cleaned, freed, and the claim (not deleted) let go.
    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{other}")
    eventually(
        lambda: [r.state for r in release.requests_of(ns, holder)] == ["freed"], what="the request freed"
    )
    let_go = eventually(
        lambda: (c := cp.request("GET", f"{path}/shared"))["metadata"].get("finalizers") is None and c,
        what="the claim let go",
    )
    assert "allocation" not in let_go["status"]
    assert names.DRA_REQUEST not in (let_go["metadata"].get("annotations") or {})

    # A pod naming it afterwards gets it allocated anew, by a request of its own.
    start("third")
    claim = cp.request("GET", f"{path}/shared")
    third_uid = pod_of(cp, ns, "third")["metadata"]["uid"]
    assert claim["metadata"]["annotations"][names.DRA_REQUEST] == f"{third_uid}.1"
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["third"]
    assert [r.state for r in release.requests_of(ns, "third")] == ["assigned"]
    cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/third")
    eventually(lambda: [r.state for r in release.requests_of(ns, "third")] == ["freed"], what="freed again")
    cp.request("DELETE", f"{path}/shared")
    eventually(lambda: not claims_in(cp, ns), what="the claim gone")


def test_a_deallocation_at_a_stale_version_is_refused_with_409(release: Release) -> None:
    """What the bridge relies on not to deallocate a claim under a pod that reserved it between
    its read and its write: the real API server refuses the admission identity's status patch
    carrying the version read (drapods.deallocation) once the claim was reserved since."""
    cp = release.cp
    _, path = unmanaged_claim(cp)
    node = sorted(release.nodes)[0]
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    allocation = {
        "devices": {"results": [{"request": "gpus", "driver": "tandem.io", "pool": node, "device": "gpu6"}]},
        "nodeSelector": {"nodeSelectorTerms": [term]},
        "allocationTimestamp": "2026-12-04T03:00:00Z",
    }
    read = cp.request(
        "PATCH",
        f"{path}/one/status",
        {"status": {"allocation": allocation}},
        content_type="application/merge-patch+json",
    )
    # kube-scheduler reserves it for a pod after the bridge read it.
    reserve = {"status": {"reservedFor": [{"resource": "pods", "name": "late", "uid": "5c0a6b1e-late"}]}}
    cp.request("PATCH", f"{path}/one/status", reserve, content_type="application/merge-patch+json")
    tandem = token_of(release, "admission")
    status, answer = cp.request_as(tandem, "PATCH", f"{path}/one/status", drapods.deallocation(read))
    assert status == 409, answer
    assert cp.request("GET", f"{path}/one")["status"]["allocation"]["devices"]["results"]
    cp.request(
        "PATCH",
        f"{path}/one/status",
        {"status": {"reservedFor": None}},
        content_type="application/merge-patch+json",
    )
    fresh = cp.request("GET", f"{path}/one")
    status, answer = cp.request_as(tandem, "PATCH", f"{path}/one/status", drapods.deallocation(fresh))
    assert status == 200 and "allocation" not in answer.get("status", {}), answer
    cp.request("DELETE", f"{path}/one")
