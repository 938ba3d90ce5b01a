"""The allocator's free path: releases in, verified cleanups, devices back.

A request's devices come back in three steps, each idempotent (a redelivery finds the step
done and does the rest):

1. ``Release`` (the pod ended, or the request was cancelled): the allocation is marked
   ``releasing`` in its node's record; the node agent sees that there and cleans up. A release
   of a request not placed (yet) cancels its request record instead — unless another replica
   placed it meanwhile, which makes it an ordinary release. A whole job is released pod by pod
   (:meth:`services.allocator.jobplacement.Jobs.release`);
2. ``Cleaned`` from that node's agent (the subject names the node, and only its agent may
   publish there): only a *verified* cleanup of an allocation that node holds ``releasing``
   frees anything. An unverified one leaves the devices held (the agent keeps them unhealthy
   and retries) and says why in the request record;
3. the request record says ``freed``, *then* the allocation is dropped from the node's record,
   then ``Freed`` is announced. In the other order a crash between the two writes left the
   request ``assigned`` with no node holding it, and a replica that loaded the record took it
   for an abandoned claim and placed the released request again.

Everything here reads the allocator's read model (it writes none of it) and writes records
through the same :class:`~services.runtime.kv.records.RecordStore` as the placement pipeline
(:mod:`.placer`), whose decision of a request in flight a release waits for
(:meth:`.Placer.settled`).
"""

from __future__ import annotations

from typing import Protocol

from opentelemetry.trace import SpanKind

from schemas import subjects
from schemas.messages import Cleaned, Freed, NodeAllocations, Release
from services.allocator import commits
from services.allocator.jobplacement import Jobs
from services.allocator.readmodel import ReadModel
from services.allocator.requestbook import RequestBook
from services.runtime.kv.records import RecordStore
from services.runtime.nats.bus import Bus, Delivery, Retry
from services.runtime.observe import tracing
from services.runtime.observe.logging import get_logger
from services.runtime.observe.tracing import tracer

__all__ = ["Frees"]

log = get_logger(__name__)
_tracer = tracer("tandem.allocator", service="allocator")

# Allocations a release may mark ``releasing`` (a job pod only ``prepared`` is the job's).
RELEASABLE = frozenset({"assigned"})


class Settling(Protocol):
    """What the free path needs of the :class:`~services.allocator.placer.Placer`."""

    async def settled(self, request_id: str) -> None: ...


class Frees:
    def __init__(
        self,
        bus: Bus,
        *,
        model: ReadModel,
        node_allocs: RecordStore[NodeAllocations],
        book: RequestBook,
        jobs: Jobs,
        placer: Settling,
    ) -> None:
        self.bus = bus
        self.model = model
        self.node_allocs = node_allocs
        self.book = book
        self.jobs = jobs
        self.placer = placer  # whose decisions in flight a release waits for

    async def on_release(self, release: object, delivery: Delivery) -> None:
        """Handler of the releases consumer."""
        if not isinstance(release, Release):
            log.warning("unexpected_message", subject=delivery.subject, kind=type(release).__name__)
            return
        with _tracer.start_as_current_span(
            "allocator.release", context=delivery.context, kind=SpanKind.CONSUMER
        ) as span:
            span.set_attributes({"tandem.request_id": release.request_id})
            span.set_attributes(tracing.messaging(delivery.subject, "process"))
            await self.release(release)

    async def release(self, release: Release) -> None:
        rid = release.request_id
        if await self.jobs.release(rid):
            return  # a whole job: every pod of it
        node = await self.placement_of(rid)
        if node is None:
            outcome = await self.book.cancel(rid, pod=release.pod)
            if outcome == "cancelled":
                await self.bus.publish(
                    subjects.ALLOC_FREED, Freed(request_id=rid), msg_id=subjects.msg_id(rid, "freed")
                )
            if outcome != "placed":
                return
            # Placed by now (its decision was in flight on another replica): release it.
            node = await self.placement_of(rid)
            if node is None:
                raise Retry(f"release of {rid}: its placement is not visible yet")
        # The node's record says "releasing" (its agent cleans up on seeing it); the request
        # record keeps "assigned" until the devices are freed.
        await self.node_allocs.update(node, commits.set_state(rid, "releasing", only_from=RELEASABLE))

    async def placement_of(self, request_id: str) -> str | None:
        """The node holding ``request_id``, after any decision of it in flight finished."""
        await self.placer.settled(request_id)
        node = self.model.placed.get(request_id)
        if node is not None:
            return node
        record = await self.book.record(request_id)
        if record is not None and record.node and record.state in ("assigned", "releasing"):
            # Placed by another replica whose write this one's watch has not shown yet.
            await self.node_allocs.fetch(record.node)
        return self.model.placed.get(request_id)

    async def on_node_report(self, event: object, delivery: Delivery) -> None:
        """Handler of the node reports consumer (cleanup verdicts)."""
        if isinstance(event, Cleaned):
            await self.on_cleaned(event, delivery)
        else:
            log.warning("unexpected_message", subject=delivery.subject, kind=type(event).__name__)

    async def on_cleaned(self, cleaned: Cleaned, delivery: Delivery) -> None:
        """A node's cleanup verdict. Only for an allocation that node holds and that is being
        released (Bus.consume checked that the node named is the one the subject names, which
        only that node's agent may publish on): anything else changes nothing."""
        rid = cleaned.request_id
        if not cleaned.ok:
            # Never free devices whose cleanup was not verified; the agent keeps them
            # unhealthy and retries the cleanup, and a verified one frees them.
            if await self.releasing_on(cleaned.node, rid):
                log.warning(
                    "cleanup_unverified", request_id=rid, node=cleaned.node, problems=cleaned.problems
                )
                self.book.cleanup_unverified(rid, cleaned.problems)
            else:
                log.info("cleaned_ignored", request_id=rid, node=cleaned.node, ok=False)
            return
        with _tracer.start_as_current_span(
            "allocator.free", context=delivery.context, kind=SpanKind.CONSUMER
        ) as span:
            span.set_attributes({"tandem.request_id": rid, "k8s.node.name": cleaned.node})
            span.set_attributes(tracing.messaging(delivery.subject, "process"))
            if await self.releasing_on(cleaned.node, rid):
                # The outcome first, then the drop (see the module: step 3). A redelivery
                # still finds the allocation releasing and drops it.
                await self.book.freed(rid)
                drop = commits.drop_allocation(rid, only_from=frozenset({"releasing"}))
                await self.node_allocs.update(cleaned.node, drop)
            else:
                record = await self.book.record(rid)
                if record is None or record.state != "freed" or record.node != cleaned.node:
                    # Not being released on that node (a report about an allocation nobody
                    # released, or that the node does not hold): nothing to free.
                    log.info("cleaned_ignored", request_id=rid, node=cleaned.node)
                    return
                # Freed already: a redelivery because announcing it failed. Announce again.
            await self.bus.publish(
                subjects.ALLOC_FREED,
                Freed(request_id=rid, node=cleaned.node, devices=cleaned.devices),
                msg_id=subjects.msg_id(rid, "freed"),
            )
            log.debug("freed", request_id=rid, node=cleaned.node)

    async def releasing_on(self, node: str, request_id: str) -> bool:
        """Whether ``node``'s record holds ``request_id`` being released (read from the
        server when this replica's copy does not show it)."""
        for attempt in range(2):
            known = self.node_allocs.cached(node) if attempt == 0 else await self.node_allocs.fetch(node)
            record = known[0] if known is not None else None
            rec = record.allocations.get(request_id) if record is not None else None
            if rec is not None and rec.state == "releasing":
                return True
        return False
