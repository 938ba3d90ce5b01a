"""A pod that asks Tandem's devices through DRA ResourceClaims: the webhook's verdict, the
bridge's request and what it writes on claims and pod (pure: no I/O; docs/dra.md, "Joint
allocation").

A pod lists its claims in ``spec.resourceClaims``: a ResourceClaim by name, or a
ResourceClaimTemplate from which the resourceclaim controller makes one claim per pod (its name
then appears in ``status.resourceClaimStatuses``). :mod:`.draclaims` reads claim specs into one
request and writes allocations; this module is the pod around them:

* **admission** (:func:`admit`): a pod whose claims (or templates) ask Tandem's classes is
  gated and labelled like any Tandem pod; what Tandem would refuse is denied with the claim and
  field named. A claim that does not exist yet cannot be read, so its pod is gated anyway and
  the bridge decides once it exists (a pod whose claims turn out not to be Tandem's is let go).
* **the request** (:func:`pod_request`): the pod's Tandem claims not yet allocated, read as one
  ``alloc.request`` with the pod's request id, pinned to the node of the claims it shares that
  are already allocated;
* **holding a claim** (:func:`held`): Tandem's finalizer and the request that holds the
  claim's devices go on the claim *before* the request is published, so a claim deleted at any
  point after is released, and a restarted bridge finds the request on the claim.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, Assignment, PodRef
from services.admission import drajobs, jobwatch, names, podrules, podwrites
from services.admission.draclaims import Claim, PodDevices, field_names, is_tandems, pod_devices
from services.admission.errors import InvalidClaim, InvalidPod, PolicyError
from services.admission.podrules import PodView, Verdict
from services.request import RequestError
from services.request import resolve as resolve_request

Obj = dict[str, Any]
HOSTNAME_LABEL = "kubernetes.io/hostname"
# The node agent's rule for a DRA device name (services/nodeagent/dra/slices.py, device_names):
# the id lower-cased, runs of other characters as "-"; a unit test holds the two together.
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")


class ClaimRef(NamedTuple):
    """One entry of ``spec.resourceClaims`` and the ResourceClaim it stands for."""

    entry: str
    claim: str | None  # None: to be made from ``template`` and not made yet
    template: str | None


def device_name(device_id: str) -> str:
    """Tandem's device id (``gpu0``, ``mlx5_0``) → its DRA device name in the node's slice."""
    return _NOT_LABEL.sub("-", device_id.lower()).strip("-")[:63].strip("-")


def device_names(a: Assignment) -> dict[str, str]:
    return {dev_id: device_name(dev_id) for dev_id in a.device_ids()}


def asks_claims(pod: PodView) -> bool:
    """A pod Tandem handles through claims: it lists claims and asks no ``tandem.io/*``
    extended resource (a pod asking both is refused at admission)."""
    return bool(pod.spec.resourceClaims) and not podrules.mentions_tandem(pod)


def claim_refs(pod: PodView) -> list[ClaimRef]:
    statuses = pod.status.resourceClaimStatuses if pod.status is not None else None
    made = {s.name: s.resourceClaimName for s in statuses or []}
    out = []
    for entry in pod.spec.resourceClaims or []:
        if entry.resourceClaimName:
            out.append(ClaimRef(entry.name, entry.resourceClaimName, None))
        else:
            out.append(ClaimRef(entry.name, made.get(entry.name), entry.resourceClaimTemplateName))
    return out


def read_claim(obj: Obj) -> Claim:
    """A ResourceClaim object as :class:`~.draclaims.Claim`."""
    meta = obj.get("metadata") or {}
    return Claim(
        str(meta.get("namespace") or ""),
        str(meta.get("name") or ""),
        str(meta.get("uid") or ""),
        spec_of(obj),
    )


def spec_of(obj: Obj) -> Obj:
    spec = obj.get("spec")
    return spec if isinstance(spec, dict) else {}


def held_by(obj: Obj) -> str | None:
    """The request holding a claim's devices (Tandem's annotation), if Tandem holds them."""
    meta = obj.get("metadata") or {}
    if names.DRA_FINALIZER not in (meta.get("finalizers") or []):
        return None
    rid = (meta.get("annotations") or {}).get(names.DRA_REQUEST)
    return str(rid) if rid else None


def allocated_node(obj: Obj) -> str | None:
    """The node of a claim's allocation (its node selector's ``metadata.name``), if allocated."""
    alloc = (obj.get("status") or {}).get("allocation")
    if not isinstance(alloc, dict):
        return None
    for term in (alloc.get("nodeSelector") or {}).get("nodeSelectorTerms") or []:
        for field in term.get("matchFields") or []:
            if field.get("key") == "metadata.name" and field.get("values"):
                return str(field["values"][0])
    return None


def is_allocated(obj: Obj) -> bool:
    return isinstance((obj.get("status") or {}).get("allocation"), dict)


def is_deleting(obj: Obj) -> bool:
    return bool((obj.get("metadata") or {}).get("deletionTimestamp"))


def reserved_for(obj: Obj) -> list[PodRef]:
    """The pods a claim is reserved for (``status.reservedFor``: kube-scheduler adds a pod when
    it binds it, the resourceclaim controller takes an ended pod out)."""
    meta = obj.get("metadata") or {}
    return [
        PodRef(namespace=str(meta.get("namespace") or ""), name=str(r.get("name") or ""), uid=str(r["uid"]))
        for r in (obj.get("status") or {}).get("reservedFor") or []
        if isinstance(r, dict) and r.get("resource", "pods") == "pods" and r.get("uid")
    ]


def in_use(obj: Obj, *, users: Collection[str]) -> bool:
    """Whether a claim still has a consumer: a pod it is reserved for, or a live pod that names
    it (``users``, their uids) and may still be bound — a pod let go to kube-scheduler but not
    reserved yet must find the claim allocated, or the scheduler would allocate it itself."""
    return bool(reserved_for(obj)) or bool(users)


def ended(obj: Obj, *, users: Collection[str]) -> bool:
    """Whether a claim Tandem holds is done with its devices: being deleted, or without any
    consumer (:func:`in_use`) — kube-scheduler's own allocator deallocates a claim then too."""
    return is_deleting(obj) or not in_use(obj, users=users)


def deallocation(obj: Obj) -> Obj:
    """Merge patch of a claim's status clearing its allocation *at the version read*: the API
    server answers 409 if anyone changed the claim since — kube-scheduler reserving it for a
    new pod changes it — so a claim taken again is never deallocated under its pod."""
    version = (obj.get("metadata") or {}).get("resourceVersion")
    if not version:
        raise ValueError("a claim is deallocated only at the version read (it has no resourceVersion)")
    return {"metadata": {"resourceVersion": str(version)}, "status": {"allocation": None, "devices": None}}


# -- admission ------------------------------------------------------------------------------


def admit(
    pod: PodView,
    *,
    specs: Mapping[tuple[str, str], Obj | None],
    device_classes: dict[str, DeviceClass],
    traceparent: str | None,
) -> Verdict | None:
    """The webhook's verdict for a pod with claims, or None when none of them is Tandem's.

    ``specs`` holds what the webhook could read: ``("claim", name)`` → the ResourceClaim's spec,
    ``("template", name)`` → the template's claim spec, None for one that does not exist."""
    namespace = pod.metadata.namespace or ""
    tandem: list[Claim] = []
    unknown = False
    for ref in claim_refs(pod):
        key = ("claim", ref.claim) if ref.claim else ("template", ref.template or "")
        spec = specs.get(key)
        if spec is None:
            unknown = True
            continue
        if is_tandems(spec):
            kind = "ResourceClaim" if key[0] == "claim" else "ResourceClaimTemplate"
            tandem.append(Claim(namespace, key[1], "", spec, kind))
    if not tandem and (not unknown or podrules.mentions_tandem(pod)):
        return None  # not Tandem's claims (a pod asking extended resources is podrules')
    who = f"tandem: pod {pod.display_name}"
    if podrules.mentions_tandem(pod):
        return Verdict(
            allowed=False,
            code=403,
            message=f"{who}: the pod asks Tandem's devices both as resources ({', '.join(names.RESOURCES)})"
            " and through ResourceClaims of Tandem's classes; ask them one way",
        )
    if names.CLAIM in pod.annotations:
        # A DeviceClaim's devices are the pod's whole allocation (docs/sharing.md "Claims");
        # claims of Tandem's classes would ask more beside them, which neither way can honour.
        return Verdict(
            allowed=False,
            code=403,
            message=f"{who}: the pod uses DeviceClaim {pod.annotations[names.CLAIM]!r} ({names.CLAIM})"
            " and asks Tandem's devices through ResourceClaims too; a pod gets its devices one way:"
            " drop the annotation, or the claims of Tandem's classes",
        )
    if pod.spec.nodeName:
        return Verdict(
            allowed=False,
            code=403,
            message=f"{who}: spec.nodeName is already set to {pod.spec.nodeName!r}; a pod whose claims ask"
            " Tandem's classes must let Tandem choose the node, so remove nodeName",
        )
    member, refused = _job_member(pod, who=who, tandem=tandem)
    if refused is not None:
        return refused
    try:
        devices = pod_devices(tandem, default_class=names.DEFAULT_CLASS)
        if devices is not None:
            r = resolve_request(devices.ask, classes=device_classes, names=field_names(tandem))
            problem = drajobs.whole_devices_problem(r) if member is not None else None
            if member is not None and problem is not None:
                return Verdict(
                    allowed=False, code=403, message=f"{who}: it is in job {member.group!r}: {problem}"
                )
    except InvalidClaim as exc:
        return Verdict(allowed=False, code=403, message=f"{who}: {exc}")
    except RequestError as exc:
        return Verdict(allowed=False, code=403, message=f"{who}: {exc}")
    ops, warnings = podrules.admission_patch(pod, None, traceparent=traceparent)
    if unknown:
        warnings.append(
            "a ResourceClaim (or template) of this pod does not exist yet; Tandem holds the pod until it"
            " does and lets it go if it asks none of Tandem's classes"
        )
    return Verdict(allowed=True, patch=ops, warnings=warnings)


def _job_member(
    pod: PodView, *, who: str, tandem: Sequence[Claim]
) -> tuple[jobwatch.Membership | None, Verdict | None]:
    """The job a pod with claims is in (its pods are placed together, all or nothing:
    :mod:`.drajobs`), or the refusal of what a job cannot honour: a group label or annotation
    that does not parse, or a Tandem ResourceClaim named directly — a claim pods share lives on
    one node, and a job's pods are placed one per node, each with claims of its own."""
    try:
        member = jobwatch.membership(pod)
    except PolicyError as exc:
        return None, Verdict(allowed=False, code=403, message=f"{who}: {exc}")
    if member is None:
        return None, None
    named = [c for c in tandem if c.kind == "ResourceClaim"]
    if named:
        return member, Verdict(
            allowed=False,
            code=403,
            message=f"{who}: it is in job {member.group!r} and names ResourceClaim"
            f" {named[0].namespace}/{named[0].name} of Tandem's classes; a job's pods are placed each on"
            " its own node with claims of its own, so ask through a ResourceClaimTemplate",
        )
    return member, None


# -- the bridge -------------------------------------------------------------------------------


def pod_request(
    pod: PodView,
    claims: Sequence[Claim],
    *,
    device_classes: dict[str, DeviceClass],
    pin: str | None,
) -> tuple[AllocationRequest, PodDevices] | None:
    """The pod's ``alloc.request`` for ``claims`` (its Tandem claims not allocated yet), pinned
    to node ``pin`` where it shares claims allocated there; None when they ask nothing.
    :class:`InvalidClaim` names the claim and field."""
    if not pod.metadata.uid or not pod.metadata.name:
        raise InvalidPod("pod has no name or uid yet; only persisted pods get an allocation request")
    ordered = sorted(claims, key=lambda c: c.name)
    devices = pod_devices(ordered, default_class=names.DEFAULT_CLASS)
    if devices is None:
        return None
    try:
        r = resolve_request(devices.ask, classes=device_classes, names=field_names(ordered))
    except RequestError as exc:
        raise InvalidClaim(str(exc)) from None
    selector = dict(pod.spec.nodeSelector or {})
    if pin is not None:
        selector[HOSTNAME_LABEL] = pin
    req = AllocationRequest(
        request_id=podrules.request_id_for(pod.metadata.uid),
        pod=podrules.pod_ref(pod),
        gpus=r.gpus,
        rdma=r.rdma,
        scope=r.scope,
        policy=r.policy,
        pairing=r.pairing,
        device_class=r.device_class,
        priority=_priority(pod),
        node_selector=selector,
        preemption=r.preemption,
        gpu_memory_mib=r.gpu_memory_mib,
        gpu_cores_percent=r.gpu_cores_percent,
        mig_profile=r.mig_profile,
    )
    return req, devices


def _priority(pod: PodView) -> int:
    text = pod.annotations.get(names.PRIORITY, str(names.DEFAULT_PRIORITY)).strip()
    lo, hi = names.PRIORITY_RANGE
    if not re.fullmatch(r"[+-]?\d+", text) or not lo <= int(text) <= hi:
        raise PolicyError(f"annotation {names.PRIORITY}: {text!r} is not a whole number in {lo}..{hi}")
    return int(text)


def held(obj: Obj, *, request_id: str, pod: str) -> Obj:
    """The claim as read with Tandem's finalizer and the holding request on it: written whole
    (an update at the version read), so another writer's finalizer is never lost."""
    out = copy.deepcopy(obj)
    meta = out.setdefault("metadata", {})
    finalizers = meta.setdefault("finalizers", [])
    if names.DRA_FINALIZER not in finalizers:
        finalizers.append(names.DRA_FINALIZER)
    meta.setdefault("annotations", {}).update({names.DRA_REQUEST: request_id, names.DRA_POD: pod})
    out.pop("status", None)  # the status is its own subresource: an update leaves it as it is
    return out


def let_go(obj: Obj) -> Obj:
    """The claim as read without Tandem's finalizer and annotations (its devices are freed)."""
    out = copy.deepcopy(obj)
    meta = out.setdefault("metadata", {})
    meta["finalizers"] = [f for f in meta.get("finalizers") or [] if f != names.DRA_FINALIZER]
    annotations = meta.get("annotations") or {}
    for key in (names.DRA_REQUEST, names.DRA_POD):
        annotations.pop(key, None)
    out.pop("status", None)
    return out


def ungate_patch(raw_pod: Obj, assignment: Assignment | None) -> Obj:
    """Merge patch removing Tandem's gate from a pod whose claims are allocated (and recording
    the assignment, when the pod has one of its own). No node affinity: kube-scheduler follows
    the allocated claims' node selectors."""
    pod = podrules.read_pod(raw_pod)
    metadata: Obj = {}
    if pod.metadata.resourceVersion:
        metadata["resourceVersion"] = pod.metadata.resourceVersion
    if assignment is not None:
        metadata["annotations"] = {names.ASSIGNMENT: podwrites.assignment_annotation(assignment)}
    gates = [{"name": g} for g in pod.gates if g != names.GATE]
    return {"metadata": metadata, "spec": {"schedulingGates": gates or None}}


def claim_event_object(obj: Obj) -> Obj:
    """A ResourceClaim as the ``involvedObject`` of an Event."""
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "name": meta.get("name") or "",
        "namespace": meta.get("namespace") or "",
        "uid": meta.get("uid") or "",
    }


def pod_from(raw: Any) -> PodView | None:
    try:
        return podrules.read_pod(raw)
    except InvalidPod:
        return None
