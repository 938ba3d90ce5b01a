"""The placement of one request, as one pipeline owned by one object: the :class:`Placer`.

::

    take ──► decide ──► reserve ──► claim ──► commit ──► announce

* **take** (:meth:`Placer.place`): one request id is in this replica's hand at most once. A
  request a node record holds already is announced again (same ``Nats-Msg-Id``) and stops
  there: a redelivery never allocates twice; a second arrival of a request in hand waits for
  the first one's outcome. The request's trace is fixed here: the one its message arrived in,
  or, for a retry of a pending request, the one its record keeps;
* **decide** (:meth:`Placer.decide`): the core picks node + devices jointly, this replica's
  shard first (:mod:`.replicas`), with the devices a preemption reserved for the request lent
  to it just before (:mod:`.preemption`); a refusal names the nodes the core does not count
  (:meth:`.ReadModel.explain`). Unschedulable → the request record says ``pending`` with the
  reason, or a preemption plan is made; invalid for good → ``rejected``;
* **hand over** (:meth:`Placer.hand_over`): with several replicas, a request whose own
  shard had no room and whose decision lands on a node of another live replica's shard is
  handed to that replica (core NATS request/reply, ``tandem.allocator.forward.<name>``),
  which decides it on its own shard only and places it there, or answers ``no_room``. Before,
  the replica committed on that node itself, from a view without the owner's decisions in
  flight, and lost the compare-and-set race to the owner's commits often enough to be most of
  two replicas' extra latency (docs/benchmarks.md, "Two replicas"). Handed over once; when
  the owner has no room, this replica decides on its own shard only (with two replicas:
  nowhere has room, the request is pending as with one); when the owner is gone, this
  replica decides on every node and places it itself, as before; when the owner took it but
  did not say what became of it (no answer in time, an error), the message is delivered
  again later, and the records say then;
* **reserve** (:meth:`Placer.reserve`): the devices are held *tentatively* in the read model,
  so the decisions taken while this one commits see them as used;
* **claim** (:meth:`Placer.claim`): the request record is written with compare-and-set,
  already as the outcome (``assigned`` to the node, owner = this replica), so two replicas
  never place one request on two nodes;
* **commit** (:meth:`Placer.commit`): the allocation is added to the node's record with
  compare-and-set; that write is the commit and the node agent's event. A device another
  replica took makes this request alone decide again; a record with no room left
  (``RecordTooLarge``) takes its node out of decisions until an allocation leaves it;
* **announce** (:meth:`Placer.announce`): ``Assignment`` is published before the request is
  acked, so a lost event means a redelivery, which announces it again (take).

Everything else talks to the Placer through a narrow interface instead of sharing its state:
the request consumer and the pending retries :meth:`~Placer.place` a request (the retries with
a decision taken ahead, :meth:`~Placer.decide_ahead`, so a pass decides every request before
anything waits); the free path waits until a request is :meth:`~Placer.settled` before it
releases it; the retry pass asks what is :meth:`~Placer.busy`; whole jobs hold and drop their
pods' devices through the same reserve stage (:meth:`~Placer.hold`, :meth:`~Placer.drop`).
Apart from the record watches and the replica heartbeats, only the Placer writes the read
model: its decide stage lends a preemptor its reserved devices and keeps them after (and a
new plan is reserved by :mod:`.preemption` for this stage), its reserve stage holds devices
tentatively (a job's pods' too), its commit stage takes a node whose record is full out of
decisions; the reservations of plans no longer pending are given back through it.

A test that needs two replicas to race on one stale view wraps :meth:`Placer.commit` of
each (it is looked up on the instance for every attempt).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import msgspec
import nats
from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from schemas import codec, limits, subjects
from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    AllocRecord,
    AssignedNic,
    Assignment,
    ForwardReply,
    NodeAllocations,
)
from services.allocator import commits, metrics
from services.allocator.core import InvalidRequest, Placement, Unschedulable
from services.allocator.evictionplans import Preemptions
from services.allocator.readmodel import ReadModel
from services.allocator.replicas import Replicas
from services.allocator.requestbook import RequestBook
from services.runtime.kv.records import Conflict, RecordStore, RecordTooLarge
from services.runtime.nats.bus import TRANSIENT_NATS_ERRORS, Bus, Delivery, Refuse, Retry
from services.runtime.observe import tracing
from services.runtime.observe.logging import get_logger
from services.runtime.observe.tracing import (
    context_from_traceparent,
    current_traceparent,
    traceparent_of,
    tracer,
)

__all__ = ["MAX_COMMIT_ATTEMPTS", "Attempt", "Origin", "Placer", "build_assignment"]

log = get_logger(__name__)
_tracer = tracer("tandem.allocator", service="allocator")

MAX_COMMIT_ATTEMPTS = 8
# How long a replica waits for the replica it handed a request to. A replica that is gone
# answers at once (no responders); one that answers late is alive and busy, and still placing
# the request. A wait of a few seconds ran out under the seconds of queue of two replicas in
# open loop at 10,000 nodes (docs/benchmarks.md, "Measurements behind the code"). Half the
# message's ack wait (30 s): a request not answered by then is delivered again.
HAND_OVER_TIMEOUT_S = 15.0
# What the replica a request was handed to answers when it took it: placed there, placed or
# in hand already, rejected, or recorded pending there (it had claimed the request before a
# lost commit race left its shard without room).
TAKEN = ("assigned", "duplicate", "rejected", "pending")
# Where a request comes from: its message (which may be a redelivery), the pending retries
# (no message: the trace is the one its record keeps), or another replica that handed it over.
Origin = Literal["message", "retry", "forwarded"]
Decision = Placement | Unschedulable
# What the commit stage found: the allocation added, a device taken by another replica
# meanwhile, or the request held by a node record already (an earlier commit whose reply
# was lost, come back through the watch).
Committed = Literal["committed", "conflict", "placed"]
# Where an attempt stands between claim and commit: besides what a commit finds, claimed
# (the request record says assigned to the node), done (the request has an outcome
# already), full (the node's record has no room).
Step = Literal["claimed", "committed", "conflict", "placed", "done", "full"]


@dataclass(slots=True)
class Attempt:
    """One decision of a request on its way from reserve to announce."""

    request: AllocationRequest
    placement: Placement
    assignment: Assignment
    trace: str  # the request's traceparent, kept in its record
    context: Context  # the decision's span: the announcement is its child
    claimed: bool = False  # the request record says assigned to this node (claim stage)

    @property
    def node(self) -> str:
        return self.placement.node


class Placer:
    def __init__(
        self,
        bus: Bus,
        *,
        instance: str,
        model: ReadModel,
        book: RequestBook,
        node_allocs: RecordStore[NodeAllocations],
        replicas: Replicas,
        preemptions: Preemptions,
    ) -> None:
        self.bus = bus
        self.instance = instance
        self.model = model
        self.book = book
        self.node_allocs = node_allocs
        self.replicas = replicas
        self.preemptions = preemptions
        self._inflight: dict[str, asyncio.Future[str]] = {}  # request id → its outcome

    # -- the narrow interface ---------------------------------------------------------------

    def busy(self, request_id: str) -> bool:
        """Whether this replica has the request in hand now."""
        return request_id in self._inflight

    @property
    def in_hand(self) -> Collection[str]:
        """The request ids in this replica's hand (a live view)."""
        return self._inflight.keys()

    async def settled(self, request_id: str) -> None:
        """Return once no decision of ``request_id`` is in flight here (its outcome, whatever
        it was, is in the records then)."""
        running = self._inflight.get(request_id)
        if running is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(running)

    def decide_ahead(self, req: AllocationRequest) -> Decision | None:
        """Decide now and hold a placement's devices at once, before the next decision; hand
        the result to :meth:`place` (``ahead``), which gives the hold back unless the request
        is placed by it. None: the request is invalid (:meth:`place` rejects it)."""
        try:
            decision = self.decide(req)
        except InvalidRequest:
            return None
        if isinstance(decision, Placement):
            self.model.hold_tentative(
                decision.node,
                req.request_id,
                decision.devices(),
                shares=decision.shares(),
                sharing=decision.sharing,
            )
        return decision

    def elsewhere(self, node: str, request_id: str) -> bool:
        """Whether ``node`` is in another live replica's shard, and that replica may place
        ``request_id`` there as well as this one (no preemption reserved devices for it here):
        the retry pass leaves such a request to that replica's own pass."""
        return request_id not in self.model.reservations and self.replicas.owner(node) is not None

    def hold(self, node: str, key: str, devices: list[str]) -> None:
        """Hold devices of a decision taken elsewhere (a job's pod) while it commits."""
        self.model.hold_tentative(node, key, devices)

    def drop(self, node: str, key: str) -> None:
        """Give back what :meth:`hold` held, unless a node record holds it by now."""
        self.model.drop_tentative(node, key)

    def sweep_reserved(self, live: Collection[str]) -> None:
        """Give back the preemption reservations of requests no longer pending (``live``) and
        not in hand (:meth:`.Preemptions.sweep`)."""
        self.preemptions.sweep(live, busy=self.in_hand)

    # -- take -------------------------------------------------------------------------------

    async def on_request(self, event: object, delivery: Delivery) -> None:
        """The request consumer's handler: the allocator's entry for a request message."""
        if isinstance(event, AllocationRequest):
            await self.place(event, origin="message", context=delivery.context)
        else:
            log.warning("unexpected_message", subject=delivery.subject, kind=type(event).__name__)

    async def place(
        self,
        req: AllocationRequest,
        *,
        origin: Origin,
        context: Context | None = None,
        ahead: Decision | None = None,
    ) -> str:
        """Place one request; returns the outcome (``assigned``, ``pending``, ``rejected``,
        ``duplicate``). ``ahead``: a decision :meth:`decide_ahead` took for it."""
        rid = req.request_id
        result = "duplicate"
        try:
            if rid in self.model.placed:
                self.book.check_same(req)
                await self._republish(rid)
                return result
            running = self._inflight.get(rid)
            if running is not None:
                await asyncio.shield(running)  # the same request, already in hand
                return result
            result = await self._in_hand(req, origin=origin, context=context, ahead=ahead)
            return result
        finally:
            if isinstance(ahead, Placement) and result != "assigned":
                self.model.drop_tentative(ahead.node, rid)

    async def _in_hand(
        self, req: AllocationRequest, *, origin: Origin, context: Context | None, ahead: Decision | None
    ) -> str:
        rid = req.request_id
        outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._inflight[rid] = outcome
        try:
            result = await self._stages(req, origin=origin, context=context, ahead=ahead)
        except BaseException as exc:
            outcome.set_exception(exc)
            outcome.exception()  # retrieved: waiters re-raise it, nobody else must
            raise
        else:
            outcome.set_result(result)
            return result
        finally:
            del self._inflight[rid]

    async def _stages(
        self, req: AllocationRequest, *, origin: Origin, context: Context | None, ahead: Decision | None
    ) -> str:
        """decide → reserve → claim → commit → announce, decided again after a lost race."""
        rid = req.request_id
        # The request's trace: the one it arrived in, or — for a retry of a pending request —
        # the one its record keeps, so an hour of retries is one trace, not 720.
        retry = origin == "retry"
        trace = self.book.traceparent(rid) if retry else traceparent_of(context)
        if retry:
            context = context_from_traceparent(trace)
        was_pending = rid in self.book.pending  # for metrics.PENDING_AGE_AT_PLACEMENT_SECONDS
        claimed: str | None = None  # the node the request record says, once claimed
        # Handed over at most once, and never a request a preemption reserved devices for
        # here (the reservation is this replica's).
        may_hand_over = origin == "message" and rid not in self.model.reservations
        forwarded = origin == "forwarded"
        # Decide beyond this replica's shard: not for a request handed over to it, nor once
        # the owner of the node it would take said its shard has no room (that owner sees its
        # own decisions in flight, which this replica's view of its nodes lacks).
        fallback = not forwarded
        for _ in range(MAX_COMMIT_ATTEMPTS):
            with _tracer.start_as_current_span(
                "allocator.decide", context=context, kind=SpanKind.CONSUMER
            ) as span:
                _describe(span, req, retry=retry)
                if not trace:  # it came without one (a CLI that exports nothing): this
                    # decision starts its trace, kept in its record for the retries and the release
                    trace = current_traceparent() or ""
                    context = context_from_traceparent(trace)
                t0 = time.perf_counter()
                try:
                    decision = ahead if ahead is not None else self.decide(req, fallback=fallback)
                    ahead = None
                except InvalidRequest as exc:
                    # Retrying cannot help (e.g. a device class removed from the config after
                    # admission): say so once and stop, instead of redelivering forever.
                    _refused(span, "rejected", str(exc))
                    await self._reject(req, str(exc))
                    return "rejected"
                metrics.DECISION_SECONDS.observe(time.perf_counter() - t0)
                if isinstance(decision, Unschedulable):
                    if forwarded and claimed is None:  # the sender decides it on every node
                        _refused(span, "no_room", decision.reason)
                        return "no_room"
                    # Claimed here before a lost commit race: the request record names this
                    # replica, so this replica records what became of it.
                    _refused(span, "unschedulable", decision.reason)
                    return await self._unschedulable(req, decision, trace=trace, message=not retry)
                owner = self.replicas.owner(decision.node) if may_hand_over else None
                if owner is not None:
                    may_hand_over = False
                    answer = await self.hand_over(req, owner, span)
                    if answer in TAKEN:
                        return answer
                    # No room there: decide again on this shard only (pending, with two
                    # replicas); gone: decide again on every node and place it here.
                    fallback = answer != "no_room"
                    continue
                decided = trace_api.set_span_in_context(span, context)
                attempt = self.reserve(req, decision, trace=trace, context=decided)
                attempt.claimed = claimed == attempt.node
                done = await self._claim_and_commit(attempt, span)
            if attempt.claimed:
                claimed = attempt.node
            if done in ("assigned", "duplicate"):
                if done == "assigned":
                    await self.announce(attempt, was_pending=was_pending)
                return done
        raise Retry(f"request {rid}: lost the commit race {MAX_COMMIT_ATTEMPTS} times")

    # -- decide -----------------------------------------------------------------------------

    def decide(self, req: AllocationRequest, *, fallback: bool = True) -> Decision:
        """The replicas' decision, with the devices a preemption reserved for the request
        lent to it first (no await in between: decisions are serial); a refusal names the
        nodes the core does not count. ``fallback``: false for a request handed over by
        another replica (this replica's shard only). Raises InvalidRequest."""
        rid = req.request_id
        self.model.lend(rid)
        decision: Decision | None = None
        try:
            decision = self.replicas.decide(req, fallback=fallback)
        finally:
            self.model.keep(rid, taken=isinstance(decision, Placement))
        if isinstance(decision, Unschedulable):
            return self.model.explain(req.node_selector, decision)
        return decision

    async def _unschedulable(
        self, req: AllocationRequest, why: Unschedulable, *, trace: str, message: bool
    ) -> str:
        """Preempt when the request may, else record it ``pending`` with the reason and
        announce a new reason (``AllocationFailed``; see :mod:`.requestbook` for how often).
        ``message``: it may be a redelivery, so a plan recorded before is published again."""
        preempting = await self.preemptions.consider(req, why, traceparent=trace, republish=message)
        if preempting is not None:
            return preempting
        try:
            said = await self.book.record_pending(req, why, traceparent=trace)
        except commits.AlreadyDone:
            return "duplicate"
        if said is not None and said != why.reason:
            await self.bus.publish(
                subjects.ALLOC_FAILED,
                AllocationFailed(request_id=req.request_id, pod=req.pod, reason=limits.clip(why.reason)),
                msg_id=subjects.msg_id(req.request_id, "failed", zlib.crc32(why.reason.encode())),
            )
            log.info("unschedulable", request_id=req.request_id, reason=why.reason)
        return "pending"

    async def _reject(self, req: AllocationRequest, reason: str) -> None:
        await self.book.reject(req, reason)
        await self.bus.publish(
            subjects.ALLOC_FAILED,
            AllocationFailed(
                request_id=req.request_id, pod=req.pod, reason=limits.clip(reason), retrying=False
            ),
            msg_id=subjects.msg_id(req.request_id, "rejected"),
        )
        log.info("rejected", request_id=req.request_id, reason=reason)

    # -- hand over --------------------------------------------------------------------------

    async def hand_over(self, req: AllocationRequest, owner: str, span: Span) -> str | None:
        """Hand ``req`` to ``owner``, the replica whose shard holds the node this one would
        take: the outcome there (one of ``TAKEN``), ``no_room`` (its shard cannot take it), or
        None when the owner is gone (no responders: the request never reached it), and this
        replica places it itself. Raises :class:`Retry` when the owner took the request but
        said nothing of it (no answer in time, a NATS error on its side): it may have claimed
        or placed the request, so this replica must not decide it again now; the message comes
        back, and its records say then what became of it."""
        span.set_attribute("tandem.handed_to", owner)
        rid = req.request_id
        try:
            msg = await self.bus.request(subjects.allocator_forward(owner), req, timeout=HAND_OVER_TIMEOUT_S)
            reply = codec.FORWARD_REPLY.decode(msg.data)
        except nats.errors.NoRespondersError:
            metrics.FORWARDS.labels("gone").inc()
            log.info("hand_over_gone", request_id=rid, to=owner)
            return None
        except (nats.errors.Error, TimeoutError, *codec.DecodeErrors) as exc:
            metrics.FORWARDS.labels("unanswered").inc()
            raise Retry(f"request {rid} handed to {owner}: no answer ({exc!r})") from exc
        if reply.outcome in TAKEN:
            metrics.FORWARDS.labels("taken").inc()
            return reply.outcome
        if reply.outcome == "no_room":
            metrics.FORWARDS.labels("no_room").inc()
            return "no_room"
        metrics.FORWARDS.labels("unanswered").inc()
        raise Retry(f"request {rid} handed to {owner}: {reply.error or reply.outcome or 'no outcome'}")

    async def on_forward(self, event: object, delivery: Delivery) -> ForwardReply:
        """A request another replica handed over (:meth:`hand_over`), placed on this
        replica's shard only: ``no_room`` when the shard cannot take it."""
        if not isinstance(event, AllocationRequest):
            return ForwardReply(error=f"not an allocation request: {type(event).__name__}")
        try:
            outcome = await self.place(event, origin="forwarded", context=delivery.context)
        except (Retry, Refuse, *TRANSIENT_NATS_ERRORS) as exc:
            # In another replica's hand, a request id used for another request, or NATS in an
            # election: said to the sender, which goes on as with its own message.
            return ForwardReply(error=limits.clip(str(exc) or repr(exc)))
        return ForwardReply(outcome=outcome)

    # -- reserve ----------------------------------------------------------------------------

    def reserve(
        self, req: AllocationRequest, placement: Placement, *, trace: str, context: Context
    ) -> Attempt:
        """The wire assignment of ``placement``, its devices held tentatively: until the
        commit lands, the next decisions must see them as used."""
        note = ""
        if not placement.met:
            # Rare (a preferred scope missed), and it may decide once more: only then.
            self.model.catch_up()  # the reason looks beyond this replica's shard
            note = self.model.cluster.scope_reason(placement)
        assignment = build_assignment(req, placement, instance=self.instance, scope_note=note)
        self.model.hold_tentative(
            placement.node,
            req.request_id,
            assignment.device_ids(),
            shares=assignment.shares(),
            sharing=assignment.sharing,
        )
        return Attempt(request=req, placement=placement, assignment=assignment, trace=trace, context=context)

    async def _claim_and_commit(self, attempt: Attempt, span: Span) -> str:
        """Claim, then commit: ``assigned``, ``duplicate``, or ``conflict``/``full`` (decide
        again). The tentative hold is given back unless the commit landed."""
        node, rid = attempt.node, attempt.request.request_id
        span.set_attributes(
            {
                "tandem.candidates": attempt.placement.candidates,
                "tandem.scope": attempt.placement.scope,
                "k8s.node.name": node,
            }
        )
        step: Step = "claimed" if attempt.claimed else "conflict"
        why = ""
        try:
            if not attempt.claimed:
                step = await self.claim(attempt)
            if step == "claimed":
                step = await self.commit(attempt)
        except RecordTooLarge as exc:
            step, why = "full", str(exc)
        finally:
            if step != "committed":
                self.model.drop_tentative(node, rid)
        if step == "full":
            # This node's record has no room until an allocation leaves it: decide again
            # without the node. A request only it can take waits (pending, saying so)
            # instead of failing; it is not this request's fault.
            self.model.close_full(node, why)
            metrics.RECORD_FULL.inc()
            span.set_attributes({"tandem.outcome": "record_full", "tandem.reason": why})
            log.warning("node_record_full", node=node, request_id=rid, why=why)
            return "full"
        if step == "placed":
            # A node record holds this request already: an earlier commit of ours landed
            # though its reply was lost, and came back through the watch. Deciding again
            # would place the request a second time.
            await self._republish(rid, claimed=attempt.request)
            return "duplicate"
        if step == "done":
            if rid in self.model.placed:
                await self._republish(rid)
            return "duplicate"
        if step == "conflict":
            metrics.COMMIT_CONFLICTS.inc()
            return "conflict"
        return "assigned"

    # -- claim ------------------------------------------------------------------------------

    async def claim(self, attempt: Attempt) -> Step:
        """Write the request record as the outcome (``assigned`` to the node): ``claimed``,
        or ``placed`` (a node record holds the request already), or ``done`` (the request
        has an outcome already)."""
        if attempt.request.request_id in self.model.placed:
            return "placed"
        try:
            claimed = await self.book.claim(attempt.request, node=attempt.node, traceparent=attempt.trace)
        except Retry:
            metrics.CLAIMS_BUSY.inc()  # another live replica has it in hand: redelivered later
            raise
        if not claimed:
            return "done"
        attempt.claimed = True
        return "claimed"

    # -- commit -----------------------------------------------------------------------------

    async def commit(self, attempt: Attempt) -> Committed:
        """Add the allocation to the node's record (compare-and-set)."""
        req, assignment = attempt.request, attempt.assignment
        if req.request_id in self.model.placed:
            return "placed"  # held by a node record since the claim
        with _tracer.start_as_current_span("allocator.commit", kind=SpanKind.PRODUCER) as cspan:
            cspan.set_attributes(tracing.messaging(subjects.node_allocs(assignment.node), "publish"))
            rec = AllocRecord(
                assignment=assignment,
                priority=req.priority,
                traceparent=current_traceparent() or "",
                # A DeviceClaim's devices are never evicted for another request
                # (docs/sharing.md, "Preemption").
                preemptible=req.claim is None,
            )
            room = self._share_room(attempt.placement, assignment) if assignment.shares() else None
            try:
                await self.node_allocs.update(
                    assignment.node,
                    commits.add_allocation(assignment.node, req.request_id, rec, share_room=room),
                )
            except RecordTooLarge:
                raise
            except Conflict as exc:
                log.info("commit_conflict", node=assignment.node, request_id=req.request_id, why=str(exc))
                cspan.set_attribute("tandem.committed", False)
                return "conflict"
            except Exception:
                # The write may have landed although no reply came: read the record, so that
                # the handler run again finds the request placed instead of placing it anew.
                with contextlib.suppress(Exception):
                    await self.node_allocs.fetch(assignment.node)
                raise
            cspan.set_attribute("tandem.committed", True)
            return "committed"

    def _share_room(self, placement: Placement, assignment: Assignment) -> commits.ShareRoom:
        """What the node's GPUs can hold in shares, checked again by the commit against the
        node's record as it is then (:mod:`.commits`); the class's limit as the decision
        resolved it."""
        topo = self.model.cluster.topology(assignment.node)
        return commits.ShareRoom(
            memory_mib={g.id: g.memory_mib for g in topo.gpus()},
            max_shares=placement.spec.dc.max_shares_per_gpu,
        )

    # -- announce ---------------------------------------------------------------------------

    async def announce(self, attempt: Attempt, *, was_pending: bool) -> None:
        """The claim said ``assigned`` to this node and the node record holds it now. The
        event is published before the request is acked, so a lost event means a redelivery,
        which announces it again (take), not a pod that never hears back. It is a child of
        the decision, so the bridge's bind joins the trace."""
        req, assignment = attempt.request, attempt.assignment
        rid = req.request_id
        metrics.DECISIONS.labels("assigned").inc()
        waited = max(0.0, assignment.decided_at - req.created_at)
        metrics.REQUEST_TO_ASSIGNMENT_SECONDS.observe(waited)
        if was_pending:
            metrics.PENDING_AGE_AT_PLACEMENT_SECONDS.observe(waited)
        for pair in assignment.pairs:
            metrics.PAIRS.labels(pair.scope).inc()
        self.book.placed_now(rid)
        with tracing.within(attempt.context):
            await self.bus.publish(
                subjects.alloc_assigned(attempt.node), assignment, msg_id=subjects.msg_id(rid, "assigned")
            )
        log.debug("assigned", request_id=rid, node=attempt.node, scope=attempt.placement.scope)

    async def _republish(self, request_id: str, *, claimed: AllocationRequest | None = None) -> None:
        """Announce a committed assignment again (same msg id) and finish its request record."""
        node = self.model.placed[request_id]
        record = self.node_allocs.cached(node)
        rec = record[0].allocations.get(request_id) if record and record[0] else None
        if rec is None:
            return  # freed meanwhile
        trace = self.book.traceparent(request_id)
        if claimed is None and request_id in self.book.claims:
            claimed = self.book.claims[request_id].request
        if claimed is not None:
            # Committed, but the request record may not say so (its write was lost, or it
            # names the node of an earlier attempt): make it match the node record, or it
            # would be "recovered" again and again.
            await self.book.mark_assigned(claimed, node=node)
        # In the request's trace, like the first announcement: the bridge's bind joins it.
        with tracing.within(context_from_traceparent(trace)):
            await self.bus.publish(
                subjects.alloc_assigned(node), rec.assignment, msg_id=subjects.msg_id(request_id, "assigned")
            )


