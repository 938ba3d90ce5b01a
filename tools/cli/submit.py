"""``tandem submit``: send a pod's request, a claim's or a whole job, and say what happened.

:mod:`.workloads` builds what is sent from the flags, before connecting; one
:class:`~.workloads.Submission` carries any of the three, so sending, waiting and the output
are one piece of code: the first answer on the ids of :attr:`~.workloads.Submission.watch_ids`,
then ``--wait`` until the assignment of its first placed id, then the rest of a job's pods. A
request that stays pending is judged once more with the allocator's own core on every node
record (:func:`never_fits`): "busy now" and "no node could ever hold it" are different news.
Nothing here writes a record: requests and jobs are published as the pod bridge does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from schemas import codec
from schemas.messages import AllocationFailed, Assignment, Freed, NodeRecord, PreemptionPlan
from services.client import TandemClient
from tools.cli import workloads
from tools.cli.errors import CliFailure
from tools.cli.session import traced
from tools.cli.table import render_table
from tools.cli.views import ASSIGNMENT_HEADERS, age, assignment_rows, emit, trace_id, without_id
from tools.cli.workloads import LIVE, Submission, plural, rfc3339

if TYPE_CHECKING:
    from services.runtime.settings import Settings

FIRST_ANSWER_S = 10.0


async def never_fits(client: TandemClient, sub: Submission, settings: Settings) -> str | None:
    """Why no node of the cluster could ever hold the submission (all its devices free and
    healthy), or None when some node could. Decided by the allocator's own core on every node
    record — a job with its gang placement — with the device classes of this configuration."""
    from services.allocator.core import Cluster, InvalidRequest, Unschedulable
    from services.allocator.core.gang import JobUnschedulable, place_job

    device_class = sub.job.device_class if sub.job is not None else sub.request.device_class  # type: ignore[union-attr]
    if device_class not in settings.device_classes:
        # The running system's classes are not this command's ($TANDEM_CONFIG here may differ
        # from the allocator's): judging with a class it does not know would contradict the
        # allocator's own, right, reason. Say nothing more than the allocator did.
        return None
    nodes: dict[str, NodeRecord] = await client.node_records()
    cluster = Cluster(device_classes=settings.device_classes)
    for rec in nodes.values():
        cluster.set_node(rec.node, rec.topology)
    try:
        if sub.job is not None:
            verdict = place_job(cluster, sub.job, tiers=settings.fabric_tiers)
            never = verdict.reason if isinstance(verdict, JobUnschedulable) else None
        else:
            assert sub.request is not None
            result = cluster.decide(sub.request)
            never = result.reason if isinstance(result, Unschedulable) else None
    except InvalidRequest as exc:
        return str(exc)
    if never is None:
        return None
    if not nodes:
        return "the cluster has no nodes"
    return never.replace(" free ", " ")


def check_submit(args: argparse.Namespace) -> None:
    args.submission = workloads.build(args)


async def submit(client: TandemClient, args: argparse.Namespace) -> int:
    sub: Submission = args.submission
    submitted: list[str] = []
    try:
        return await _submit(client, args, submitted)
    except (KeyboardInterrupt, asyncio.CancelledError):
        if submitted:  # Ctrl-C stops the waiting, not the request: say so, and how to go on
            print(
                f"tandem: interrupted; {sub.noun} {sub.id} goes on without this command "
                f"(`tandem explain {sub.id}` follows it, `tandem release {sub.id}` withdraws it)",
                file=sys.stderr,
            )
        raise


@dataclass
class _Reply:
    """What submit answers: one ``state: reason`` line (and a hint), or with ``-o json|yaml``
    one document: ``result`` (what was submitted) with the state and reason added."""

    fmt: str
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def structured(self) -> bool:
        return self.fmt in ("json", "yaml")

    def say(self, line: str) -> None:
        """A progress line, for a person only (a document is printed once, at the end)."""
        if not self.structured:
            print(line)

    def said(self, state: str, reason: str, *, code: int = 1, hint: str = "") -> int:
        """The last word of a submit that was not placed; returns the exit code."""
        if self.structured:
            emit({**self.result, "state": state, "reason": reason}, self.fmt)
        else:
            print(f"{state}: {reason}")
            if hint:
                print(f"  ({hint})")
        return code


async def _submit(client: TandemClient, args: argparse.Namespace, submitted: list[str]) -> int:
    """Send, take the first answer, wait as asked, say what happened (module docstring)."""
    sub: Submission = args.submission
    reply = _Reply(fmt=args.output)
    if getattr(args, sub.kind, None) is not None and not args.new:
        await _refuse_second(client, sub)
    traced(args.settings)
    if sub.job is not None:
        submitted_trace = await client.submit_job(sub.job)
    else:
        assert sub.request is not None
        submitted_trace = await client.submit(sub.request)
    submitted.append(sub.id)
    if submitted_trace:
        reply.say(f"{sub.headline()}, trace {submitted_trace}")
    try:
        outcome = await _first_answer(client, sub, args)
    finally:
        if not submitted_trace:  # not exported: the allocator's answer says which trace it began
            submitted_trace = next((t for i in sub.watch_ids if (t := client.trace_of(i))), "")
            reply.say(f"{sub.headline()}" + (f", trace {submitted_trace}" if submitted_trace else ""))
    start = time.monotonic()
    reply.result = {
        ("job_id" if sub.job is not None else "request_id"): sub.id,
        sub.kind: f"{sub.ref.namespace}/{sub.ref.name}",
        "trace_id": submitted_trace,
    }
    placed = await _settle(client, sub, outcome=outcome, args=args, reply=reply, start=start)
    if isinstance(placed, int):
        return placed
    return await _assigned(client, sub, outcome=placed, reply=reply, submitted_trace=submitted_trace)


async def _first_answer(
    client: TandemClient, sub: Submission, args: argparse.Namespace
) -> Assignment | AllocationFailed | PreemptionPlan:
    """The allocator's first answer about the submission: within ``--timeout`` (without
    ``--wait``), else :data:`FIRST_ANSWER_S`."""
    first = args.timeout if args.timeout is not None and not args.wait else FIRST_ANSWER_S
    try:
        outcome = await client.wait_for(
            sub.watch_ids, (Assignment, AllocationFailed, PreemptionPlan), timeout=first
        )
    except TimeoutError:
        raise CliFailure(
            f"no answer about {sub.id} within {first:g}s",
            hint=f"is an allocator running? `tandem explain {sub.id}` shows where it stands",
        ) from None
    assert isinstance(outcome, Assignment | AllocationFailed | PreemptionPlan)
    return outcome


async def _settle(
    client: TandemClient,
    sub: Submission,
    *,
    outcome: Assignment | AllocationFailed | PreemptionPlan,
    args: argparse.Namespace,
    reply: _Reply,
    start: float,
) -> Assignment | int:
    """From the first answer to the assignment (waiting with ``--wait``), or the exit code
    after saying why there is none."""
    rid = sub.id
    if isinstance(outcome, PreemptionPlan):
        said = preempting(outcome)
        if not args.wait:
            return reply.said(
                "preempting",
                said,
                hint=f"placed once they are released; `tandem submit --wait` waits, "
                f"`tandem explain {rid}` follows it",
            )
        outcome = await _wait_assigned(
            client, rid, said, args, start=start, structured=reply.structured, sub=sub
        )
    if isinstance(outcome, AllocationFailed) and not outcome.retrying:
        return reply.said("rejected", without_id(outcome.reason, rid))
    if isinstance(outcome, AllocationFailed):
        waited = await _pending(client, sub, outcome=outcome, args=args, reply=reply, start=start)
        if isinstance(waited, int):
            return waited
        outcome = waited
    if isinstance(outcome, AllocationFailed):  # rejected while waiting
        return reply.said("rejected", without_id(outcome.reason, rid))
    return outcome


async def _pending(
    client: TandemClient,
    sub: Submission,
    *,
    outcome: AllocationFailed,
    args: argparse.Namespace,
    reply: _Reply,
    start: float,
) -> Assignment | AllocationFailed | int:
    """A submission that waits: "unschedulable" when no node could ever hold it, "pending"
    without ``--wait``, else what waiting brought."""
    rid = sub.id
    never = await never_fits(client, sub, args.settings)
    if never is not None:
        reply.result["never_fits"] = never
        reply.say(f"pending: {outcome.reason}")
        return reply.said(
            "unschedulable",
            f"no node of this cluster could ever hold it, even with every device free: {never}",
            hint=f"it stays pending until such a node joins; `tandem release {rid}` withdraws it",
        )
    if not args.wait:
        return reply.said(
            "pending",
            outcome.reason,
            hint=f"busy now; `tandem submit --wait` waits, `tandem explain {rid}` shows why",
        )
    reply.say(f"pending: {outcome.reason}")
    return await _wait_assigned(
        client, rid, outcome.reason, args, start=start, structured=reply.structured, sub=sub
    )


async def _assigned(
    client: TandemClient, sub: Submission, *, outcome: Assignment, reply: _Reply, submitted_trace: str
) -> int:
    """Say where the submission was placed (every pod of a job), with its trace."""
    placed = [outcome, *[await _assignment_of(client, pid) for pid in sub.placed_ids[1:]]]
    tid = submitted_trace or trace_id(
        client.headers_of(outcome.request_id, Assignment).get("traceparent", "")
    )
    if not tid:  # the allocation's trace, as its node record keeps it
        for allocs in await client.allocations([outcome.node]):
            held = allocs.allocations.get(outcome.request_id)
            tid = trace_id(held.traceparent) if held is not None else ""
    claim = sub.request.claim if sub.request is not None else None
    if reply.structured:
        done: dict[str, Any] = {**reply.result, "state": "assigned", "trace_id": tid}
        if sub.job is not None:
            done["assignments"] = [codec.to_builtins(a) for a in placed]
        else:
            done["assignment"] = codec.to_builtins(outcome)
        if claim is not None:
            done["expires_at"] = claim.expires_at
        emit(done, reply.fmt)
        return 0
    trace_note = f", trace {tid}" if tid else ""
    if sub.job is not None:
        nodes = ", ".join(dict.fromkeys(a.node for a in placed))
        print(f"assigned: {plural(len(placed), 'pod')} on {nodes}{trace_note}")
    else:
        print(f"assigned: node {outcome.node}, scope {outcome.scope}{trace_note}")
        if outcome.scope_note:
            print(f"  scope {outcome.scope}, not as asked: {outcome.scope_note}")
    print(render_table(assignment_rows(placed), ASSIGNMENT_HEADERS))
    if claim is not None:
        name = f"{sub.ref.namespace}/{sub.ref.name}"
        if claim.expires_at is not None:
            print(
                f"held by claim {name} until {rfc3339(claim.expires_at)} (a reservation: released then "
                f"if no pod uses it; `tandem release --claim {name}` frees it sooner)"
            )
        else:
            print(f"held by claim {name} until it is released (`tandem release --claim {name}`)")
    return 0


async def _assignment_of(client: TandemClient, rid: str) -> Assignment:
    """A job's other pods: their assignments are published together with the first one's."""
    try:
        found = await client.wait_for(rid, (Assignment,), timeout=FIRST_ANSWER_S)
    except TimeoutError:
        raise CliFailure(
            f"the job is committed but the assignment of {rid} did not arrive within {FIRST_ANSWER_S:g}s",
            hint=f"`tandem explain {rid.split('/')[0]}` shows every pod",
        ) from None
    assert isinstance(found, Assignment)
    return found


async def _refuse_second(client: TandemClient, sub: Submission) -> None:
    """A pod (a claim, a job) asks once: a second submit while its request is live would hold a
    second set of devices for one pod (and ``explain --pod`` would show only the newest)."""
    ref = f"{sub.ref.namespace}/{sub.ref.name}"
    flag = f"{sub.flag} {ref}"
    if sub.job is not None:
        jobs = workloads.jobs_named(await client.job_records(), sub.ref)
        held: list[tuple[str, str, str]] = [
            (j.job.job_id, j.state, "") for j in jobs if j.state in workloads.JOB_LIVE
        ]
    else:
        if sub.kind == "claim":
            records = workloads.claims_named(await client.request_records(), sub.ref)
        else:
            records = [r for r in await client.requests_of_pod(sub.ref) if r.request.claim is None]
        held = [
            (r.request.request_id, r.state, f" on {r.node}" if r.node else "")
            for r in records
            if r.state in LIVE
        ]
    if not held:
        return
    other, state, where = held[0]
    raise CliFailure(
        f"{sub.kind} {ref} already has {sub.noun} {other} ({state}{where})",
        hint=f"`tandem release {flag}` first, or --new for a second {sub.noun}",
    )


def preempting(plan: PreemptionPlan) -> str:
    """What a preemption plan means for the request that waits on it, in one line."""
    count = len(plan.victims)
    who = ", ".join(
        f"{v.request_id} (pod {v.pod.namespace}/{v.pod.name}, priority {v.priority})" for v in plan.victims
    )
    return f"evicting {count} allocation{'' if count == 1 else 's'} of lower priority on {plan.node}: {who}"


async def _wait_assigned(
    client: TandemClient,
    rid: str,
    said: str,
    args: argparse.Namespace,
    *,
    start: float,
    structured: bool,
    sub: Submission,
) -> Assignment | AllocationFailed:
    """Wait for the assignment (a job's: its first pod's), printing each new reason it stays
    pending for, each preemption made for it and each of its victims as it is freed, and a
    line every 30 s; gives up after ``--timeout`` when given."""
    deadline = None if args.timeout is None else start + args.timeout
    seen = 0
    last_print = time.monotonic()
    plans_seen = 0
    victims: dict[str, bool] = {}  # request id -> its release said

    def report_preemptions() -> None:
        nonlocal plans_seen, said
        plans = [e for e, _ in client.outcomes.get(rid, []) if isinstance(e, PreemptionPlan)]
        for plan in plans[plans_seen:]:
            said = preempting(plan)
            if not structured:
                print(f"preempting: {said}")
            victims.update({v.request_id: False for v in plan.victims if v.request_id not in victims})
        plans_seen = len(plans)
        for victim, told in victims.items():
            freed = [e for e, _ in client.outcomes.get(victim, []) if isinstance(e, Freed)]
            if freed and not told:
                victims[victim] = True
                if not structured:
                    print(f"victim released: {victim} freed on {freed[0].node or '-'}")

    while True:
        report_preemptions()
        if deadline is not None and time.monotonic() >= deadline:
            raise CliFailure(
                f"{rid} still pending after {args.timeout:g}s: {said}",
                hint=f"it stays pending; `tandem release {rid}` withdraws it",
            )
        step = 1.0 if deadline is None else max(0.05, min(1.0, deadline - time.monotonic()))
        try:
            outcome = await client.wait_for(sub.placed_ids[0], (Assignment,), timeout=step)
        except TimeoutError:
            pass
        else:
            # Its victims' frees were published before it was placed; the events may still be
            # on their way (another subscription): each step in its order.
            for victim in [v for v, told in victims.items() if not told]:
                with contextlib.suppress(TimeoutError):
                    await client.wait_for(victim, (Freed,), timeout=1.0)
            report_preemptions()
            return outcome  # type: ignore[return-value]
        events = [e for e, _ in client.outcomes.get(rid, []) if isinstance(e, AllocationFailed)]
        for event in events[seen:]:
            if not event.retrying:
                return event
            if event.reason != said and not structured:
                print(f"pending ({age(time.monotonic() - start)}): {event.reason}")
            said = event.reason
        seen = len(events)
        if not structured and time.monotonic() - last_print >= 30:
            print(f"still pending ({age(time.monotonic() - start)})")
            last_print = time.monotonic()
