"""``tandem demo`` (``make demo``): the whole event flow on simulated nodes, scripted.

Starts an embedded nats-server and the full system (inventory, allocator, one node agent per
simulated node of a mixed fleet), then plays what a cluster would see:

1. a realistic mix of pods asks for 1/2/4/8 GPUs with matching RDMA NICs, plus GPU-only pods;
2. one GPU fails (as an XID would report it): a pod that needs it stays pending with the reason;
   the GPU recovers and the pending pod is placed without being resubmitted;
3. some pods finish: their devices are cleaned up (verified) and freed, and a large pod that
   did not fit before gets the whole freed board;
4. an urgent job of higher priority that may preempt needs that board: the allocator plans the
   eviction of the job on it (``tandem.alloc.preempt``), the demo evicts it as the pod bridge
   would (its release, verified cleanup, freed), and the urgent job gets the board;
5. two inference pods of a class that allows sharing take 20 GiB and 50 % of one GPU each;
6. a training job of two pods is placed whole (both pods or neither) by a two-phase commit;

and prints who got which GPUs and NICs with the alignment of each GPU/NIC pair, the latency
from request to assignment (p50/p99, measured by the client on the wall clock), and the trace
of one allocation across the services. Exits 0 when every step behaved, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from schemas import codec, subjects
from schemas.config import DeviceClass, default_device_classes
from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    Assignment,
    Freed,
    JobRequest,
    PodRef,
    PreemptionPlan,
)
from services.client import TandemClient
from services.runtime.nats.bus import Bus
from services.runtime.observe.logging import setup_logging
from services.runtime.observe.tracing import (
    context_from_traceparent,
    current_traceparent,
    setup_tracing,
    shutdown_tracing,
    tracer,
)
from services.runtime.process.embedded import EmbeddedNats
from tools.cli.session import cli_settings
from tools.cli.table import render_table
from tools.cli.views import ASSIGNMENT_HEADERS, assignment_rows
from tools.localstack import DEFAULT_FLEET, LocalStack

_tracer = tracer("tandem.demo")
HOSTNAME = "kubernetes.io/hostname"
SHARED_CLASS = "inference-shared"

# (pod name, gpus, rdma, scope, policy): what a mixed training/inference cluster asks for.
WORKLOAD: list[tuple[str, int, int, str | None, str | None]] = [
    ("llm-pretrain-0", 8, 8, "pcie-switch", "required"),
    ("llm-pretrain-1", 8, 8, "pcie-switch", "required"),
    ("finetune-a", 4, 4, "pcie-switch", "preferred"),
    ("finetune-b", 4, 4, "pcie-switch", "preferred"),
    ("finetune-c", 4, 4, "numa", "required"),
    ("ddp-small-0", 2, 2, None, None),
    ("ddp-small-1", 2, 2, None, None),
    ("ddp-small-2", 2, 2, None, None),
    ("rl-actor-0", 1, 1, None, None),
    ("rl-actor-1", 1, 1, None, None),
    ("rl-actor-2", 1, 1, "pcie-root", "required"),
    ("inference-0", 1, 0, None, None),
    ("inference-1", 2, 0, None, None),
    ("inference-2", 4, 0, None, None),
    ("notebook-0", 1, 0, None, None),
]


class DemoFailure(Exception):
    """A demo step did not behave as the system promises."""


def _request(name: str, gpus: int, rdma: int, scope: str | None, policy: str | None) -> AllocationRequest:
    uid = f"demo-{name}"
    return AllocationRequest(
        request_id=f"{uid}.1",
        pod=PodRef(namespace="training", name=name, uid=uid),
        gpus=gpus,
        rdma=rdma,
        scope=scope,  # type: ignore[arg-type]
        policy=policy,  # type: ignore[arg-type]
    )


class Demo:
    def __init__(self, client: TandemClient, stack: LocalStack, spans: InMemorySpanExporter) -> None:
        self.client = client
        self.stack = stack
        self.spans = spans
        self.latencies: list[float] = []
        self.trace_ids: dict[str, str] = {}
        self.traceparents: dict[str, str] = {}

    async def submit(self, req: AllocationRequest) -> None:
        # The pod's trace starts here (in a cluster: the admission webhook) and its
        # traceparent is kept for the release, as the pod annotation keeps it.
        with _tracer.start_as_current_span("demo.submit") as span:
            span.set_attributes({"k8s.pod.name": req.pod.name, "k8s.pod.uid": req.pod.uid})
            self.trace_ids[req.request_id] = format(span.get_span_context().trace_id, "032x")
            self.traceparents[req.request_id] = current_traceparent() or ""
            await self.client.submit(req)

    def all_assignments(self) -> list[Assignment]:
        out = []
        for rid in self.trace_ids:
            a = self.client.assignment(rid)
            if a is not None:
                out.append(a)
        return out

    async def place(self, req: AllocationRequest, *, timeout: float = 10.0) -> Assignment | AllocationFailed:
        t0 = time.perf_counter()
        await self.submit(req)
        outcome = await self.client.wait_for(req.request_id, timeout=timeout)
        if isinstance(outcome, Assignment):
            self.latencies.append((time.perf_counter() - t0) * 1000)
        assert isinstance(outcome, Assignment | AllocationFailed)
        return outcome

    async def release(self, request_id: str) -> Freed:
        parent = context_from_traceparent(self.traceparents.get(request_id))
        with _tracer.start_as_current_span("demo.release", context=parent):
            await self.client.release(request_id)
        outcome = await self.client.wait_for(request_id, (Freed,), timeout=10.0)
        assert isinstance(outcome, Freed)
        return outcome


def _print_section(title: str) -> None:
    print(f"\n== {title}")


async def run_demo(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    spans = InMemorySpanExporter()
    with EmbeddedNats() as server:
        settings = cli_settings(
            "demo",
            nats_url=server.url,
            log_level="warning",
            heartbeat_interval=0.5,
            node_lost_after=3.0,
            # A class whose GPUs may be shared (step 5), beside the default one.
            device_classes={**default_device_classes(), SHARED_CLASS: DeviceClass(sharing="hami")},
        )
        setup_logging(level=settings.log_level, json=True)
        setup_tracing("tandem-demo", otlp_endpoint=settings.otlp_endpoint, exporter=spans)
        stack = LocalStack(settings, fleet=DEFAULT_FLEET, retry_interval=0.5)
        await stack.start()
        bus = await Bus.open(settings, provision_streams=False)
        client = await TandemClient(bus).start()
        try:
            await stack.wait_ready()
            return await _script(Demo(client, stack, spans), t_start)
        except DemoFailure as exc:
            print(f"\nDEMO FAILED: {exc}")
            return 1
        finally:
            await client.close()
            await bus.close()
            await stack.stop()
            shutdown_tracing()  # flush the OTLP exporter before the process exits


async def _script(demo: Demo, t_start: float) -> int:
    stack = demo.stack
    fleet = ", ".join(f"{e.count}x {e.topology}" for e in DEFAULT_FLEET)
    gpus = sum(len(a.topology.gpus()) for a in stack.agents.values() if a.topology)
    nics = sum(len(a.topology.nics()) for a in stack.agents.values() if a.topology)
    print(f"Tandem demo: embedded NATS JetStream, {len(stack.agents)} simulated nodes ({fleet})")
    print(f"             {gpus} GPUs, {nics} RDMA NICs")
    placed = await _mixed_pods(demo)
    await _gpu_failure(demo, placed)
    board = await _pods_finish(demo, placed)
    await _preemption(demo, placed, board)
    await _shared_gpu(demo)
    await _whole_job(demo)
    _alignment_and_latency(demo)
    await _one_trace(demo)
    print(f"\nDemo finished in {time.perf_counter() - t_start:.1f} s")
    return 0


async def _mixed_pods(demo: Demo) -> dict[str, Assignment]:
    """Step 1: the workload's pods ask on an empty fleet; all but one at most are placed."""
    _print_section(f"1. {len(WORKLOAD)} pods ask for GPUs and RDMA NICs")
    placed: dict[str, Assignment] = {}
    pending: list[str] = []
    for spec in WORKLOAD:
        outcome = await demo.place(_request(*spec))
        if isinstance(outcome, Assignment):
            placed[outcome.request_id] = outcome
        else:
            pending.append(f"{spec[0]}: {outcome.reason}")
    print(render_table(assignment_rows(list(placed.values())), ASSIGNMENT_HEADERS))
    for line in pending:
        print(f"pending  {line}")
    if len(placed) < len(WORKLOAD) - 1:
        raise DemoFailure(f"only {len(placed)} of {len(WORKLOAD)} pods placed on an empty fleet")
    return placed


