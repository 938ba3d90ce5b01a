"""The DRA bridge's jobs: the pods of one job through claims, requested once and placed all or
nothing (docs/dra.md, "Jobs"; the rules are :mod:`.drajobs`, pure).

* a gated pod of a job whose claims all exist joins its job's :class:`~.jobwatch.Gatherer`;
  nothing is requested, nothing held, while a pod of the job is missing;
* once all ``N`` pods are there, each pod's Tandem claims are read into its request
  (:func:`.drapods.pod_request`), the job is made of them (:func:`.drajobs.job_request`; pods
  that differ make it invalid: an Event on every pod), pod ``i``'s claims get Tandem's finalizer
  and the request id ``JOB/i`` (before anything is requested, as for one pod), and **one**
  ``alloc.job`` is published;
* each pod's ``Assignment`` (``JOB/i``) goes the single pod's way (:meth:`.DraBridge.apply`):
  its claims' allocation on that pod's node, then the gate removed; kube-scheduler binds it;
* a pod's claims ended → :func:`.drajobs.release_step` on the job record: that pod released
  alone (its ``Freed`` lets the claims go), the job cancelled when it is not placed yet, or the
  claims let go when nothing is held;
* a restarted bridge finds the claims carrying ``JOB/i`` for the same pods (the same job id):
  the job record says where the job stands, and a committed job's pods still gated are written
  from their nodes' allocation records instead of requesting the job again.

Everything runs under the DRA bridge's lock, through its claim cache and writers (``Host``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from nats.js.errors import KeyNotFoundError

from schemas import codec, subjects
from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, Assignment, JobRecord, JobRequest, PodRef
from services.admission import drajobs, drapods, jobwatch, names, podrules
from services.admission.draclaims import is_tandems
from services.admission.errors import InvalidClaim, InvalidPod, PolicyError
from services.kube.errors import Conflict, KubeError, NotFound
from services.runtime.nats.bus import Bus, Retry
from services.runtime.observe.logging import get_logger

log = get_logger(__name__)

Obj = dict[str, Any]
Key = tuple[str, str]


class Host(Protocol):
    """What the jobs need of :class:`~.drabridge.DraBridge` (its cache, writers and events)."""

    kube: Any
    bus: Bus
    device_classes: dict[str, DeviceClass]
    claims: dict[Key, Obj]
    waiting: dict[str, Key]
    by_request: dict[str, set[Key]]

    def store(self, obj: Obj) -> Obj: ...

    async def let_go(self, obj: Obj) -> None: ...

    async def deallocate_all(self, held: list[Obj], rid: str) -> bool: ...

    async def publish_release(
        self, obj: Obj | None, rid: str, *, reason: str, pod: PodRef | None = None, node: str | None = None
    ) -> None: ...

    async def pod_event(self, pod: podrules.PodView, reason: str, message: str) -> None: ...

    async def apply(self, a: Assignment, raw: Obj) -> None: ...

    async def assignment_from_record(self, node: str, rid: str) -> Assignment | None: ...


class DraJobs:
    def __init__(self, host: Host, *, clock: Callable[[], float] = time.time) -> None:
        self.host = host
        self.clock = clock
        self.gather = jobwatch.Gatherer()
        self.cancelled: set[str] = set()  # jobs cancelled by the bridge: late assignments not applied

    def claims_of(self, job_id: str) -> list[Obj]:
        """The claims held by any pod of job ``job_id``."""
        h = self.host
        return [
            h.claims[k] for rid, keys in h.by_request.items() if rid.startswith(f"{job_id}/") for k in keys
        ]

    async def judge(
        self, pod: podrules.PodView, raw: Obj, objs: Sequence[Obj], member: jobwatch.Membership
    ) -> None:
        """A gated pod of a job whose claims all exist (``objs``, Tandem's among them)."""
        h = self.host
        tandem = [o for o in objs if is_tandems(drapods.spec_of(o))]
        problem = drajobs.own_claims_problem(pod, tandem)
        if problem is not None:
            await h.pod_event(pod, jobwatch.EVENT_REASON_INVALID, f"job {member.group}: {problem}")
            return
        if await self._placed_before(raw, tandem):
            return
        key, complete = self.gather.add(pod, member, now=self.clock())
        if complete is None:
            log.info(
                "dra_job_waiting",
                job=member.group,
                namespace=pod.metadata.namespace,
                pod=pod.metadata.name,
                size=member.size,
            )
            return
        if not any(names.GATE in p.gates for p in complete):
            return
        await self._request(key, complete)

    def _tandem_claims(self, pod: podrules.PodView) -> list[Obj] | None:
        ns = pod.metadata.namespace or ""
        out = []
        for ref in drapods.claim_refs(pod):
            obj = self.host.claims.get((ns, ref.claim)) if ref.claim else None
            if obj is None:
                return None  # deleted since the pod joined: its pod's end comes next
            if is_tandems(drapods.spec_of(obj)):
                out.append(obj)
        return out

    async def _request(self, key: tuple[str, str], pods: list[podrules.PodView]) -> None:
        h = self.host
        claims: dict[str, list[Obj]] = {}
        for p in pods:
            found = self._tandem_claims(p)
            if found is None:
                return
            claims[p.metadata.uid or ""] = found
        try:
            job = drajobs.job_request(pods, self._requests(pods, claims), device_classes=h.device_classes)
        except (InvalidClaim, PolicyError, InvalidPod) as exc:
            for p in pods:
                await h.pod_event(p, jobwatch.EVENT_REASON_INVALID, str(exc))
            return
        if await self._already_requested(job, claims):
            self.gather.requested(key, job.job_id)
            return
        for i, ref in enumerate(job.members):
            rid = job.pod_id(i)
            for obj in claims[ref.uid]:
                if drapods.held_by(obj) == rid:
                    continue
                claim = drapods.read_claim(obj)
                ns, name = claim.namespace, claim.name
                try:
                    h.store(
                        await h.kube.replace_resource_claim(
                            ns, name, drapods.held(obj, request_id=rid, pod=ref.name)
                        )
                    )
                except (Conflict, NotFound):
                    # Changed or gone meanwhile: the claim's event wakes its pod, which completes
                    # the job again.
                    h.waiting[ref.uid] = (ref.namespace, ref.name)
                    return
                except KubeError as exc:
                    log.warning("dra_claim_not_held", claim=f"{ns}/{name}", error=str(exc))
                    return
        await h.bus.publish(subjects.ALLOC_JOB, job, msg_id=subjects.msg_id("job", job.job_id))
        self.gather.requested(key, job.job_id)
        log.info("dra_job_requested", job=job.job_id, namespace=job.namespace, pods=job.pods)

    def _requests(
        self, pods: list[podrules.PodView], claims: Mapping[str, list[Obj]]
    ) -> dict[str, AllocationRequest | None]:
        out: dict[str, AllocationRequest | None] = {}
        for p in pods:
            uid = p.metadata.uid or ""
            made = drapods.pod_request(
                p,
                [drapods.read_claim(o) for o in claims[uid]],
                device_classes=self.host.device_classes,
                pin=None,
            )
            out[uid] = made[0] if made is not None else None
        return out

    async def _placed_before(self, raw: Obj, tandem: Sequence[Obj]) -> bool:
        """The pod's claims carry a job's pod id this bridge did not request (a restart, or a
        gate removal that failed): a committed job's pod its node holds is written from the
        node's record, alone — its job's other pods may be bound and gone from the gathering."""
        rids = {drapods.held_by(o) for o in tandem}
        rid = next(iter(rids)) if len(rids) == 1 else None
        if rid is None or not drajobs.is_job_pod(rid):
            return False
        job_id, index = drajobs.split(rid)
        if self.gather.job_of(job_id):
            return False  # requested by this bridge: its assignment is on its way
        record = await self.record(job_id)
        if record is None or record.state != "committed" or index >= len(record.placement):
            return False
        a = await self.host.assignment_from_record(record.placement[index], rid)
        if a is None:
            return False
        with contextlib.suppress(Retry):
            await self.host.apply(a, raw)
        return True

    async def _already_requested(self, job: JobRequest, claims: Mapping[str, list[Obj]]) -> bool:
        """The claims already carry this job's pod ids (a restart): its record says where it
        stands, and a job not placed, placed or refused is not requested again."""
        marked = all(
            drapods.held_by(o) == job.pod_id(i) for i, ref in enumerate(job.members) for o in claims[ref.uid]
        )
        record = await self.record(job.job_id) if marked else None
        return record is not None and record.state in (*drajobs.NOT_PLACED, "committed", "rejected")

    async def release_if_ended(self, rid: str, held: list[Obj], *, reason: str) -> None:
        """Pod ``rid``'s (``JOB/i``) claims are all done with their devices (the DRA bridge checked)."""
        h = self.host
        job_id, index = drajobs.split(rid)
        record = await self.record(job_id)
        node = None
        if record is not None and record.state == "committed" and index < len(record.placement):
            node = record.placement[index]
        on_node = node is not None and await h.assignment_from_record(node, rid) is not None
        step = drajobs.release_step(record, index, on_node=on_node)
        pod = _pod_of(held[0], rid)
        if step == "let_go":
            for obj in held:
                await h.let_go(obj)
        elif step == "cancel_job":
            self.cancelled.add(job_id)
            self.gather.reopen(job_id)  # the pods left form a new job once the missing one is back
            why = f"{reason}: a pod of job {job_id} ended before the job was placed"
            await h.publish_release(held[0], job_id, reason=why, pod=pod)
            for obj in held:  # nothing was allocated; the allocator holds a job's devices itself
                await h.let_go(obj)
        elif await h.deallocate_all(held, rid):
            await h.publish_release(held[0], rid, reason=reason, pod=pod, node=node)

    async def record(self, job_id: str) -> JobRecord | None:
        kv = await self.host.bus.kv(subjects.KV_JOBS)
        try:
            entry = await kv.get(subjects.kv_key(job_id))
        except KeyNotFoundError:
            return None
        return codec.JOB_RECORD.decode(entry.value) if entry.value else None


def _pod_of(obj: Obj, rid: str) -> PodRef:
    """The pod a claim held for ``rid`` was marked for (name annotation, owner uid)."""
    meta = obj.get("metadata") or {}
    name = str((meta.get("annotations") or {}).get(names.DRA_POD) or rid)
    uid = next(
        (str(o["uid"]) for o in meta.get("ownerReferences") or [] if o.get("kind") == "Pod" and o.get("uid")),
        "",
    )
    return PodRef(namespace=str(meta.get("namespace") or ""), name=name, uid=uid)
