"""What ``tandem submit`` asks for, built from its flags before connecting, and found again by
name: a pod's request (``--pod``), a DeviceClaim's (``--claim``) or a whole job (``--job``).

One :class:`Submission` carries any of the three, so submit's sending, waiting, "never fits"
verdict, refusal of a second live one and its output are one piece of code in
:mod:`tools.cli.submit`, not three. What differs is only what goes on the wire, which is what
the pod bridge sends for the same thing in a cluster:

* a **pod**: an ``AllocationRequest`` (request id ``<uid>.1``) on ``tandem.alloc.request``;
* a **claim**: the same message with the bridge's claim marker (``ClaimMarker``: name,
  ``shareable``, deadline), request id ``claim-<uid>`` and ``pod`` naming the claim
  (:mod:`services.admission.claims`). A **reservation** is not a kind of its own: it is a claim
  with a deadline (``--expires-after`` / ``--expires-at``, the CRD's ``expiresAfter`` /
  ``expiresAt``), as docs/sharing.md defines it. ``tandem up`` keeps the claim's record and
  releases it at its deadline (:class:`tools.localstack.LocalClaims`); in a cluster a claim
  is a ``DeviceClaim`` object and the bridge does;
* a **job**: a ``JobRequest`` on ``tandem.alloc.job``, ``pods`` identical pods placed
  together or not at all. The allocator answers under the job id while it cannot place it
  (``AllocationFailed``) and with one ``Assignment`` per pod (``JOB/INDEX``) once the job is
  committed, so a job is waited for on two ids (:attr:`Submission.watch_ids`). Its id is
  ``NAME.<8 hex>``: a name can be submitted again after a release (the allocator keeps each
  job id's record and refuses an id reused for another job), and ``--job NS/NAME`` finds it
  again (:func:`job_name`).

What is sent is checked before connecting, first as the wire will (:func:`_validated`), then
by the one request resolver (:func:`services.request.check`): every rule that holds whatever
the device class, the errors naming the flags (``--pairing: per-gpu gives every GPU its own
NIC, ...``). The scope, policy and pairing a request leaves out are the device class's, applied
by the allocator with the same resolver: the CLI does not know the running system's classes
(its own configuration may differ), so it never fills them in or judges a class — an unknown
class, or shares of a class that does not share, is the allocator's ``rejected: ...``.
"""

from __future__ import annotations

import argparse
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import msgspec

from schemas import codec
from schemas.messages import (
    AllocationRequest,
    ClaimMarker,
    JobRecord,
    JobRequest,
    NetworkSpec,
    PodRef,
    RequestRecord,
)
from services.request import Field, RequestError, check
from tools.cli.errors import CliError
from tools.cli.refs import parse_ref

Kind = Literal["pod", "claim", "job"]
M = TypeVar("M", AllocationRequest, JobRequest)
LIVE = frozenset({"pending", "deciding", "assigned", "releasing"})
# A job record that still waits or holds (aborted: an attempt undone, decided again).
JOB_LIVE = frozenset({"pending", "committing", "aborted", "committed"})
JOB_ONLY = ("pods", "fabric", "fabric_policy", "nvlink_domain")
CLAIM_ONLY = ("shareable", "expires_after", "expires_at")
# Flags a kind cannot carry on the wire (or the docs say it does not use), and why.
NOT_FOR = {
    "job": {
        "gpu_memory_mib": "a job's pods take whole GPUs",
        "gpu_cores_percent": "a job's pods take whole GPUs",
        "mig_profile": "a job's pods take whole GPUs",
        "preemption": "a job never preempts (docs/architecture.md, 'Jobs')",
    },
    "claim": {
        "preemption": "a claim does not evict anything (docs/sharing.md, 'Claims')",
        "mtu": "a claim's NICs go to the pods that use it",
    },
}


# How submit's user writes each field of a request (services.request names the field in errors).
FLAG_NAMES: dict[Field, str] = {
    "gpus": "--gpus",
    "rdma": "--rdma",
    "device_class": "--device-class",
    "scope": "--scope",
    "policy": "--policy",
    "pairing": "--pairing",
    "preemption": "--preemption",
    "gpu_memory_mib": "--gpu-memory-mib",
    "gpu_cores_percent": "--gpu-cores-percent",
    "mig_profile": "--mig-profile",
}
# The flag behind a wire field a validation error names (``$.network.mtu``: --mtu).
WIRE_FLAGS: dict[str, str] = {
    **{str(f): flag for f, flag in FLAG_NAMES.items()},
    "priority": "--priority",
    "network": "--mtu",
    "pods": "--pods",
    "fabric": "--fabric",
}
_WIRE_PATH = re.compile(r"`\$\.([a-z_]+)")