async def _gpu_failure(demo: Demo, placed: dict[str, Assignment]) -> None:
    """Step 2: a GPU fails; a pod that needs it waits with the reason, and is placed once the
    GPU recovers, without being submitted again."""
    stack, client = demo.stack, demo.client
    _print_section("2. a GPU fails (XID 79: fallen off the bus), then recovers")
    node, free = _most_free_gpus(stack, placed)
    victim = f"gpu{free[0]}"
    ev = await client.command(node, victim, "fail", reason="XID 79: GPU has fallen off the bus")
    print(f"{node}/{victim}: healthy={ev.healthy} reason={ev.reason!r}")
    # Health travels agent → inventory → KV → allocator; wait until the decision side sees it
    # (a request racing the failure event could otherwise still get the GPU, as it would in a
    # cluster: the demo shows the steady state, not the race).
    await _until(lambda: victim in stack.allocators[0].nodes[node].unavailable(), what="failure seen")
    # A pod that needs every GPU still free on that node can only wait for the failed one.
    big = AllocationRequest(
        **{**_as_dict(_request("eval-job", len(free), 0, None, None)), "node_selector": {HOSTNAME: node}}
    )
    outcome = await demo.place(big)
    if isinstance(outcome, Assignment):
        raise DemoFailure(f"{big.pod.name} was placed although {node}/{victim} is failed")
    print(f"{big.pod.name} ({len(free)} GPUs on {node}): pending: {outcome.reason}")
    ev = await client.command(node, victim, "recover", reason="operator: GPU reset done")
    print(f"{node}/{victim}: healthy={ev.healthy} reason={ev.reason!r}")
    late = await client.wait_for(big.request_id, (Assignment,), timeout=10.0)
    assert isinstance(late, Assignment)
    placed[late.request_id] = late
    print(f"{big.pod.name}: placed after recovery, not resubmitted → {late.node} gpus {_gpus(late)}")


