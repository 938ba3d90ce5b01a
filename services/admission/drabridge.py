"""The pod bridge's DRA half: a pod's ResourceClaims ⇄ allocation messages (docs/dra.md).

Rules are pure (:mod:`.draclaims` reads claims and writes allocations, :mod:`.drapods` the pod
around them); this module applies them:

* every ``resource.k8s.io/v1`` ResourceClaim is listed and watched (cluster-wide) into a cache;
* a gated pod whose claims ask Tandem's classes (the webhook gated it) waits until every claim
  it names exists (the resourceclaim controller makes them from templates), then its Tandem
  claims not yet allocated get Tandem's finalizer and the request id (annotations) and become
  **one** ``alloc.request`` (``<pod uid>.1``, the same allocator core and commit path as every
  pod). A claim already allocated (shared by several pods) is reused: the pod's other claims are
  pinned to its node; a pod whose claims are all allocated, or none Tandem's, is just let go;
* ``alloc.assigned`` for such a pod → each claim's ``status.allocation``, *then* the gate is
  removed, so kube-scheduler finds the claims allocated and binds the pod to their node;
* the pods of a job (:func:`.jobwatch.membership`) are requested together, as one ``alloc.job``
  once all exist, each pod's claims held under its pod id ``JOB/i`` and released through the
  job record (:mod:`.drajobbridge`);
* ``alloc.failed`` or a claim Tandem refuses → a Warning Event on the pod and on each claim (a
  ResourceClaim's status has no conditions), in the allocator's words (``tandem explain``);
* a held claim deleted (its pod's end, for a claim made from a template) or left without a
  consumer (no pod reserved for it, none alive that names it: a claim shared by pods, after its
  last pod) → ``alloc.release`` of its request once every claim that request holds is (their
  devices were chosen together) → the node agent's verified cleanup → ``Freed`` (durable
  consumer) → Tandem's finalizer removed. A claim without a consumer is first deallocated at
  the version read again, so a pod that reserved it meanwhile keeps it (the write gets a 409);
  a pod naming it after that waits until ``Freed`` and gets it allocated anew. Until then the
  claim is held.

State lives in the claims (finalizer, annotations, allocation) and the request records, so a
restarted bridge rebuilds it: the claims are listed before the pods are judged, a pod whose
claims already carry its request is not requested again (its record says where it stands), and
a deleted claim whose request is already freed is let go at once. One lock serialises the
handlers, which all read and write the one claim cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol

from nats.js.errors import KeyNotFoundError

from schemas import codec, subjects
from schemas.config import DeviceClass
from schemas.messages import AllocationFailed, Assignment, Freed, PodRef, Release, RequestRecord
from services.admission import drajobs, drapods, jobwatch, names, podrules
from services.admission.draclaims import allocations, is_tandems, pod_devices
from services.admission.drajobbridge import DraJobs
from services.admission.errors import InvalidClaim, InvalidPod, PolicyError
from services.kube.errors import Conflict, KubeError, NotFound
from services.kube.relist import list_then_watch
from services.runtime.nats.bus import Bus, Retry
from services.runtime.observe.logging import get_logger
from services.runtime.observe.tracing import context_from_traceparent, tracer

log = get_logger(__name__)

Obj = dict[str, Any]
Key = tuple[str, str]
ACTIVE_STATES = frozenset({"pending", "deciding", "assigned"})
RecordEvent = Callable[..., Awaitable[None]]


class ClaimApi(Protocol):
    """The Kubernetes calls of the DRA bridge (:class:`services.kube.client.KubeClient`)."""

    async def list_resource_claims(self) -> tuple[list[Obj], str]: ...

    def watch_resource_claims(
        self, *, resource_version: str, timeout_s: int
    ) -> AsyncIterator[tuple[str, Obj]]: ...

    async def get_resource_claim(self, namespace: str, name: str) -> Obj: ...

    async def replace_resource_claim(self, namespace: str, name: str, body: Obj) -> Obj: ...

    async def patch_resource_claim_status(self, namespace: str, name: str, patch: Obj) -> Obj: ...

    async def get_pod(self, namespace: str, name: str) -> Obj: ...

    async def patch_pod(self, namespace: str, name: str, patch: Obj) -> Obj: ...


def _key(obj: Obj) -> Key:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


class DraBridge:
    def __init__(
        self,
        *,
        kube: ClaimApi,
        bus: Bus,
        device_classes: dict[str, DeviceClass],
        record_event: RecordEvent,
        watch_timeout: int = 300,
        relist_backoff: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self.bus = bus
        self.device_classes = device_classes
        self.record_event = record_event
        self.watch_timeout = watch_timeout
        self.relist_backoff = relist_backoff
        self.claims: dict[Key, Obj] = {}
        self.by_request: dict[str, set[Key]] = {}  # the claims each request holds (index)
        self.waiting: dict[str, Key] = {}  # gated pods (uid → namespace, name) waiting for claims
        self._requested: set[str] = set()
        self._released: set[str] = set()
        # Live pods naming each claim (claim → pod uids; pod uid → its claims and its ref): a
        # claim no pod is reserved for is deallocated only once none of these is left either.
        self._users: dict[Key, set[str]] = {}
        self._claims_of_pod: dict[str, tuple[PodRef, frozenset[Key]]] = {}
        self._pods_synced = False  # the index above is trusted only after the pods' first list
        self._lock = asyncio.Lock()
        self._tracer = tracer("tandem.bridge")
        self.jobs = DraJobs(self, clock=clock)  # pods of a job: placed together (drajobbridge)
        self.synced = asyncio.Event()
        """Set after the first list of claims (or after finding no resource.k8s.io/v1)."""

    # -- watching ------------------------------------------------------------------------------

    async def watch(
        self, stop: asyncio.Event, *, records: Callable[[], Awaitable[dict[str, RequestRecord]]]
    ) -> None:
        """List + resync, then watch; on any watch end, do it again. A cluster without DRA
        (404) is looked at again every 30 s, and pods are not held up meanwhile."""
        recs: dict[str, RequestRecord] = {}

        async def listed() -> tuple[list[Obj], str]:
            nonlocal recs
            recs = await records()  # the records first: a claim listed after is no surprise
            return await self.kube.list_resource_claims()

        await list_then_watch(
            stop,
            listed=listed,
            resync=lambda items: self.resync(items, recs),
            watch=lambda version: self.kube.watch_resource_claims(
                resource_version=version, timeout_s=self.watch_timeout
            ),
            on_event=self.on_claim_event,
            synced=self.synced,
            backoff=self.relist_backoff,
            name="dra_claim",
            absent_hint="resource.k8s.io/v1 is not served",
        )

    async def resync(self, items: list[Obj], records: dict[str, RequestRecord]) -> None:
        async with self._lock:
            self.claims, self.by_request = {}, {}
            for obj in items:
                self.store(obj)
            for rid in sorted(self.by_request):
                await self._release_if_ended(rid, reason="claims deleted or unused", records=records)
            await self._wake(None)

    async def pods_resynced(self, live: set[str]) -> None:
        """The pod bridge listed every managed pod (``live``, their uids; each was handed to
        :meth:`on_pod_event` first): the pods gone meanwhile stop counting as users, and every
        request whose claims no pod uses any more is released."""
        async with self._lock:
            for uid in [u for u in self._claims_of_pod if u not in live]:
                self._forget_user(uid)
            self._pods_synced = True
            for rid in sorted(self.by_request):
                await self._release_if_ended(rid, reason="no pod uses the claims any more")

    def consumers(self, request_id: str) -> list[PodRef] | None:
        """Every pod using the claims ``request_id`` holds (reserved for, or naming them while
        alive), or None when it holds no claim: a victim of preemption is all of them, since
        the claims' devices come back only once no pod uses them."""
        keys = self.by_request.get(request_id)
        if not keys:
            return None
        found: dict[str, PodRef] = {}
        for key in sorted(keys):
            for ref in drapods.reserved_for(self.claims[key]):
                found.setdefault(ref.uid, ref)
            for uid in sorted(self._users.get(key, ())):
                found.setdefault(uid, self._claims_of_pod[uid][0])
        return list(found.values())

    def holds(self, request_id: str) -> bool:
        """Whether ``request_id`` holds devices of DRA claims (its pod's end frees nothing)."""
        return bool(self.by_request.get(request_id))

    def _held(self, request_id: str) -> list[Obj]:
        return [self.claims[k] for k in sorted(self.by_request.get(request_id, ()))]

    def store(self, obj: Obj) -> Obj:
        """Cache a claim as the API server returned it (and index who holds it)."""
        key = _key(obj)
        self._drop(key)
        self.claims[key] = obj
        rid = drapods.held_by(obj)
        if rid is not None:
            self.by_request.setdefault(rid, set()).add(key)
        return obj

    def _drop(self, key: Key) -> None:
        old = self.claims.pop(key, None)
        rid = drapods.held_by(old) if old is not None else None
        if rid is not None:
            keys = self.by_request.get(rid, set())
            keys.discard(key)
            if not keys:
                self.by_request.pop(rid, None)

    async def on_claim_event(self, kind: str, obj: Obj) -> None:
        key = _key(obj)
        async with self._lock:
            if kind == "DELETED":
                self._drop(key)
                return
            if _older(obj, self.claims.get(key)):
                return  # the watch is behind this bridge's own write of the claim
            self.store(obj)
            rid = drapods.held_by(obj)
            if rid is not None:
                reason = "claim deleted" if drapods.is_deleting(obj) else "no pod uses the claim any more"
                await self._release_if_ended(rid, reason=reason)
            await self._wake(key[0], owner=_owner_pod(obj))

    # -- pods ------------------------------------------------------------------------------------

    async def on_pod_event(self, kind: str, pod: podrules.PodView, raw: Obj) -> None:
        async with self._lock:
            uid = pod.metadata.uid or ""
            if kind == "DELETED" or pod.terminal:
                self.waiting.pop(uid, None)
                self.jobs.gather.remove(pod)
                named = self._forget_user(uid)
                await self._pod_ended(pod)
                # Its claims may have no consumer left (the claim's own event can come first).
                for rid in sorted({r for k in named if (r := self._holder(k)) is not None}):
                    await self._release_if_ended(rid, reason="the last pod using the claims ended")
                return
            self._note_user(pod)
            if names.GATE not in pod.gates or pod.metadata.deletionTimestamp:
                self.waiting.pop(uid, None)
                return
            await self._judge(pod, raw)

    def _note_user(self, pod: podrules.PodView) -> None:
        uid, ns = pod.metadata.uid or "", pod.metadata.namespace or ""
        keys = frozenset((ns, ref.claim) for ref in drapods.claim_refs(pod) if ref.claim)
        self._forget_user(uid)
        self._claims_of_pod[uid] = (podrules.pod_ref(pod), keys)
        for key in keys:
            self._users.setdefault(key, set()).add(uid)

    def _forget_user(self, uid: str) -> frozenset[Key]:
        """Take a pod out of the users index; the claims it named."""
        _, keys = self._claims_of_pod.pop(uid, (None, frozenset[Key]()))
        for key in keys:
            users = self._users.get(key, set())
            users.discard(uid)
            if not users:
                self._users.pop(key, None)
        return keys

    def _holder(self, key: Key) -> str | None:
        obj = self.claims.get(key)
        return drapods.held_by(obj) if obj is not None else None

    async def _wake(self, namespace: str | None, *, owner: str | None = None) -> None:
        """Judge again the pods waiting for claims (of ``namespace``; None: all). A claim made
        from a template belongs to one pod (``owner``, its uid): only that pod can have been
        waiting for it, so only it is read again, not every waiting pod of the namespace."""
        for uid, (ns, name) in list(self.waiting.items()):
            if namespace is not None and ns != namespace:
                continue
            if owner is not None and uid != owner:
                continue
            try:
                raw = await self.kube.get_pod(ns, name)
            except NotFound:
                self.waiting.pop(uid, None)
                continue
            pod = drapods.pod_from(raw)
            if pod is None or pod.metadata.uid != uid or names.GATE not in pod.gates:
                self.waiting.pop(uid, None)
                continue
            await self._judge(pod, raw)

    async def _claims_of(self, pod: podrules.PodView) -> list[Obj] | None:
        """Every claim the pod names, or None while one is not made (or not seen) yet."""
        ns = pod.metadata.namespace or ""
        out = []
        for ref in drapods.claim_refs(pod):
            obj = self.claims.get((ns, ref.claim)) if ref.claim else None
            if obj is None:
                return None
            out.append(obj)
        return out

    async def _judge(self, pod: podrules.PodView, raw: Obj) -> None:
        uid, ns = pod.metadata.uid or "", pod.metadata.namespace or ""
        objs = await self._claims_of(pod)
        if objs is None:
            self.waiting[uid] = (ns, pod.metadata.name or "")
            return
        tandem = [o for o in objs if is_tandems(drapods.spec_of(o))]
        try:
            member = jobwatch.membership(pod) if tandem else None
        except PolicyError as exc:
            await self.pod_event(pod, jobwatch.EVENT_REASON_INVALID, str(exc))
            return
        if member is not None:
            self.waiting.pop(uid, None)
            await self.jobs.judge(pod, raw, objs, member)  # placed with its job, all or nothing
            return
        rid = podrules.request_id_for(uid)
        todo = [o for o in tandem if not drapods.is_allocated(o)]
        nodes = {drapods.allocated_node(o) for o in tandem if drapods.is_allocated(o)}
        if len(nodes) > 1:
            await self.pod_event(
                pod,
                names.EVENT_REASON_INVALID,
                "the pod's ResourceClaims are allocated on different nodes"
                f" ({', '.join(sorted(map(str, nodes)))}); a pod runs on one node",
            )
            return
        holders = {drapods.held_by(o) for o in todo} - {None}
        if holders - {rid}:
            # A shared claim being allocated for another pod: this one waits for that.
            self.waiting[uid] = (ns, pod.metadata.name or "")
            return
        self.waiting.pop(uid, None)
        if not todo:
            await self._ungate(pod, raw, assignment=None)
            return
        if all(drapods.held_by(o) == rid for o in todo) and await self._already_requested(rid, raw):
            return
        await self._request(pod, todo, pin=next(iter(nodes), None))

    async def _already_requested(self, rid: str, raw: Obj) -> bool:
        """Requested before (this run, or before a restart: the claims carry the request id):
        the request record says where it stands; an assigned one is applied from its node's
        allocation record."""
        if rid in self._requested:
            return True
        record = await self._record(rid)
        if record is None or record.state not in (*ACTIVE_STATES, "rejected"):
            return False
        self._requested.add(rid)  # a rejected one is not asked again: its Events say why
        if record.state == "assigned" and record.node:
            assignment = await self.assignment_from_record(record.node, rid)
            if assignment is not None:
                with contextlib.suppress(Retry):
                    await self.apply(assignment, raw)
        return True

    async def _request(self, pod: podrules.PodView, todo: list[Obj], *, pin: str | None) -> None:
        try:
            made = drapods.pod_request(
                pod, [drapods.read_claim(o) for o in todo], device_classes=self.device_classes, pin=pin
            )
        except (InvalidClaim, PolicyError, InvalidPod) as exc:
            await self.pod_event(pod, names.EVENT_REASON_INVALID, str(exc))
            for obj in todo:
                await self._claim_event(obj, names.EVENT_REASON_CLAIM_INVALID, str(exc))
            return
        if made is None:
            return
        req, _ = made
        rid = req.request_id
        for obj in todo:
            if drapods.held_by(obj) == rid:
                continue
            ns, name = _key(obj)
            try:
                body = drapods.held(obj, request_id=rid, pod=pod.metadata.name or "")
                self.store(await self.kube.replace_resource_claim(ns, name, body))
            except (Conflict, NotFound):
                return  # changed or gone meanwhile: its watch event brings the pod back here
            except KubeError as exc:
                log.warning("dra_claim_not_held", claim=f"{ns}/{name}", error=str(exc))
                await self.pod_event(pod, names.EVENT_REASON_FAILED, f"ResourceClaim {ns}/{name}: {exc}")
                return
        # In the pod's trace (the webhook's span), as the pod bridge's requests are.
        parent = context_from_traceparent(pod.annotations.get(names.TRACEPARENT))
        with self._tracer.start_as_current_span("bridge.request", context=parent) as span:
            span.set_attribute("tandem.request_id", rid)
            span.set_attribute("tandem.dra.claims", len(todo))
            await self.bus.publish(subjects.ALLOC_REQUEST, req, msg_id=subjects.msg_id("request", rid))
        self._requested.add(rid)
        log.info(
            "dra_requested", request_id=rid, namespace=req.pod.namespace, pod=req.pod.name, claims=len(todo)
        )

    async def _pod_ended(self, pod: podrules.PodView) -> None:
        """A pod gone before its request was placed: the request is cancelled (its claims' holds
        go with the ``Freed`` that answers). Allocated claims keep their devices until no pod
        uses them (:meth:`_release_if_ended`)."""
        rid = podrules.request_id_for(pod.metadata.uid or "")
        held = self._held(rid)
        if held and not all(drapods.is_allocated(o) for o in held):
            await self.publish_release(held[0], rid, reason="pod ended before its claims were allocated")

    async def _ungate(self, pod: podrules.PodView, raw: Obj, *, assignment: Assignment | None) -> bool:
        """Remove the gate; False when the pod changed since ``raw`` (its next event, or the
        outcome's redelivery, comes back here)."""
        if names.GATE not in pod.gates:
            return True
        ns, name = pod.metadata.namespace or "", pod.metadata.name or ""
        try:
            await self.kube.patch_pod(ns, name, drapods.ungate_patch(raw, assignment))
        except Conflict:
            return False
        except NotFound:
            return True
        log.info("dra_pod_released_to_scheduler", namespace=ns, pod=name)
        return True

    # -- outcomes --------------------------------------------------------------------------------

    async def on_assignment(self, a: Assignment, raw: Obj) -> None:
        """Devices chosen for a pod with claims: write each claim's allocation, then let the pod go."""
        await self.synced.wait()
        async with self._lock:
            await self.apply(a, raw)

    async def apply(self, a: Assignment, raw: Obj) -> None:
        if a.request_id in self._released:
            return  # a late redelivery: its claims are already on their way back
        if drajobs.is_job_pod(a.request_id) and drajobs.split(a.request_id)[0] in self.jobs.cancelled:
            return  # its job was cancelled (a pod ended first): the allocator releases it whole
        pod = podrules.read_pod(raw)
        ns = pod.metadata.namespace or ""
        # The claims this bridge marked for the request (its own writes are in the cache); the
        # pod's references only when the cache has none, e.g. after a restart.
        held = self._held(a.request_id) or await self._held_by_refs(a, pod, ns)
        if not held or any(drapods.is_deleting(o) for o in held):
            await self.publish_release(
                held[0] if held else None, a.request_id, reason="claims gone", pod=a.pod
            )
            return
        devices = pod_devices(
            sorted((drapods.read_claim(o) for o in held), key=lambda c: c.name),
            default_class=names.DEFAULT_CLASS,
        )
        if devices is None:
            return
        written = allocations(
            devices, a, names=drapods.device_names(a), at=datetime.datetime.now(datetime.UTC)
        )
        for obj in held:
            if drapods.is_allocated(obj):
                continue  # a redelivery: an allocation is written once
            key = _key(obj)
            try:
                self.store(
                    await self.kube.patch_resource_claim_status(
                        *key, {"status": {"allocation": written[key[1]]}}
                    )
                )
            except NotFound:
                await self.publish_release(obj, a.request_id, reason="claim gone before its allocation")
                return
        if not await self._ungate(pod, raw, assignment=a):
            raise Retry(f"pod {ns}/{pod.metadata.name} changed while its gate was removed", delay=0.2)
        log.info("dra_allocated", request_id=a.request_id, node=a.node, claims=[_key(o)[1] for o in held])

    async def _held_by_refs(self, a: Assignment, pod: podrules.PodView, ns: str) -> list[Obj]:
        """The pod's claims that carry ``a``'s request, read from the API. A pod seen before the
        resourceclaim controller named its claims is read again: a watch that lags behind must
        not make claims that exist look gone (that would release what was just assigned)."""
        refs = drapods.claim_refs(pod)
        if any(not ref.claim for ref in refs):
            with contextlib.suppress(NotFound):
                refs = drapods.claim_refs(podrules.read_pod(await self.kube.get_pod(ns, a.pod.name)))
        held: list[Obj] = []
        for ref in refs:
            if not ref.claim:
                continue
            obj = self.claims.get((ns, ref.claim))
            if obj is None or drapods.held_by(obj) != a.request_id:
                with contextlib.suppress(NotFound):
                    obj = await self.kube.get_resource_claim(ns, ref.claim)
            if obj is not None and drapods.held_by(obj) == a.request_id:
                held.append(obj)
        return held

    async def on_failed(self, f: AllocationFailed) -> None:
        """The allocator's reason on each claim the request holds (the pod's Event is the pod
        bridge's). A request refused for good keeps its claims held until they are deleted: the
        claims say which request they waited for, so it is not asked again."""
        async with self._lock:
            for obj in self._held(f.request_id) or self.jobs.claims_of(f.request_id):
                await self._claim_event(obj, names.EVENT_REASON_FAILED, f.reason)

    async def on_freed(self, f: Freed) -> None:
        """The devices of ``f.request_id`` are clean and free: its claims are let go."""
        await self.synced.wait()
        async with self._lock:
            for obj in self._held(f.request_id):
                await self.let_go(obj)
            self._released.discard(f.request_id)
            self._requested.discard(f.request_id)

    # -- releasing -------------------------------------------------------------------------------

    def _ended(self, obj: Obj) -> bool:
        """Whether a held claim is done with its devices. A claim made from a template for a pod
        is once it is being deleted (the pod's end deletes it: no write is spent deallocating
        it first); a claim pods name is once none uses it — before the pods' first list nobody
        knows who names it, so then only a claim being deleted is."""
        if drapods.is_deleting(obj):
            return True
        if _owner_pod(obj) is not None:
            return False  # made for one pod: the resourceclaim controller deletes it when it ends
        return self._pods_synced and drapods.ended(obj, users=self._users.get(_key(obj), ()))

    async def _release_if_ended(
        self, rid: str, *, reason: str, records: Mapping[str, RequestRecord] | None = None
    ) -> None:
        """Release ``rid`` once every claim it holds is deleted or has no consumer left (their
        devices were chosen in one decision and go back in one release). A claim that is not
        being deleted is first deallocated at the version read again (:meth:`_deallocate`): a
        pod reserving it meanwhile makes that write fail, and nothing is released. Tandem's
        finalizer and request stay on the claim until ``Freed``, so a pod naming it meanwhile
        waits for the devices to be clean, then gets the claim allocated anew."""
        held = self._held(rid)
        if not held or rid in self._released:
            return
        if not all(self._ended(o) for o in held):
            self._note_in_use(held, rid)
            return
        if drajobs.is_job_pod(rid):
            await self.jobs.release_if_ended(rid, held, reason=reason)  # a job's pod: its job record says
            return
        record = records.get(rid) if records is not None else await self._record(rid)
        if record is None or record.state not in (*ACTIVE_STATES, "releasing"):
            # Freed, cancelled or refused already (or its record expired): nothing is held and
            # no Freed will come. (A request not recorded *yet* that is placed later finds its
            # claims gone when assigned, and is released then.)
            for claim in held:
                await self.let_go(claim)
            return
        node = record.node or next((n for o in held if (n := drapods.allocated_node(o))), None)
        if await self.deallocate_all(held, rid):
            await self.publish_release(held[0], rid, reason=reason, node=node)

    def _note_in_use(self, held: list[Obj], rid: str) -> None:
        """Say which shared claims keep ``rid``'s devices and for how many pods: what an operator
        asks when a shared claim's devices do not come back (a claim made for one pod goes with
        its pod, nothing to say)."""
        for obj in held:
            if _owner_pod(obj) is None and drapods.is_allocated(obj) and not drapods.is_deleting(obj):
                key = _key(obj)
                log.info(
                    "dra_shared_claim_in_use",
                    claim=f"{key[0]}/{key[1]}",
                    request_id=rid,
                    reserved_for=len(drapods.reserved_for(obj)),
                    users=len(self._users.get(key, ())),
                )

    async def deallocate_all(self, held: list[Obj], rid: str) -> bool:
        """Deallocate every claim of ``rid`` still allocated and not being deleted
        (:meth:`_deallocate`); False as soon as one is in use again (nothing is released then)."""
        for obj in held:
            live = drapods.is_allocated(obj) and not drapods.is_deleting(obj)
            if live and not await self._deallocate(obj, rid):
                return False
        return True

    async def _deallocate(self, obj: Obj, rid: str) -> bool:
        """Clear an unused claim's allocation, reading it again first and writing at the version
        read; False when it is in use again (or no longer ``rid``'s), True when it is clear."""
        key = _key(obj)
        try:
            fresh = self.store(await self.kube.get_resource_claim(*key))
        except NotFound:
            self._drop(key)
            return True
        if drapods.held_by(fresh) != rid:
            return False
        if drapods.is_deleting(fresh) or not drapods.is_allocated(fresh):
            return True
        if drapods.in_use(fresh, users=self._users.get(key, ())):
            return False
        try:
            self.store(await self.kube.patch_resource_claim_status(*key, drapods.deallocation(fresh)))
        except Conflict:
            # Changed since it was read (kube-scheduler reserved it for a pod): still in use.
            log.info("dra_claim_taken_again", claim=f"{key[0]}/{key[1]}", request_id=rid)
            return False
        except NotFound:
            self._drop(key)
            return True
        log.info("dra_claim_deallocated", claim=f"{key[0]}/{key[1]}", request_id=rid)
        return True

    async def publish_release(
        self, obj: Obj | None, rid: str, *, reason: str, pod: PodRef | None = None, node: str | None = None
    ) -> None:
        if rid in self._released:
            return
        if pod is None:
            meta = (obj or {}).get("metadata") or {}
            name = str((meta.get("annotations") or {}).get(names.DRA_POD) or "")
            pod = PodRef(namespace=str(meta.get("namespace") or ""), name=name, uid=rid.rsplit(".", 1)[0])
        if node is None and obj is not None:
            node = drapods.allocated_node(obj)
        subject = subjects.alloc_release(node)
        msg = Release(request_id=rid, pod=pod, node=node, reason=reason)
        await self.bus.publish(subject, msg, msg_id=subjects.msg_id("release", rid, subject))
        self._released.add(rid)
        log.info("dra_released", request_id=rid, node=node, reason=reason)

    async def let_go(self, obj: Obj) -> None:
        """Clear a claim's allocation and take Tandem's finalizer off (its devices are free)."""
        key = _key(obj)
        try:
            for _ in range(3):
                try:
                    if drapods.is_allocated(obj) and not drapods.reserved_for(obj):
                        obj = await self.kube.patch_resource_claim_status(*key, drapods.deallocation(obj))
                    self.store(await self.kube.replace_resource_claim(*key, drapods.let_go(obj)))
                    break
                except Conflict:
                    obj = await self.kube.get_resource_claim(*key)
        except NotFound:
            self._drop(key)
            return
        except KubeError as exc:
            log.warning("dra_claim_not_let_go", claim=f"{key[0]}/{key[1]}", error=str(exc))
            return
        log.info("dra_claim_let_go", claim=f"{key[0]}/{key[1]}")

    # -- records and events ----------------------------------------------------------------------

    async def _record(self, rid: str) -> RequestRecord | None:
        kv = await self.bus.kv(subjects.KV_REQUESTS)
        try:
            entry = await kv.get(subjects.kv_key(rid))
        except KeyNotFoundError:
            return None
        return codec.REQUEST_RECORD.decode(entry.value) if entry.value else None

    async def assignment_from_record(self, node: str, rid: str) -> Assignment | None:
        kv = await self.bus.kv(subjects.KV_ALLOCS)
        try:
            entry = await kv.get(subjects.kv_key(node))
        except KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        rec = codec.NODE_ALLOCS.decode(entry.value).allocations.get(rid)
        return rec.assignment if rec is not None else None

    async def pod_event(self, pod: podrules.PodView, reason: str, message: str) -> None:
        with contextlib.suppress(KubeError):
            await self.record_event(pod, reason=reason, message=message)

    async def _claim_event(self, obj: Obj, reason: str, message: str) -> None:
        """A Warning Event on the claim (``kubectl describe resourceclaim`` shows it)."""
        involved = drapods.claim_event_object(obj)
        who = podrules.read_pod({"metadata": {k: involved[k] for k in ("namespace", "name", "uid")}})
        with contextlib.suppress(KubeError):
            await self.record_event(who, reason=reason, message=message, involved=involved)


def _owner_pod(obj: Obj) -> str | None:
    """The uid of the pod a claim was made for (the resourceclaim controller makes it the
    claim's owner), or None for a claim written by hand, which any pod may name."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1" and ref.get("uid"):
            return str(ref["uid"])
    return None


def _older(obj: Obj, cached: Obj | None) -> bool:
    """Whether ``obj`` is an older version of the claim than ``cached``. A watch delivers a
    claim's versions in order, but the bridge also caches what its own writes returned, so an
    event already in flight (the claim as the resourceclaim controller made it) can arrive after
    the bridge marked the claim, and must not undo the mark. Resource versions are opaque by
    contract; the API server's are etcd revisions (integers), and anything else counts as newer."""
    if cached is None:
        return False
    try:
        return int(obj["metadata"]["resourceVersion"]) < int(cached["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return False
