"""A job whose pods ask through DRA ResourceClaims: one job, placed all or nothing (pure: no I/O;
docs/dra.md, "Jobs").

A pod of a Tandem job (``tandem.io/job`` + ``tandem.io/job-size``, a LeaderWorkerSet group, a
JobSet: :func:`.jobwatch.membership`) whose claims ask Tandem's classes is placed the way a job
asking ``tandem.io/*`` resources is (docs/kubernetes.md, "Jobs: pods placed together"):

* **one per-pod template**: each pod's Tandem claims are read by :mod:`.draclaims` and resolved
  by the one resolver into that pod's request (:func:`.drapods.pod_request`, by the bridge), and
  :func:`job_request` makes the job of them (:func:`.jobwatch.job_request`) — every pod must
  ask the same, with the message the resource path gives. A job's template has no GPU shares
  and no MIG profile, so a pod asking those is refused (:func:`whole_devices_problem`);
* **claims of its own**: each pod's Tandem claims are made for it from a ResourceClaimTemplate
  (the resourceclaim controller makes the pod their owner). A claim several pods name lives on
  one node and outlives its pods, which a job's per-pod placement cannot honour
  (:func:`own_claims_problem`; a job pod naming a Tandem ResourceClaim is refused at admission);
* **held per pod**: pod ``i``'s claims carry the request id ``JOB/i`` — the id the allocator
  holds that pod's devices under and its ``Assignment`` names — so the single pod's path writes
  their allocation, removes the gate, releases them and lets them go unchanged;
* **released per pod** (:func:`release_step`): a pod's claims ended, the job record says what
  is held: a committed job's pod still on its node is released alone (its ``Freed`` lets the
  claims go), a job not placed yet is cancelled whole (it cannot run without the pod; the
  claims are let go at once — the allocator holds a job's devices until it releases them), and
  anything else holds nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, JobRecord, JobRequest
from services.admission import jobwatch
from services.admission.errors import PolicyError
from services.admission.podrules import PodView
from services.request import Resolved

Obj = dict[str, object]
ReleaseStep = Literal["release_pod", "cancel_job", "let_go"]
# Job records whose pods hold nothing yet (the job is not placed): a pod's end cancels the job.
NOT_PLACED = frozenset({"pending", "committing", "aborted"})


def is_job_pod(request_id: str) -> bool:
    """Whether a request id is a job's pod (``JOB/INDEX``), not a pod's own (``<uid>.1``)."""
    return "/" in request_id


def split(request_id: str) -> tuple[str, int]:
    """``JOB/INDEX`` → (job id, index)."""
    job, _, index = request_id.rpartition("/")
    return job, int(index)


def whole_devices_problem(r: Resolved | AllocationRequest) -> str | None:
    """Why a job's pod cannot ask what ``r`` asks (a job's template carries whole GPUs and NICs
    only), or None."""
    if r.gpu_memory_mib is not None or r.gpu_cores_percent is not None:
        return "a job's pods get whole GPUs: its per-pod template has no GPU share (memory or compute)"
    if r.mig_profile is not None:
        return "a job's pods get whole GPUs: its per-pod template has no MIG profile"
    return None


def own_claims_problem(pod: PodView, tandem: Sequence[Obj]) -> str | None:
    """Why the pod's Tandem claims cannot be placed as part of its job, or None: each must be
    made for this pod from a ResourceClaimTemplate (its owner is the pod)."""
    uid = pod.metadata.uid or ""
    for obj in tandem:
        meta = obj.get("metadata")
        owners = meta.get("ownerReferences") if isinstance(meta, dict) else None
        mine = any(
            isinstance(o, dict) and o.get("kind") == "Pod" and o.get("uid") == uid for o in owners or []
        )
        if not mine:
            name = meta.get("name") if isinstance(meta, dict) else "?"
            return (
                f"ResourceClaim {pod.metadata.namespace}/{name} is not made for this pod from a"
                " ResourceClaimTemplate; a job's pods are placed one per node, each with claims of its own"
            )
    return None


def job_request(
    pods: list[PodView],
    requests: Mapping[str, AllocationRequest | None],
    *,
    device_classes: dict[str, DeviceClass],
) -> JobRequest:
    """The job of ``pods``, each pod's request read from its Tandem claims (``requests``, by pod
    uid: :func:`.drapods.pod_request`). Raises :class:`PolicyError` when the pods differ, one
    asks nothing, or one asks a GPU share or MIG profile."""

    def request_of(pod: PodView) -> AllocationRequest | None:
        req = requests.get(pod.metadata.uid or "")
        problem = whole_devices_problem(req) if req is not None else None
        if problem is not None:
            raise PolicyError(f"pod {pod.metadata.name}: {problem}")
        return req

    return jobwatch.job_request(pods, device_classes=device_classes, request_of=request_of)


def release_step(record: JobRecord | None, index: int, *, on_node: bool) -> ReleaseStep:
    """What pod ``index``'s ended claims need, from its job's record: ``release_pod`` (a
    committed job's pod its node still holds: released alone), ``cancel_job`` (not placed yet:
    the whole job, which cannot run without the pod), ``let_go`` (nothing is held: the pod was
    freed already, or the job is cancelled, refused or released)."""
    if record is None or record.state in NOT_PLACED:
        # None: published but not recorded yet (or expired); cancelling an unknown job is harmless.
        return "cancel_job"
    if record.state == "committed" and index < len(record.placement) and on_node:
        return "release_pod"
    return "let_go"