async def _pods_finish(demo: Demo, placed: dict[str, Assignment]) -> Assignment:
    """Step 3: pods finish; their verified cleanup frees devices for the pending pods, and a
    new 8-GPU pod takes a freed board (returned: step 4 preempts it)."""
    client = demo.client
    _print_section("3. pods finish: verified cleanup frees their devices, pending pods move in")
    waiting = [rid for rid in demo.trace_ids if rid not in placed]
    for name in ("llm-pretrain-0", "finetune-a", "ddp-small-0", "inference-0", "llm-pretrain-1"):
        rid = f"demo-{name}.1"
        if rid in placed:
            freed = await demo.release(rid)
            placed.pop(rid)
            print(f"{name}: cleaned and freed on {freed.node}: {', '.join(freed.devices)}")
    for rid in waiting:
        moved = await client.wait_for(rid, (Assignment,), timeout=10.0)
        assert isinstance(moved, Assignment)
        placed[rid] = moved
        print(f"{moved.pod.name}: was pending, placed on freed devices → {moved.node} gpus {_gpus(moved)}")
    outcome = await demo.place(_request("llm-pretrain-2", 8, 8, "pcie-switch", "required"))
    if not isinstance(outcome, Assignment):
        raise DemoFailure(f"llm-pretrain-2 not placed on the freed board: {outcome.reason}")
    placed[outcome.request_id] = outcome
    print("a new 8-GPU job takes the freed board:")
    print(render_table(assignment_rows([outcome]), ASSIGNMENT_HEADERS))
    return outcome


def _alignment_and_latency(demo: Demo) -> None:
    """What the pairs' alignment came to, and the request → assignment latency."""
    _print_section("Alignment achieved (GPU/NIC pairs by scope)")
    hist = Counter(p.scope for a in demo.all_assignments() for p in a.pairs)
    total = sum(hist.values())
    for scope in ("pcie-switch", "pcie-root", "numa", "socket", "node"):
        if hist[scope]:
            print(f"  {scope:<12} {hist[scope]:>3} pairs  {100 * hist[scope] / total:5.1f} %")

    _print_section("Latency, request → assignment (client wall clock)")
    lat = sorted(demo.latencies)
    p99 = lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))]
    print(f"  {len(lat)} assignments: p50 {statistics.median(lat):.1f} ms, p99 {p99:.1f} ms")


async def _one_trace(demo: Demo) -> None:
    """One allocation's spans across the services, from the in-memory exporter."""
    _print_section("One allocation's trace")
    rid = "demo-llm-pretrain-0.1"
    trace_id = demo.trace_ids[rid]
    await asyncio.sleep(0.2)
    spans = sorted(
        (s for s in demo.spans.get_finished_spans() if format(s.context.trace_id, "032x") == trace_id),
        key=lambda s: s.start_time or 0,
    )
    names = [s.name for s in spans]
    print(f"  trace_id {trace_id}")
    print(f"  spans: {' → '.join(names)}")
    print("  (export to Jaeger: set OTEL_EXPORTER_OTLP_ENDPOINT=http://<jaeger>:4318)")
    expected = {
        "allocator.decide",
        "allocator.commit",
        "nodeagent.apply",
        "nodeagent.cleanup",
        "allocator.free",
    }
    if not expected <= set(names):
        raise DemoFailure(f"trace {trace_id} lacks spans {sorted(expected - set(names))}")


