"""A job's writes, as pure mutations of the records they change (see :mod:`.jobs`).

Like :mod:`.commits`, each mutation decides from the fresh record it is given, never from the
replica's view, because :class:`~services.runtime.kv.records.RecordStore` re-applies it to the
record another writer left when its compare-and-set loses. The job record's mutations are the
protocol's decision points: only one of *commit* (``committing`` → ``committed``) and *abort*
(``committing`` → ``aborted``) of an epoch can ever succeed, because both require the record
to be ``committing`` with that epoch.
"""

from __future__ import annotations

import time

import msgspec

from schemas.messages import AllocRecord, JobRecord, JobRequest, NodeAllocations
from services.allocator.commits import AlreadyDone, DifferentRequest
from services.runtime.kv.records import Conflict, Mutation
from services.runtime.nats.bus import Retry

# A job whose record is in one of these has an outcome: nothing places it again.
JOB_DONE = frozenset({"committed", "rejected", "cancelled", "released"})


class Superseded(Exception):
    """The job record is no longer ``committing`` with this epoch: another replica aborted
    the attempt (it took this one for dead) or the job was cancelled. The attempt's prepared
    pods must be dropped."""


def same_job(a: JobRequest, b: JobRequest) -> bool:
    """The same job sent again (a redelivery, a resubmission): all but its send time."""
    return a == msgspec.structs.replace(b, created_at=a.created_at)


def check_same(current: JobRecord | None, job: JobRequest) -> None:
    if current is not None and current.state != "cancelled" and not same_job(current.job, job):
        raise DifferentRequest(
            f"job id {job.job_id!r} is already used by a different job ({current.state}); "
            "a new job needs a new id"
        )


def stale(record: JobRecord, *, now: float, claim_timeout: float) -> bool:
    """A ``committing`` record whose owner has not finished within ``claim_timeout``: taken
    for dead (a live owner that was only slow loses its commit, see :class:`Superseded`)."""
    return record.state == "committing" and now - record.updated_at >= claim_timeout


# -- job records -------------------------------------------------------------------------------


def begin(
    job: JobRequest,
    *,
    nodes: list[str],
    instance: str,
    now: float,
    claim_timeout: float,
    traceparent: str = "",
) -> tuple[Mutation[JobRecord], list[int]]:
    """Claim the job for a commit attempt on ``nodes``: ``committing`` with a new epoch.

    The epoch the attempt got is put in the returned list once the write landed. Raises
    :class:`AlreadyDone` when the job has an outcome, :class:`Retry` while another replica's
    attempt is live, and :class:`Superseded` with the stale record's epoch when an abandoned
    attempt must be rolled back first (the caller aborts it, then begins again)."""
    got: list[int] = []

    def mutate(current: JobRecord | None) -> JobRecord | None:
        check_same(current, job)
        if current is not None:
            if current.state in JOB_DONE:
                raise AlreadyDone(current.state)
            if current.state == "committing":
                if not stale(current, now=now, claim_timeout=claim_timeout):
                    raise Retry(f"job {job.job_id} is being committed by {current.owner}")
                raise Superseded(str(current.epoch))
        epoch = (current.epoch if current is not None else 0) + 1
        got[:] = [epoch]
        return JobRecord(
            job=job,
            state="committing",
            epoch=epoch,
            owner=instance,
            nodes=sorted(set(nodes)),
            reason=current.reason if current is not None else "",
            updated_at=now,
            traceparent=(current.traceparent if current is not None else "") or traceparent,
        )

    return mutate, got


def commit(epoch: int, *, placement: list[str]) -> Mutation[JobRecord]:
    """The commit point: ``committing`` (this epoch) → ``committed`` with pod → node."""

    def mutate(current: JobRecord | None) -> JobRecord | None:
        if current is None or current.state != "committing" or current.epoch != epoch:
            raise Superseded(f"job record is {current.state if current else 'gone'}")
        return msgspec.structs.replace(
            current, state="committed", placement=placement, updated_at=time.time()
        )

    return mutate


def abort(epoch: int, *, reason: str) -> Mutation[JobRecord]:
    """``committing`` (this epoch) → ``aborted``; raises :class:`AlreadyDone` when the
    attempt committed meanwhile (then it is rolled forward, not back)."""

    def mutate(current: JobRecord | None) -> JobRecord | None:
        if current is None or current.epoch != epoch:
            return None
        if current.state == "committed":
            raise AlreadyDone("committed")
        if current.state != "committing":
            return None
        return msgspec.structs.replace(current, state="aborted", reason=reason, updated_at=time.time())

    return mutate


