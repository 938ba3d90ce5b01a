"""Pods of one job, gathered before the job is requested (pure: no I/O).

A pod belongs to a job when it carries a group label Tandem knows, and the job's size is known:

* Tandem's own: label ``tandem.io/job: NAME`` and annotation ``tandem.io/job-size: N``
  (optional ``tandem.io/job-index: I``, 0-based);
* LeaderWorkerSet: label ``leaderworkerset.sigs.k8s.io/name`` with ``.../group-index`` (one
  group = one job), annotation ``leaderworkerset.sigs.k8s.io/size`` and label
  ``.../worker-index`` (0 = the leader) — what the LWS controller puts on every pod of a group;
* JobSet: label ``jobset.sigs.k8s.io/jobset-name`` (one JobSet = one job) with the size given
  by ``tandem.io/job-size`` (a pod does not carry the JobSet's total pod count), index from
  ``batch.kubernetes.io/job-completion-index`` when the Jobs are Indexed.

Optional annotations on the pods: ``tandem.io/job-fabric`` (a fabric tier, e.g. ``leaf``),
``tandem.io/job-fabric-policy`` (``required``/``preferred``), ``tandem.io/job-nvlink-domain``
(``required``/``preferred``).

The bridge adds every gated pod of a job to a :class:`Gatherer` and requests the job once all
``N`` pods exist (:func:`job_request`); until then nothing is requested, so nothing is held.
Every pod must ask the same devices (the job request has one per-pod template); pods that
differ make the job invalid, with a message naming the pods. The job id is derived from the
group and its pods' UIDs, so the same pods always make the same id (a bridge restart requests
the same job, which the allocator answers from its record) and a job re-created with new pods
gets a new id.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, JobRequest
from services.admission import names
from services.admission.errors import PolicyError
from services.admission.podrules import PodView, allocation_request, pod_ref

JOB = f"{names.PREFIX}job"
JOB_SIZE = f"{names.PREFIX}job-size"
JOB_INDEX = f"{names.PREFIX}job-index"
JOB_FABRIC = f"{names.PREFIX}job-fabric"
JOB_FABRIC_POLICY = f"{names.PREFIX}job-fabric-policy"
JOB_NVLINK_DOMAIN = f"{names.PREFIX}job-nvlink-domain"
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_SIZE = "leaderworkerset.sigs.k8s.io/size"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
MAX_JOB_SIZE = 1024

EVENT_REASON_WAITING = "TandemJobIncomplete"
EVENT_REASON_INVALID = "InvalidTandemJob"


@dataclass(frozen=True)
class Membership:
    """Which job a pod is in: ``group`` (unique in its namespace), the job's ``size``, and the
    pod's ``index`` when its controller numbers pods."""

    group: str
    size: int
    index: int | None


def _int(value: str | None, *, key: str, low: int, high: int) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise PolicyError(f"annotation {key}: {value!r} is not a whole number") from None
    if not low <= n <= high:
        raise PolicyError(f"annotation {key}: {n} is outside {low}..{high}")
    return n


def membership(pod: PodView) -> Membership | None:
    """The job ``pod`` belongs to, or None for a pod placed alone. Raises
    :class:`PolicyError` naming the label or annotation that is wrong."""
    labels, ann = pod.labels, pod.annotations
    size = _int(ann.get(JOB_SIZE), key=JOB_SIZE, low=1, high=MAX_JOB_SIZE)
    if JOB in labels:
        if size is None:
            raise PolicyError(f"pod is in job {labels[JOB]!r} (label {JOB}) but has no {JOB_SIZE} annotation")
        index = _int(ann.get(JOB_INDEX), key=JOB_INDEX, low=0, high=size - 1)
        return Membership(group=f"job/{labels[JOB]}", size=size, index=index)
    if LWS_NAME in labels and LWS_GROUP in labels:
        lws_size = _int(ann.get(LWS_SIZE), key=LWS_SIZE, low=1, high=MAX_JOB_SIZE)
        if lws_size is None:
            return None  # not an LWS-managed pod after all
        index = _int(labels.get(LWS_WORKER), key=LWS_WORKER, low=0, high=lws_size - 1)
        return Membership(group=f"lws/{labels[LWS_NAME]}/{labels[LWS_GROUP]}", size=lws_size, index=index)
    if JOBSET_NAME in labels and size is not None:
        index = _int(
            labels.get(COMPLETION_INDEX) or ann.get(COMPLETION_INDEX), key=COMPLETION_INDEX, low=0, high=10**6
        )
        return Membership(group=f"jobset/{labels[JOBSET_NAME]}", size=size, index=index)
    return None


def job_id(namespace: str, group: str, uids: list[str]) -> str:
    """Stable for the same pods; fits the wire's id pattern (``[A-Za-z0-9_=.-]``)."""
    name = re.sub(r"[^A-Za-z0-9_=.-]", "-", group.split("/", 1)[1])[:80]
    digest = hashlib.sha256("\0".join([namespace, group, *sorted(uids)]).encode()).hexdigest()[:16]
    return f"{name}.{digest}"


def _template(req: AllocationRequest) -> tuple[object, ...]:
    return (
        req.gpus,
        req.rdma,
        req.scope,
        req.policy,
        req.pairing,
        req.device_class,
        req.priority,
        tuple(sorted(req.node_selector.items())),
        req.network,
    )


