"""Priority preemption in the allocator service: plan, record, ask for evictions, then place.

A request that may preempt (``preemption: lower-priority``, on the request or its device
class) and finds no room goes through :meth:`Preemptions.consider` instead of only being
recorded ``pending``:

1. the core's search (:func:`services.allocator.core.preempt.plan`) names the victims: the
   fewest running allocations of lower priority, then the lowest priorities, then the best
   alignment (the order is in that module). Allocations being released, claims and other
   protected holds, and the devices reserved for other preemptors are never victims;
2. the devices the request will get are *reserved* for it at once in this replica's read
   model (``ReadModel.reserve``, under a key that is not a request id), so that nothing
   decided meanwhile takes them when the victims free them (and in the other replicas' as
   the record reaches them, below);
3. the request record stays ``pending``, now with ``victims``, ``preempt_node``,
   ``preempt_devices`` and a reason naming them (``tandem requests`` / ``explain`` show it);
   the record is what every replica reads, so no replica plans a second eviction while the
   victims of the first are still held anywhere;
4. a :class:`~schemas.messages.PreemptionPlan` is published on ``tandem.alloc.preempt``
   (message id from the request and its victims, so a redelivered request publishes it
   once). The pod bridge evicts the victims' pods through the Kubernetes Eviction API, which
   respects PodDisruptionBudgets; their pods' ends release the allocations the normal way
   (``releasing`` → verified cleanup → freed);
5. when the victims' devices are freed the pending request is decided again (capacity grew):
   :meth:`Preemptions.decide` gives the reservation back just before the decision (no await
   in between, decisions are serial), so the request gets those devices — first in line
   whatever the priorities of the other pending requests.

Every replica keeps the reservation: the record carries the devices (``preempt_devices``), and
each replica reserves them as the record reaches it (:meth:`Preemptions._on_record`, told by
the request book), keeps them while some replica has the request claimed, and drops them once
the request is placed, cancelled or rejected (:meth:`Preemptions.sweep`). Until the record
reaches another replica (a watch's delay), that replica could still decide on freed devices;
the compare-and-set writes keep every device held once whatever happens, and a request that
lost its devices plans again once its victims are gone. While any victim is still held the
request waits (no new plan, nothing written).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass

from schemas import subjects
from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, NodeAllocations, PreemptionPlan, RequestRecord, Victim
from services.allocator import commits, metrics
from services.allocator.core import Placement, Unschedulable, preempt
from services.allocator.readmodel import ReadModel
from services.allocator.requestbook import RequestBook
from services.runtime.bus import Bus
from services.runtime.logging import get_logger
from services.runtime.records import Mutation, RecordStore

__all__ = ["Preemptions", "reservation_key"]

log = get_logger(__name__)

Decide = Callable[[AllocationRequest], Placement | Unschedulable]


def reservation_key(request_id: str) -> str:
    """The hold key of a preemptor's reserved devices: ``:`` never occurs in a request id."""
    return f"preempt:{request_id}"


@dataclass(slots=True)
class _Reserved:
    node: str
    devices: list[str]


