"""A job whose pods ask through DRA ResourceClaims is placed as one job, all or nothing
(services.admission.drajobs, drajobbridge; docs/dra.md "Jobs"): the pure rules, the webhook's
verdicts, and the bridge against a fake API server — nothing requested while a pod is missing,
one ``alloc.job`` once all exist, each pod's claims held under its pod id, a pod's end released
through its job record. The running path against the real control plane:
tests/cluster/test_dra_jobs.py."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from typing import Any

import pytest

from schemas import codec, subjects
from schemas.config import DeviceClass
from schemas.messages import (
    AllocationRequest,
    AllocRecord,
    AssignedGpu,
    AssignedNic,
    Assignment,
    JobRecord,
    JobRequest,
    NodeAllocations,
    PodRef,
    Release,
)
from services.admission import drajobs, drapods, jobwatch, names, podrules
from services.admission.drabridge import DraBridge
from services.admission.errors import PolicyError
from services.kube.errors import Conflict, NotFound
from tests.unit.drafakes import FakeBus

Obj = dict[str, Any]
CLASSES = {"default": DeviceClass()}
SPEC = {
    "devices": {
        "requests": [
            {"name": "gpus", "exactly": {"deviceClassName": "gpu.tandem.io", "count": 2}},
            {"name": "nics", "exactly": {"deviceClassName": "nic.tandem.io", "count": 2}},
        ]
    }
}


def job_pod(index: int, *, size: int = 2, made: bool = True, uid: str = "") -> tuple[podrules.PodView, Obj]:
    raw: Obj = {
        "metadata": {
            "name": f"worker-{index}",
            "namespace": "team",
            "uid": uid or f"u-{index}",
            "resourceVersion": "5",
            "labels": {names.MANAGED: "true", jobwatch.JOB: "allreduce"},
            "annotations": {jobwatch.JOB_SIZE: str(size), jobwatch.JOB_INDEX: str(index)},
        },
        "spec": {
            "resourceClaims": [{"name": "devices", "resourceClaimTemplateName": "pairs"}],
            "containers": [{"name": "c"}],
            "schedulingGates": [{"name": names.GATE}],
        },
    }
    if made:
        raw["status"] = {
            "resourceClaimStatuses": [{"name": "devices", "resourceClaimName": f"claim-{index}"}]
        }
    return podrules.read_pod(raw), raw


def claim_of(index: int, spec: Obj = SPEC, *, uid: str = "") -> Obj:
    owner = {"apiVersion": "v1", "kind": "Pod", "name": f"worker-{index}", "uid": uid or f"u-{index}"}
    return {
        "metadata": {
            "namespace": "team",
            "name": f"claim-{index}",
            "uid": f"c-{index}",
            "resourceVersion": "10",
            "ownerReferences": [owner],
        },
        "spec": copy.deepcopy(spec),
        "status": {},
    }


# -- the pure rules -------------------------------------------------------------------------------


def request(uid: str, gpus: int = 2, **extra: Any) -> AllocationRequest:
    return AllocationRequest(
        request_id=f"{uid}.1", pod=PodRef(namespace="team", name=uid, uid=uid), gpus=gpus, rdma=2, **extra
    )


def test_the_job_is_made_of_each_pods_claims_and_pods_that_differ_make_it_invalid() -> None:
    pods = [job_pod(i)[0] for i in (1, 0)]
    job = drajobs.job_request(pods, {"u-0": request("u-0"), "u-1": request("u-1")}, device_classes=CLASSES)
    assert (job.pods, job.gpus, job.rdma, job.namespace) == (2, 2, 2, "team")
    assert [m.name for m in job.members] == ["worker-0", "worker-1"]  # by index
    assert job.pod_id(1) == f"{job.job_id}/1" and drajobs.split(job.pod_id(1)) == (job.job_id, 1)
    assert drajobs.is_job_pod(job.pod_id(0)) and not drajobs.is_job_pod("u-0.1")
    # The same message the job path of resources gives.
    with pytest.raises(PolicyError, match=r"must ask the same devices; worker-1 differ from worker-0"):
        drajobs.job_request(pods, {"u-0": request("u-0"), "u-1": request("u-1", 4)}, device_classes=CLASSES)
    with pytest.raises(PolicyError, match="worker-1 of job job/allreduce asks no Tandem devices"):
        drajobs.job_request(pods, {"u-0": request("u-0"), "u-1": None}, device_classes=CLASSES)
    with pytest.raises(PolicyError, match="no GPU share"):
        shared = request("u-1", gpu_memory_mib=1024)
        drajobs.job_request(pods, {"u-0": request("u-0"), "u-1": shared}, device_classes=CLASSES)


def test_a_job_pods_claims_must_be_made_for_it() -> None:
    view, _ = job_pod(0)
    assert drajobs.own_claims_problem(view, [claim_of(0)]) is None
    problem = drajobs.own_claims_problem(view, [claim_of(1)])
    assert problem is not None and "team/claim-1 is not made for this pod" in problem


def test_a_pods_end_releases_what_its_job_record_says_is_held() -> None:
    job = JobRequest(job_id="allreduce.x", pods=2, gpus=2)
    committed = JobRecord(job=job, state="committed", placement=["gpu-0", "gpu-1"])
    assert drajobs.release_step(committed, 1, on_node=True) == "release_pod"
    assert drajobs.release_step(committed, 1, on_node=False) == "let_go"  # freed already
    for state in ("pending", "committing", "aborted"):
        assert drajobs.release_step(JobRecord(job=job, state=state), 0, on_node=False) == "cancel_job"  # type: ignore[arg-type]
    assert drajobs.release_step(None, 0, on_node=False) == "cancel_job"
    for state in ("rejected", "cancelled", "released"):
        assert drajobs.release_step(JobRecord(job=job, state=state), 0, on_node=False) == "let_go"  # type: ignore[arg-type]


# -- the webhook ------------------------------------------------------------------------------------


def test_a_job_pod_through_a_template_is_admitted_and_one_naming_a_claim_is_refused() -> None:
    view, _ = job_pod(0, made=False)
    verdict = drapods.admit(
        view, specs={("template", "pairs"): SPEC}, device_classes=CLASSES, traceparent=None
    )
    assert verdict is not None and verdict.allowed and not verdict.warnings, verdict
    named = copy.deepcopy(job_pod(0, made=False)[1])
    named["spec"]["resourceClaims"] = [{"name": "devices", "resourceClaimName": "shared"}]
    verdict = drapods.admit(
        podrules.read_pod(named), specs={("claim", "shared"): SPEC}, device_classes=CLASSES, traceparent=None
    )
    assert verdict is not None and not verdict.allowed and verdict.code == 403
    assert "job 'job/allreduce' and names ResourceClaim team/shared" in verdict.message, verdict.message
    assert "ResourceClaimTemplate" in verdict.message


# -- the bridge against a fake API server -------------------------------------------------------------


@dataclass
class FakeApi:
    """Claims and pods by name; writes at a stale resourceVersion are a 409."""

    claims: dict[str, Obj] = field(default_factory=dict)
    pods: dict[str, Obj] = field(default_factory=dict)

    async def replace_resource_claim(self, namespace: str, name: str, body: Obj) -> Obj:
        obj = self.claims[name]
        if body["metadata"]["resourceVersion"] != obj["metadata"]["resourceVersion"]:
            raise Conflict("the object has been modified", status=409)
        new = {**copy.deepcopy(body), "status": obj.get("status") or {}}
        new["metadata"]["resourceVersion"] = str(int(obj["metadata"]["resourceVersion"]) + 1)
        if obj["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            del self.claims[name]
            return new
        self.claims[name] = new
        return copy.deepcopy(new)

    async def patch_resource_claim_status(self, namespace: str, name: str, patch: Obj) -> Obj:
        obj = self.claims[name]
        obj["status"] = {k: v for k, v in {**obj["status"], **patch["status"]}.items() if v is not None}
        obj["metadata"]["resourceVersion"] = str(int(obj["metadata"]["resourceVersion"]) + 1)
        return copy.deepcopy(obj)

    async def get_resource_claim(self, namespace: str, name: str) -> Obj:
        if name not in self.claims:
            raise NotFound("gone", status=404)
        return copy.deepcopy(self.claims[name])

    async def get_pod(self, namespace: str, name: str) -> Obj:
        if name not in self.pods:
            raise NotFound("gone", status=404)
        return copy.deepcopy(self.pods[name])

    async def patch_pod(self, namespace: str, name: str, patch: Obj) -> Obj:
        pod = self.pods[name]
        pod["spec"]["schedulingGates"] = patch["spec"]["schedulingGates"] or []
        pod["metadata"].setdefault("annotations", {}).update(patch["metadata"].get("annotations") or {})
        return copy.deepcopy(pod)


def make_bridge() -> tuple[DraBridge, FakeApi, FakeBus, list[tuple[str, str]]]:
    api, bus = FakeApi(), FakeBus()
    events: list[tuple[str, str]] = []

    async def record_event(pod: podrules.PodView, *, reason: str, message: str, **_: Any) -> None:
        events.append((reason, message))

    bridge = DraBridge(kube=api, bus=bus, device_classes=CLASSES, record_event=record_event)  # type: ignore[arg-type]
    return bridge, api, bus, events


def jobs(bus: FakeBus) -> list[JobRequest]:
    return [m for s, m in bus.published if s == subjects.ALLOC_JOB]


async def add_pod(bridge: DraBridge, api: FakeApi, index: int, spec: Obj = SPEC, *, uid: str = "") -> None:
    api.claims[f"claim-{index}"] = claim_of(index, spec, uid=uid)
    await bridge.on_claim_event("ADDED", copy.deepcopy(api.claims[f"claim-{index}"]))
    view, raw = job_pod(index, uid=uid)
    api.pods[f"worker-{index}"] = raw
    await bridge.on_pod_event("ADDED", view, copy.deepcopy(raw))


def test_the_job_is_requested_once_all_its_pods_exist_and_each_pods_claims_are_held_for_it() -> None:
    bridge, api, bus, _ = make_bridge()

    async def run() -> None:
        await bridge.resync([], {})
        bridge.synced.set()  # the claims' first list (its watch loop sets it)
        await add_pod(bridge, api, 0)
        assert jobs(bus) == [] and drapods.held_by(api.claims["claim-0"]) is None  # nothing held yet
        await add_pod(bridge, api, 1)
        (job,) = jobs(bus)
        assert (job.pods, job.gpus, job.rdma) == (2, 2, 2)
        assert [m.uid for m in job.members] == ["u-0", "u-1"]
        for i in (0, 1):
            assert drapods.held_by(api.claims[f"claim-{i}"]) == job.pod_id(i)
        # The second pod's assignment: its claim allocated on its node, then its gate removed.
        gpus = [AssignedGpu(index=i, uuid=f"GPU-{i}") for i in (0, 1)]
        nics = [AssignedNic(name=f"mlx5_{i}", pf=f"mlx5_{i}") for i in (0, 1)]
        a = Assignment(request_id=job.pod_id(1), pod=job.members[1], node="gpu-1", gpus=gpus, nics=nics)
        await bridge.on_assignment(a, copy.deepcopy(api.pods["worker-1"]))
        assert drapods.allocated_node(api.claims["claim-1"]) == "gpu-1"
        assert not drapods.is_allocated(api.claims["claim-0"])
        assert api.pods["worker-1"]["spec"]["schedulingGates"] == []
        assert api.pods["worker-0"]["spec"]["schedulingGates"] == [{"name": names.GATE}]
        # Worker 1 ends: its claim is deleted; the job is committed and its node holds it.
        record = JobRecord(job=job, state="committed", placement=["gpu-0", "gpu-1"])
        bus.buckets.setdefault(subjects.KV_JOBS, {})[subjects.kv_key(job.job_id)] = codec.encode(record)
        allocs = NodeAllocations(node="gpu-1", allocations={a.request_id: AllocRecord(assignment=a)})
        bus.buckets.setdefault(subjects.KV_ALLOCS, {})[subjects.kv_key("gpu-1")] = codec.encode(allocs)
        deleting = copy.deepcopy(api.claims["claim-1"])
        deleting["metadata"]["deletionTimestamp"] = "2026-12-04T00:00:00Z"
        api.claims["claim-1"] = copy.deepcopy(deleting)
        await bridge.on_claim_event("MODIFIED", deleting)

    asyncio.run(run())
    (released,) = [m for _, m in bus.published if isinstance(m, Release)]
    (job,) = jobs(bus)
    assert (released.request_id, released.node, released.pod.name) == (job.pod_id(1), "gpu-1", "worker-1")
    assert "claim-1" in api.claims  # held until Freed


def test_pods_that_ask_differently_make_the_job_invalid_on_every_pod() -> None:
    bridge, api, bus, events = make_bridge()
    bigger = copy.deepcopy(SPEC)
    bigger["devices"]["requests"][0]["exactly"]["count"] = 4

    async def run() -> None:
        await bridge.resync([], {})
        await add_pod(bridge, api, 0)
        await add_pod(bridge, api, 1, bigger)

    asyncio.run(run())
    assert jobs(bus) == []
    invalid = [m for r, m in events if r == jobwatch.EVENT_REASON_INVALID]
    assert len(invalid) == 2 and all("must ask the same devices" in m for m in invalid), events
    assert all(drapods.held_by(c) is None for c in api.claims.values())


def test_a_pod_ending_before_its_job_is_placed_cancels_the_job_and_lets_its_claim_go() -> None:
    """...and the pods left form a new job with the pod that replaces it."""
    bridge, api, bus, _ = make_bridge()

    async def run() -> None:
        await bridge.resync([], {})
        await add_pod(bridge, api, 0)
        await add_pod(bridge, api, 1)
        deleting = copy.deepcopy(api.claims["claim-0"])
        deleting["metadata"]["deletionTimestamp"] = "2026-12-04T00:00:00Z"
        api.claims["claim-0"] = copy.deepcopy(deleting)
        await bridge.on_claim_event("MODIFIED", deleting)  # no job record yet: not placed
        (job,) = jobs(bus)
        (released,) = [m for _, m in bus.published if isinstance(m, Release)]
        assert released.request_id == job.job_id  # the whole job
        assert "claim-0" not in api.claims  # let go: the deletion finished
        await bridge.on_claim_event("DELETED", deleting)
        await bridge.on_pod_event("DELETED", *job_pod(0))
        await add_pod(bridge, api, 0, uid="u-0b")  # its controller makes it again

    asyncio.run(run())
    first, second = jobs(bus)
    assert second.job_id != first.job_id and [m.uid for m in second.members] == ["u-0b", "u-1"]
    assert drapods.held_by(api.claims["claim-1"]) == second.pod_id(1)  # held for the new job


def test_a_restarted_bridge_writes_a_committed_jobs_gated_pod_from_its_nodes_record() -> None:
    """Its other pod is bound already (not gated, so never gathered): the pod is not left waiting
    for a job that is complete and placed."""
    bridge, api, bus, _ = make_bridge()
    job = JobRequest(job_id="allreduce.abc", pods=2, gpus=2, rdma=2, namespace="team")
    rid = job.pod_id(1)
    held = claim_of(1)
    held["metadata"]["finalizers"] = [names.DRA_FINALIZER]
    held["metadata"]["annotations"] = {names.DRA_REQUEST: rid, names.DRA_POD: "worker-1"}
    api.claims["claim-1"] = held
    gpus = [AssignedGpu(index=i, uuid=f"GPU-{i}") for i in (0, 1)]
    nics = [AssignedNic(name=f"mlx5_{i}", pf=f"mlx5_{i}") for i in (0, 1)]
    ref = PodRef(namespace="team", name="worker-1", uid="u-1")
    a = Assignment(request_id=rid, pod=ref, node="gpu-1", gpus=gpus, nics=nics)
    record = JobRecord(job=job, state="committed", placement=["gpu-0", "gpu-1"])
    bus.buckets[subjects.KV_JOBS] = {subjects.kv_key(job.job_id): codec.encode(record)}
    allocs = NodeAllocations(node="gpu-1", allocations={rid: AllocRecord(assignment=a)})
    bus.buckets[subjects.KV_ALLOCS] = {subjects.kv_key("gpu-1"): codec.encode(allocs)}

    async def run() -> None:
        await bridge.resync([copy.deepcopy(held)], {})
        bridge.synced.set()
        view, raw = job_pod(1)
        api.pods["worker-1"] = raw
        await bridge.on_pod_event("ADDED", view, copy.deepcopy(raw))

    asyncio.run(run())
    assert jobs(bus) == []  # not requested again
    assert drapods.allocated_node(api.claims["claim-1"]) == "gpu-1"
    assert api.pods["worker-1"]["spec"]["schedulingGates"] == []