def _choice(pods: list[PodView], key: str, allowed: tuple[str, ...]) -> str | None:
    values = {p.annotations[key] for p in pods if key in p.annotations}
    if len(values) > 1:
        raise PolicyError(f"the job's pods disagree on annotation {key}: {', '.join(sorted(values))}")
    value = next(iter(values), None)
    if value is not None and allowed and value not in allowed:
        raise PolicyError(f"annotation {key}: {value!r} is not one of {', '.join(allowed)}")
    return value


def job_request(
    pods: list[PodView],
    *,
    device_classes: dict[str, DeviceClass],
    request_of: Callable[[PodView], AllocationRequest | None] | None = None,
) -> JobRequest:
    """The job of ``pods`` (all of it, ordered by index, then name). Raises
    :class:`PolicyError` when the pods do not make one valid job. ``request_of`` reads one
    pod's request (default: its ``tandem.io/*`` resources; :mod:`.drajobs` reads its claims)."""
    if not pods:
        raise PolicyError("a job needs at least one pod")
    ordered = sorted(pods, key=_order)
    first = ordered[0]
    m = membership(first)
    assert m is not None
    indices = [membership(p).index for p in ordered]  # type: ignore[union-attr]
    given = [i for i in indices if i is not None]
    if len(set(given)) != len(given):
        raise PolicyError(f"two pods of job {m.group} have the same index")
    reqs: list[AllocationRequest] = []
    for p in ordered:
        r = request_of(p) if request_of is not None else allocation_request(p, device_classes=device_classes)
        if r is None:
            raise PolicyError(f"pod {p.metadata.name} of job {m.group} asks no Tandem devices")
        reqs.append(r)
    base = _template(reqs[0])
    odd = [p.metadata.name or "?" for p, r in zip(ordered, reqs, strict=True) if _template(r) != base]
    if odd:
        raise PolicyError(
            f"the pods of job {m.group} must ask the same devices; {', '.join(odd[:5])} differ from "
            f"{first.metadata.name}"
        )
    r0 = reqs[0]
    namespace = first.metadata.namespace or ""
    fabric_policy = _choice(ordered, JOB_FABRIC_POLICY, ("required", "preferred")) or "preferred"
    nvlink = _choice(ordered, JOB_NVLINK_DOMAIN, ("required", "preferred"))
    return JobRequest(
        job_id=job_id(namespace, m.group, [p.metadata.uid or "" for p in ordered]),
        pods=len(ordered),
        gpus=r0.gpus,
        rdma=r0.rdma,
        namespace=namespace,
        scope=r0.scope,
        policy=r0.policy,
        pairing=r0.pairing,
        device_class=r0.device_class,
        priority=r0.priority,
        node_selector=r0.node_selector,
        network=r0.network,
        fabric=_choice(ordered, JOB_FABRIC, ()),
        fabric_policy=fabric_policy,  # type: ignore[arg-type]
        nvlink_domain=nvlink,  # type: ignore[arg-type]
        members=[pod_ref(p) for p in ordered],
    )


def _order(p: PodView) -> tuple[int, str]:
    m = membership(p)
    index = m.index if m is not None and m.index is not None else 10**9
    return (index, p.metadata.name or "")


@dataclass
class _Group:
    size: int
    since: float
    pods: dict[str, PodView] = field(default_factory=dict)  # uid → pod
    requested: str | None = None  # the job id, once requested


class Gatherer:
    """The gated pods of each job seen so far, per ``(namespace, group)``."""

    def __init__(self) -> None:
        self.groups: dict[tuple[str, str], _Group] = {}

    def add(self, pod: PodView, m: Membership, *, now: float) -> tuple[tuple[str, str], list[PodView] | None]:
        """Add a pod; returns its group key and, when the job is complete and not requested
        yet, all its pods."""
        key = (pod.metadata.namespace or "", m.group)
        g = self.groups.get(key)
        if g is None or g.size != m.size:
            g = self.groups[key] = _Group(size=m.size, since=now)
        g.pods[pod.metadata.uid or ""] = pod
        if g.requested is None and len(g.pods) >= g.size:
            return key, list(g.pods.values())[: g.size] if len(g.pods) == g.size else None
        return key, None

    def requested(self, key: tuple[str, str], job: str) -> None:
        self.groups[key].requested = job

    def remove(self, pod: PodView) -> tuple[str | None, list[PodView]]:
        """Forget a pod (deleted or finished); returns the job id it was requested under
        (None when its job was never requested) and the pods left in its group."""
        uid = pod.metadata.uid or ""
        for key, g in list(self.groups.items()):
            if uid in g.pods:
                del g.pods[uid]
                job = g.requested
                if not g.pods:
                    del self.groups[key]
                return job, list(g.pods.values())
        return None, []

    def reopen(self, job: str) -> None:
        """Job ``job`` was cancelled before it was placed: its pods left form a new job once
        the group is complete again (new pods, so a new job id)."""
        for g in self.groups.values():
            if g.requested == job:
                g.requested = None

    def job_of(self, job: str) -> list[PodView]:
        for g in self.groups.values():
            if g.requested == job:
                return list(g.pods.values())
        return []

    def waiting(self, *, now: float, timeout: float) -> list[tuple[str, int, list[PodView]]]:
        """Groups still missing pods after ``timeout`` seconds: (group, size, pods present)."""
        return [
            (group, g.size, list(g.pods.values()))
            for (_, group), g in self.groups.items()
            if g.requested is None and len(g.pods) < g.size and now - g.since >= timeout
        ]