async def _preemption(demo: Demo, placed: dict[str, Assignment], board: Assignment) -> None:
    """Step 4: an urgent job pinned to ``board``'s node preempts the job holding it."""
    _print_section("4. an urgent job (priority 100, may preempt) needs that board")
    urgent = AllocationRequest(
        **{
            **_as_dict(_request("urgent-train", 8, 8, "pcie-switch", "required")),
            "priority": 100,
            "preemption": "lower-priority",
            "node_selector": {HOSTNAME: board.node},
        }
    )
    plans = await demo.client.bus.nc.subscribe(subjects.ALLOC_PREEMPT)
    try:
        await demo.submit(urgent)
        try:
            msg = await plans.next_msg(timeout=10.0)
        except TimeoutError:
            raise DemoFailure("no preemption plan for urgent-train") from None
    finally:
        await plans.unsubscribe()
    plan = codec.ALLOC_EVENT.decode(msg.data)
    if not isinstance(plan, PreemptionPlan) or plan.request_id != urgent.request_id or not plan.victims:
        raise DemoFailure(f"unexpected preemption plan: {plan!r}")
    for v in plan.victims:
        # What the pod bridge does in a cluster: evict the pod (Eviction API, PDBs respected),
        # whose deletion releases its allocation.
        freed = await demo.release(v.request_id)
        placed.pop(v.request_id, None)
        print(f"{v.pod.name} (priority {v.priority}) preempted on {v.node}: evicted, cleaned, freed")
        print(f"  {', '.join(freed.devices)}")
    moved = await demo.client.wait_for(urgent.request_id, (Assignment,), timeout=15.0)
    assert isinstance(moved, Assignment)
    placed[moved.request_id] = moved
    print("urgent-train takes the board once its devices are clean:")
    print(render_table(assignment_rows([moved]), ASSIGNMENT_HEADERS))


async def _shared_gpu(demo: Demo) -> None:
    """Step 5: two inference pods each take a share of one GPU (memory and compute limits)."""
    _print_section("5. two inference pods share one GPU (20 GiB and 50 % of its compute each)")
    shares = []
    for name in ("chat-a", "chat-b"):
        req = AllocationRequest(
            **{
                **_as_dict(_request(name, 1, 0, None, None)),
                "device_class": SHARED_CLASS,
                "gpu_memory_mib": 20480,
                "gpu_cores_percent": 50,
            }
        )
        outcome = await demo.place(req)
        if not isinstance(outcome, Assignment):
            raise DemoFailure(f"{name} (a GPU share) not placed: {outcome.reason}")
        shares.append(outcome)
    where = {(a.node, a.gpus[0].uuid) for a in shares}
    if len(where) != 1:
        raise DemoFailure(f"binpack put the two shares on different GPUs: {sorted(where)}")
    for a in shares:
        g = a.gpus[0]
        limits = f"{g.memory_mib} MiB, {g.cores_percent} % (HAMi-core limits)"
        print(f"{a.pod.name}: {a.node} gpu{g.index} — {limits}")


async def _whole_job(demo: Demo) -> None:
    """Step 6: a job of two pods, placed whole or not at all, committed across nodes."""
    _print_section("6. a training job of 2 pods x (4 GPUs + 2 NICs): all pods or none")
    job = JobRequest(
        job_id="demo-allreduce",
        pods=2,
        gpus=4,
        rdma=2,
        namespace="training",
        members=[
            PodRef(namespace="training", name=f"allreduce-{i}", uid=f"demo-allreduce-{i}") for i in range(2)
        ],
    )
    await demo.client.bus.publish(subjects.ALLOC_JOB, job, msg_id=subjects.msg_id("job", job.job_id))
    pods = []
    for i in range(job.pods):
        outcome = await demo.client.wait_for(job.pod_id(i), (Assignment,), timeout=15.0)
        assert isinstance(outcome, Assignment)
        pods.append(outcome)
    print(render_table(assignment_rows(pods), ASSIGNMENT_HEADERS))
    print("both pods were reserved, then committed by one write of the job's record (docs/architecture.md)")


async def _until(predicate: Callable[[], bool], *, what: str, timeout: float = 10.0) -> None:
    async def poll() -> None:
        while not predicate():  # noqa: ASYNC110 - the allocator's read model has no change event
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(poll(), timeout)
    except TimeoutError:
        raise DemoFailure(f"timed out waiting for: {what}") from None


def _gpus(a: Assignment) -> list[int]:
    return [g.index for g in a.gpus]


def _most_free_gpus(stack: LocalStack, placed: dict[str, Assignment]) -> tuple[str, list[int]]:
    best: tuple[str, list[int]] = ("", [])
    for name, agent in sorted(stack.agents.items()):
        used = {g.index for a in placed.values() if a.node == name for g in a.gpus}
        free = [g.index for g in (agent.topology.gpus() if agent.topology else []) if g.index not in used]
        if len(free) > len(best[1]):
            best = (name, free)
    if len(best[1]) < 2:
        raise DemoFailure("no node has two free GPUs left for the failure scenario")
    return best


def _as_dict(req: AllocationRequest) -> dict[str, Any]:
    return {f: getattr(req, f) for f in req.__struct_fields__}
