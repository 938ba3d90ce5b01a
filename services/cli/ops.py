"""The commands that talk to a running system over NATS (declared in :mod:`.stack_cmd`).

Where the answers come from: request records (KV ``tandem-requests``: pending, claimed,
freed, cancelled, rejected, with the reason), node allocation records (KV ``tandem-allocs``:
what each node holds, and whether it is being released), node records (KV ``tandem-nodes``:
hardware and health) and the events on ``tandem.alloc.*`` and ``tandem.node.*.cleaned``.
Nothing here writes a record: requests and releases are published as the pod bridge does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from schemas import codec, subjects
from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    AllocRecord,
    Assignment,
    ClaimRecord,
    Cleaned,
    Freed,
    NetworkSpec,
    NodeAllocations,
    NodeRecord,
    PodRef,
    PreemptionPlan,
    RequestRecord,
)
from services.cli.conn import CliConnection
from services.cli.errors import CliError, CliFailure, describe
from services.cli.table import render_table
from services.client import ClientError, TandemClient

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from services.runtime.settings import Settings

REQUEST_ID = re.compile(r"^[A-Za-z0-9_=.-]{1,200}$")  # schemas.messages.RequestId
LIVE = frozenset({"pending", "deciding", "assigned", "releasing"})
DONE = frozenset({"freed", "cancelled", "rejected"})
FIRST_ANSWER_S = 10.0
CLI_EXPORT_S = 1.0  # at most this long spent exporting a command's spans

Command = Callable[[TandemClient, argparse.Namespace], Awaitable[int]]


def cli_settings(service: str, **overrides: Any) -> Settings:
    from services.runtime.errors import SettingsError
    from services.runtime.settings import load_settings

    try:
        return load_settings(service, **overrides)
    except SettingsError as exc:
        raise CliError(str(exc), hint="check $TANDEM_CONFIG and the TANDEM_* variables") from None


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


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


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


def assignment_rows(assignments: list[Assignment]) -> list[list[str]]:
    """One row per GPU/NIC pair (pod and node on the first row of each pod); GPUs without a
    NIC of their own (GPU-only pods) are listed together on one row."""
    rows: list[list[str]] = []
    for a in assignments:
        first = [f"{a.pod.namespace}/{a.pod.name}", a.node]
        paired = {p.gpu for p in a.pairs}
        lines = [[str(p.gpu), p.nic, p.scope] for p in a.pairs]
        lonely = [str(g.index) for g in a.gpus if g.index not in paired]
        if lonely:
            lines.append([",".join(lonely), "-", "-"])
        for i, line in enumerate(lines or [["-", "-", "-"]]):
            rows.append((first if i == 0 else ["", ""]) + line)
    return rows


# ---------------------------------------------------------------------------------------------
# which request


# Kubernetes' own rules: a namespace is a DNS label, a pod name a DNS subdomain.
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def parse_pod(text: str) -> PodRef:
    namespace, sep, name = text.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise CliError(f"--pod {text!r} is not NAMESPACE/NAME", hint="e.g. --pod team-a/trainer-0")
    if len(namespace) > 63 or not DNS_LABEL.match(namespace):
        raise CliError(
            f"--pod {text!r}: namespace {namespace!r} is not a Kubernetes namespace name",
            hint="lowercase letters, digits and '-', starting and ending with a letter or digit, at most 63",
        )
    if len(name) > 253 or not DNS_SUBDOMAIN.match(name):
        raise CliError(
            f"--pod {text!r}: {name!r} is not a Kubernetes pod name",
            hint="lowercase letters, digits, '-' and '.', starting and ending with a letter or digit",
        )
    return PodRef(namespace=namespace, name=name)


def check_request_id(rid: str) -> str:
    if not REQUEST_ID.match(rid):
        raise CliError(
            f"{rid!r} is not a request id",
            hint="ids are letters, digits and _=.- such as <pod uid>.1; `tandem requests` lists them",
        )
    return rid


def check_target(args: argparse.Namespace) -> None:
    if args.request_id is not None and args.pod is not None:
        raise CliError("give a request id or --pod, not both")
    if args.request_id is None and args.pod is None:
        raise CliError(
            "name the request: a REQUEST_ID or --pod NAMESPACE/NAME", hint="`tandem requests` lists them"
        )
    if args.request_id is not None:
        check_request_id(args.request_id)
    else:
        parse_pod(args.pod)


async def target(
    client: TandemClient, args: argparse.Namespace, *, live: bool
) -> tuple[str, RequestRecord | None]:
    """The request a command names (its id, or ``--pod``), and its record when there is one.
    ``live``: with ``--pod``, the pod's request that is still live (release), else its newest."""
    check_target(args)
    if args.request_id is not None:
        rid = args.request_id
        return rid, await client.request_record(rid)
    pod = parse_pod(args.pod)
    records = await client.requests_of_pod(pod)
    if not records:
        raise CliFailure(
            f"no request of pod {pod.namespace}/{pod.name} is known",
            hint=f"`tandem requests -n {pod.namespace}` lists that namespace's requests",
        )
    alive = [r for r in records if r.state in LIVE]
    if live and len(alive) > 1:
        ids = ", ".join(r.request.request_id for r in alive)
        raise CliError(
            f"pod {pod.namespace}/{pod.name} has {len(alive)} live requests: {ids}", hint="name one by its id"
        )
    chosen = (alive or records)[0] if live else records[0]
    if not live and len(alive) > 1:
        others = ", ".join(r.request.request_id for r in alive if r is not chosen)
        print(
            f"note: pod {pod.namespace}/{pod.name} has {len(alive)} live requests; the newest is shown, "
            f"the others: {others}",
            file=sys.stderr,
        )
    return chosen.request.request_id, chosen


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
            return f"{self.gpus} GPUs + {self.rdma} NICs"
        mem, cores = next(iter(self.shares.values()))
        return f"{self.gpus} GPU shares ({mem} MiB, {cores} %) + {self.rdma} NICs"

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
) -> list[Row]:
    """One row per request; a DeviceClaim's request (``claim-<uid>``) also says which pods use
    the claim (from the bridge's record in ``tandem-claims``)."""
    claims = claims or {}
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
                extra=_claim_extra(req, claims.get(rid)),
                shares=assignment.shares() if assignment is not None else {},
            )
        )
    return sorted(rows, key=lambda r: (r.created_at, r.request_id))


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
    """``claim, used by a,b`` / ``claim, no pod yet`` for a claim's row (table output)."""
    claim = row.extra.get("claim")
    if not claim:
        return ""
    pods = claim["pods"]
    return "claim, used by " + ",".join(pods) if pods else "claim, no pod yet"


