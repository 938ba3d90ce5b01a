"""Pending requests, decided again when capacity may have grown.

A request that finds no place is recorded ``pending`` with its reason (:mod:`.requestbook`)
and its message acked, so no redelivery will bring it back: the allocator decides pending
requests again itself. :class:`PendingRetries` runs one pass over them when the read model
says capacity may have grown (:attr:`~services.allocator.readmodel.ReadModel.capacity`, set
by frees, recoveries and joins; a burst within ``RETRY_COALESCE_S`` is answered by one pass)
and every ``retry_interval``. A pass also takes up *abandoned claims* (a replica claimed a
request and died before committing it, see :mod:`.commits`), and the same loop sweeps
half-done job commits and retries pending jobs (:mod:`.jobs`).

A pass decides in priority order (then oldest first), every decision before anything waits;
only a request that finds a place (or has something new to say) goes on, as a task, through
the placement loop's :meth:`~services.allocator.service.Allocator.handle_request`. So a pass
over thousands of still-unschedulable requests writes nothing, and the commits of those that
found a place overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping

from schemas.messages import AllocationRequest
from services.allocator.core import InvalidRequest, Placement, Unschedulable
from services.allocator.jobs import Jobs
from services.allocator.preemption import Preemptions
from services.allocator.readmodel import ReadModel
from services.allocator.requestbook import RequestBook
from services.runtime.bus import Retry
from services.runtime.logging import get_logger

__all__ = ["RETRY_COALESCE_S", "PendingRetries"]

log = get_logger(__name__)

# Capacity events within this long are answered by one pass over the pending requests.
RETRY_COALESCE_S = 0.1

Decide = Callable[[AllocationRequest], Placement | Unschedulable]
Handle = Callable[..., Awaitable[str]]  # handle_request(req, first=decision) -> outcome


class PendingRetries:
    def __init__(
        self,
        *,
        model: ReadModel,
        book: RequestBook,
        preemptions: Preemptions,
        jobs: Jobs,
        inflight: Mapping[str, object],
        decide: Decide,
        handle: Handle,
        concurrency: int,
        retry_interval: float,
        every_interval: Callable[[], None] = lambda: None,
    ) -> None:
        self.model = model
        self.book = book
        self.preemptions = preemptions
        self.jobs = jobs
        self.inflight = inflight  # requests in this replica's hand (request id → outcome)
        self.decide = decide
        self.handle = handle
        self.concurrency = concurrency
        self.retry_interval = retry_interval
        self.every_interval = every_interval  # housekeeping of the service's, on the same clock

    async def run(self) -> None:
        last_housekeeping = last_sweep = 0.0
        while True:
            now = time.monotonic()
            if now - last_housekeeping >= self.retry_interval:
                last_housekeeping = now
                self.every_interval()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.model.capacity.wait(), self.retry_interval)
                # Frees come in bursts: answer a burst with one pass, not one pass per free.
                await asyncio.sleep(RETRY_COALESCE_S)
            self.model.capacity.clear()
            if self.book.pending or self.book.claims:
                await self.retry_pending()
            if now - last_sweep >= self.retry_interval:
                # Half-done job commits are rare; every retry_interval is soon enough.
                last_sweep = now
                await self.jobs.sweep()
            await self.jobs.retry_pending()

    async def retry_pending(self) -> int:
        """One pass (see the module); returns how many requests it placed."""
        self.preemptions.sweep(self.book.pending, busy=self.inflight)
        abandoned = self.book.abandoned(busy=self.inflight)
        candidates = {r.request_id: r for r in [*abandoned, *self.book.pending.values()]}
        order = sorted(candidates.values(), key=lambda r: (-r.priority, r.created_at))
        gate = asyncio.Semaphore(self.concurrency)

        async def retry(req: AllocationRequest, first: Placement | Unschedulable | None) -> bool:
            outcome = ""
            try:
                outcome = await self.handle(req, first=first)
                return outcome == "assigned"
            except Retry as r:
                log.info("retry_deferred", request_id=req.request_id, reason=str(r))
                return False
            finally:
                gate.release()
                if isinstance(first, Placement) and outcome != "assigned":
                    self.model.drop_tentative(first.node, req.request_id)

        tasks: list[asyncio.Task[bool]] = []
        for req in order:
            rid = req.request_id
            if rid not in self.book.pending and rid not in self.book.claims:
                continue
            if rid in self.inflight or rid in self.model.placed:
                continue
            await gate.acquire()
            try:
                decision = self.decide(req)
            except InvalidRequest:
                decision = None  # handle_request rejects it, with the reason
            if isinstance(decision, Unschedulable) and not self.book.reason_due(rid, decision):
                gate.release()
                continue
            if isinstance(decision, Placement):
                # Held now, before the next decision (the task holds it again, idempotently).
                self.model.hold_tentative(
                    decision.node, rid, decision.devices(), shares=decision.shares(), sharing=decision.sharing
                )
            # Held in ``tasks`` and gathered below: not a bare task.
            tasks.append(asyncio.get_running_loop().create_task(retry(req, decision)))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, asyncio.CancelledError):
                log.warning("retry_failed", error=repr(res))
        return sum(1 for res in results if res is True)
