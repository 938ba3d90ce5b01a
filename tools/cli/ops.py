"""The commands that talk to a running system over NATS (declared in :mod:`.stack_cmd`).

Where the answers come from: request records (KV ``tandem-requests``: pending, claimed,
freed, cancelled, rejected, with the reason), node allocation records (KV ``tandem-allocs``:
what each node holds, and whether it is being released), node records (KV ``tandem-nodes``:
hardware and health), job records (KV ``tandem-jobs``: where a whole job stands), claim
records (KV ``tandem-claims``, the bridge's or ``tandem up``'s view of a DeviceClaim) and the
events on ``tandem.alloc.*`` and ``tandem.node.*.cleaned``. Nothing here writes a record:
requests, jobs and releases are published as the pod bridge does.

``submit`` sends a pod's request, a claim's or a whole job (:mod:`.workloads` builds them) and
follows any of them with the same code: the first answer on the ids of
:attr:`~.workloads.Submission.watch_ids`, ``--wait`` until the assignment of its first placed
id, then the rest of a job's pods. ``release`` and ``explain`` take a job (``--job``, or its id)
on a path of their own, since a job has a record of its own and several allocations; a claim
is a request like a pod's and takes the request's path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from schemas import codec, subjects
from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    AllocRecord,
    AssignedGpu,
    Assignment,
    ClaimRecord,
    Cleaned,
    Freed,
    JobRecord,
    NodeAllocations,
    NodeRecord,
    PodRef,
    PreemptionPlan,
    RequestRecord,
)
from services.client import ClientError, TandemClient
from tools.cli import workloads
from tools.cli.conn import CliConnection
from tools.cli.errors import CliError, CliFailure, describe
from tools.cli.refs import check_request_id, parse_pod, parse_ref
from tools.cli.table import render_table
from tools.cli.workloads import LIVE, Submission, plural, rfc3339

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from services.runtime.settings import Settings

DONE = frozenset({"freed", "cancelled", "rejected"})
FIRST_ANSWER_S = 10.0
CLI_EXPORT_S = 1.0  # at most this long spent exporting a command's spans

Command = Callable[[TandemClient, argparse.Namespace], Awaitable[int]]


def cli_settings(
    service: str, *, config: str | None = None, defaults: dict[str, Any] | None = None, **overrides: Any
) -> Settings:
    from services.runtime.errors import SettingsError
    from services.runtime.settings import load_settings

    try:
        return load_settings(service, config=config, defaults=defaults, **overrides)
    except SettingsError as exc:
        where = "--config" if config else "$TANDEM_CONFIG"
        raise CliError(str(exc), hint=f"check {where} and the TANDEM_* variables") from None


async def with_client(args: argparse.Namespace, fn: Command) -> int:
    """Check the arguments, connect, run ``fn``, close; the errors a command can meet become
    one line. Input that is wrong whatever the system says is refused before connecting."""
    check = CHECKS.get(fn.__name__)
    if check is not None:
        check(args)
    settings = cli_settings("cli", nats_url=args.nats)
    conn = await CliConnection.open(settings.nats_url, settings=settings)
    args.settings = settings
    try:
        client = await TandemClient(conn).start()
        try:
            return await fn(client, args)
        finally:
            await client.close()
    except ClientError as exc:
        raise CliFailure(str(exc)) from None
    except (CliError, KeyboardInterrupt, BrokenPipeError, asyncio.CancelledError):
        raise
    except Exception as exc:
        known = describe(exc, nats_url=conn.url)
        if known is None:
            raise
        raise known from None
    finally:
        await conn.close()
        if "services.runtime.tracing" in sys.modules:  # a command that traced (see _traced)
            sys.modules["services.runtime.tracing"].shutdown_tracing(timeout_s=CLI_EXPORT_S)


def _traced(settings: Settings) -> None:
    """Set up tracing for a command that starts a request's trace (submit, release): the
    spans are exported when OTEL_EXPORTER_OTLP_ENDPOINT is set, and the trace id is printed
    either way. Only those commands pay for importing OpenTelemetry's SDK (~0.15 s)."""
    import logging

    from services.runtime.tracing import setup_tracing

    # A collector that is down or slow costs a command at most CLI_EXPORT_S, silently: the
    # exporter's retry warnings are not the command's output (its spans are then lost).
    logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.CRITICAL)
    setup_tracing("cli", otlp_endpoint=settings.otlp_endpoint, export_timeout=CLI_EXPORT_S)


