"""``tandem requests`` (``tandem get requests``): one row per request, oldest first.

A row is read from the records of several buckets: the request record (KV
``tandem-requests``: pending, claimed, freed, cancelled, rejected, with the reason), the node
allocation records (KV ``tandem-allocs``: what each node holds, and whether it is being
released; the truth about what is held), the claim records (KV ``tandem-claims``: which pods
use a DeviceClaim) and the job records (KV ``tandem-jobs``: a whole job that is not placed yet
has one row of its own). ``explain`` shows one such row in full (:mod:`.explain`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

from schemas.messages import (
    AllocationRequest,
    AllocRecord,
    ClaimRecord,
    JobRecord,
    NodeAllocations,
    PodRef,
    RequestRecord,
)
from services.client import TandemClient
from tools.cli import workloads
from tools.cli.errors import CliFailure
from tools.cli.table import render_table
from tools.cli.views import age, asks_text, compact, emit, short, trace_id, without_id
from tools.cli.workloads import plural


@dataclass
class Row:
    """One request as `tandem requests` shows it."""

    request_id: str
    namespace: str
    pod: str
    state: str
    node: str | None
    devices: list[str]
    created_at: float
    updated_at: float
    reason: str
    gpus: int
    rdma: int
    device_class: str
    priority: int
    scope: str | None = None
    trace_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # Shared GPUs (docs/sharing.md): device id -> (memory MiB, compute percent).
    shares: dict[str, tuple[int, int]] = field(default_factory=dict)

    def asks(self) -> str:
        if not self.shares:
            return asks_text(self.gpus, self.rdma)
        mem, cores = next(iter(self.shares.values()))
        return asks_text(self.gpus, self.rdma, memory_mib=mem, cores_percent=cores)

    def as_dict(self, now: float) -> dict[str, Any]:
        shares = {d: {"memory_mib": m, "cores_percent": c} for d, (m, c) in self.shares.items()}
        return {
            "request_id": self.request_id,
            "pod": f"{self.namespace}/{self.pod}",
            "state": self.state,
            "node": self.node,
            "devices": self.devices,
            "age_s": round(now - self.created_at, 1),
            "reason": self.reason,
            "asks": {"gpus": self.gpus, "rdma": self.rdma, "device_class": self.device_class},
            "priority": self.priority,
            "scope": self.scope,
            "trace_id": self.trace_id,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            **self.extra,
            **({"shares": shares} if shares else {}),
        }


def state_of(record: RequestRecord | None, held: AllocRecord | None) -> str:
    """A request's state from its record and its node's allocation record (the node record
    is the truth about what is held; a request record saying ``assigned`` that no node holds
    is a claim whose commit has not landed: still being decided)."""
    if held is not None:
        # A job's pod reserved by the first phase of its commit is still being decided.
        return "deciding" if held.state == "prepared" else held.state
    if record is None:
        return "assigned"
    if record.state == "assigned":
        return "deciding"
    return record.state


def build_rows(
    records: dict[str, RequestRecord],
    allocs: list[NodeAllocations],
    claims: dict[str, ClaimRecord] | None = None,
    jobs: dict[str, JobRecord] | None = None,
) -> list[Row]:
    """One row per request; a DeviceClaim's request (``claim-<uid>``) also says which pods use
    the claim (from the bridge's record in ``tandem-claims``); a whole job has a row per pod once
    placed (``JOB/INDEX``, saying which job) and one row of its own until then."""
    claims = claims or {}
    jobs = jobs or {}
    held = {rid: (a.node, rec) for a in allocs for rid, rec in a.allocations.items()}
    rows = []
    for rid in set(records) | set(held):
        record = records.get(rid)
        node, alloc = held.get(rid, (None, None))
        req = record.request if record is not None else None
        assignment = alloc.assignment if alloc is not None else None
        pod = (
            req.pod
            if req is not None
            else assignment.pod
            if assignment is not None
            else PodRef(namespace="", name="")
        )
        state = state_of(record, alloc)
        reason = without_id(record.reason, rid) if record is not None else ""
        if state == "releasing" and not reason:
            reason = "waiting for the node to verify its cleanup"
        rows.append(
            Row(
                request_id=rid,
                namespace=pod.namespace,
                pod=pod.name,
                state=state,
                node=node or (record.node if record is not None else None),
                devices=assignment.device_ids() if assignment is not None else [],
                created_at=req.created_at
                if req is not None
                else (assignment.requested_at if assignment else 0.0),
                updated_at=max(record.updated_at if record else 0.0, alloc.updated_at if alloc else 0.0),
                reason=reason,
                gpus=req.gpus if req is not None else len(assignment.gpus if assignment else []),
                rdma=req.rdma if req is not None else len(assignment.nics if assignment else []),
                device_class=req.device_class if req is not None else "",
                priority=req.priority if req is not None else (alloc.priority if alloc else 0),
                scope=assignment.scope if assignment is not None else None,
                # The allocation's trace; a request not placed yet has its record's.
                trace_id=trace_id(
                    alloc.traceparent if alloc is not None else (record.traceparent if record else "")
                ),
                extra=_claim_extra(req, claims.get(rid)) or _job_extra(alloc, jobs),
                shares=assignment.shares() if assignment is not None else {},
            )
        )
    rows += [
        _waiting_job_row(record)
        for record in jobs.values()
        if record.state in ("pending", "committing", "aborted")
    ]
    return sorted(rows, key=lambda r: (r.created_at, r.request_id))


def _job_extra(alloc: AllocRecord | None, jobs: dict[str, JobRecord]) -> dict[str, Any]:
    if alloc is None or not alloc.job:
        return {}
    record = jobs.get(alloc.job)
    return {"job": {"id": alloc.job, "pods": record.job.pods if record is not None else None}}


def _waiting_job_row(record: JobRecord) -> Row:
    """A job not placed yet: one row under the job's id (it holds nothing, so no pod has one)."""
    job = record.job
    return Row(
        request_id=job.job_id,
        namespace=job.namespace,
        pod=workloads.job_name(job.job_id),
        state="deciding" if record.state == "committing" else "pending",
        node=None,
        devices=[],
        created_at=job.created_at,
        updated_at=record.updated_at,
        reason=record.reason,
        gpus=job.gpus,
        rdma=job.rdma,
        device_class=job.device_class,
        priority=job.priority,
        scope=job.scope,
        trace_id=trace_id(record.traceparent),
        extra={"job": {"id": job.job_id, "pods": job.pods}},
    )


def _claim_extra(req: AllocationRequest | None, record: ClaimRecord | None) -> dict[str, Any]:
    if req is None or req.claim is None:
        return {}
    return {
        "claim": {
            "name": req.claim.name,
            "shareable": req.claim.shareable,
            "expires_at": req.claim.expires_at,
            "phase": record.phase if record is not None else None,
            "pods": record.pods if record is not None else [],
        }
    }


def claim_note(row: Row) -> str:
    """``claim, used by a,b`` / ``claim, no pod yet`` for a claim's row, ``job X of N pods``
    for a job's (table output)."""
    job = row.extra.get("job")
    if job:
        if job["id"] == row.request_id:
            return f"job of {plural(job['pods'], 'pod')}"
        return f"job {job['id']}" + (f" of {plural(job['pods'], 'pod')}" if job["pods"] else "")
    claim = row.extra.get("claim")
    if not claim:
        return ""
    pods = claim["pods"]
    return "claim, used by " + ",".join(pods) if pods else "claim, no pod yet"


async def requests(client: TandemClient, args: argparse.Namespace) -> int:
    records = await client.request_records()
    allocs = await client.allocations()
    claims = await client.claim_records()
    jobs = await client.job_records()
    rows = [
        r
        for r in build_rows(records, allocs, claims, jobs)
        if (not args.state or r.state in args.state)
        and (args.node is None or r.node == args.node)
        and (args.namespace is None or r.namespace == args.namespace)
    ]
    if args.node is not None and not rows and args.node not in await client.node_records():
        # A typo would read as "nothing runs there"; a node that left keeps its history.
        raise CliFailure(f"no node {args.node!r} is known", hint="`tandem status` lists the nodes")
    now = time.time()
    if args.output in ("json", "yaml"):
        emit([r.as_dict(now) for r in rows], args.output)
        return 0
    wide = args.output == "wide"
    headers = ["request", "pod", "state", "node", "devices", "age", "reason"]
    if wide:
        headers += ["asks", "class", "scope", "priority", "trace"]
    table = []
    for r in rows:
        line = [
            r.request_id,
            f"{r.namespace}/{r.pod}",
            r.state,
            r.node or "-",
            (",".join(r.devices) if wide else compact(r.devices)) or "-",
            age(now - r.created_at),
            "; ".join(
                x
                for x in (
                    claim_note(r),
                    r.reason
                    if wide
                    else short(r.reason.split(": ", 1)[0] if r.state == "pending" else r.reason),
                )
                if x
            )
            or "-",
        ]
        if wide:
            line += [
                r.asks(),
                r.device_class or "-",
                r.scope or "-",
                str(r.priority),
                r.trace_id or "-",
            ]
        table.append(line)
    print(render_table(table, headers))
    if not rows:
        print("(no requests" + (" match the filters)" if args.state or args.node or args.namespace else ")"))
    return 0