def _describe(span: Span, req: AllocationRequest, *, retry: bool) -> None:
    span.set_attributes(
        {
            "k8s.pod.uid": req.pod.uid,
            "k8s.pod.name": req.pod.name,
            "k8s.namespace.name": req.pod.namespace,
            "tandem.request_id": req.request_id,
            "tandem.gpus": req.gpus,
            "tandem.rdma": req.rdma,
        }
    )
    span.set_attributes(tracing.messaging(subjects.ALLOC_REQUEST, "process"))
    span.set_attribute("tandem.retry", retry)


def _refused(span: Span, outcome: str, reason: str) -> None:
    metrics.DECISIONS.labels(outcome).inc()
    span.set_attributes({"tandem.outcome": outcome, "tandem.reason": reason})
    span.set_status(
        Status(StatusCode.ERROR, limits.clip(reason, 500) if outcome == "unschedulable" else reason)
    )


def build_assignment(
    req: AllocationRequest, placement: Placement, *, instance: str, scope_note: str = ""
) -> Assignment:
    """The wire assignment for a placement, with the pod's network wishes applied per NIC;
    ``scope_note``: why its pairs are coarser than asked (``Cluster.scope_reason``)."""
    net = req.network
    nics: list[AssignedNic] = []
    for i, nic in enumerate(placement.nics):
        if net is not None:
            nic = msgspec.structs.replace(
                nic,
                ifname=f"{net.ifname_prefix}{i + 1}",
                mtu=net.mtu,
                addresses=[net.addresses[i]] if i < len(net.addresses) else [],
            )
        nics.append(nic)
    return Assignment(
        request_id=req.request_id,
        pod=req.pod,
        node=placement.node,
        gpus=list(placement.gpus),
        nics=nics,
        pairs=list(placement.pairs),
        scope=placement.scope,
        candidates=placement.candidates,
        allocator=instance,
        requested_at=req.created_at,
        sharing="hami" if placement.sharing == "hami" else "mps" if placement.sharing == "mps" else "",
        memory_limit="soft" if placement.memory_limit == "soft" else "hard",
        scope_note=limits.clip(scope_note),
    )