class Preemptions:
    def __init__(
        self,
        bus: Bus,
        *,
        instance: str,
        model: ReadModel,
        book: RequestBook,
        node_allocs: RecordStore[NodeAllocations],
        device_classes: dict[str, DeviceClass],
    ) -> None:
        self.bus = bus
        self.instance = instance
        self.model = model
        self.book = book
        self.node_allocs = node_allocs
        self.device_classes = device_classes
        self.reserved: dict[str, _Reserved] = {}  # preemptor request id → its reservation
        book.on_record = self._on_record

    def decide(self, req: AllocationRequest, decide: Decide) -> Placement | Unschedulable:
        """``decide(req)`` with the request's own reservation given back first (synchronous:
        nothing else decides in between). Kept when the request still cannot be placed."""
        held = self.reserved.get(req.request_id)
        if held is None:
            return decide(req)
        key = reservation_key(req.request_id)
        self.model.unreserve(held.node, key)
        try:
            decision = decide(req)
        except BaseException:
            self.model.reserve(held.node, key, held.devices)
            raise
        if isinstance(decision, Placement):
            del self.reserved[req.request_id]
        else:
            self.model.reserve(held.node, key, held.devices)
        return decision

    def sweep(self, live: Collection[str], *, busy: Collection[str]) -> None:
        """Drop the reservations of requests that are no longer pending (``live``), not in
        hand (``busy``: one being planned right now is not pending yet) and not claimed by a
        replica that is placing them."""
        claims = self.book.claims
        for rid in [r for r in self.reserved if r not in live and r not in busy and r not in claims]:
            held = self.reserved.pop(rid)
            self.model.unreserve(held.node, reservation_key(rid))
            self.model.capacity.set()

    def waiting(self, req: AllocationRequest) -> bool:
        """Whether the request's recorded victims are still held somewhere (wait for them)."""
        known = self.book.store.cached(req.request_id)
        record = known[0] if known is not None else None
        if record is None or record.state != "pending" or not record.victims:
            return False
        return any(v in self.model.placed for v in record.victims)

    async def consider(
        self, req: AllocationRequest, *, traceparent: str = "", republish: bool = False
    ) -> str | None:
        """Preempt for an unschedulable request when it may: None when it may not or nothing
        can make room (the caller records it pending as usual), else the outcome
        (``pending``: victims being evicted; ``duplicate``: it has an outcome already).

        ``republish``: the request message is being handled (not a retry of a pending
        request), so it may be a redelivery: a plan already recorded is published again (same
        message id), in case the first publish was lost after the record was written."""
        if not preempt.may_preempt(req, self.device_classes):
            return None
        rid = req.request_id
        if self.waiting(req):
            if republish:
                await self._publish_recorded(req)
            return "pending"
        self.model.catch_up()  # victims may be on any node
        plan = preempt.plan(self.model.cluster, req)
        if plan is None:
            return None
        # Reserved now, before any await: the next decisions must not take these devices.
        old = self.reserved.pop(rid, None)
        if old is not None:
            self.model.unreserve(old.node, reservation_key(rid))
        devices = plan.placement.devices()
        self.model.reserve(plan.node, reservation_key(rid), devices)
        self.reserved[rid] = _Reserved(plan.node, devices)
        victims = self._victims(plan)
        reason = (
            f"preempting {len(victims)} allocation{'' if len(victims) == 1 else 's'} of lower priority"
            f" on {plan.node}: " + ", ".join(f"{v.request_id} (priority {v.priority})" for v in victims)
        )
        try:
            record = _record_plan(
                req,
                victims,
                node=plan.node,
                devices=devices,
                reason=reason,
                book=self.book,
                trace=traceparent,
            )
            await self.book.store.update(rid, record)
        except commits.AlreadyDone:
            self.sweep_one(rid)
            return "duplicate"
        except BaseException:
            self.sweep_one(rid)
            raise
        self.book.pending[rid] = req
        metrics.PREEMPTIONS.inc()
        metrics.PREEMPTED.inc(len(victims))
        await self._publish(req, plan.node, victims)
        log.info("preempting", request_id=rid, node=plan.node, victims=[v.request_id for v in victims])
        return "pending"

    async def _publish(self, req: AllocationRequest, node: str, victims: list[Victim]) -> None:
        ids = ",".join(v.request_id for v in victims)
        await self.bus.publish(
            subjects.ALLOC_PREEMPT,
            PreemptionPlan(
                request_id=req.request_id, pod=req.pod, node=node, priority=req.priority, victims=victims
            ),
            msg_id=subjects.msg_id(req.request_id, "preempt", zlib.crc32(ids.encode())),
        )

    async def _publish_recorded(self, req: AllocationRequest) -> None:
        """Publish the plan the request record holds again (its victims still held)."""
        known = self.book.store.cached(req.request_id)
        record = known[0] if known is not None else None
        if record is None or not record.preempt_node:
            return
        allocs = self.node_allocs.cached(record.preempt_node)
        held = allocs[0].allocations if allocs is not None and allocs[0] is not None else {}
        victims = [
            Victim(
                request_id=rid,
                pod=held[rid].assignment.pod,
                node=record.preempt_node,
                priority=held[rid].priority,
            )
            for rid in record.victims
            if rid in held
        ]
        if victims:
            await self._publish(req, record.preempt_node, victims)

    def _on_record(self, rid: str, record: RequestRecord | None) -> None:
        """Every replica keeps the devices a recorded plan names reserved while the request is
        pending with it (its own plans are reserved before the record is even written)."""
        planned = (
            record is not None
            and record.state == "pending"
            and bool(record.preempt_node)
            and bool(record.preempt_devices)
            and rid not in self.model.placed
        )
        held = self.reserved.get(rid)
        if record is not None and record.state in commits.CLAIMED_STATES and rid not in self.model.placed:
            return  # being placed (on the reserved devices, most likely): keep them until it is
        if not planned:
            if held is not None:
                self.sweep_one(rid)
                self.model.capacity.set()
            return
        assert record is not None and record.preempt_node is not None
        devices = list(record.preempt_devices)
        if held is not None and held.node == record.preempt_node and held.devices == devices:
            return
        self.sweep_one(rid)
        self.model.reserve(record.preempt_node, reservation_key(rid), devices)
        self.reserved[rid] = _Reserved(record.preempt_node, devices)

    def sweep_one(self, rid: str) -> None:
        held = self.reserved.pop(rid, None)
        if held is not None:
            self.model.unreserve(held.node, reservation_key(rid))

    def _victims(self, plan: preempt.Preemption) -> list[Victim]:
        known = self.node_allocs.cached(plan.node)
        record = known[0] if known is not None else None
        out = []
        for v in plan.victims:
            rec = record.allocations.get(v.request_id) if record is not None else None
            if rec is None:
                # A hold the read model has but the record not (cannot happen for a
                # preemptible hold, which comes from the record): nothing to evict.
                continue
            out.append(
                Victim(request_id=v.request_id, pod=rec.assignment.pod, node=plan.node, priority=v.priority)
            )
        return out


def _record_plan(
    req: AllocationRequest,
    victims: list[Victim],
    *,
    node: str,
    devices: list[str],
    reason: str,
    book: RequestBook,
    trace: str,
) -> Mutation[RequestRecord]:
    """The request record: still ``pending``, with the plan (unless it has an outcome)."""

    def mutate(current: RequestRecord | None) -> RequestRecord | None:
        commits.check_same(current, req)
        if current is not None and current.state in commits.TERMINAL_STATES:
            raise commits.AlreadyDone(current.state)
        claimed = current is not None and current.state in commits.CLAIMED_STATES
        # As RequestBook.record_pending: a live claim of another replica waits (Retry).
        if current is not None and claimed and book._held_elsewhere(current):
            raise commits.AlreadyDone(current.state)
        return RequestRecord(
            request=req,
            state="pending",
            reason=reason,
            traceparent=(current.traceparent if current is not None else "") or trace,
            victims=[v.request_id for v in victims],
            preempt_node=node,
            preempt_devices=devices,
        )

    return mutate
