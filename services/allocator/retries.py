"""Pending requests, decided again when capacity may have grown.

A request that finds no place is recorded ``pending`` with its reason (:mod:`.requestbook`)
and its message acked, so no redelivery will bring it back: the allocator decides pending
requests again itself. :class:`PendingRetries` runs one pass over them when the read model
says capacity may have grown (:attr:`~services.allocator.readmodel.ReadModel.capacity`, set
by frees, recoveries and joins; a burst within ``RETRY_COALESCE_S`` is answered by one pass)
and every ``retry_interval``. A pass also takes up *abandoned claims* (a replica claimed a
request and died before committing it, see :mod:`.requestbook`), and the same loop sweeps
half-done job commits and retries pending jobs (:mod:`.jobs`).

With several replicas every one runs passes over every pending request; a replica places
only the requests whose decision lands in its own shard, and leaves the others to the pass of
the node's owner (:meth:`.Placer.elsewhere`), as a request message is handed over.

A pass decides in priority order (then oldest first), every decision before anything waits;
only a request that finds a place (or has something new to say) goes on, as a task, through
the placement pipeline (:meth:`.Placer.place`, with the decision taken ahead and its devices
already held, so the next decision of the pass sees them as used). So a pass
over thousands of still-unschedulable requests writes nothing, and the commits of those that
found a place overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Collection
from typing import Protocol

from schemas.messages import AllocationRequest
from services.allocator.core import Placement, Unschedulable
from services.allocator.jobplacement import Jobs
from services.allocator.placer import Origin
from services.allocator.readmodel import ReadModel
from services.allocator.requestbook import RequestBook
from services.runtime.nats.bus import Retry
from services.runtime.observe.logging import get_logger

__all__ = ["RETRY_COALESCE_S", "PendingRetries"]

log = get_logger(__name__)

# Capacity events within this long are answered by one pass over the pending requests.
RETRY_COALESCE_S = 0.1

Decision = Placement | Unschedulable


class Placing(Protocol):
    """What the retries need of the :class:`~services.allocator.placer.Placer`."""

    @property
    def in_hand(self) -> Collection[str]: ...

    def busy(self, request_id: str) -> bool: ...

    def decide_ahead(self, req: AllocationRequest) -> Decision | None: ...

    def elsewhere(self, node: str, request_id: str) -> bool: ...

    def drop(self, node: str, key: str) -> None: ...

    def sweep_reserved(self, live: Collection[str]) -> None: ...

    async def place(
        self, req: AllocationRequest, *, origin: Origin, ahead: Decision | None = None
    ) -> str: ...


class PendingRetries:
    def __init__(
        self,
        *,
        model: ReadModel,
        book: RequestBook,
        jobs: Jobs,
        placer: Placing,
        concurrency: int,
        retry_interval: float,
    ) -> None:
        self.model = model  # read only: its capacity event and what the node records hold
        self.book = book
        self.jobs = jobs
        self.placer = placer
        self.concurrency = concurrency
        self.retry_interval = retry_interval

    async def run(self) -> None:
        last_sweep = 0.0
        while True:
            now = time.monotonic()
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
        placer = self.placer
        placer.sweep_reserved(self.book.pending)
        abandoned = self.book.abandoned(busy=placer.in_hand)
        candidates = {r.request_id: r for r in [*abandoned, *self.book.pending.values()]}
        order = sorted(candidates.values(), key=lambda r: (-r.priority, r.created_at))
        gate = asyncio.Semaphore(self.concurrency)

        async def retry(req: AllocationRequest, ahead: Decision | None) -> bool:
            try:
                return await placer.place(req, origin="retry", ahead=ahead) == "assigned"
            except Retry as r:
                log.info("retry_deferred", request_id=req.request_id, reason=str(r))
                return False
            finally:
                gate.release()

        tasks: list[asyncio.Task[bool]] = []
        for req in order:
            rid = req.request_id
            if rid not in self.book.pending and rid not in self.book.claims:
                continue
            if placer.busy(rid) or rid in self.model.placed:
                continue
            await gate.acquire()
            # Decided (and a placement held) now, before the next decision; an invalid
            # request (None) is rejected by place, with the reason.
            decision = placer.decide_ahead(req)
            if isinstance(decision, Unschedulable) and not self.book.reason_due(rid, decision):
                gate.release()
                continue
            if isinstance(decision, Placement) and placer.elsewhere(decision.node, rid):
                # Another live replica's node: its own pass places the request there, from a
                # view with its own decisions in flight, which this replica's commit would race.
                placer.drop(decision.node, rid)
                gate.release()
                continue
            # Held in ``tasks`` and gathered below: not a bare task.
            tasks.append(asyncio.get_running_loop().create_task(retry(req, decision)))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, asyncio.CancelledError):
                log.warning("retry_failed", error=repr(res))
        return sum(1 for res in results if res is True)
