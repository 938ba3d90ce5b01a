"""Whole jobs over JetStream: the commit that places every pod of a job or none.

A job (:class:`~schemas.messages.JobRequest`, subject ``tandem.alloc.job``) is decided by the
pure core (:func:`services.allocator.core.gang.place_job`) and committed across the nodes its
pods land on. JetStream KV has no multi-key transaction, so the commit is two-phase with the
job's own record as the single decision point:

* the **job record** (KV ``tandem-jobs``, key = job id, :class:`~schemas.messages.JobRecord`)
  says where the job stands; each commit attempt has its own ``epoch``;
* every pod is an allocation in its node's record (KV ``tandem-allocs``) under ``JOB/INDEX``,
  tagged with the job and the epoch that wrote it.

One attempt (one replica; each step a compare-and-set):

1. *decide* on the read model; every pod's devices are held tentatively;
2. *begin*: job record → ``committing`` with a new epoch, this replica as owner and the nodes
   it will write. Another replica's live attempt → ``Retry``; one older than
   ``claim_timeout`` is aborted first (its owner is taken for dead);
3. *prepare*: one write per node adds that node's pods as ``prepared`` — they hold their
   devices (no other request or job can take them) but no node agent acts on them. A device
   taken meanwhile (``Conflict``) aborts the attempt, which is decided again;
4. *commit*: job record ``committing`` (this epoch) → ``committed`` with pod → node. **This one
   write is the moment the job is placed.** If the record is no longer ``committing`` with this
   epoch (another replica aborted the attempt), the attempt's pods are dropped;
5. *roll forward*: per node, the epoch's ``prepared`` pods become ``assigned`` (the node
   agent's event), and an ``Assignment`` per pod is published; then the message is acked.

*Abort* (of one epoch): job record ``committing`` → ``aborted`` (fails when it committed
meanwhile: then the attempt is rolled forward instead), then the epoch's prepared pods are
dropped. Commit and abort both need the record ``committing`` with that epoch, so exactly one
of them can win, and an epoch never comes back once aborted (epochs only grow).

Every replica restores the invariant *a prepared pod lives only while its job record is
committing with its epoch* in a **sweep** (at start and every ``retry_interval``): for each
prepared pod it reads the job record from the server; committed with that epoch → roll
forward; committing with that epoch → leave it (or abort it once stale); anything else →
drop it. So a SIGKILL at any point leaves either a committed job, rolled forward by whoever
looks next, or — after ``claim_timeout`` — nothing held; the job message was never acked, so
it is delivered again and placed once. A pod's devices reach a pod only as ``assigned``,
which exists only after step 4: no device of a job is handed out unless all are.

Releasing ``JOB/INDEX`` releases that pod alone (the normal release path: the pod is an
ordinary allocation once assigned); releasing ``JOB`` releases every pod of the job (or
cancels a job not placed yet). A job whose pods are all freed is ``released``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections.abc import Sequence
from typing import Protocol

import msgspec
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from schemas import codec, limits, subjects
from schemas.messages import AllocationFailed, AllocRecord, Assignment, JobRecord, JobRequest, NodeAllocations
from services.allocator import commits, jobcommits
from services.allocator.core import InvalidRequest, Placement
from services.allocator.core.gang import DEFAULT_TIERS, JobPlacement, JobUnschedulable, place_job
from services.allocator.placer import build_assignment
from services.allocator.readmodel import ReadModel
from services.allocator.requestbook import REASON_REFRESH_S, reason_key
from services.runtime.kv.records import Conflict, RecordStore
from services.runtime.nats.bus import Bus, Delivery, Retry
from services.runtime.observe.logging import get_logger
from services.runtime.observe.tracing import current_traceparent, traceparent_of, tracer

__all__ = ["Jobs"]

log = get_logger(__name__)
_tracer = tracer("tandem.allocator", service="allocator")

MAX_ATTEMPTS = 8
# Records kept in memory: the live ones, and committed jobs (a release names them).
_RETAIN = frozenset({"pending", "committing", "aborted", "committed"})


class Holds(Protocol):
    """How a job's pods hold their devices while the job commits: through the reserve stage of
    the :class:`~services.allocator.placer.Placer` (besides the record watches, the only writer
    of the read model)."""

    def hold(self, node: str, key: str, devices: list[str]) -> None: ...

    def drop(self, node: str, key: str) -> None: ...


class Jobs:
    """The job half of an allocator replica; :class:`~services.allocator.service.Allocator`
    owns it and feeds it the job consumer, releases of job ids and its retry loop."""

    def __init__(
        self,
        bus: Bus,
        *,
        instance: str,
        model: ReadModel,
        node_allocs: RecordStore[NodeAllocations],
        holds: Holds,
        claim_timeout: float,
        tiers: Sequence[str] = DEFAULT_TIERS,
    ) -> None:
        self.bus = bus
        self.instance = instance
        self.model = model  # read only: the core, prepared pods
        self.node_allocs = node_allocs
        self.holds = holds
        self.claim_timeout = claim_timeout
        self.tiers = tuple(tiers)
        self.store: RecordStore[JobRecord] = RecordStore(
            bus, subjects.KV_JOBS, codec.JOB_RECORD, retain=lambda r: r.state in _RETAIN
        )
        self._inflight: dict[str, asyncio.Future[str]] = {}

    async def aclose(self) -> None:
        await self.store.aclose()

    # -- reading ----------------------------------------------------------------------------

    def known(self, job_id: str) -> JobRecord | None:
        cached = self.store.cached(job_id)
        return cached[0] if cached is not None else None

    async def fresh(self, job_id: str) -> JobRecord | None:
        """The job record as the server has it now (the sweep never acts on a stale copy)."""
        record, _ = await self.store.fetch(job_id)
        return record

    def waiting(self) -> list[JobRequest]:
        """Jobs to decide again: pending, aborted, or left committing by a dead replica."""
        now = time.time()
        out = []
        for cached in list(self.store.cache.values()):
            record = cached[0]
            if record is None or record.job.job_id in self._inflight:
                continue
            if record.state in ("pending", "aborted") or jobcommits.stale(
                record, now=now, claim_timeout=self.claim_timeout
            ):
                out.append(record.job)
        return sorted(out, key=lambda j: (-j.priority, j.created_at, j.job_id))

    # -- jobs -------------------------------------------------------------------------------

    async def on_job(self, event: object, delivery: Delivery) -> None:
        if isinstance(event, JobRequest):
            await self.handle(event, context=delivery.context)
        else:
            log.warning("unexpected_message", subject=delivery.subject, kind=type(event).__name__)

    async def handle(self, job: JobRequest, *, context: Context | None = None) -> str:
        """Place one job; returns ``assigned``, ``pending``, ``rejected`` or ``duplicate``."""
        running = self._inflight.get(job.job_id)
        if running is not None:
            await asyncio.shield(running)
            return "duplicate"
        outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._inflight[job.job_id] = outcome
        try:
            with _tracer.start_as_current_span(
                "allocator.job", context=context, kind=SpanKind.CONSUMER
            ) as span:
                span.set_attributes(
                    {
                        "tandem.job": job.job_id,
                        "tandem.pods": job.pods,
                        "tandem.gpus": job.gpus,
                        "tandem.rdma": job.rdma,
                    }
                )
                # A job that came without a trace (a CLI that exports nothing) is in this span's.
                trace = (traceparent_of(context) if context else "") or current_traceparent() or ""
                result = await self._place(job, traceparent=trace)
                span.set_attribute("tandem.outcome", result)
        except BaseException as exc:
            outcome.set_exception(exc)
            outcome.exception()
            raise
        else:
            outcome.set_result(result)
            return result
        finally:
            del self._inflight[job.job_id]

    async def retry_pending(self) -> int:
        placed = 0
        for job in self.waiting():
            try:
                placed += await self.handle(job) == "assigned"
            except Retry as r:
                log.info("job_retry_deferred", job=job.job_id, reason=str(r))
            except Exception as exc:  # one job's failure must not stop the others' retries
                log.warning("job_retry_failed", job=job.job_id, error=repr(exc))
        return placed

    async def _place(self, job: JobRequest, *, traceparent: str) -> str:
        for _ in range(MAX_ATTEMPTS):
            known = self.known(job.job_id)
            if known is not None and known.state in jobcommits.JOB_DONE:
                jobcommits.check_same(known, job)
                if known.state == "committed":
                    await self._roll_forward(known.job, known.epoch, known.nodes)
                return "duplicate"
            try:
                self.model.catch_up()  # a job spans the whole fleet
                decision = place_job(self.model.cluster, job, tiers=self.tiers)
            except InvalidRequest as exc:
                await self._finish(job, "rejected", str(exc))
                return "rejected"
            if isinstance(decision, JobUnschedulable):
                return await self._unschedulable(job, decision)
            held = [(p.node, job.pod_id(i)) for i, p in enumerate(decision.pods)]
            for (node, rid), p in zip(held, decision.pods, strict=True):
                self.holds.hold(node, rid, p.devices())
            try:
                result = await self._attempt(job, decision, traceparent=traceparent)
            finally:
                for node, rid in held:
                    self.holds.drop(node, rid)
            if result != "conflict":
                return result
        raise Retry(f"job {job.job_id}: lost the commit race {MAX_ATTEMPTS} times")

    async def _attempt(self, job: JobRequest, decision: JobPlacement, *, traceparent: str) -> str:
        nodes = [p.node for p in decision.pods]
        begin, got = jobcommits.begin(
            job,
            nodes=nodes,
            instance=self.instance,
            now=time.time(),
            claim_timeout=self.claim_timeout,
            traceparent=traceparent,
        )
        try:
            await self.store.update(job.job_id, begin, assume_absent=True)
        except jobcommits.Superseded as stale:
            record = await self.fresh(job.job_id)
            await self._abort(job.job_id, int(str(stale)), record.nodes if record else [], reason="abandoned")
            return "conflict"
        except commits.AlreadyDone:
            return await self._place_done(job)
        epoch = got[0]
        by_node: dict[str, dict[str, AllocRecord]] = {}
        trace = current_traceparent() or ""
        for i, p in enumerate(decision.pods):
            assignment = _assignment(job, i, p, instance=self.instance)
            rec = AllocRecord(
                assignment=assignment,
                state="prepared",
                priority=job.priority,
                traceparent=trace,
                job=job.job_id,
                epoch=epoch,
            )
            by_node.setdefault(p.node, {})[job.pod_id(i)] = rec
        try:
            await self.prepare(by_node)
        except Exception as exc:
            await self._abort(job.job_id, epoch, sorted(by_node), reason=f"prepare failed: {exc}")
            if isinstance(exc, Conflict):
                log.info("job_commit_conflict", job=job.job_id, epoch=epoch, why=str(exc))
                return "conflict"
            raise
        try:
            await self.store.update(job.job_id, jobcommits.commit(epoch, placement=nodes))
        except jobcommits.Superseded as exc:
            log.warning("job_attempt_superseded", job=job.job_id, epoch=epoch, why=str(exc))
            await self._drop(job.job_id, epoch, sorted(by_node))
            return "conflict"
        except Exception:
            # The write may have landed although no reply came: the server's record decides.
            record = await self.fresh(job.job_id)
            if record is None or record.state != "committed" or record.epoch != epoch:
                raise
        await self._roll_forward(job, epoch, sorted(by_node))
        log.info("job_assigned", job=job.job_id, pods=job.pods, nodes=len(by_node), tier=decision.tier)
        return "assigned"

    async def _place_done(self, job: JobRequest) -> str:
        record = await self.fresh(job.job_id)
        if record is not None and record.state == "committed":
            await self._roll_forward(record.job, record.epoch, record.nodes)
        return "duplicate"

    async def prepare(self, by_node: dict[str, dict[str, AllocRecord]]) -> None:
        """Step 3: every node's pods, all nodes at once. Raises the first failure after every
        write finished. (A crash test pauses a replica here, half-way, by wrapping it.)"""
        results = await asyncio.gather(
            *(self.node_allocs.update(n, jobcommits.prepare(n, pods)) for n, pods in by_node.items()),
            return_exceptions=True,
        )
        for res in results:
            if isinstance(res, BaseException):
                raise res

    async def _abort(self, job_id: str, epoch: int, nodes: Sequence[str], *, reason: str) -> None:
        try:
            await self.store.update(job_id, jobcommits.abort(epoch, reason=reason))
        except commits.AlreadyDone:
            record = await self.fresh(job_id)
            if record is not None:
                await self._roll_forward(record.job, epoch, nodes)
            return
        await self._drop(job_id, epoch, nodes)

    async def _drop(self, job_id: str, epoch: int, nodes: Sequence[str]) -> None:
        results = await asyncio.gather(
            *(self.node_allocs.update(n, jobcommits.roll_back(job_id, epoch)) for n in set(nodes)),
            return_exceptions=True,
        )
        for res in results:
            if isinstance(res, BaseException):
                # The sweep drops what is left; the caller's outcome stands.
                log.warning("job_rollback_failed", job=job_id, epoch=epoch, error=repr(res))

    async def _roll_forward(self, job: JobRequest, epoch: int, nodes: Sequence[str]) -> None:
        """Step 5 (idempotent): the epoch's pods become ``assigned``; each pod's assignment is
        published (the same message id every time, so JetStream stores it once)."""
        await asyncio.gather(
            *(self.node_allocs.update(n, jobcommits.roll_forward(job.job_id, epoch)) for n in set(nodes))
        )
        for node in sorted(set(nodes)):
            cached = self.node_allocs.cached(node)
            record = cached[0] if cached is not None else None
            for rid, rec in record.allocations.items() if record is not None else ():
                if rec.job == job.job_id and rec.epoch == epoch and rec.state != "prepared":
                    await self.bus.publish(
                        subjects.alloc_assigned(node), rec.assignment, msg_id=subjects.msg_id(rid, "assigned")
                    )

    async def _unschedulable(self, job: JobRequest, why: JobUnschedulable) -> str:
        known = self.known(job.job_id)
        said = known.reason if known is not None else None
        if (
            known is not None
            and known.state == "pending"
            and reason_key(known.reason) == reason_key(why.reason)
            and time.time() - known.updated_at < REASON_REFRESH_S
        ):
            # Only the counts moved: as for requests (.requestbook), not a write per retry.
            return "pending"
        try:
            await self.store.update(
                job.job_id, jobcommits.pending(job, reason=why.reason), assume_absent=True
            )
        except commits.AlreadyDone:
            return "duplicate"
        if said != why.reason:
            await self.bus.publish(
                subjects.ALLOC_FAILED,
                AllocationFailed(request_id=job.job_id, pod=job.member(0), reason=limits.clip(why.reason)),
                msg_id=subjects.msg_id(job.job_id, "failed", zlib.crc32(why.reason.encode())),
            )
            log.info("job_unschedulable", job=job.job_id, reason=why.reason)
        return "pending"

    async def _finish(self, job: JobRequest, state: str, reason: str) -> None:
        await self.store.update(job.job_id, jobcommits.finish(job, state, reason=reason))
        if state == "rejected":
            await self.bus.publish(
                subjects.ALLOC_FAILED,
                AllocationFailed(
                    request_id=job.job_id, pod=job.member(0), reason=limits.clip(reason), retrying=False
                ),
                msg_id=subjects.msg_id(job.job_id, "rejected"),
            )
            log.info("job_rejected", job=job.job_id, reason=reason)

    # -- release ----------------------------------------------------------------------------

    async def release(self, job_id: str) -> bool:
        """Release a whole job by its id; False when ``job_id`` names no job this replica
        knows (the caller treats it as a request id)."""
        record = self.known(job_id)
        if record is None:
            return False
        if record.state == "committed":
            for node in record.nodes:
                await self.node_allocs.update(
                    node, jobcommits.release_pods(job_id, only_from=frozenset({"assigned"}))
                )
            return True
        if record.state in ("pending", "aborted", "committing"):
            running = self._inflight.get(job_id)
            if running is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(running)
                return await self.release(job_id)
            await self._finish(record.job, "cancelled", "released before it was placed")
            return True
        return True  # finished already

    # -- the sweep --------------------------------------------------------------------------

    async def sweep(self) -> None:
        """Restore the invariant of the module docstring for every prepared pod in sight,
        and mark jobs whose pods are all gone ``released``."""
        attempts: dict[tuple[str, int], set[str]] = {}
        for node, held in list(self.model.prepared.items()):
            for attempt in held:
                attempts.setdefault(attempt, set()).add(node)
        for (job_id, epoch), nodes in attempts.items():
            if job_id in self._inflight:
                continue  # this replica's own attempt, in flight
            try:
                await self._settle(job_id, epoch, nodes)
            except Exception as exc:
                log.warning("job_sweep_failed", job=job_id, epoch=epoch, error=repr(exc))
        await self._mark_released()

    async def _settle(self, job_id: str, epoch: int, nodes: set[str]) -> None:
        record = await self.fresh(job_id)
        if record is not None and record.epoch == epoch:
            if record.state == "committed":
                log.info("job_roll_forward", job=job_id, epoch=epoch)
                await self._roll_forward(record.job, epoch, sorted(nodes | set(record.nodes)))
                return
            if record.state == "committing":
                if jobcommits.stale(record, now=time.time(), claim_timeout=self.claim_timeout):
                    log.warning("job_attempt_abandoned", job=job_id, epoch=epoch, owner=record.owner)
                    await self._abort(job_id, epoch, sorted(nodes | set(record.nodes)), reason="abandoned")
                return
        # No record, a later epoch, or this epoch aborted: the attempt is over for good.
        log.info("job_rollback", job=job_id, epoch=epoch, nodes=sorted(nodes))
        await self._drop(job_id, epoch, sorted(nodes))

    async def _mark_released(self) -> None:
        for job_id, (record, _) in list(self.store.cache.items()):
            if record is None or record.state != "committed" or job_id in self._inflight:
                continue
            if self._holds_pods(job_id, record.nodes):
                continue
            # This replica's copy may lag another replica's writes: ask the server.
            for node in record.nodes:
                await self.node_allocs.fetch(node)
            if not self._holds_pods(job_id, record.nodes):
                await self.store.update(job_id, jobcommits.released(record.epoch))

    def _holds_pods(self, job_id: str, nodes: Sequence[str]) -> bool:
        for node in nodes:
            cached = self.node_allocs.cached(node)
            record = cached[0] if cached is not None else None
            if record is not None and any(rec.job == job_id for rec in record.allocations.values()):
                return True
        return False


def _assignment(job: JobRequest, index: int, p: Placement, *, instance: str) -> Assignment:
    """Pod ``index``'s assignment: the single-request one, under the pod's id and name."""
    one = build_assignment(job.template(), p, instance=instance)
    return msgspec.structs.replace(one, request_id=job.pod_id(index), pod=job.member(index))
