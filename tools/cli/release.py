"""``tandem release``: withdraw a request or a whole job, and by default wait until each node
verified its cleanup and the allocator freed the devices.

A request is released on the node that holds it (found from the allocation records; ``--node``
only checks it), or cancelled when it is not placed. A job (``--job``, or its id) is released
with one ``Release`` of the job id, then waited for pod by pod. The cleanup reports come from
``tandem.node.*.cleaned``, the frees from ``tandem.alloc.*``; a cleanup that was not verified
is a failure (the devices stay held and unhealthy).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from schemas import codec, subjects
from schemas.messages import Cleaned, Freed, JobRecord
from services.client import TandemClient
from tools.cli import workloads
from tools.cli.errors import CliError, CliFailure
from tools.cli.session import traced
from tools.cli.targets import job_target, target
from tools.cli.workloads import plural

if TYPE_CHECKING:
    from nats.aio.msg import Msg

DONE = frozenset({"freed", "cancelled", "rejected"})


async def release(client: TandemClient, args: argparse.Namespace) -> int:
    job = await job_target(client, args, live=True)
    if job is not None:
        return await _release_job(client, job, args)
    rid, record = await target(client, args, live=True)
    holder = await client.holder(rid)
    if record is None and holder is None:
        raise CliFailure(f"no request {rid!r} is known", hint="`tandem requests` lists the requests")
    node = holder[0] if holder is not None else None
    if args.node is not None and args.node != node:
        where = f"is on node {node}" if node else "is not placed on any node"
        raise CliError(
            f"request {rid} {where}, not {args.node}", hint="drop --node: release finds the node itself"
        )
    if holder is None and record is not None and record.state in DONE:
        print(f"request {rid} is {record.state} already: nothing to release")
        return 0
    pod = record.request.pod if record is not None else holder[1].assignment.pod if holder else None
    cleaned: list[Cleaned] = []
    sub = None
    if node is not None and args.wait:
        sub = await client.bus.nc.subscribe(subjects.node_cleaned(node), cb=_collect(rid, cleaned))
    try:
        parent = holder[1].traceparent if holder is not None else record.traceparent if record else ""
        traced(args.settings)
        await client.release(rid, node=node, pod=pod, traceparent=parent)
        print(f"release of {rid} sent" + (f" to node {node}" if node else " (not placed: cancels it)"))
        if not args.wait:
            return 0
        return await _wait_freed(client, rid, node, cleaned, timeout=args.timeout)
    finally:
        if sub is not None:
            await sub.unsubscribe()


def _collect(rid: str, into: list[Cleaned]) -> Callable[[Msg], Awaitable[None]]:
    return _collect_each({rid: into})


def _collect_each(into: dict[str, list[Cleaned]]) -> Callable[[Msg], Awaitable[None]]:
    """A callback keeping each cleanup report of the requests of ``into`` in its list."""

    async def on_msg(msg: Msg) -> None:
        try:
            event = codec.NODE_EVENT.decode(msg.data)
        except codec.DecodeErrors:
            return
        if isinstance(event, Cleaned) and event.request_id in into:
            into[event.request_id].append(event)

    return on_msg


async def _release_job(client: TandemClient, record: JobRecord, args: argparse.Namespace) -> int:
    """Release a whole job (``Release`` of the job id: every pod, or the job cancelled when it
    is not placed yet), then wait, pod by pod, for each node's verified cleanup and the free."""
    job = record.job
    jid = job.job_id
    if args.node is not None:
        raise CliError(f"{jid} is a job: its pods are released on their nodes", hint="drop --node")
    if record.state not in workloads.JOB_LIVE:
        print(f"job {jid} is {record.state} already: nothing to release")
        return 0
    pods = {
        rid: a.node
        for a in await client.allocations(record.nodes or None)
        for rid, rec in a.allocations.items()
        if rec.job == jid and rec.state != "prepared"
    }
    if record.state == "committed" and not pods:
        print(f"job {jid} is released already: nothing to release")  # its last pod freed just now
        return 0
    cleaned: dict[str, list[Cleaned]] = {rid: [] for rid in pods}
    sub = (
        await client.bus.nc.subscribe(subjects.NODE_CLEANED_ALL, cb=_collect_each(cleaned))
        if args.wait
        else None
    )
    try:
        traced(args.settings)
        await client.release(jid, pod=job.member(0), traceparent=record.traceparent)
        where = ", ".join(dict.fromkeys(sorted(pods.values())))
        print(
            f"release of job {jid} sent"
            + (f" ({plural(len(pods), 'pod')} on {where})" if pods else " (not placed: cancels it)")
        )
        if not args.wait:
            return 0
        deadline = time.monotonic() + args.timeout
        for rid, node in sorted(pods.items(), key=lambda p: int(p[0].rsplit("/", 1)[1])):
            left = max(0.01, deadline - time.monotonic())
            await _wait_freed(client, rid, node, cleaned[rid], timeout=left)
        if pods:
            print(f"job {jid} released: {plural(len(pods), 'pod')} freed")
            return 0
        while (now := await client.job_record(jid)) is None or now.state in workloads.JOB_LIVE:
            if time.monotonic() >= deadline:
                state = now.state if now is not None else "unknown"
                raise CliFailure(f"job {jid} not cancelled within {args.timeout:g}s (state: {state})")
            await asyncio.sleep(0.2)
        print(f"{now.state}: job {jid} was not placed; nothing was held")
        return 0
    finally:
        if sub is not None:
            await sub.unsubscribe()


async def _wait_freed(
    client: TandemClient, rid: str, node: str | None, cleaned: list[Cleaned], *, timeout: float
) -> int:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    told = 0
    while True:
        for report in cleaned[told:]:
            if report.ok:
                print(f"cleanup verified on {report.node}: {', '.join(report.devices) or 'no devices'}")
            else:
                raise CliFailure(
                    f"cleanup on {report.node} not verified: {'; '.join(report.problems)}",
                    hint="its devices stay held and unhealthy; `tandem status --devices` shows them",
                )
        told = len(cleaned)
        try:
            freed = await client.wait_for(rid, (Freed,), timeout=min(0.5, max(0.01, deadline - loop.time())))
        except TimeoutError:
            freed = None
        if freed is None:
            record = await client.request_record(rid)
            if record is not None and record.state in ("freed", "cancelled"):
                freed = Freed(request_id=rid, node=node)
        if isinstance(freed, Freed):
            for report in cleaned[told:]:
                if report.ok:
                    print(f"cleanup verified on {report.node}: {', '.join(report.devices) or 'no devices'}")
            if node is None:
                print(f"cancelled: {rid} was not placed; nothing was held")
            else:
                devices = freed.devices or (cleaned[-1].devices if cleaned else [])
                print(f"freed on {node}: {', '.join(devices) or 'its devices'}")
            return 0
        if loop.time() >= deadline:
            record = await client.request_record(rid)
            state = record.state if record is not None else "unknown"
            raise CliFailure(
                f"{rid} not freed within {timeout:g}s (state: {state})",
                hint=f"is the node agent of {node} running? `tandem explain {rid}`"
                if node
                else f"`tandem explain {rid}`",
            )