async def requests(client: TandemClient, args: argparse.Namespace) -> int:
    records = await client.request_records()
    allocs = await client.allocations()
    claims = await client.claim_records()
    rows = [
        r
        for r in build_rows(records, allocs, claims)
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


def new_request(args: argparse.Namespace) -> AllocationRequest:
    pod = parse_pod(args.pod) if args.pod else PodRef(namespace="default", name=f"pod-{uuid.uuid4().hex[:6]}")
    uid = str(uuid.uuid4())
    req = AllocationRequest(
        request_id=f"{uid}.1",
        pod=PodRef(namespace=pod.namespace, name=pod.name, uid=uid),
        gpus=args.gpus,
        rdma=args.rdma,
        scope=args.scope,
        policy=args.policy,
        pairing=args.pairing,
        device_class=args.device_class,
        priority=args.priority,
        network=NetworkSpec(mtu=args.mtu) if args.mtu else None,
        preemption=getattr(args, "preemption", None),
        gpu_memory_mib=getattr(args, "gpu_memory_mib", None),
        gpu_cores_percent=getattr(args, "gpu_cores_percent", None),
        mig_profile=getattr(args, "mig_profile", None),
    )
    try:
        return codec.validated(req)
    except msgspec.ValidationError as exc:
        raise CliError(f"invalid request: {exc}", hint="see `tandem submit --help`") from None


async def never_fits(client: TandemClient, req: AllocationRequest, settings: Settings) -> str | None:
    """Why no node of the cluster could ever hold ``req`` (all its devices free and healthy),
    or None when some node could. Decided by the allocator's own core on every node record,
    with the device classes of this configuration."""
    from services.allocator.core import Cluster, InvalidRequest, Unschedulable

    if req.device_class not in settings.device_classes:
        # The running system's classes are not this command's ($TANDEM_CONFIG here may differ
        # from the allocator's): judging with a class it does not know would contradict the
        # allocator's own, right, reason. Say nothing more than the allocator did.
        return None
    nodes: dict[str, NodeRecord] = await client.node_records()
    cluster = Cluster(device_classes=settings.device_classes)
    for rec in nodes.values():
        cluster.set_node(rec.node, rec.topology)
    try:
        result = cluster.decide(req)
    except InvalidRequest as exc:
        return str(exc)
    if not isinstance(result, Unschedulable):
        return None
    if not nodes:
        return "the cluster has no nodes"
    return result.reason.replace(" free ", " ")


def check_submit(args: argparse.Namespace) -> None:
    args.request = new_request(args)


async def submit(client: TandemClient, args: argparse.Namespace) -> int:
    rid = args.request.request_id
    submitted: list[str] = []
    try:
        return await _submit(client, args, submitted)
    except (KeyboardInterrupt, asyncio.CancelledError):
        if submitted:  # Ctrl-C stops the waiting, not the request: say so, and how to go on
            print(
                f"tandem: interrupted; request {rid} goes on without this command "
                f"(`tandem explain {rid}` follows it, `tandem release {rid}` withdraws it)",
                file=sys.stderr,
            )
        raise


async def _submit(client: TandemClient, args: argparse.Namespace, submitted: list[str]) -> int:
    req: AllocationRequest = args.request
    rid = req.request_id
    structured = args.output in ("json", "yaml")
    if args.pod and not args.new:
        await _refuse_second_request(client, req.pod)
    _traced(args.settings)
    submitted_trace = await client.submit(req)
    submitted.append(rid)
    if not structured:
        trace_note = f", trace {submitted_trace}" if submitted_trace else ""
        print(f"request {rid} (pod {req.pod.namespace}/{req.pod.name}){trace_note}")
    first = args.timeout if args.timeout is not None and not args.wait else FIRST_ANSWER_S
    try:
        outcome = await client.wait_for(rid, (Assignment, AllocationFailed, PreemptionPlan), timeout=first)
    except TimeoutError:
        raise CliFailure(
            f"no answer about {rid} within {first:g}s",
            hint=f"is an allocator running? `tandem explain {rid}` shows where it stands",
        ) from None
    start = time.monotonic()
    result: dict[str, Any] = {
        "request_id": rid,
        "pod": f"{req.pod.namespace}/{req.pod.name}",
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
        outcome = await _wait_assigned(client, rid, said, args, start=start, structured=structured)
    if isinstance(outcome, AllocationFailed) and not outcome.retrying:
        return _said(result, "rejected", without_id(outcome.reason, rid), structured, args.output, code=1)
    if isinstance(outcome, AllocationFailed):
        never = await never_fits(client, req, args.settings)
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
        outcome = await _wait_assigned(client, rid, outcome.reason, args, start=start, structured=structured)
    if isinstance(outcome, AllocationFailed):  # rejected while waiting
        return _said(result, "rejected", without_id(outcome.reason, rid), structured, args.output, code=1)
    assert isinstance(outcome, Assignment)
    tid = submitted_trace or trace_id(client.headers_of(rid, Assignment).get("traceparent", ""))
    if not tid:  # the allocation's trace, as its node record keeps it
        for allocs in await client.allocations([outcome.node]):
            held = allocs.allocations.get(rid)
            tid = trace_id(held.traceparent) if held is not None else ""
    if structured:
        emit(
            {**result, "state": "assigned", "trace_id": tid, "assignment": codec.to_builtins(outcome)},
            args.output,
        )
        return 0
    print(f"assigned: node {outcome.node}, scope {outcome.scope}" + (f", trace {tid}" if tid else ""))
    print(render_table(assignment_rows([outcome]), ASSIGNMENT_HEADERS))
    return 0


async def _refuse_second_request(client: TandemClient, pod: PodRef) -> None:
    """A pod asks once: a second submit for a pod whose request is live would hold a second
    set of devices for one pod (and ``explain --pod`` would show only the newest)."""
    live = [r for r in await client.requests_of_pod(pod) if r.state in LIVE]
    if not live:
        return
    rec = live[0]
    where = f" on {rec.node}" if rec.node else ""
    raise CliFailure(
        f"pod {pod.namespace}/{pod.name} already has request {rec.request.request_id} ({rec.state}{where})",
        hint=f"`tandem release --pod {pod.namespace}/{pod.name}` first, or --new for a second request",
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
) -> Assignment | AllocationFailed:
    """Wait for the assignment, printing each new reason it stays pending for, each
    preemption made for it and each of its victims as it is freed, and a line every 30 s;
    gives up after ``--timeout`` when given."""
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
            outcome = await client.wait_for(rid, (Assignment,), timeout=step)
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
    async def on_msg(msg: Msg) -> None:
        try:
            event = codec.NODE_EVENT.decode(msg.data)
        except codec.DecodeErrors:
            return
        if isinstance(event, Cleaned) and event.request_id == rid:
            into.append(event)

    return on_msg


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


async def explain(client: TandemClient, args: argparse.Namespace) -> int:
    rid, rec = await target(client, args, live=False)
    holder = await client.holder(rid)
    if rec is None and holder is None:
        raise CliFailure(
            f"no request {rid!r} is known to the allocator",
            hint="it may not have been decided yet, or the id is wrong; `tandem requests` lists them",
        )
    node, alloc = holder if holder is not None else (None, None)
    row = build_rows(
        {rid: rec} if rec is not None else {},
        [NodeAllocations(node=node, allocations={rid: alloc})] if node and alloc else [],
    )[0]
    if args.output in ("json", "yaml"):
        doc = row.as_dict(time.time())
        doc["request"] = codec.to_builtins(rec.request) if rec is not None else None
        doc["assignment"] = codec.to_builtins(alloc.assignment) if alloc is not None else None
        emit(doc, args.output)
        return 0
    print(f"request  {rid}  pod {row.namespace}/{row.pod}")
    if rec is not None:
        req = rec.request
        wanted = f"{plural(req.gpus, 'GPU')} + {plural(req.rdma, 'NIC')}, class {req.device_class}"
        scope = f"scope {req.scope}" if req.scope else "the class's scope"
        policy = f"policy {req.policy}" if req.policy else "the class's policy"
        print(f"asks     {wanted}, {scope}, {policy}")
    now = time.time()
    # How long it has waited counts from the submit; the last write may be a later retry.
    since = f"submitted {age(now - rec.request.created_at)} ago, " if rec is not None else ""
    print(
        f"state    {row.state}"
        + (f" on {row.node}" if row.node else "")
        + f" ({since}last update {age(now - row.updated_at)} ago)"
    )
    if row.reason:
        print(f"reason   {row.reason}")
    if row.trace_id:
        print(f"trace    {row.trace_id}")
    if alloc is not None:
        print(render_table(assignment_rows([alloc.assignment]), ASSIGNMENT_HEADERS))
    return 0


# ---------------------------------------------------------------------------------------------
# status, devices


def device_states(rec: NodeRecord, allocs: NodeAllocations | None) -> list[dict[str, Any]]:
    holders = {
        d: r.assignment
        for r in (allocs.allocations.values() if allocs else ())
        for d in r.assignment.device_ids()
    }
    out = []
    for kind, ids in (
        ("gpu", [g.id for g in rec.topology.gpus()]),
        ("nic", [n.id for n in rec.topology.nics()]),
    ):
        for dev in ids:
            h = rec.health.get(dev)
            held = holders.get(dev)
            out.append(
                {
                    "node": rec.node,
                    "device": dev,
                    "kind": kind,
                    "state": "used" if held is not None else "free",
                    "pod": f"{held.pod.namespace}/{held.pod.name}" if held is not None else None,
                    "request_id": held.request_id if held is not None else None,
                    "healthy": h.healthy if h else True,
                    "cordoned": h.cordoned if h else False,
                    "reason": h.reason if h else "",
                }
            )
    return out


async def topology_live(client: TandemClient, args: argparse.Namespace) -> int:
    """``tandem topology show NODE --live``: the node's tree with each device's state now."""
    from services.cli.topology_cmd import draw

    record = (await client.node_records()).get(args.source)
    if record is None:
        raise CliFailure(f"no node {args.source!r} is known", hint="`tandem status` lists the nodes")
    allocs = {a.node: a for a in await client.allocations([record.node])}
    states = {d["device"]: _device_state_text(d) for d in device_states(record, allocs.get(record.node))}
    if record.status != "ready":
        print(f"note: node {record.node} is {record.status}", file=sys.stderr)
    sys.stdout.write(draw(record.topology, args.output, states=states))
    return 0


def _device_state_text(d: dict[str, Any]) -> str:
    text = f"used by {d['pod']}" if d["pod"] else "free"
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