# ---------------------------------------------------------------------------------------------
# output


def emit(data: Any, fmt: str) -> None:
    """``data`` (builtins) as JSON or YAML on stdout."""
    if fmt == "json":
        print(json.dumps(data, indent=2, sort_keys=False))
    else:
        import yaml

        sys.stdout.write(yaml.safe_dump(data, sort_keys=False, default_flow_style=False))


def age(seconds: float) -> str:
    """kubectl's way: 42s, 7m, 3h, 5d."""
    s = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size * (2 if unit != "m" else 1):
            return f"{s // size}{unit}"
    return f"{s}s"


def short(text: str, width: int = 70) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def compact(devices: list[str]) -> str:
    """Device ids in short: ``gpu0-3,6 mlx5_0,1`` for gpu0..gpu3, gpu6, mlx5_0, mlx5_1."""
    groups: dict[str, list[int]] = {}
    other: list[str] = []
    for dev in devices:
        m = re.fullmatch(r"(.*?)(\d+)", dev)
        if m is None:
            other.append(dev)
        else:
            groups.setdefault(m.group(1), []).append(int(m.group(2)))
    parts = []
    for prefix, numbers in groups.items():
        numbers = sorted(set(numbers))
        runs: list[str] = []
        start = prev = numbers[0]
        for n in [*numbers[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            runs.append(f"{start}-{prev}" if prev > start + 1 else ",".join(map(str, range(start, prev + 1))))
            if n is not None:
                start = prev = n
        parts.append(prefix + ",".join(runs))
    return " ".join(parts + other)


def without_id(reason: str, rid: str) -> str:
    """A reason without the ``request <id>: `` the allocator puts in front of some."""
    return reason.removeprefix(f"request {rid}: ")


def trace_id(traceparent: str) -> str:
    parts = traceparent.split("-")
    return parts[1] if len(parts) >= 4 else ""


ASSIGNMENT_HEADERS = ["pod", "node", "gpu", "nic", "alignment"]


def gpu_label(gpu: AssignedGpu) -> str:
    """A GPU as the assignment tables show it: ``4``, a share ``4 (20480 MiB, 25 %)``, a MIG
    instance ``1 (MIG 1g.10gb gpu1-mig9-0)``."""
    if gpu.mig is not None:
        return f"{gpu.index} (MIG {gpu.mig.profile} {gpu.mig.device})"
    if gpu.shared:
        return f"{gpu.index} ({share_size(gpu.memory_mib, gpu.cores_percent)})"
    return str(gpu.index)


def assignment_rows(assignments: list[Assignment]) -> list[list[str]]:
    """One row per GPU/NIC pair (pod and node on the first row of each pod); GPUs without a
    NIC of their own (GPU-only pods) are listed together on one row. A shared GPU shows the
    share's size, a MIG instance its profile and id."""
    rows: list[list[str]] = []
    for a in assignments:
        first = [f"{a.pod.namespace}/{a.pod.name}", a.node]
        by_index = {g.index: gpu_label(g) for g in a.gpus}
        paired = {p.gpu for p in a.pairs}
        lines = [[by_index.get(p.gpu, str(p.gpu)), p.nic, p.scope] for p in a.pairs]
        lonely = [gpu_label(g) for g in a.gpus if g.index not in paired]
        if lonely:
            lines.append([", ".join(lonely) if any(" " in x for x in lonely) else ",".join(lonely), "-", "-"])
        for i, line in enumerate(lines or [["-", "-", "-"]]):
            rows.append((first if i == 0 else ["", ""]) + line)
    return rows


# ---------------------------------------------------------------------------------------------
# which request


TARGET_FLAGS = ("pod", "claim", "job")


def check_target(args: argparse.Namespace) -> None:
    """Exactly one of an id, ``--pod``, ``--claim``, ``--job``, each well formed."""
    given = [f"--{f}" for f in TARGET_FLAGS if getattr(args, f, None) is not None]
    if args.request_id is not None:
        given.insert(0, "an id")
    if len(given) > 1:
        both = "both" if len(given) == 2 else "all"
        raise CliError(f"give one of an id, --pod, --claim or --job, not {both} ({' and '.join(given)})")
    if not given:
        raise CliError(
            "name the request: an ID, --pod NAMESPACE/NAME, --claim NAMESPACE/NAME or --job NAMESPACE/NAME",
            hint="`tandem requests` lists them",
        )
    if args.request_id is not None:
        check_request_id(args.request_id)
    for flag in TARGET_FLAGS:
        if getattr(args, flag, None) is not None:
            parse_ref(getattr(args, flag), flag=f"--{flag}")


async def target(
    client: TandemClient, args: argparse.Namespace, *, live: bool
) -> tuple[str, RequestRecord | None]:
    """The request a command names (its id, ``--pod`` or ``--claim``), and its record when
    there is one. ``live``: the one still live (release), else the newest."""
    check_target(args)
    if args.request_id is not None:
        rid = args.request_id
        return rid, await client.request_record(rid)
    if getattr(args, "claim", None) is not None:
        ref = parse_ref(args.claim, flag="--claim")
        what, hint = f"claim {ref.namespace}/{ref.name}", "`tandem status` lists the claims"
        records = workloads.claims_named(await client.request_records(), ref)
    else:
        ref = parse_pod(args.pod)
        what, hint = f"pod {ref.namespace}/{ref.name}", f"`tandem requests -n {ref.namespace}` lists them"
        records = [r for r in await client.requests_of_pod(ref) if r.request.claim is None]
    if not records:
        raise CliFailure(f"no request of {what} is known", hint=hint)
    alive = [r for r in records if r.state in LIVE]
    if live and len(alive) > 1:
        ids = ", ".join(r.request.request_id for r in alive)
        raise CliError(f"{what} has {len(alive)} live requests: {ids}", hint="name one by its id")
    chosen = (alive or records)[0] if live else records[0]
    if not live and len(alive) > 1:
        others = ", ".join(r.request.request_id for r in alive if r is not chosen)
        print(
            f"note: {what} has {len(alive)} live requests; the newest is shown, the others: {others}",
            file=sys.stderr,
        )
    return chosen.request.request_id, chosen


async def job_target(client: TandemClient, args: argparse.Namespace, *, live: bool) -> JobRecord | None:
    """The whole job a command names (``--job``, or an id that is a job's), or None when it
    names a request. ``live``: with ``--job``, the one still waiting or holding."""
    check_target(args)
    if getattr(args, "job", None) is None:
        return await client.job_record(args.request_id) if args.request_id is not None else None
    ref = parse_ref(args.job, flag="--job")
    records = workloads.jobs_named(await client.job_records(), ref)
    if not records:
        raise CliFailure(
            f"no job {ref.namespace}/{ref.name} is known", hint="`tandem requests` lists the jobs"
        )
    alive = [r for r in records if r.state in workloads.JOB_LIVE]
    return (alive or records)[0] if live else records[0]


# ---------------------------------------------------------------------------------------------
# requests


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


# ---------------------------------------------------------------------------------------------
# submit


new_request = workloads.new_request  # a pod's (or a claim's) request from submit's flags


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


async def _submit(client: TandemClient, args: argparse.Namespace, submitted: list[str]) -> int:
    sub: Submission = args.submission
    rid = sub.id
    structured = args.output in ("json", "yaml")
    if getattr(args, sub.kind, None) is not None and not args.new:
        await _refuse_second(client, sub)
    _traced(args.settings)
    if sub.job is not None:
        submitted_trace = await client.submit_job(sub.job)
    else:
        assert sub.request is not None
        submitted_trace = await client.submit(sub.request)
    submitted.append(rid)
    if not structured:
        trace_note = f", trace {submitted_trace}" if submitted_trace else ""
        print(f"{sub.headline()}{trace_note}")
    first = args.timeout if args.timeout is not None and not args.wait else FIRST_ANSWER_S
    try:
        outcome = await client.wait_for(
            sub.watch_ids, (Assignment, AllocationFailed, PreemptionPlan), timeout=first
        )
    except TimeoutError:
        raise CliFailure(
            f"no answer about {rid} within {first:g}s",
            hint=f"is an allocator running? `tandem explain {rid}` shows where it stands",
        ) from None
    start = time.monotonic()
    result: dict[str, Any] = {
        ("job_id" if sub.job is not None else "request_id"): rid,
        sub.kind: f"{sub.ref.namespace}/{sub.ref.name}",
        "trace_id": submitted_trace,
    }
    if isinstance(outcome, PreemptionPlan):
        said = preempting(outcome)
        if not args.wait:
            return _said(
                result,
                "preempting",
                said,
                structured,
                args.output,
                code=1,
                hint=f"placed once they are released; `tandem submit --wait` waits, "
                f"`tandem explain {rid}` follows it",
            )
        outcome = await _wait_assigned(client, rid, said, args, start=start, structured=structured, sub=sub)
    if isinstance(outcome, AllocationFailed) and not outcome.retrying:
        return _said(result, "rejected", without_id(outcome.reason, rid), structured, args.output, code=1)
    if isinstance(outcome, AllocationFailed):
        never = await never_fits(client, sub, args.settings)
        if never is not None:
            result["never_fits"] = never
            if not structured:
                print(f"pending: {outcome.reason}")
            return _said(
                result,
                "unschedulable",
                f"no node of this cluster could ever hold it, even with every device free: {never}",
                structured,
                args.output,
                code=1,
                hint=f"it stays pending until such a node joins; `tandem release {rid}` withdraws it",
            )
        if not args.wait:
            return _said(
                result,
                "pending",
                outcome.reason,
                structured,
                args.output,
                code=1,
                hint=f"busy now; `tandem submit --wait` waits, `tandem explain {rid}` shows why",
            )
        if not structured:
            print(f"pending: {outcome.reason}")
        outcome = await _wait_assigned(
            client, rid, outcome.reason, args, start=start, structured=structured, sub=sub
        )
    if isinstance(outcome, AllocationFailed):  # rejected while waiting
        return _said(result, "rejected", without_id(outcome.reason, rid), structured, args.output, code=1)
    assert isinstance(outcome, Assignment)
    placed = [outcome, *[await _assignment_of(client, pid) for pid in sub.placed_ids[1:]]]
    tid = submitted_trace or trace_id(
        client.headers_of(outcome.request_id, Assignment).get("traceparent", "")
    )
    if not tid:  # the allocation's trace, as its node record keeps it
        for allocs in await client.allocations([outcome.node]):
            held = allocs.allocations.get(outcome.request_id)
            tid = trace_id(held.traceparent) if held is not None else ""
    claim = sub.request.claim if sub.request is not None else None
    if structured:
        done: dict[str, Any] = {**result, "state": "assigned", "trace_id": tid}
        if sub.job is not None:
            done["assignments"] = [codec.to_builtins(a) for a in placed]
        else:
            done["assignment"] = codec.to_builtins(outcome)
        if claim is not None:
            done["expires_at"] = claim.expires_at
        emit(done, args.output)
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


def _said(
    result: dict[str, Any], state: str, reason: str, structured: bool, fmt: str, *, code: int, hint: str = ""
) -> int:
    if structured:
        emit({**result, "state": state, "reason": reason}, fmt)
    else:
        print(f"{state}: {reason}")
        if hint:
            print(f"  ({hint})")
    return code


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


# ---------------------------------------------------------------------------------------------
# release


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
        _traced(args.settings)
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
        _traced(args.settings)
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


# ---------------------------------------------------------------------------------------------
# explain


def share_size(memory_mib: int | None, cores_percent: int | None) -> str:
    """``20480 MiB, 25 %`` (what a share asked; 0 or None: not limited)."""
    parts = [f"{memory_mib} MiB" if memory_mib else "", f"{cores_percent} %" if cores_percent else ""]
    return ", ".join(p for p in parts if p) or "no limit"


def asks_text(
    gpus: int,
    rdma: int,
    *,
    memory_mib: int | None = None,
    cores_percent: int | None = None,
    mig_profile: str | None = None,
) -> str:
    """``2 GPUs + 2 NICs``, ``1 GPU share (20480 MiB, 25 % of each GPU) + 0 NICs``,
    ``2 MIG instances 1g.10gb + 1 NIC``."""
    if mig_profile is not None:
        what = f"{plural(gpus, 'MIG instance')} {mig_profile}"
    elif memory_mib is not None or cores_percent is not None:
        what = f"{plural(gpus, 'GPU share')} ({share_size(memory_mib, cores_percent)} of each GPU)"
    else:
        what = plural(gpus, "GPU")
    return f"{what} + {plural(rdma, 'NIC')}"


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


# ---------------------------------------------------------------------------------------------
# status, devices


def device_states(rec: NodeRecord, allocs: NodeAllocations | None) -> list[dict[str, Any]]:
    """Every device of a node and who holds it. A GPU may have several holders: the shares
    on it (each with its size) or its MIG instances (each with its profile); ``pod`` and
    ``request_id`` name the first, ``holders`` all of them."""
    holders: dict[str, list[dict[str, Any]]] = {}
    for r in allocs.allocations.values() if allocs else ():
        a = r.assignment
        who = {"pod": f"{a.pod.namespace}/{a.pod.name}", "request_id": a.request_id}
        for g in a.gpus:
            held: dict[str, Any] = dict(who)
            if g.shared:
                held.update(memory_mib=g.memory_mib or 0, cores_percent=g.cores_percent or 0)
            if g.mig is not None:
                held.update(mig_profile=g.mig.profile, mig_device=g.mig.device)
            holders.setdefault(f"gpu{g.index}", []).append(held)
        for n in a.nics:
            holders.setdefault(n.name, []).append(dict(who))
    out = []
    for kind, ids in (
        ("gpu", [g.id for g in rec.topology.gpus()]),
        ("nic", [n.id for n in rec.topology.nics()]),
    ):
        for dev in ids:
            h = rec.health.get(dev)
            held_by = sorted(holders.get(dev, []), key=lambda x: (x["pod"], x["request_id"]))
            shared = any("memory_mib" in x for x in held_by)
            out.append(
                {
                    "node": rec.node,
                    "device": dev,
                    "kind": kind,
                    "state": ("shared" if shared else "used") if held_by else "free",
                    "pod": held_by[0]["pod"] if held_by else None,
                    "request_id": held_by[0]["request_id"] if held_by else None,
                    "holders": held_by,
                    "healthy": h.healthy if h else True,
                    "cordoned": h.cordoned if h else False,
                    "reason": h.reason if h else "",
                }
            )
    return out


async def topology_live(client: TandemClient, args: argparse.Namespace) -> int:
    """``tandem topology show NODE --live``: the node's tree with each device's state now."""
    from services.topology.picture import render_as

    record = (await client.node_records()).get(args.source)
    if record is None:
        raise CliFailure(f"no node {args.source!r} is known", hint="`tandem status` lists the nodes")
    allocs = {a.node: a for a in await client.allocations([record.node])}
    states = {d["device"]: _device_state_text(d) for d in device_states(record, allocs.get(record.node))}
    if record.status != "ready":
        print(f"note: node {record.node} is {record.status}", file=sys.stderr)
    sys.stdout.write(render_as(record.topology, args.output, states=states))
    return 0


def _holder_text(holder: dict[str, Any]) -> str:
    if "memory_mib" in holder:
        return f"{holder['pod']} ({share_size(holder['memory_mib'], holder['cores_percent'])})"
    if "mig_profile" in holder:
        return f"{holder['pod']} (MIG {holder['mig_profile']} {holder['mig_device']})"
    return str(holder["pod"])


def _device_state_text(d: dict[str, Any]) -> str:
    holders = d.get("holders") or []
    if holders:
        verb = "shared by" if d["state"] == "shared" else "used by"
        text = f"{verb} " + ", ".join(_holder_text(h) for h in holders)
    else:
        text = "free"
    if d["cordoned"]:
        text += ", cordoned"
    if not d["healthy"]:
        text += f", unhealthy ({d['reason']})"
    elif d["cordoned"] and d["reason"]:
        text += f" ({d['reason']})"
    return text


async def _status_doc(
    client: TandemClient,
) -> tuple[list[NodeRecord], dict[str, NodeAllocations], list[ClaimRecord]]:
    nodes = sorted((await client.node_records()).values(), key=lambda r: r.node)
    allocs = {a.node: a for a in await client.allocations()}
    claims = sorted((await client.claim_records()).values(), key=lambda c: (c.namespace, c.name))
    return nodes, allocs, claims


CLAIM_HEADERS = ["claim", "phase", "node", "devices", "pods", "expires", "reason"]


def claim_rows(claims: list[ClaimRecord], *, now: float) -> list[list[str]]:
    return [
        [
            f"{c.namespace}/{c.name}" + (" (shareable)" if c.shareable else ""),
            c.phase,
            c.node or "-",
            compact(c.devices) or "-",
            ",".join(c.pods) or "-",
            ("in " + age(c.expires_at - now) if c.expires_at > now else "passed") if c.expires_at else "-",
            short(c.reason) or "-",
        ]
        for c in claims
    ]


async def status(client: TandemClient, args: argparse.Namespace) -> int:
    if not args.watch:
        await _status_once(client, args)
        return 0
    tty = sys.stdout.isatty() and args.output == "table"
    try:
        while True:
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J")
            if args.output == "table":
                print(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}  (every {args.interval:g}s; Ctrl-C to stop)")
            await _status_once(client, args, compact=True)
            sys.stdout.flush()
            await asyncio.sleep(args.interval)
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130  # the shell's code for Ctrl-C, as every other command (README)


async def _status_once(client: TandemClient, args: argparse.Namespace, *, compact: bool = False) -> None:
    nodes, allocs, claims = await _status_doc(client)
    if args.output in ("json", "yaml"):
        doc = {
            "nodes": [
                {
                    "node": rec.node,
                    "status": rec.status,
                    "gpus": len(rec.topology.gpus()),
                    "nics": len(rec.topology.nics()),
                    "allocations": len(allocs[rec.node].allocations) if rec.node in allocs else 0,
                    "unavailable": sorted(rec.unavailable()),
                    "devices": device_states(rec, allocs.get(rec.node)),
                }
                for rec in nodes
            ],
            "allocations": [
                {**codec.to_builtins(r.assignment), "state": r.state}
                for a in allocs.values()
                for r in a.allocations.values()
            ],
            "claims": [codec.to_builtins(c) for c in claims],
        }
        if compact and args.output == "json":
            print(json.dumps(doc))
        else:
            emit(doc, args.output)
        return
    rows = []
    device_rows = []
    for rec in nodes:
        devices = device_states(rec, allocs.get(rec.node))
        gpus = [d for d in devices if d["kind"] == "gpu"]
        nics = [d for d in devices if d["kind"] == "nic"]
        rows.append(
            [
                rec.node,
                rec.status,
                f"{sum(1 for d in gpus if d['pod'])}/{len(gpus)}",
                f"{sum(1 for d in nics if d['pod'])}/{len(nics)}",
                ",".join(sorted(rec.unavailable())) or "-",
                str(len(allocs[rec.node].allocations) if rec.node in allocs else 0),
            ]
        )
        device_rows += [[d["node"], d["device"], _device_state_text(d)] for d in devices]
    print(render_table(rows, ["node", "status", "gpus used", "nics used", "unavailable", "allocations"]))
    if not nodes:
        print("(no nodes have reported yet)")
    if args.devices:
        print()
        print(render_table(device_rows, ["node", "device", "state"]))
    assignments = [r.assignment for a in allocs.values() for r in a.allocations.values()]
    if assignments:
        print()
        print(render_table(assignment_rows(assignments), ASSIGNMENT_HEADERS))
    if claims:
        print()
        print(render_table(claim_rows(claims, now=time.time()), CLAIM_HEADERS))


def check_device(args: argparse.Namespace) -> None:
    if args.action == "list":
        if args.device is not None:
            raise CliError("`device list` takes at most a NODE", hint="e.g. tandem device list dgx-0")
        return
    if args.node is None or args.device is None:
        raise CliError(
            f"`device {args.action}` needs NODE and DEVICE",
            hint=f"e.g. tandem device {args.action} dgx-0 gpu3",
        )
    if args.output != "table":
        raise CliError("-o applies to `device list` only")


async def device(client: TandemClient, args: argparse.Namespace) -> int:
    if args.action == "list":
        nodes, allocs, _ = await _status_doc(client)
        if args.node is not None:
            nodes = [n for n in nodes if n.node == args.node]
            if not nodes:
                raise CliFailure(f"no node {args.node!r} is known", hint="`tandem status` lists the nodes")
        devices = [d for rec in nodes for d in device_states(rec, allocs.get(rec.node))]
        if args.output in ("json", "yaml"):
            emit(devices, args.output)
        else:
            print(
                render_table(
                    [[d["node"], d["device"], d["kind"], _device_state_text(d)] for d in devices],
                    ["node", "device", "kind", "state"],
                )
            )
        return 0
    return await _device_command(client, args)


async def _device_command(client: TandemClient, args: argparse.Namespace) -> int:
    import nats.errors

    known = await client.node_records()
    rec = known.get(args.node)
    if rec is None:
        raise CliFailure(f"no node {args.node!r} is known", hint="`tandem status` lists the nodes")
    devices = [g.id for g in rec.topology.gpus()] + [n.id for n in rec.topology.nics()]
    if args.device not in devices:
        raise CliFailure(
            f"node {args.node} has no device {args.device!r}",
            hint=f"its devices: {', '.join(devices)}; `tandem device list {args.node}`",
        )
    try:
        ev = await client.command(args.node, args.device, args.action, reason=args.reason)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        raise CliFailure(
            f"the agent of node {args.node} did not answer",
            hint=f"node status is {rec.status}; is its node agent running?",
        ) from None
    state = "healthy" if ev.healthy else "unhealthy"
    why = f" ({ev.reason})" if ev.reason else ""
    print(f"{ev.node}/{ev.device}: {state}{', cordoned' if ev.cordoned else ''}{why}")
    return 0


# ---------------------------------------------------------------------------------------------
# dead letters


async def dlq(client: TandemClient, args: argparse.Namespace) -> int:
    letters = await client.dead_letters(limit=args.limit)
    if args.output in ("json", "yaml"):
        emit(
            [
                {
                    "ts": d.ts,
                    "service": d.service,
                    "subject": d.subject,
                    "size": len(d.data),
                    "error": d.error,
                }
                for d in letters
            ],
            args.output,
        )
        return 0
    rows = [
        [
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d.ts)),
            d.service,
            d.subject,
            f"{len(d.data)} B",
            short(d.error, 100),
        ]
        for d in letters
    ]
    print(render_table(rows, ["time (UTC)", "service", "subject", "size", "error"]))
    return 0


# Argument checks that need no system, run before connecting (by command function name).
CHECKS: dict[str, Callable[[argparse.Namespace], None]] = {
    "submit": check_submit,
    "release": check_target,
    "explain": check_target,
    "device": check_device,
}
