"""Priority preemption in the allocator service: plan, record, ask for evictions, then place.

A request that may preempt (``preemption: lower-priority``, on the request or its device
class) and finds no room goes through :meth:`Preemptions.consider` instead of only being
recorded ``pending``. It reads the request as the failed decision resolved it (the
``Unschedulable``'s ``spec``: whether it may preempt, its priority), so nothing here
re-derives a default:

1. the core's step after the failed decision (``Cluster.preempt``, :mod:`.core.preempt`) names
   the victims: the fewest running allocations of lower priority, then the lowest priorities,
   then the best alignment (the order is in that module). Allocations being released, claims and other
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
   the Placer's decide stage (:mod:`.placer`) lends the request its reservation just before
   the decision (``ReadModel.lend``; no await in between, decisions are serial), so the
   request gets those devices — first in line whatever the priorities of the other pending
   requests.

Every replica keeps the reservation: the record carries the devices (``preempt_devices``), and
each replica reserves them as the record reaches it (:meth:`Preemptions._on_record`, told by
the request book's watch; the read model holds every reservation, ``ReadModel.reserve_for``),
keeps them while some replica has the request claimed, and drops them once the request is
placed, cancelled or rejected (:meth:`Preemptions.sweep`). Until the record
reaches another replica (a watch's delay), that replica could still decide on freed devices;
the compare-and-set writes keep every device held once whatever happens, and a request that
lost its devices plans again once its victims are gone. While any victim is still held the
request waits (no new plan, nothing written).
"""

from __future__ import annotations

import zlib
from collections.abc import Collection

from schemas import subjects
from schemas.messages import AllocationRequest, NodeAllocations, PreemptionPlan, RequestRecord, Victim
from services.allocator import commits, metrics
from services.allocator.core import Unschedulable, preempt
from services.allocator.readmodel import ReadModel, reservation_key
from services.allocator.requestbook import CLAIMED_STATES, RequestBook
from services.runtime.kv.records import RecordStore
from services.runtime.nats.bus import Bus
from services.runtime.observe.logging import get_logger

__all__ = ["Preemptions", "reservation_key"]

log = get_logger(__name__)


class Preemptions:
    def __init__(
        self,
        bus: Bus,
        *,
        instance: str,
        model: ReadModel,
        book: RequestBook,
        node_allocs: RecordStore[NodeAllocations],
    ) -> None:
        self.bus = bus
        self.instance = instance
        self.model = model
        self.book = book
        self.node_allocs = node_allocs
        book.on_record = self._on_record

    def sweep(self, live: Collection[str], *, busy: Collection[str]) -> None:
        """Drop the reservations of requests that are no longer pending (``live``), not in
        hand (``busy``: one being planned right now is not pending yet) and not claimed by a
        replica that is placing them."""
        claims = self.book.claims
        over = [r for r in self.model.reservations if r not in live and r not in busy and r not in claims]
        for rid in over:
            self.model.unreserve_for(rid)
            self.model.capacity.set()

    def waiting(self, req: AllocationRequest) -> bool:
        """Whether the request's recorded victims are still held somewhere (wait for them)."""
        known = self.book.store.cached(req.request_id)
        record = known[0] if known is not None else None
        if record is None or record.state != "pending" or not record.victims:
            return False
        return any(v in self.model.placed for v in record.victims)

    async def consider(
        self, req: AllocationRequest, why: Unschedulable, *, traceparent: str = "", republish: bool = False
    ) -> str | None:
        """Preempt for a request the decision found ``why`` unschedulable when it may: None
        when it may not or nothing can make room (the caller records it pending as usual), else
        the outcome (``pending``: victims being evicted; ``duplicate``: it has an outcome
        already).

        ``republish``: the request message is being handled (not a retry of a pending
        request), so it may be a redelivery: a plan already recorded is published again (same
        message id), in case the first publish was lost after the record was written."""
        spec = why.spec  # resolved by the decision: the PostFilter works on it
        if spec.preempt_below is None:
            return None
        rid = req.request_id
        if self.waiting(req):
            if republish:
                await self._publish_recorded(req)
            return "pending"
        self.model.catch_up()  # victims may be on any node
        plan = self.model.cluster.preempt(spec)
        if plan is None:
            return None
        # Reserved now, before any await: the next decisions must not take these devices.
        devices = plan.placement.devices()
        self.model.reserve_for(rid, plan.node, devices)
        victims = self._victims(plan)
        reason = (
            f"preempting {len(victims)} allocation{'' if len(victims) == 1 else 's'} of lower priority"
            f" on {plan.node}: " + ", ".join(f"{v.request_id} (priority {v.priority})" for v in victims)
        )
        try:
            await self.book.record_plan(
                req,
                victims=[v.request_id for v in victims],
                node=plan.node,
                devices=devices,
                reason=reason,
                traceparent=traceparent,
            )
        except commits.AlreadyDone:
            self.model.unreserve_for(rid)
            return "duplicate"
        except BaseException:
            self.model.unreserve_for(rid)
            raise
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
        if record is not None and record.state in CLAIMED_STATES and rid not in self.model.placed:
            return  # being placed (on the reserved devices, most likely): keep them until it is
        if not planned:
            if self.model.unreserve_for(rid):
                self.model.capacity.set()
            return
        assert record is not None and record.preempt_node is not None
        devices = list(record.preempt_devices)
        if self.model.reservations.get(rid) == (record.preempt_node, devices):
            return
        self.model.reserve_for(rid, record.preempt_node, devices)

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
