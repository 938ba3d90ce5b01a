"""The pod bridge's DeviceClaim half: claims ⇄ allocation messages, and pods that use a claim.

Rules are in :mod:`services.admission.claims` (pure); this module applies them:

* a ``DeviceClaim`` listed or watched (``tandem.io/v1alpha1``, every namespace) → one
  ``alloc.request`` (``request_id = claim-<uid>``, ``Nats-Msg-Id`` from it), status ``Pending``;
  an invalid spec → status ``Invalid`` with the message naming the field, nothing published;
* ``alloc.assigned`` for a claim → status ``Allocated`` (node, devices), then every pod waiting
  for the claim is bound to the claim's assignment; ``alloc.failed`` → the reason in the status;
* a claim that holds devices gets the finalizer ``tandem.io/claim-release``; deleted, it is
  released once no pod uses it → ``alloc.release`` of its request (the node agent's verified
  cleanup, then the allocator frees the devices and retries pending requests on them), and the
  finalizer is removed;
* a gated pod with ``tandem.io/claim: NAME`` → bound to the claim's assignment when
  :func:`~services.admission.claims.blocking_reason` says nothing, else one Warning Event
  (``WaitingForClaim``) saying why it waits; its end releases nothing;
* every ``tick`` seconds, a reservation past its deadline with no pod using it is released
  (status ``Released``, reason ``reservation expired``).

State lives in the claims themselves (spec, status), the allocator's request records and the
pods, so a restarted bridge rebuilds it: it lists claims first (request records tell what was
requested and assigned; a claim's status ``Released`` is never requested again; a claim request
whose claim is gone is released), then the pods (bound pods become the claim's users again).
Every change of a claim is also written to KV ``tandem-claims`` for the CLI, which reads NATS
only. One lock serialises the claim handlers: the pod watch, the claim watch, the outcome
consumers and the tick all touch the same users and waiters.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from nats.js.errors import KeyNotFoundError

from schemas import codec, subjects
from schemas.config import DeviceClass
from schemas.messages import AllocationFailed, Assignment, PodRef, Release, RequestRecord
from services.admission import claims, names, podrules, podwrites
from services.admission.claims import ClaimState
from services.admission.errors import InvalidClaim, PolicyError
from services.kube.client import KubeApi
from services.kube.errors import Conflict, KubeError, NotFound
from services.kube.relist import list_then_watch
from services.runtime.nats.bus import Bus
from services.runtime.observe.logging import get_logger

log = get_logger(__name__)

ACTIVE_STATES = frozenset({"pending", "deciding", "assigned"})
RecordEvent = Callable[..., Awaitable[None]]
Key = tuple[str, str]


class ClaimBridge:
    def __init__(
        self,
        *,
        kube: KubeApi,
        bus: Bus,
        device_classes: dict[str, DeviceClass],
        record_event: RecordEvent,
        clock: Callable[[], float],
        watch_timeout: int = 300,
        relist_backoff: float = 1.0,
        tick: float = 1.0,
    ) -> None:
        self.kube = kube
        self.bus = bus
        self.device_classes = device_classes
        self.record_event = record_event
        self.clock = clock
        self.watch_timeout = watch_timeout
        self.relist_backoff = relist_backoff
        self.tick = tick
        self.states: dict[Key, ClaimState] = {}
        self.by_request: dict[str, Key] = {}
        self.waiting: dict[Key, dict[str, str]] = {}  # claim -> {pod uid: pod name}
        self._lock = asyncio.Lock()
        self.synced = asyncio.Event()
        """Set after the first list of claims (or after finding no DeviceClaim CRD)."""
        self.pods_synced = asyncio.Event()
        """Set by the bridge after its first list of pods: only then are a claim's users known,
        so only then may a reservation expire or a deleted claim be released."""

    # -- watching ----------------------------------------------------------------------------

    async def watch(
        self, stop: asyncio.Event, *, records: Callable[[], Awaitable[dict[str, RequestRecord]]]
    ) -> None:
        """List + resync, then watch; on any watch end, do it again. No CRD (404): claims are
        off; looked for again every 30 s, and pods are not held up meanwhile."""
        recs: dict[str, RequestRecord] = {}

        async def listed() -> tuple[list[dict[str, Any]], str]:
            nonlocal recs
            recs = await records()
            return await self.kube.list_claims()

        await list_then_watch(
            stop,
            listed=listed,
            resync=lambda items: self.resync(items, recs),
            watch=lambda version: self.kube.watch_claims(
                resource_version=version, timeout_s=self.watch_timeout
            ),
            on_event=self.on_claim_event,
            synced=self.synced,
            backoff=self.relist_backoff,
            name="claim",
            absent_hint="install the DeviceClaim CRD",
        )

    async def expire(self, stop: asyncio.Event) -> None:
        """Release reservations past their deadline (the first pass runs right after the
        first list, so a bridge that was down at a deadline releases at once)."""
        await self.synced.wait()
        await self.pods_synced.wait()
        while not stop.is_set():
            async with self._lock:
                now = self.clock()
                for state in list(self.states.values()):
                    if claims.expiry_due(state, now=now):
                        await self._release(state, reason="reservation expired")
                        await self._write(state)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.tick)

    async def resync(self, items: list[dict[str, Any]], records: dict[str, RequestRecord]) -> None:
        live: set[str] = set()
        for obj in items:
            uid = (obj.get("metadata") or {}).get("uid")
            if isinstance(uid, str) and uid:
                live.add(claims.claim_request_id(uid))
            await self.on_claim_event("ADDED", obj, record=records.get(claims.claim_request_id(str(uid))))
        released: set[str] = set()
        async with self._lock:
            # Deleted between two watches (a DELETED event can fall into the gap).
            for state in [s for s in self.states.values() if s.request_id not in live]:
                await self._forget(state, reason="claim deleted")
                released.add(state.request_id)
        for rid, record in records.items():
            req = record.request
            if req.claim is None or rid in live or rid in released or record.state not in ACTIVE_STATES:
                continue
            await self._publish_release(
                rid, req.pod, node=record.node, reason="claim deleted while the bridge was away"
            )

    # -- claims ------------------------------------------------------------------------------

    async def on_claim_event(
        self, kind: str, obj: dict[str, Any], *, record: RequestRecord | None = None
    ) -> None:
        try:
            view = claims.read_claim(obj)
        except InvalidClaim as exc:
            log.warning("unreadable_claim", error=str(exc))
            return
        async with self._lock:
            old = self.states.get(view.key)
            if old is not None and old.view.uid != view.uid:  # deleted and created again
                await self._forget(old, reason="claim replaced")
                old = None
            if kind == "DELETED":
                if old is not None:
                    await self._forget(old, reason="claim deleted")
                return
            if old is not None:
                old.view = view
                await self._finalize(old)
                return
            state = ClaimState(view=view)
            self.states[view.key] = state
            self.by_request[state.request_id] = view.key
            await self._start(state, obj, record)
            await self._write(state)
            await self._finalize(state)
            await self._bind_waiting(view.key)

    async def _finalize(self, state: ClaimState) -> None:
        """Keep the finalizer on a claim that holds devices; on a deleted claim, release it once
        no pod uses it (the pods' processes would fail the node's cleanup), then let it go."""
        view = state.view
        if view.deleting:
            if not self.pods_synced.is_set():
                return  # its users are not known yet
            if state.users and not state.released:
                reason = f"deleting: waiting for pods {','.join(sorted(state.users.values()))} to end"
                if state.reason != reason:
                    state.reason = reason
                    await self._write(state)
                return
            if not state.released:
                await self._release(state, reason="claim deleted")
                await self._write(state)
            patch = claims.finalizer_patch(view, present=False)
        else:
            holds = state.phase != "Invalid" and not state.released
            patch = claims.finalizer_patch(view, present=holds)
        if patch is None:
            return
        try:
            await self.kube.patch_claim(view.namespace, view.name, patch)
        except (Conflict, NotFound):
            pass  # changed or gone meanwhile: its next event brings it back here
        except KubeError as exc:
            log.warning("claim_finalizer_not_written", claim=view.display, error=str(exc))

    async def finish_deletions(self) -> None:
        """After a (re)list of pods: release deleted claims that no pod uses any more."""
        async with self._lock:
            for state in [s for s in self.states.values() if s.view.deleting]:
                await self._finalize(state)

    async def _start(self, state: ClaimState, obj: dict[str, Any], record: RequestRecord | None) -> None:
        try:
            state.request = claims.claim_request(state.view, device_classes=self.device_classes)
        except InvalidClaim as exc:
            state.phase, state.reason = "Invalid", str(exc)
            log.warning("invalid_claim", claim=state.view.display, error=str(exc))
            return
        status = obj.get("status") or {}
        if state.view.deleting and record is None:
            # Deleted before it was ever requested: nothing to hold, nothing to release.
            state.phase, state.released, state.reason = "Released", True, "claim deleted"
            return
        if status.get("phase") == "Released":
            # Released for good (expired): never requested again, even after its request
            # record has gone (finished records expire).
            state.phase, state.released, state.reason = "Released", True, str(status.get("reason") or "")
            return
        if record is not None:
            state.record_node = record.node
            if record.state == "assigned" and record.node:
                state.assignment = await self._assignment_from_record(record.node, state.request_id)
                state.phase = "Allocated" if state.assignment is not None else "Pending"
            elif record.state in ACTIVE_STATES:
                state.phase, state.reason = "Pending", record.reason
            else:
                state.phase, state.released, state.reason = "Released", True, record.reason or record.state
            return
        await self.bus.publish(
            subjects.ALLOC_REQUEST,
            state.request,
            msg_id=subjects.msg_id("request", state.request_id),
        )
        log.info("claim_requested", claim=state.view.display, request_id=state.request_id)

    async def _assignment_from_record(self, node: str, rid: str) -> Assignment | None:
        kv = await self.bus.kv(subjects.KV_ALLOCS)
        try:
            entry = await kv.get(subjects.kv_key(node))
        except KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        rec = codec.NODE_ALLOCS.decode(entry.value).allocations.get(rid)
        return rec.assignment if rec is not None else None

    async def _forget(self, state: ClaimState, *, reason: str) -> None:
        await self._release(state, reason=reason)
        self.states.pop(state.view.key, None)
        self.by_request.pop(state.request_id, None)
        kv = await self.bus.kv(subjects.KV_CLAIMS)
        with contextlib.suppress(KeyNotFoundError):
            await kv.delete(subjects.kv_key(state.request_id))
        # Pods still waiting for it hear that it is gone.
        await self._bind_waiting(state.view.key)

    async def _release(self, state: ClaimState, *, reason: str) -> None:
        if state.released or state.request is None:
            state.released = state.released or state.request is None
            return
        node = state.assignment.node if state.assignment is not None else state.record_node
        await self._publish_release(state.request_id, state.request.pod, node=node, reason=reason)
        state.released, state.phase, state.reason = True, "Released", reason

    async def _publish_release(self, rid: str, ref: PodRef, *, node: str | None, reason: str) -> None:
        subject = subjects.alloc_release(node)
        msg = Release(request_id=rid, pod=ref, node=node, reason=reason)
        await self.bus.publish(subject, msg, msg_id=subjects.msg_id("release", rid, subject))
        log.info("claim_released", request_id=rid, node=node, reason=reason)

    async def _write(self, state: ClaimState) -> None:
        """The claim's status subresource and its KV record (for the CLI)."""
        if state.view.key not in self.states:
            return
        kv = await self.bus.kv(subjects.KV_CLAIMS)
        await kv.put(
            subjects.kv_key(state.request_id), codec.encode(claims.claim_record(state, now=self.clock()))
        )
        try:
            await self.kube.patch_claim_status(
                state.view.namespace, state.view.name, claims.status_patch(state)
            )
        except NotFound:
            pass  # deleted meanwhile: the watch says so next
        except KubeError as exc:
            log.warning("claim_status_not_written", claim=state.view.display, error=str(exc))

    # -- outcomes ------------------------------------------------------------------------------

    async def on_assignment(self, a: Assignment) -> None:
        async with self._lock:
            key = self.by_request.get(a.request_id)
            state = self.states.get(key) if key is not None else None
            if state is None or state.released:
                # The claim went away before its devices were chosen: give them back.
                await self._publish_release(
                    a.request_id, a.pod, node=a.node, reason="claim gone before its devices were assigned"
                )
                return
            if state.assignment is not None and state.assignment.node == a.node:
                return  # a redelivery
            state.assignment, state.phase, state.reason = a, "Allocated", ""
            await self._write(state)
            await self._bind_waiting(state.view.key)

    async def on_failed(self, f: AllocationFailed) -> None:
        async with self._lock:
            key = self.by_request.get(f.request_id)
            state = self.states.get(key) if key is not None else None
            if state is None or state.released or state.assignment is not None:
                return
            phase: claims.Phase = "Pending" if f.retrying else "Invalid"
            if (state.phase, state.reason) == (phase, f.reason):
                return
            state.phase, state.reason = phase, f.reason
            await self._write(state)

    # -- pods that use a claim -------------------------------------------------------------------

    async def on_pod_event(self, kind: str, pod: podrules.PodView, raw: dict[str, Any]) -> None:
        async with self._lock:
            await self._on_pod(kind, pod, raw)

    async def _on_pod(self, kind: str, pod: podrules.PodView, raw: dict[str, Any]) -> None:
        uid, name = pod.metadata.uid or "", pod.metadata.name or ""
        key = (pod.metadata.namespace or "", pod.annotations.get(names.CLAIM, ""))
        state = self.states.get(key)
        if kind == "DELETED" or pod.terminal:
            self.waiting.get(key, {}).pop(uid, None)
            if state is not None and state.users.pop(uid, None) is not None:
                await self._write(state)
                await self._bind_waiting(key)
                if state.view.deleting:
                    await self._finalize(state)
            return
        if state is not None and podwrites.is_bound(pod, state.request_id):
            if state.users.get(uid) != name:
                state.users[uid] = name
                await self._write(state)
            return
        if names.GATE not in pod.gates or pod.metadata.deletionTimestamp:
            return
        try:
            wants = podrules.resolve(pod, device_classes=self.device_classes)
        except PolicyError as exc:
            await self.record_event(pod, reason=names.EVENT_REASON_INVALID, message=str(exc))
            return
        gpus, rdma = (wants.gpus, wants.rdma) if wants is not None else (0, 0)
        why = claims.blocking_reason(
            state,
            claim=key[1],
            pod_uid=uid,
            gpus=gpus,
            rdma=rdma,
            mig_profile=wants.mig_profile if wants is not None else None,
            gpu_memory_mib=wants.gpu_memory_mib if wants is not None else None,
            gpu_cores_percent=wants.gpu_cores_percent if wants is not None else None,
        )
        if why is not None or state is None or state.assignment is None:
            self.waiting.setdefault(key, {})[uid] = name
            await self.record_event(pod, reason=names.EVENT_REASON_CLAIM, message=why or "waiting")
            return
        try:
            await self.kube.patch_pod(key[0], name, podwrites.bind_patch(raw, state.assignment))
        except Conflict:
            # The pod changed since it was read: its MODIFIED event brings it back here.
            self.waiting.setdefault(key, {})[uid] = name
            return
        except NotFound:
            self.waiting.get(key, {}).pop(uid, None)
            return
        self.waiting.get(key, {}).pop(uid, None)
        state.users[uid] = name
        await self._write(state)
        log.info("pod_bound_to_claim", claim=state.view.display, pod=name, node=state.assignment.node)

    async def prune(self, live_pods: set[str]) -> None:
        """After a (re)list of pods: forget users and waiters that are not among them (their
        DELETED event may have fallen between two watches)."""
        async with self._lock:
            for waiting in self.waiting.values():
                for uid in [u for u in waiting if u not in live_pods]:
                    del waiting[uid]
            for state in list(self.states.values()):
                gone = [u for u in state.users if u not in live_pods]
                for uid in gone:
                    del state.users[uid]
                if gone:
                    await self._write(state)
                    await self._bind_waiting(state.view.key)
                    if state.view.deleting:
                        await self._finalize(state)

    async def _bind_waiting(self, key: Key) -> None:
        """Look again at every pod waiting for this claim (it was allocated, freed by a pod,
        or went away)."""
        for uid, name in list(self.waiting.get(key, {}).items()):
            try:
                raw = await self.kube.get_pod(key[0], name)
            except NotFound:
                self.waiting[key].pop(uid, None)
                continue
            pod = podrules.read_pod(raw)
            if pod.metadata.uid != uid:
                self.waiting[key].pop(uid, None)
                continue
            await self._on_pod("MODIFIED", pod, raw)