@dataclass(frozen=True)
class Submission:
    """What one ``tandem submit`` sends: ``request`` (a pod or a claim) or ``job``."""

    kind: Kind
    request: AllocationRequest | None = None
    job: JobRequest | None = None

    @property
    def id(self) -> str:
        """The id the allocator's refusals and preemptions name (the job's id for a job)."""
        if self.job is not None:
            return self.job.job_id
        assert self.request is not None
        return self.request.request_id

    @property
    def placed_ids(self) -> tuple[str, ...]:
        """The ids whose ``Assignment``\\ s mean it is placed: one, or each pod of a job."""
        if self.job is not None:
            return tuple(self.job.pod_id(i) for i in range(self.job.pods))
        return (self.id,)

    @property
    def watch_ids(self) -> tuple[str, ...]:
        """The ids whose first outcome answers the submit (a job's, and its first pod's)."""
        return (self.id, self.placed_ids[0]) if self.job is not None else (self.id,)

    @property
    def ref(self) -> PodRef:
        """The pod, the claim or the job, by namespace and name."""
        if self.job is not None:
            return PodRef(namespace=self.job.namespace, name=job_name(self.job.job_id))
        assert self.request is not None
        return self.request.pod

    @property
    def noun(self) -> str:
        return "job" if self.kind == "job" else "request"

    @property
    def flag(self) -> str:
        return f"--{self.kind}"

    def headline(self) -> str:
        """``request <id> (pod ns/name)``, ``request claim-<uid> (claim ns/name, ...)``,
        ``job <id> (2 pods: ns/a-0, ns/a-1)``: the first line submit prints."""
        ref = f"{self.ref.namespace}/{self.ref.name}"
        if self.job is not None:
            names = [f"{p.namespace}/{p.name}" for p in map(self.job.member, range(self.job.pods))]
            pods = ", ".join(names) if len(names) <= 3 else f"{names[0]} … {names[-1]}"
            return f"job {self.id} ({plural(self.job.pods, 'pod')}: {pods})"
        assert self.request is not None
        marker = self.request.claim
        if marker is None:
            return f"request {self.id} (pod {ref})"
        until = f", a reservation until {rfc3339(marker.expires_at)}" if marker.expires_at else ""
        return f"request {self.id} (claim {ref}{until})"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def rfc3339(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def kind_of(args: argparse.Namespace) -> Kind:
    if getattr(args, "job", None) is not None:
        return "job"
    if getattr(args, "claim", None) is not None:
        return "claim"
    return "pod"


def check_flags(args: argparse.Namespace) -> Kind:
    """The kind the flags ask for; a flag of another kind is refused naming both."""
    kind = kind_of(args)
    given = {k for k in (*JOB_ONLY, *CLAIM_ONLY) if getattr(args, k, None) not in (None, False)}
    for flag_of, names in (("job", JOB_ONLY), ("claim", CLAIM_ONLY)):
        stray = sorted(given & set(names)) if kind != flag_of else []
        if stray:
            raise CliError(
                f"--{stray[0].replace('_', '-')} goes with --{flag_of} NAMESPACE/NAME",
                hint=f"`tandem submit --{flag_of} team/x ...`; see `tandem submit --help`",
            )
    for name, why in NOT_FOR.get(kind, {}).items():
        if getattr(args, name, None) is not None:
            raise CliError(f"--{name.replace('_', '-')} does not go with --{kind}: {why}")
    if kind == "job" and args.pods is None:
        raise CliError("--job needs --pods N: how many pods the job has", hint="e.g. --job team/ddp --pods 4")
    return kind


def build(args: argparse.Namespace) -> Submission:
    """The submission the flags ask for, validated as the wire will and checked by the request
    resolver (module docstring); :class:`CliError` else."""
    kind = check_flags(args)
    if kind == "job":
        job = _validated(_job(args))
        _check(job.template())
        return Submission(kind="job", job=job)
    return Submission(kind=kind, request=new_request(args))


def new_request(args: argparse.Namespace) -> AllocationRequest:
    """A pod's request, or a claim's with ``--claim``."""
    uid = str(uuid.uuid4())
    claim = None
    if getattr(args, "claim", None) is not None:
        from services.admission import claims

        ref = parse_ref(args.claim, flag="--claim")
        rid = claims.claim_request_id(uid)
        claim = ClaimMarker(name=ref.name, shareable=args.shareable, expires_at=_deadline(args, ref))
    else:
        ref = (
            parse_ref(args.pod)
            if args.pod
            else PodRef(namespace="default", name=f"pod-{uuid.uuid4().hex[:6]}")
        )
        rid = f"{uid}.1"
    req = AllocationRequest(
        request_id=rid,
        pod=PodRef(namespace=ref.namespace, name=ref.name, uid=uid),
        **_each_pod_asks(args),
        preemption=getattr(args, "preemption", None),
        gpu_memory_mib=getattr(args, "gpu_memory_mib", None),
        gpu_cores_percent=getattr(args, "gpu_cores_percent", None),
        mig_profile=getattr(args, "mig_profile", None),
        claim=claim,
    )
    return _check(_validated(req))


def _each_pod_asks(args: argparse.Namespace) -> dict[str, Any]:
    """What a pod asks, the same fields for a pod's request and each pod of a job."""
    return {
        "gpus": args.gpus,
        "rdma": args.rdma,
        "scope": args.scope,
        "policy": args.policy,
        "pairing": args.pairing,
        "device_class": args.device_class,
        "priority": args.priority,
        "network": NetworkSpec(mtu=args.mtu) if getattr(args, "mtu", None) else None,
    }


def _deadline(args: argparse.Namespace, ref: PodRef) -> float | None:
    """A reservation's deadline from ``--expires-after`` (from now, as ``expiresAfter`` counts
    from the claim's creation) or ``--expires-at``: the bridge's own reading of the claim's
    fields (:func:`services.admission.claims.expires_at`), its errors told by the flags."""
    from services.admission import claims
    from services.admission.errors import InvalidClaim

    spec = claims.ClaimSpec(expires_after=args.expires_after, expires_at=args.expires_at)
    view = claims.ClaimView(namespace=ref.namespace, name=ref.name, uid="", created=time.time(), spec=spec)
    try:
        deadline = claims.expires_at(view)
    except InvalidClaim as exc:
        said = str(exc).replace(f"{view.display}: spec.expiresAfter", "--expires-after")
        raise CliError(said.replace(f"{view.display}: spec.expiresAt", "--expires-at")) from None
    if deadline is not None and deadline <= view.created:
        raise CliError(f"--expires-at: {args.expires_at} has passed already")
    return deadline


def _job(args: argparse.Namespace) -> JobRequest:
    ref = parse_ref(args.job, flag="--job")
    uid = uuid.uuid4().hex
    job_id = f"{ref.name[:150]}.{uid[:8]}"
    return JobRequest(
        job_id=job_id,
        pods=args.pods,
        namespace=ref.namespace,
        **_each_pod_asks(args),
        fabric=args.fabric,
        fabric_policy=args.fabric_policy or "preferred",
        nvlink_domain=args.nvlink_domain,
        members=[
            PodRef(namespace=ref.namespace, name=f"{ref.name}-{i}", uid=f"{uid}-{i}")
            for i in range(args.pods)
        ],
    )


def _validated(message: M) -> M:
    """``message`` as the wire accepts it; else the error, naming the flag behind the field."""
    try:
        return codec.validated(message)
    except msgspec.ValidationError as exc:
        at = _WIRE_PATH.search(str(exc))
        flag = WIRE_FLAGS.get(at.group(1), "") if at is not None else ""
        said = f"{flag}: {exc}" if flag else str(exc)
        raise CliError(f"invalid request: {said}", hint="see `tandem submit --help`") from None


def _check(req: AllocationRequest) -> AllocationRequest:
    """``req`` (a pod's, a claim's, a job's template) by the rules of :func:`services.request.check`."""
    try:
        check(req, names=FLAG_NAMES)
    except RequestError as exc:
        raise CliError(f"invalid request: {exc}", hint="see `tandem submit --help`") from None
    return req


# ---------------------------------------------------------------------------------------------
# found again by name


def job_name(job_id: str) -> str:
    """The name a job was submitted under: its id without the ``.<suffix>`` (the CLI's
    ``NAME.<8 hex>``, the bridge's ``GROUP.<digest>``)."""
    return job_id.rsplit(".", 1)[0]


def claims_named(records: dict[str, RequestRecord], ref: PodRef) -> list[RequestRecord]:
    """The claim requests of claim ``ref``, newest first."""
    found = [
        r
        for r in records.values()
        if r.request.claim is not None
        and (r.request.pod.namespace, r.request.pod.name) == (ref.namespace, ref.name)
    ]
    return sorted(found, key=lambda r: r.request.created_at, reverse=True)


def jobs_named(records: dict[str, JobRecord], ref: PodRef) -> list[JobRecord]:
    """The job records of job ``ref`` (namespace and name), newest first."""
    found = [
        r for r in records.values() if r.job.namespace == ref.namespace and job_name(r.job.job_id) == ref.name
    ]
    return sorted(found, key=lambda r: r.job.created_at, reverse=True)
