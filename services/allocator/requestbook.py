"""Request records (KV ``tandem-requests``): where each request stands, as this replica sees it.

A request record is written when a request is *claimed* (already as its outcome: ``assigned``
to the chosen node), when it cannot be placed (``pending`` with the reason for the pod author,
and the plan of a preemption), rejected, cancelled, or freed. The :class:`RequestBook` keeps the live
ones in memory (a watch of the bucket and its own writes) and answers the placement pipeline:
which requests are pending, which claims were abandoned by a replica that died, whether a
refusal is worth writing again. Every write is a compare-and-set of the shared
:class:`~services.runtime.kv.records.RecordStore`.

A refusal's per-node breakdown ("993 nodes: fewer than 2 free GPUs; ...") moves with every
free and placement; with the same head (:func:`reason_key`) the record is rewritten, and the
reason announced, at most every ``REASON_REFRESH_S`` — writing on every change was a storm
under load (72,000 writes in one run of ``tandem loadtest``).

The *claim* is the only compare-and-set that guards a request rather than a device: two
replicas retrying one pending request would otherwise place it on two different nodes. It is
written after the decision and before the commit, already as the outcome (``assigned`` to the
chosen node, owner = this replica), so a placed request costs one request-record write. Until
the node's record holds the request, an ``assigned`` record is only a claim: another replica
waits ``claim_timeout`` for it and then, if no node holds the request, takes it over (its
owner died between claim and commit). ``deciding`` is the claim state of older versions and is
read the same way. The writes are pure mutations (:func:`claim_mutation` and the others here),
as the node records' are (:mod:`.commits`).

Finished records (freed, cancelled, rejected) are written with a lifetime (``finished_ttl``,
the setting ``finished_request_ttl``, 7 days by default) and vanish after it, so the bucket
holds the live requests and the recent past rather than all history.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import Literal

import msgspec

from schemas import codec, subjects
from schemas.messages import AllocationRequest, PodRef, RequestRecord
from services.allocator.commits import AlreadyDone, DifferentRequest
from services.allocator.core import Unschedulable
from services.runtime.kv.records import Mutation, RecordStore
from services.runtime.nats.bus import Bus, Retry

RequestState = Literal["pending", "deciding", "assigned", "releasing", "freed", "cancelled", "rejected"]
# Outcomes a request record keeps for good, and the states of a request in some replica's hand.
TERMINAL_STATES = frozenset({"releasing", "freed", "cancelled", "rejected"})
CLAIMED_STATES = frozenset({"deciding", "assigned"})
# Request records kept in memory: those a later write of this replica will change.
LIVE_STATES = frozenset({"pending", "deciding", "assigned"})
# Outcomes after which nothing changes the record any more: it expires (``finished_ttl``).
FINISHED_STATES = frozenset({"freed", "cancelled", "rejected"})
# A pending request's reason, when only its breakdown changed, is rewritten at most this often.
REASON_REFRESH_S = 30.0

CancelOutcome = Literal["placed", "done", "cancelled"]


def _lifetime(finished_ttl: float) -> Callable[[RequestRecord], float | None]:
    return lambda r: finished_ttl if r.state in FINISHED_STATES else None


def reason_key(reason: str) -> str:
    """What a refusal says at its head ("no node can take 8 GPUs + 8 NICs"), without the
    per-node breakdown whose counts move with every free and every placement."""
    return reason.split(":", 1)[0]


def same_request(a: AllocationRequest, b: AllocationRequest) -> bool:
    """The same request sent again (a redelivery, a resubmission): all but its send time."""
    return a == msgspec.structs.replace(b, created_at=a.created_at)


def check_same(current: RequestRecord | None, req: AllocationRequest) -> None:
    """Raise :class:`DifferentRequest` when ``current`` holds another request under ``req``'s
    id. A cancelled record may hold a stand-in (a release that came before its request)."""
    if current is not None and current.state != "cancelled" and not same_request(current.request, req):
        raise DifferentRequest(
            f"request id {req.request_id!r} is already used by a different request "
            f"(pod {current.request.pod.namespace}/{current.request.pod.name}, {current.state}); "
            "a new request needs a new id"
        )


def claim_mutation(
    req: AllocationRequest,
    *,
    node: str,
    instance: str,
    claim_timeout: float,
    now: float,
    placed: Callable[[str], bool],
    traceparent: str = "",
) -> Mutation[RequestRecord]:
    """Take the request for ``instance``, to be committed on ``node``: the record says
    ``assigned`` to that node before the node's record does (see the module docstring).
    Raises :class:`AlreadyDone` when the request has an outcome (``placed`` says whether a
    node record holds it), :class:`Retry` while another live replica has it in hand."""

    def mutate(current: RequestRecord | None) -> RequestRecord | None:
        check_same(current, req)
        if current is not None:
            if current.state in TERMINAL_STATES:
                raise AlreadyDone(current.state)
            if current.state in CLAIMED_STATES and current.owner != instance:
                if placed(req.request_id):
                    raise AlreadyDone(current.state)
                if now - current.updated_at < claim_timeout:
                    raise Retry(f"request {req.request_id} is being placed by {current.owner}")
                # A claim older than claim_timeout that no node holds: its replica died.
        return RequestRecord(
            request=req,
            state="assigned",
            node=node,
            owner=instance,
            # Why it waited is not why it is placed: a pending reason would read as current.
            reason="",
            updated_at=now,
            traceparent=(current.traceparent if current else "") or traceparent,
        )

    return mutate


def put_request(record: RequestRecord) -> Mutation[RequestRecord]:
    def mutate(_: RequestRecord | None) -> RequestRecord | None:
        return record

    return mutate


def request_state(
    state: RequestState, *, reason: str | None = None, only_from: frozenset[str] | None = None
) -> Mutation[RequestRecord]:
    """Move an existing request record to ``state`` (keeping its request)."""

    def mutate(current: RequestRecord | None) -> RequestRecord | None:
        if current is None or (only_from is not None and current.state not in only_from):
            return None
        if current.state == state and (reason is None or reason == current.reason):
            return None
        return msgspec.structs.replace(
            current,
            state=state,
            reason=current.reason if reason is None else reason,
            updated_at=time.time(),
        )

    return mutate


class RequestBook:
    def __init__(
        self,
        bus: Bus,
        *,
        instance: str,
        claim_timeout: float,
        placed: Mapping[str, str],
        finished_ttl: float | None = None,
    ) -> None:
        self.instance = instance
        self.claim_timeout = claim_timeout
        self.placed = placed  # request id → node, from the node records (the read model)
        self.store: RecordStore[RequestRecord] = RecordStore(
            bus,
            subjects.KV_REQUESTS,
            codec.REQUEST_RECORD,
            on_change=self._on_record,
            retain=lambda r: r.state in LIVE_STATES,
            ttl=None if finished_ttl is None else _lifetime(finished_ttl),
        )
        self.pending: dict[str, AllocationRequest] = {}
        self.claims: dict[str, RequestRecord] = {}  # claimed, not yet held by a node record
        # Told of every record change after the book took it in (services/allocator/evictionplans.py
        # keeps the devices reserved for preempting requests from it).
        self.on_record: Callable[[str, RequestRecord | None], None] | None = None

    async def aclose(self) -> None:
        await self.store.aclose()

    def check_same(self, req: AllocationRequest) -> None:
        """Raise :class:`DifferentRequest` when the record under ``req``'s id holds another
        request (a request id reused)."""
        known = self.store.cached(req.request_id)
        check_same(known[0] if known is not None else None, req)

    def _on_record(self, key: str, record: RequestRecord | None, _: int) -> None:
        self.pending.pop(key, None)
        self.claims.pop(key, None)
        if record is not None:
            if record.state == "pending":
                self.pending[key] = record.request
            elif record.state in CLAIMED_STATES and key not in self.placed:
                self.claims[key] = record
        if self.on_record is not None:
            self.on_record(key, record)

    def abandoned(self, *, busy: Collection[str]) -> list[AllocationRequest]:
        """Requests a replica claimed and then never committed (it crashed in between).

        A claim is only taken while a message is being handled or a pending request retried;
        the pending path has no message left to redeliver, so without this such a request
        would wait forever. ``busy``: requests this replica has in hand."""
        cutoff = time.time() - self.claim_timeout
        abandoned = []
        for rid, r in list(self.claims.items()):
            if rid in self.placed:
                del self.claims[rid]  # committed: not a claim any more
            elif r.updated_at < cutoff and rid not in busy:
                abandoned.append(r.request)
        return abandoned

    async def record(self, request_id: str) -> RequestRecord | None:
        cached = self.store.cached(request_id)
        if cached is not None:
            return cached[0]
        record, _ = await self.store.fetch(request_id)
        return record

    def _held_elsewhere(self, current: RequestRecord) -> bool:
        """A live claim of another replica (raises Retry) — or a committed one (True)."""
        rid = current.request.request_id
        if rid in self.placed:
            return True
        if current.owner != self.instance and time.time() - current.updated_at < self.claim_timeout:
            raise Retry(f"request {rid} is being placed by {current.owner}")
        return False

    def traceparent(self, request_id: str) -> str:
        """The trace the request arrived in, as its record keeps it ("" when unknown)."""
        known = self.store.cached(request_id)
        return known[0].traceparent if known is not None and known[0] is not None else ""

    async def claim(self, req: AllocationRequest, *, node: str, traceparent: str = "") -> bool:
        """Take the request for this instance, to be committed on ``node``; False when it has
        an outcome already. Raises Retry while another live replica has it in hand."""
        mutate = claim_mutation(
            req,
            node=node,
            instance=self.instance,
            claim_timeout=self.claim_timeout,
            now=time.time(),
            placed=self.placed.__contains__,
            traceparent=traceparent,
        )
        try:
            # A request never seen is created without reading it first (the common case).
            await self.store.update(req.request_id, mutate, assume_absent=True)
        except AlreadyDone:
            return False
        return True

    async def mark_assigned(self, req: AllocationRequest, *, node: str) -> None:
        """Make the record say what the node record says (a lost write, an earlier node) —
        unless it has an outcome by now. This write was unconditional: when it lost its
        compare-and-set race to the ``freed`` write of a release, it re-read the record and
        overwrote ``freed`` with ``assigned``, a claim no node held, which another replica
        took over after ``claim_timeout`` and placed the released request again
        (``tandem chaos``, seed 1, round 24; ``docs/reliability.md``)."""
        record = RequestRecord(
            request=req,
            state="assigned",
            node=node,
            owner=self.instance,
            traceparent=self.traceparent(req.request_id),
        )

        def mutate(current: RequestRecord | None) -> RequestRecord | None:
            if current is not None and current.state in TERMINAL_STATES:
                return None  # released (or rejected) meanwhile: the outcome stands
            return record

        await self.store.update(req.request_id, mutate)

    def placed_now(self, request_id: str) -> None:
        """The request's commit landed: it is not pending, and its claim is the outcome."""
        self.pending.pop(request_id, None)
        self.claims.pop(request_id, None)

    def reason_due(self, request_id: str, why: Unschedulable) -> bool:
        """Whether an unschedulable request's record needs writing (module docstring)."""
        known = self.store.cached(request_id)
        was = known[0] if known is not None else None
        return not (
            was is not None
            and was.state == "pending"
            and reason_key(was.reason) == reason_key(why.reason)
            and time.time() - was.updated_at < REASON_REFRESH_S
        )

    async def record_pending(
        self, req: AllocationRequest, why: Unschedulable, *, traceparent: str = ""
    ) -> str | None:
        """Record ``pending`` with the reason; returns the reason it said before (None when
        nothing was written). Raises AlreadyDone when the request has an outcome."""
        if not self.reason_due(req.request_id, why):
            return None
        said: list[str] = []

        def mutate(current: RequestRecord | None) -> RequestRecord | None:
            self._check_pending(current, req)
            said[:] = [current.reason if current is not None else ""]
            if current is not None and current.state == "pending" and current.reason == why.reason:
                return None
            trace = (current.traceparent if current is not None else "") or traceparent
            return RequestRecord(request=req, state="pending", owner="", reason=why.reason, traceparent=trace)

        await self.store.update(req.request_id, mutate, assume_absent=True)
        self.pending[req.request_id] = req
        return said[0] if said else None

    async def record_plan(
        self,
        req: AllocationRequest,
        *,
        victims: list[str],
        node: str,
        devices: list[str],
        reason: str,
        traceparent: str = "",
    ) -> None:
        """Record ``pending`` with a preemption plan (:mod:`.preemption`): the victims, and the
        node and devices kept for the request. Raises AlreadyDone when it has an outcome."""

        def mutate(current: RequestRecord | None) -> RequestRecord | None:
            self._check_pending(current, req)
            return RequestRecord(
                request=req,
                state="pending",
                reason=reason,
                traceparent=(current.traceparent if current is not None else "") or traceparent,
                victims=victims,
                preempt_node=node,
                preempt_devices=devices,
            )

        await self.store.update(req.request_id, mutate)
        self.pending[req.request_id] = req

    def _check_pending(self, current: RequestRecord | None, req: AllocationRequest) -> None:
        """Whether ``req`` may be recorded pending over ``current``: raises AlreadyDone when it
        has an outcome (or another replica committed it), Retry while another live replica
        has it claimed, DifferentRequest for another request under its id."""
        check_same(current, req)
        if current is not None and current.state in TERMINAL_STATES:
            raise AlreadyDone(current.state)
        claimed = current is not None and current.state in CLAIMED_STATES
        if current is not None and claimed and self._held_elsewhere(current):
            raise AlreadyDone(current.state)

    async def reject(self, req: AllocationRequest, reason: str) -> None:
        record = RequestRecord(
            request=req, state="rejected", reason=reason, traceparent=self.traceparent(req.request_id)
        )
        await self.store.update(req.request_id, put_request(record))
        self.pending.pop(req.request_id, None)

    async def cancel(self, request_id: str, *, pod: PodRef) -> CancelOutcome:
        """Cancel a request that is not placed (pending, or its release overtook it).
        No decision of this replica may be in flight for it (the caller awaited those)."""
        outcome: list[CancelOutcome] = []

        def mutate(current: RequestRecord | None) -> RequestRecord | None:
            claimed = current is not None and current.state in CLAIMED_STATES
            if current is not None and claimed and self._held_elsewhere(current):
                outcome.append("placed")
                return None
            if current is not None and current.state == "releasing":
                outcome.append("placed")
                return None
            if current is not None and current.state in ("freed", "cancelled", "rejected"):
                outcome.append("done")
                return None
            request = (
                current.request if current else AllocationRequest(request_id=request_id, pod=pod, gpus=0)
            )
            outcome.append("cancelled")
            return RequestRecord(request=request, state="cancelled", reason="released")

        await self.store.update(request_id, mutate)
        if outcome[-1] == "cancelled":
            self.pending.pop(request_id, None)
        return outcome[-1]

    async def freed(self, request_id: str) -> None:
        await self.store.update(request_id, request_state("freed"))

    def cleanup_unverified(self, request_id: str, problems: list[str]) -> None:
        self.store.submit(request_id, request_state("releasing", reason="; ".join(problems)))
