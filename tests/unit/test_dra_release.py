"""A DRA claim's devices go back when no pod uses the claim any more (services.admission.drapods,
drabridge; docs/dra.md "Deallocation"): the pure rules, and the bridge's decisions against a
fake API server that answers a stale write with 409 as the real one does. The running path
against the real control plane: tests/cluster/test_dra_bridge.py."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from typing import Any

import pytest

from schemas import codec, subjects
from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, Freed, PodRef, Release, RequestRecord
from services.admission import drapods, jobwatch, names, podrules
from services.admission.drabridge import DraBridge
from services.kube.errors import Conflict, NotFound
from tests.unit.drafakes import FakeBus

Obj = dict[str, Any]
RID = "u-first.1"
ALLOCATION = {
    "devices": {"results": [{"request": "gpus", "driver": "tandem.io", "pool": "gpu-0", "device": "gpu0"}]},
    "nodeSelector": {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-0"]}]}
        ]
    },
}


def claim(*, reserved: list[str], rv: str = "10", owner: str | None = None) -> Obj:
    meta: Obj = {
        "namespace": "team",
        "name": "shared",
        "uid": "c-1",
        "resourceVersion": rv,
        "finalizers": [names.DRA_FINALIZER],
        "annotations": {names.DRA_REQUEST: RID, names.DRA_POD: "first"},
    }
    if owner is not None:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": owner}]
    status: Obj = {"allocation": ALLOCATION}
    if reserved:
        status["reservedFor"] = [{"resource": "pods", "name": f"pod-{u}", "uid": u} for u in reserved]
    return {"metadata": meta, "spec": {"devices": {"requests": []}}, "status": status}


def pod(uid: str) -> tuple[podrules.PodView, Obj]:
    raw = {
        "metadata": {
            "name": f"pod-{uid}",
            "namespace": "team",
            "uid": uid,
            "labels": {names.MANAGED: "true"},
        },
        "spec": {
            "resourceClaims": [{"name": "d", "resourceClaimName": "shared"}],
            "containers": [{"name": "c"}],
        },
        "status": {"phase": "Running"},
    }
    return podrules.read_pod(raw), raw


# -- the pure rules -------------------------------------------------------------------------------


def test_a_claim_is_in_use_while_reserved_or_named_by_a_live_pod() -> None:
    reserved = claim(reserved=["u-second"])
    assert [r.uid for r in drapods.reserved_for(reserved)] == ["u-second"]
    assert drapods.in_use(reserved, users=()) and not drapods.ended(reserved, users=())
    # Let go to kube-scheduler and not reserved yet: still a consumer.
    free = claim(reserved=[])
    assert drapods.in_use(free, users={"u-third"})
    assert drapods.ended(free, users=()) and not drapods.in_use(free, users=())
    deleting = claim(reserved=["u-second"])
    deleting["metadata"]["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    assert drapods.ended(deleting, users={"u-second"})


def test_a_deallocation_is_written_only_at_the_version_read() -> None:
    patch = drapods.deallocation(claim(reserved=[], rv="41"))
    assert patch == {"metadata": {"resourceVersion": "41"}, "status": {"allocation": None, "devices": None}}
    unversioned = claim(reserved=[])
    del unversioned["metadata"]["resourceVersion"]
    with pytest.raises(ValueError, match="resourceVersion"):
        drapods.deallocation(unversioned)


# -- the bridge against a fake API server ------------------------------------------------------


@dataclass
class FakeApi:
    """One claim; writes carry optimistic locking (a stale resourceVersion is a 409)."""

    obj: Obj
    reserve_before_write: str | None = None  # a pod kube-scheduler reserves between read and write
    writes: list[str] = field(default_factory=list)

    def _bump(self) -> None:
        self.obj["metadata"]["resourceVersion"] = str(int(self.obj["metadata"]["resourceVersion"]) + 1)

    async def get_resource_claim(self, namespace: str, name: str) -> Obj:
        return copy.deepcopy(self.obj)

    async def patch_resource_claim_status(self, namespace: str, name: str, patch: Obj) -> Obj:
        if self.reserve_before_write:
            status = self.obj["status"]
            status["reservedFor"] = [{"resource": "pods", "name": "late", "uid": self.reserve_before_write}]
            self.reserve_before_write = None
            self._bump()
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != self.obj["metadata"]["resourceVersion"]:
            raise Conflict("the object has been modified", status=409)
        self.obj["status"] = {
            k: v for k, v in {**self.obj["status"], **patch["status"]}.items() if v is not None
        }
        self._bump()
        self.writes.append("status")
        return copy.deepcopy(self.obj)

    async def replace_resource_claim(self, namespace: str, name: str, body: Obj) -> Obj:
        if body["metadata"]["resourceVersion"] != self.obj["metadata"]["resourceVersion"]:
            raise Conflict("the object has been modified", status=409)
        self.obj = {**copy.deepcopy(body), "status": self.obj["status"]}
        self._bump()
        self.writes.append("metadata")
        return copy.deepcopy(self.obj)

    async def get_pod(self, namespace: str, name: str) -> Obj:
        raise NotFound("no pods here", status=404)


def bridge_for(api: FakeApi, *, state: str = "assigned") -> tuple[DraBridge, FakeBus]:
    bus = FakeBus()
    req = AllocationRequest(request_id=RID, pod=PodRef(namespace="team", name="first", uid="u-first"), gpus=1)
    record = RequestRecord(request=req, state=state, node="gpu-0")  # type: ignore[arg-type]
    bus.buckets[subjects.KV_REQUESTS] = {subjects.kv_key(RID): codec.encode(record)}

    async def no_event(*_: Any, **__: Any) -> None:
        return None

    bridge = DraBridge(kube=api, bus=bus, device_classes={}, record_event=no_event)  # type: ignore[arg-type]
    return bridge, bus


def releases(bus: FakeBus) -> list[Release]:
    return [m for _, m in bus.published if isinstance(m, Release)]


def test_a_shared_claim_is_released_after_its_last_pod_not_before() -> None:
    api = FakeApi(claim(reserved=["u-first", "u-second"]))
    bridge, bus = bridge_for(api)

    async def run() -> None:
        await bridge.resync([copy.deepcopy(api.obj)], {})
        for uid in ("u-first", "u-second"):
            await bridge.on_pod_event("ADDED", *pod(uid))
        await bridge.pods_resynced({"u-first", "u-second"})
        # The first pod ends: the controller takes it out of reservedFor; the second still uses it.
        await bridge.on_pod_event("DELETED", *pod("u-first"))
        api.obj = claim(reserved=["u-second"], rv="11")
        await bridge.on_claim_event("MODIFIED", copy.deepcopy(api.obj))
        assert releases(bus) == [] and api.writes == []
        # The second ends, and its pod event comes before the claim's.
        await bridge.on_pod_event("DELETED", *pod("u-second"))
        assert releases(bus) == []  # still reserved for it, as far as the bridge knows
        api.obj = claim(reserved=[], rv="12")
        await bridge.on_claim_event("MODIFIED", copy.deepcopy(api.obj))

    asyncio.run(run())
    # Deallocated first (at the version read), then released to the node; still held.
    assert api.writes == ["status"] and "allocation" not in api.obj["status"]
    (release,) = releases(bus)
    assert (release.request_id, release.node) == (RID, "gpu-0")
    assert drapods.held_by(api.obj) == RID

    async def freed() -> None:
        await bridge.on_freed(Freed(request_id=RID, node="gpu-0"))

    bridge.synced.set()
    asyncio.run(freed())
    assert drapods.held_by(api.obj) is None and names.DRA_FINALIZER not in api.obj["metadata"]["finalizers"]
    assert api.writes == ["status", "metadata"]


def test_a_claim_reserved_again_between_read_and_write_is_not_released() -> None:
    api = FakeApi(claim(reserved=[]), reserve_before_write="u-late")
    bridge, bus = bridge_for(api)

    async def run() -> None:
        await bridge.resync([copy.deepcopy(api.obj)], {})
        await bridge.pods_resynced(set())

    asyncio.run(run())
    assert api.writes == [] and releases(bus) == []  # the write got its 409
    assert api.obj["status"]["allocation"] == ALLOCATION
    assert [r.uid for r in drapods.reserved_for(api.obj)] == ["u-late"]


def test_a_pod_let_go_but_not_reserved_yet_keeps_the_claim_allocated() -> None:
    api = FakeApi(claim(reserved=[]))
    bridge, bus = bridge_for(api)

    async def run() -> None:
        await bridge.resync([copy.deepcopy(api.obj)], {})
        await bridge.on_pod_event("ADDED", *pod("u-third"))  # bound soon; not reserved yet
        await bridge.pods_resynced({"u-third"})

    asyncio.run(run())
    assert api.writes == [] and releases(bus) == []
    assert [r.uid for r in bridge.consumers(RID) or []] == ["u-third"]  # a preemption evicts it


def test_nothing_is_deallocated_before_the_pods_are_listed() -> None:
    # After a restart the claims are listed before the pods: until then nobody knows who names
    # a claim, and an unreserved one may belong to a pod about to be bound.
    api = FakeApi(claim(reserved=[]))
    bridge, bus = bridge_for(api)
    asyncio.run(bridge.resync([copy.deepcopy(api.obj)], {}))
    assert api.writes == [] and releases(bus) == []


def test_a_claim_made_for_a_pod_waits_for_its_deletion() -> None:
    # The resourceclaim controller deletes it when its pod ends: no deallocation write is spent.
    api = FakeApi(claim(reserved=[], owner="u-first"))
    bridge, bus = bridge_for(api)

    async def run() -> None:
        await bridge.resync([copy.deepcopy(api.obj)], {})
        await bridge.pods_resynced(set())
        assert releases(bus) == []
        deleting = copy.deepcopy(api.obj)
        deleting["metadata"]["deletionTimestamp"] = "2026-12-04T00:00:00Z"
        deleting["metadata"]["resourceVersion"] = "11"
        await bridge.on_claim_event("MODIFIED", deleting)

    asyncio.run(run())
    assert api.writes == [] and [r.request_id for r in releases(bus)] == [RID]


# -- a job's pods through claims (docs/dra.md, "Jobs") -----------------------------------------


def job_pod(labels: dict[str, str], annotations: dict[str, str]) -> podrules.PodView:
    return podrules.read_pod(
        {
            "metadata": {
                "name": "worker-0",
                "namespace": "team",
                "uid": "u-w0",
                "labels": labels,
                "annotations": annotations,
            },
            "spec": {
                "resourceClaims": [{"name": "d", "resourceClaimTemplateName": "pairs"}],
                "containers": [{"name": "c"}],
            },
        }
    )


TANDEM_SPEC = {"devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": "gpu.tandem.io"}}]}}


def test_a_tandem_job_through_claims_is_admitted_and_a_bad_job_size_refused_saying_why() -> None:
    """Its pods are placed together (tests/unit/test_dra_jobs.py); what cannot be read is refused."""
    view = job_pod({jobwatch.JOB: "allreduce"}, {jobwatch.JOB_SIZE: "2"})
    classes = {"default": DeviceClass()}
    verdict = drapods.admit(
        view, specs={("template", "pairs"): TANDEM_SPEC}, device_classes=classes, traceparent=None
    )
    assert verdict is not None and verdict.allowed, verdict
    bad = job_pod({jobwatch.JOB: "allreduce"}, {jobwatch.JOB_SIZE: "two"})
    verdict = drapods.admit(
        bad, specs={("template", "pairs"): TANDEM_SPEC}, device_classes=classes, traceparent=None
    )
    assert verdict is not None and not verdict.allowed and verdict.code == 403
    assert f"annotation {jobwatch.JOB_SIZE}: 'two' is not a whole number" in verdict.message, verdict.message


def test_a_leaderworkerset_pod_through_claims_is_admitted_as_its_groups_pod() -> None:
    labels = {jobwatch.LWS_NAME: "llm", jobwatch.LWS_GROUP: "0", jobwatch.LWS_WORKER: "0"}
    view = job_pod(labels, {jobwatch.LWS_SIZE: "2"})
    verdict = drapods.admit(
        view,
        specs={("template", "pairs"): TANDEM_SPEC},
        device_classes={"default": DeviceClass()},
        traceparent=None,
    )
    assert verdict is not None and verdict.allowed
    assert not any("placed on its own" in w for w in verdict.warnings), verdict.warnings
