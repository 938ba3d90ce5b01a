"""DeviceClaims, pure: read and check a claim, build its allocation request, decide its expiry
and who may use it, and compute the status the bridge writes. No I/O (the bridge applies it:
:mod:`services.admission.claimbridge`).

A ``DeviceClaim`` (``tandem.io/v1alpha1``, namespaced; CRD in
``deploy/helm/tandem/crds/deviceclaims.yaml``) asks for devices like a pod does, but its
devices are held until the claim goes away, not until a pod ends:

* The bridge turns a claim into one ``AllocationRequest`` whose ``pod`` names the claim
  (namespace, name, uid), whose ``request_id`` is ``claim-<uid>`` (never a pod's
  ``<uid>.1``) and whose ``claim`` marker carries ``shareable`` and the reservation deadline.
  The allocator places it like any request; nothing in the core knows claims.
* A pod that names the claim in the annotation ``tandem.io/claim`` (same namespace) gets the
  claim's assignment bound onto it — node affinity, ``tandem.io/assignment`` with the claim's
  request id, gate removed — and makes no request of its own. Its end frees nothing.
* A claim that is not ``shareable`` serves one live pod at a time; a second pod waits, with an
  Event saying which pod holds the claim.
* Deleting the claim releases its request once no pod uses it (the bridge's finalizer
  ``tandem.io/claim-release`` holds the claim until then): the node agent cleans up and
  verifies, then the allocator frees the devices and places pending requests on them.
* A **reservation** is a claim no pod uses yet. With ``expiresAfter`` (from the claim's
  creation) or ``expiresAt`` it is released at that time if no pod uses it then; if pods use it,
  when the last of them ends. The claim object stays, in phase ``Released``.

Why the bridge, not the allocator, enforces expiry: only the bridge knows whether a pod uses
the claim (the allocator sees one allocation, not its users). The deadline is computed from the
claim's own fields (``creationTimestamp`` + ``expiresAfter``), never from when a bridge saw it,
so a bridge that was down at the deadline, or a new Lease holder, releases an expired claim in
its first pass after the start (:func:`expiry_due`), and a restart never extends a reservation.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, cast

import msgspec

from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, Assignment, ClaimMarker, ClaimRecord, PodRef
from schemas.topology import MigProfile
from services.admission import names
from services.admission.errors import InvalidClaim
from services.request import Ask, Field, RequestError, resolve

__all__ = [
    "CLAIM_REQUEST_PREFIX",
    "ClaimSpec",
    "ClaimState",
    "ClaimView",
    "Phase",
    "blocking_reason",
    "claim_record",
    "claim_request",
    "claim_request_id",
    "expiry_due",
    "is_claim_request",
    "parse_duration",
    "read_claim",
    "status_patch",
]

CLAIM_REQUEST_PREFIX = "claim-"
MAX_COUNT = 64
# A reservation longer than a year is a mistake, not a plan.
MAX_EXPIRY_S = 366 * 24 * 3600
Phase = Literal["Pending", "Allocated", "Released", "Invalid"]

Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
_lo, _hi = names.PRIORITY_RANGE


class Shares(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    gpu_memory_mib: Annotated[int, msgspec.Meta(ge=1, le=2**24)] | None = msgspec.field(
        default=None, name="gpuMemoryMiB"
    )
    gpu_cores_percent: Annotated[int, msgspec.Meta(ge=1, le=100)] | None = msgspec.field(
        default=None, name="gpuCoresPercent"
    )


class ClaimSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, rename="camel"):
    """``spec`` of a DeviceClaim (the CRD's schema says the same; this is what the bridge trusts)."""

    device_class: Annotated[str, msgspec.Meta(min_length=1, max_length=63)] = names.DEFAULT_CLASS
    gpus: Count = 0
    rdma: Count = 0
    scope: str | None = None
    policy: str | None = None
    pairing: str | None = None
    priority: Annotated[int, msgspec.Meta(ge=_lo, le=_hi)] = names.DEFAULT_PRIORITY
    shares: Shares | None = None
    shareable: bool = False
    expires_after: str | None = None
    expires_at: str | None = None
    # ``gpus`` existing MIG instances of this profile instead of whole GPUs (docs/sharing.md
    # "MIG"); the pattern is the request's, so a bad profile is refused naming spec.migProfile.
    mig_profile: MigProfile | None = None


@dataclass(frozen=True, slots=True)
class ClaimView:
    namespace: str
    name: str
    uid: str
    created: float
    spec: ClaimSpec
    deleting: bool = False
    finalizers: tuple[str, ...] = ()
    resource_version: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def display(self) -> str:
        return f"DeviceClaim {self.namespace}/{self.name}"


def claim_request_id(uid: str) -> str:
    return f"{CLAIM_REQUEST_PREFIX}{uid}"


def is_claim_request(request_id: str) -> bool:
    return request_id.startswith(CLAIM_REQUEST_PREFIX)


_DURATION = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def parse_duration(text: str, *, where: str) -> float:
    """``90s``, ``30m``, ``2h``, ``1d``, ``1h30m`` → seconds; :class:`InvalidClaim` naming
    ``where`` otherwise."""
    m = _DURATION.match(text.strip())
    if not text.strip() or m is None or not any(m.groups()):
        raise InvalidClaim(f"{where}: {text!r} is not a duration like 90s, 30m, 2h, 1d or 1h30m")
    d, h, mi, s = (int(g or 0) for g in m.groups())
    seconds = float(((d * 24 + h) * 60 + mi) * 60 + s)
    if not 0 < seconds <= MAX_EXPIRY_S:
        raise InvalidClaim(f"{where}: {text!r} must be more than 0s and at most 366d")
    return seconds


def _timestamp(text: str, *, where: str) -> float:
    try:
        stamp = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidClaim(f"{where}: {text!r} is not an RFC 3339 time like 2026-12-01T08:00:00Z") from None
    if stamp.tzinfo is None:
        raise InvalidClaim(f"{where}: {text!r} has no time zone (end it with Z or +00:00)")
    return stamp.timestamp()


def read_claim(obj: Any) -> ClaimView:
    """A DeviceClaim object as the API server returns it; :class:`InvalidClaim` names the field."""
    if not isinstance(obj, dict):
        raise InvalidClaim("DeviceClaim: not a JSON object")
    meta = obj.get("metadata") or {}
    ns, name, uid = meta.get("namespace"), meta.get("name"), meta.get("uid")
    if not all(isinstance(v, str) and v for v in (ns, name, uid)):
        raise InvalidClaim("DeviceClaim: metadata.namespace, metadata.name and metadata.uid are required")
    ns, name, uid = cast(str, ns), cast(str, name), cast(str, uid)
    where = f"{names.CLAIM_KIND} {ns}/{name}"
    created_text = meta.get("creationTimestamp")
    created = (
        _timestamp(created_text, where=f"{where}: metadata.creationTimestamp")
        if isinstance(created_text, str) and created_text
        else 0.0
    )
    raw_spec = obj.get("spec") or {}
    try:
        spec = msgspec.convert(raw_spec, ClaimSpec)
    except msgspec.ValidationError as exc:
        profile = raw_spec.get("migProfile") if isinstance(raw_spec, dict) else None
        if isinstance(profile, str) and str(exc).endswith("`$.migProfile`"):
            # msgspec would quote the regex; say it as the webhook says a pod's bad profile.
            raise InvalidClaim(
                f'{where}: spec.migProfile: {profile!r} is not a MIG profile like "1g.10gb" or "3g.40gb"'
            ) from None
        raise InvalidClaim(f"{where}: {_spec_path(str(exc))}") from None
    return ClaimView(
        namespace=ns,
        name=name,
        uid=uid,
        created=created,
        spec=spec,
        deleting=bool(meta.get("deletionTimestamp")),
        finalizers=tuple(f for f in meta.get("finalizers") or () if isinstance(f, str)),
        resource_version=str(meta.get("resourceVersion") or ""),
    )


def finalizer_patch(view: ClaimView, *, present: bool) -> dict[str, Any] | None:
    """Merge patch that adds (``present``) or removes the bridge's finalizer, keeping everyone
    else's (a merge patch replaces the list whole); ``None`` when there is nothing to do. The
    resourceVersion makes a stale list a 409 instead of dropping another writer's finalizer."""
    has = names.CLAIM_FINALIZER in view.finalizers
    if has == present:
        return None
    others = [f for f in view.finalizers if f != names.CLAIM_FINALIZER]
    meta: dict[str, Any] = {"finalizers": [*others, names.CLAIM_FINALIZER] if present else others}
    if view.resource_version:
        meta["resourceVersion"] = view.resource_version
    return {"metadata": meta}


def _spec_path(message: str) -> str:
    """msgspec says ``at `$.gpus``` / ``at `$.shares.gpuMemoryMiB```; a user reads ``spec.gpus``."""
    message = re.sub(r"`\$\.?", "`spec.", message).replace("`spec.`", "`spec`")
    return message.replace("Object contains unknown field", "unknown field")


def expires_at(view: ClaimView) -> float | None:
    """The reservation's deadline (Unix seconds) from the claim's own fields, or ``None``."""
    spec, where = view.spec, view.display
    if spec.expires_after is not None and spec.expires_at is not None:
        raise InvalidClaim(f"{where}: spec.expiresAfter and spec.expiresAt: set one of them, not both")
    if spec.expires_after is not None:
        return view.created + parse_duration(spec.expires_after, where=f"{where}: spec.expiresAfter")
    if spec.expires_at is not None:
        return _timestamp(spec.expires_at, where=f"{where}: spec.expiresAt")
    return None


def claim_request(view: ClaimView, *, device_classes: dict[str, DeviceClass]) -> AllocationRequest:
    """The claim's ``AllocationRequest``, with the device class's defaults applied, or
    :class:`InvalidClaim` naming the field (the same rules as a pod's annotations)."""
    spec, where = view.spec, view.display
    if spec.shares is not None:
        if spec.shares.gpu_memory_mib is None and spec.shares.gpu_cores_percent is None:
            raise InvalidClaim(f"{where}: spec.shares: give gpuMemoryMiB and/or gpuCoresPercent")
        if spec.gpus == 0:
            raise InvalidClaim(f"{where}: spec.shares needs spec.gpus > 0 (a share is of a GPU)")
    ask = Ask(
        gpus=spec.gpus,
        rdma=spec.rdma,
        device_class=spec.device_class,
        scope=spec.scope,
        policy=spec.policy,
        pairing=spec.pairing,
        gpu_memory_mib=spec.shares.gpu_memory_mib if spec.shares else None,
        gpu_cores_percent=spec.shares.gpu_cores_percent if spec.shares else None,
        mig_profile=spec.mig_profile,
    )
    try:
        r = resolve(ask, classes=device_classes, names=_CLAIM_NAMES)
    except RequestError as exc:
        raise InvalidClaim(f"{where}: {exc}") from None
    if r.dc.nic_function == "vf" and spec.rdma:
        # The node agent moves a VF's netdev into the network namespace of the allocation's
        # pod; a claim's allocation has no pod of its own (docs/sharing.md, "Limits").
        raise InvalidClaim(
            f"{where}: spec.deviceClass: class {spec.device_class!r} hands out NIC VFs, which a claim "
            "cannot pass on to its pods yet; use a class with PF NICs or ask for rdma: 0"
        )
    deadline = expires_at(view)
    return AllocationRequest(
        request_id=claim_request_id(view.uid),
        pod=PodRef(namespace=view.namespace, name=view.name, uid=view.uid),
        gpus=spec.gpus,
        rdma=spec.rdma,
        scope=r.scope,
        policy=r.policy,
        pairing=r.pairing,
        device_class=spec.device_class,
        priority=spec.priority,
        claim=ClaimMarker(name=view.name, shareable=spec.shareable, expires_at=deadline),
        gpu_memory_mib=r.gpu_memory_mib,
        gpu_cores_percent=r.gpu_cores_percent,
        mig_profile=r.mig_profile,
    )


# How a claim's author writes each field (services.request names the field in errors).
_CLAIM_NAMES: dict[Field, str] = {
    "gpus": "spec.gpus",
    "rdma": "spec.rdma",
    "device_class": "spec.deviceClass",
    "scope": "spec.scope",
    "policy": "spec.policy",
    "pairing": "spec.pairing",
    "preemption": "spec.preemption",
    "gpu_memory_mib": "spec.shares.gpuMemoryMiB",
    "gpu_cores_percent": "spec.shares.gpuCoresPercent",
    "mig_profile": "spec.migProfile",
}


# ---------------------------------------------------------------------------------------------
# the bridge's view of one claim


@dataclass(slots=True)
class ClaimState:
    """What the bridge knows about one claim: its request, outcome and users (pod uid → name)."""

    view: ClaimView
    request: AllocationRequest | None = None
    phase: Phase = "Pending"
    reason: str = ""
    assignment: Assignment | None = None
    users: dict[str, str] = field(default_factory=dict)
    released: bool = False
    record_node: str | None = None  # the node of the allocator's record (a restarted bridge)

    @property
    def request_id(self) -> str:
        return claim_request_id(self.view.uid)

    @property
    def expires_at(self) -> float | None:
        return self.request.claim.expires_at if self.request and self.request.claim else None


def _gpu_kind(
    mig_profile: str | None, gpu_memory_mib: int | None, gpu_cores_percent: int | None
) -> tuple[str, str]:
    """What kind of GPU device a request holds, and how a pod asks for that kind."""
    if mig_profile is not None:
        return (
            f"MIG instances {mig_profile}",
            f"{names.RESOURCE_MIG} with annotation {names.MIG_PROFILE}: {mig_profile}",
        )
    if gpu_memory_mib is not None or gpu_cores_percent is not None:
        given = ((names.GPU_MEMORY_MIB, gpu_memory_mib), (names.GPU_CORES_PERCENT, gpu_cores_percent))
        sizes = [f"{key}: {value}" for key, value in given if value is not None]
        return "shares of GPUs", f"{names.RESOURCE_GPU_SHARE} with annotations {', '.join(sizes)}"
    return "whole GPUs", names.RESOURCE_GPU


def blocking_reason(
    state: ClaimState | None,
    *,
    claim: str,
    pod_uid: str,
    gpus: int,
    rdma: int,
    mig_profile: str | None = None,
    gpu_memory_mib: int | None = None,
    gpu_cores_percent: int | None = None,
) -> str | None:
    """Why a pod that names ``claim`` cannot get its devices now (a message for the pod author),
    or ``None`` when it may be bound to the claim's assignment.

    The pod asks for the claim's devices the way kubelet hands them out: the same counts and
    the same kind of GPU device (``tandem.io/gpu`` for whole GPUs, ``tandem.io/gpu-share`` with
    the claim's share size, ``tandem.io/mig`` with its profile), because the device plugin of
    that resource is the one that answers with the claim's devices (MIG: ``MIG-`` UUIDs in
    ``NVIDIA_VISIBLE_DEVICES``; shares: the share's limits)."""
    if state is None:
        return f"{names.CLAIM_KIND} {claim!r} does not exist in this namespace; the pod waits for it"
    if state.view.deleting:
        return f"{names.CLAIM_KIND} {claim!r} is being deleted; its devices go once its pods end"
    if state.phase == "Invalid":
        return f"{names.CLAIM_KIND} {claim!r} is invalid: {state.reason}"
    if state.released or state.phase == "Released":
        return f"{names.CLAIM_KIND} {claim!r} was released ({state.reason}); its devices are gone"
    req = state.request
    if req is not None and (gpus, rdma) != (req.gpus, req.rdma):
        return (
            f"the pod asks for {gpus} {names.RESOURCE_GPU} and {rdma} {names.RESOURCE_RDMA}, but "
            f"{names.CLAIM_KIND} {claim!r} holds {req.gpus} and {req.rdma}; a pod using a claim asks "
            "for exactly the claim's counts"
        )
    if req is not None and req.gpus:
        held, how = _gpu_kind(req.mig_profile, req.gpu_memory_mib, req.gpu_cores_percent)
        asked, _ = _gpu_kind(mig_profile, gpu_memory_mib, gpu_cores_percent)
        if (mig_profile, gpu_memory_mib, gpu_cores_percent) != (
            req.mig_profile,
            req.gpu_memory_mib,
            req.gpu_cores_percent,
        ):
            return (
                f"the pod asks for {asked}, but {names.CLAIM_KIND} {claim!r} holds {held}; a pod using "
                f"it asks for {how}"
            )
    if state.assignment is None:
        why = f": {state.reason}" if state.reason else ""
        return f"{names.CLAIM_KIND} {claim!r} is not allocated yet{why}"
    others = sorted(name for uid, name in state.users.items() if uid != pod_uid)
    if others and not (req is not None and req.claim is not None and req.claim.shareable):
        return (
            f"{names.CLAIM_KIND} {claim!r} is not shareable and is used by pod {others[0]}; the pod "
            "waits until that pod ends (set spec.shareable: true to let pods share it)"
        )
    return None


def expiry_due(state: ClaimState, *, now: float) -> bool:
    """A reservation is released at its deadline if no pod uses it, else when its last pod ends."""
    deadline = state.expires_at
    return (
        deadline is not None
        and not state.released
        and state.phase != "Invalid"
        and now >= deadline
        and not state.users
    )


def rfc3339(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_patch(state: ClaimState) -> dict[str, Any]:
    """Merge patch for the claim's ``status`` subresource (every key written, so a phase that
    moved on never keeps an old node or device list)."""
    a = state.assignment if not state.released else None
    status: dict[str, Any] = {
        "phase": state.phase,
        "requestId": state.request_id,
        "node": a.node if a else None,
        "devices": a.device_ids() if a else [],
        "pods": sorted(state.users.values()),
        "reason": state.reason[:1024],
        "expiresAt": rfc3339(state.expires_at) if state.expires_at is not None else None,
    }
    return {"status": status}


def claim_record(state: ClaimState, *, now: float) -> ClaimRecord:
    a = state.assignment if not state.released else None
    return ClaimRecord(
        request_id=state.request_id,
        namespace=state.view.namespace,
        name=state.view.name,
        uid=state.view.uid,
        phase=state.phase,
        node=a.node if a else None,
        devices=a.device_ids() if a else [],
        pods=sorted(state.users.values()),
        shareable=state.view.spec.shareable,
        expires_at=state.expires_at,
        reason=state.reason[:1024],
        updated_at=now,
    )