def pending(job: JobRequest, *, reason: str) -> Mutation[JobRecord]:
    """Record the job ``pending`` with why it cannot be placed now (not over an outcome or a
    live attempt)."""

    def mutate(current: JobRecord | None) -> JobRecord | None:
        check_same(current, job)
        if current is not None and current.state in (*JOB_DONE, "committing"):
            if current.state == "committing":
                return None
            raise AlreadyDone(current.state)
        if current is not None and current.state == "pending" and current.reason == reason:
            return None
        return JobRecord(
            job=job,
            state="pending",
            epoch=current.epoch if current is not None else 0,
            reason=reason,
            updated_at=time.time(),
            traceparent=current.traceparent if current is not None else "",
        )

    return mutate


def finish(job: JobRequest, state: str, *, reason: str) -> Mutation[JobRecord]:
    """``rejected`` or ``cancelled``: an outcome without placement (not over a commit)."""

    def mutate(current: JobRecord | None) -> JobRecord | None:
        if current is not None and current.state in JOB_DONE:
            return None
        if current is not None and current.state == "committing":
            raise Retry(f"job {job.job_id} is being committed by {current.owner}")
        return JobRecord(
            job=current.job if current is not None else job,
            state=state,  # type: ignore[arg-type]
            epoch=current.epoch if current is not None else 0,
            reason=reason,
            updated_at=time.time(),
        )

    return mutate


# -- node allocation records -------------------------------------------------------------------


def prepare(node: str, pods: dict[str, AllocRecord]) -> Mutation[NodeAllocations]:
    """Reserve a job's pods on one node, all or none (``prepared``); :class:`Conflict` when a
    device went to someone else."""
    wanted = {d: rid for rid, rec in pods.items() for d in rec.assignment.device_ids()}

    def mutate(current: NodeAllocations | None) -> NodeAllocations | None:
        base = current if current is not None else NodeAllocations(node=node)
        mine = [rid for rid in pods if rid in base.allocations]
        if mine and all(base.allocations[rid].epoch == pods[rid].epoch for rid in pods):
            return None  # landed already (a retried write)
        if mine:
            raise Conflict(f"{node}: {', '.join(mine)} held by another attempt")
        clash = base.used() & wanted.keys()
        if clash:
            raise Conflict(f"{node}: {', '.join(sorted(clash))} held by another allocation")
        return NodeAllocations(node=node, allocations={**base.allocations, **pods})

    return mutate


def roll_forward(job_id: str, epoch: int) -> Mutation[NodeAllocations]:
    """The job committed: its prepared pods on this node become ``assigned`` (the agent's
    event)."""

    def mutate(current: NodeAllocations | None) -> NodeAllocations | None:
        if current is None:
            return None
        now = time.time()
        changed = {
            rid: msgspec.structs.replace(rec, state="assigned", updated_at=now)
            for rid, rec in current.allocations.items()
            if rec.job == job_id and rec.epoch == epoch and rec.state == "prepared"
        }
        if not changed:
            return None
        return msgspec.structs.replace(current, allocations={**current.allocations, **changed})

    return mutate


def roll_back(job_id: str, epoch: int) -> Mutation[NodeAllocations]:
    """Drop the prepared pods of one attempt (never a committed, assigned one)."""

    def mutate(current: NodeAllocations | None) -> NodeAllocations | None:
        if current is None:
            return None
        rest = {
            rid: rec
            for rid, rec in current.allocations.items()
            if not (rec.job == job_id and rec.epoch == epoch and rec.state == "prepared")
        }
        if len(rest) == len(current.allocations):
            return None
        return msgspec.structs.replace(current, allocations=rest)

    return mutate


def release_pods(job_id: str, *, only_from: frozenset[str]) -> Mutation[NodeAllocations]:
    """Every pod of ``job_id`` on this node → ``releasing`` (its agent cleans up)."""

    def mutate(current: NodeAllocations | None) -> NodeAllocations | None:
        if current is None:
            return None
        now = time.time()
        changed = {
            rid: msgspec.structs.replace(rec, state="releasing", updated_at=now)
            for rid, rec in current.allocations.items()
            if rec.job == job_id and rec.state in only_from
        }
        if not changed:
            return None
        return msgspec.structs.replace(current, allocations={**current.allocations, **changed})

    return mutate


def released(epoch: int) -> Mutation[JobRecord]:
    """A committed job whose pods are all freed → ``released``."""

    def mutate(current: JobRecord | None) -> JobRecord | None:
        if current is None or current.state != "committed" or current.epoch != epoch:
            return None
        return msgspec.structs.replace(current, state="released", updated_at=time.time())

    return mutate
