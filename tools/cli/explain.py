"""``tandem explain``: where one request or whole job stands and why (e.g. why a pod is
pending): what it asks, its state and last reason, its trace, and its assignment.

The request is named as for ``release`` (:mod:`.targets`); its row is the one ``tandem
requests`` would show (:func:`.request_rows.build_rows`), printed in full.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from schemas import codec
from schemas.messages import JobRecord, NodeAllocations
from services.client import TandemClient
from tools.cli import workloads
from tools.cli.errors import CliFailure
from tools.cli.request_rows import build_rows
from tools.cli.table import render_table
from tools.cli.targets import job_target, target
from tools.cli.views import ASSIGNMENT_HEADERS, age, asks_text, assignment_rows, emit, trace_id
from tools.cli.workloads import plural, rfc3339


async def explain(client: TandemClient, args: argparse.Namespace) -> int:
    job = await job_target(client, args, live=False)
    if job is not None:
        return await _explain_job(client, job, args)
    rid, rec = await target(client, args, live=False)
    holder = await client.holder(rid)
    if rec is None and holder is None:
        raise CliFailure(
            f"no request {rid!r} is known to the allocator",
            hint="it may not have been decided yet, or the id is wrong; `tandem requests` lists them",
        )
    node, alloc = holder if holder is not None else (None, None)
    claims = await client.claim_records() if rec is not None and rec.request.claim is not None else {}
    row = build_rows(
        {rid: rec} if rec is not None else {},
        [NodeAllocations(node=node, allocations={rid: alloc})] if node and alloc else [],
        claims,
    )[0]
    if args.output in ("json", "yaml"):
        doc = row.as_dict(time.time())
        doc["request"] = codec.to_builtins(rec.request) if rec is not None else None
        doc["assignment"] = codec.to_builtins(alloc.assignment) if alloc is not None else None
        emit(doc, args.output)
        return 0
    owner = "claim" if rec is not None and rec.request.claim is not None else "pod"
    print(f"request  {rid}  {owner} {row.namespace}/{row.pod}")
    if rec is not None:
        req = rec.request
        wanted = asks_text(
            req.gpus,
            req.rdma,
            memory_mib=req.gpu_memory_mib,
            cores_percent=req.gpu_cores_percent,
            mig_profile=req.mig_profile,
        )
        scope = f"scope {req.scope}" if req.scope else "the class's scope"
        policy = f"policy {req.policy}" if req.policy else "the class's policy"
        print(f"asks     {wanted}, class {req.device_class}, {scope}, {policy}")
        if req.claim is not None:
            print(
                f"claim    {_claim_line(req.claim.shareable, req.claim.expires_at, row.extra.get('claim'))}"
            )
    if alloc is not None and alloc.job:
        print(f"job      {alloc.job} (`tandem explain {alloc.job}` shows the whole job)")
    _print_state(
        row.state, node=row.node, created=rec.request.created_at if rec else None, updated=row.updated_at
    )
    if row.reason:
        print(f"reason   {row.reason}")
    if row.trace_id:
        print(f"trace    {row.trace_id}")
    if alloc is not None and alloc.assignment.scope_note:
        print(f"scope    {alloc.assignment.scope}, not as asked: {alloc.assignment.scope_note}")
    if alloc is not None:
        print(render_table(assignment_rows([alloc.assignment]), ASSIGNMENT_HEADERS))
    return 0


def _claim_line(shareable: bool, expires_at: float | None, known: dict[str, Any] | None) -> str:
    """How a claim holds its devices, and what the bridge (or ``tandem up``) says of it."""
    held = (
        f"a reservation until {rfc3339(expires_at)} (released then if no pod uses it)"
        if expires_at is not None
        else "held until released"
    )
    parts = [held, "shareable" if shareable else "one pod at a time"]
    if known and known.get("phase"):
        parts.append(f"phase {known['phase']}, pods {','.join(known['pods']) or '-'}")
    return "; ".join(parts)


def _print_state(state: str, *, node: str | None, created: float | None, updated: float) -> None:
    now = time.time()
    # How long it has waited counts from the submit; the last write may be a later retry.
    since = f"submitted {age(now - created)} ago, " if created is not None else ""
    print(
        f"state    {state}"
        + (f" on {node}" if node else "")
        + f" ({since}last update {age(now - updated)} ago)"
    )


async def _explain_job(client: TandemClient, record: JobRecord, args: argparse.Namespace) -> int:
    """A whole job: what it asks, where its record stands, and every pod's assignment."""
    job = record.job
    held = [
        (rec.assignment, rec.state)
        for a in await client.allocations(record.nodes or None)
        for rec in a.allocations.values()
        if rec.job == job.job_id
    ]
    held.sort(key=lambda h: int(h[0].request_id.rsplit("/", 1)[1]))
    if args.output in ("json", "yaml"):
        doc = {
            "job_id": job.job_id,
            "job": f"{job.namespace}/{workloads.job_name(job.job_id)}",
            "state": record.state,
            "reason": record.reason,
            "placement": record.placement,
            "trace_id": trace_id(record.traceparent),
            "request": codec.to_builtins(job),
            "assignments": [{**codec.to_builtins(a), "state": state} for a, state in held],
        }
        emit(doc, args.output)
        return 0
    print(f"job      {job.job_id}  job {job.namespace}/{workloads.job_name(job.job_id)}")
    scope = f"scope {job.scope}" if job.scope else "the class's scope"
    policy = f"policy {job.policy}" if job.policy else "the class's policy"
    extra = [f"fabric {job.fabric} ({job.fabric_policy})"] if job.fabric else []
    extra += [f"NVLink domain {job.nvlink_domain}"] if job.nvlink_domain else []
    each = asks_text(job.gpus, job.rdma)
    print(
        f"asks     {plural(job.pods, 'pod')} x ({each}), class {job.device_class}, {scope}, {policy}"
        + "".join(f", {e}" for e in extra)
    )
    nodes = ", ".join(dict.fromkeys(record.placement)) if record.state == "committed" else None
    _print_state(record.state, node=nodes, created=job.created_at, updated=record.updated_at)
    if record.reason and record.state != "committed":
        print(f"reason   {record.reason}")
    if record.traceparent:
        print(f"trace    {trace_id(record.traceparent)}")
    if held:
        print(render_table(assignment_rows([a for a, _ in held]), ASSIGNMENT_HEADERS))
    return 0
