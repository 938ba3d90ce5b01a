"""``tandem up | submit | release | status | device``: run and drive a local Tandem system.

``tandem up`` starts an embedded nats-server on 127.0.0.1 (port 4222 when free, else any)
plus inventory, allocator and simulated node agents, and runs until Ctrl-C. The other
commands talk to any Tandem system through NATS (``--nats`` or ``TANDEM_NATS_URL``).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from schemas import codec
from schemas.messages import AllocationFailed, AllocationRequest, Assignment, NetworkSpec, PodRef
from schemas.topology import SCOPES
from services.cli.errors import CliError
from services.cli.table import render_table
from services.client import ClientError, TandemClient
from services.localstack import DEFAULT_FLEET, LocalStack, parse_fleet
from services.runtime.bus import Bus
from services.runtime.embedded import EmbeddedNats
from services.runtime.errors import SettingsError
from services.runtime.lifecycle import install_signal_handlers
from services.runtime.logging import setup_logging
from services.runtime.settings import Settings, load_settings
from services.runtime.tracing import setup_tracing


def register(sub: Any) -> None:
    up = sub.add_parser("up", help="run NATS + all services + simulated nodes until Ctrl-C")
    up.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="TOPOLOGY[:COUNT[:PREFIX]]",
        help="simulated nodes (built-in name or file); repeatable; default: a mixed fleet",
    )
    up.add_argument("--port", type=int, default=4222, help="NATS port (any free one if taken)")
    up.add_argument("--allocators", type=int, default=1)
    up.set_defaults(func=lambda a: _run(_up(a)))

    s = sub.add_parser("submit", help="request GPUs/NICs for a pod and wait for the outcome")
    _nats_arg(s)
    s.add_argument("--pod", default=None, help="namespace/name (default: default/pod-<random>)")
    s.add_argument("--gpus", type=int, required=True)
    s.add_argument("--rdma", type=int, default=0)
    s.add_argument("--scope", choices=SCOPES)
    s.add_argument("--policy", choices=["required", "preferred"])
    s.add_argument("--pairing", choices=["per-gpu", "shared"])
    s.add_argument("--device-class", default="default")
    s.add_argument("--priority", type=int, default=0)
    s.add_argument("--mtu", type=int)
    s.add_argument("--timeout", type=float, default=10.0)
    s.set_defaults(func=lambda a: _run(_with_client(a, _submit)))

    r = sub.add_parser("release", help="release a pod's allocation")
    _nats_arg(r)
    r.add_argument("request_id")
    r.add_argument("--node", help="node holding it (default: the allocator forwards it)")
    r.set_defaults(func=lambda a: _run(_with_client(a, _release)))

    st = sub.add_parser("status", help="nodes, devices and allocations as tables")
    _nats_arg(st)
    st.add_argument("--devices", action="store_true", help="one row per device")
    st.set_defaults(func=lambda a: _run(_with_client(a, _status)))

    e = sub.add_parser("explain", help="where a request stands and why (e.g. why a pod is pending)")
    _nats_arg(e)
    e.add_argument("request_id")
    e.set_defaults(func=lambda a: _run(_with_client(a, _explain)))

    q = sub.add_parser("dlq", help="messages parked on the dead-letter subjects, with the error")
    _nats_arg(q)
    q.add_argument("--limit", type=int, default=20)
    q.set_defaults(func=lambda a: _run(_with_client(a, _dlq)))

    d = sub.add_parser("device", help="fail / recover / cordon / uncordon one device")
    _nats_arg(d)
    d.add_argument("action", choices=["fail", "recover", "cordon", "uncordon"])
    d.add_argument("node")
    d.add_argument("device", help="gpuN or an RDMA device name")
    d.add_argument("--reason", default="")
    d.set_defaults(func=lambda a: _run(_with_client(a, _device)))


def _nats_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", default=None, help="NATS URL (default: $TANDEM_NATS_URL or localhost:4222)")


def _run(coro: Awaitable[int]) -> int:
    return asyncio.run(coro)  # type: ignore[arg-type]


def cli_settings(service: str, **overrides: Any) -> Settings:
    try:
        return load_settings(service, **overrides)
    except SettingsError as exc:
        raise CliError(str(exc)) from exc


async def _with_client(
    args: argparse.Namespace, fn: Callable[[TandemClient, argparse.Namespace], Awaitable[int]]
) -> int:
    settings = cli_settings("cli", nats_url=args.nats)
    try:
        bus = await asyncio.wait_for(Bus.open(settings, provision_streams=False), 5)
    except (TimeoutError, OSError) as exc:
        raise CliError(f"cannot reach NATS at {settings.nats_url} (is `tandem up` running?)") from exc
    client = await TandemClient(bus).start()
    try:
        return await fn(client, args)
    except ClientError as exc:
        raise CliError(str(exc)) from exc
    finally:
        await client.close()
        await bus.close()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


async def _up(args: argparse.Namespace) -> int:
    fleet = parse_fleet(args.node) if args.node else list(DEFAULT_FLEET)
    server = EmbeddedNats(port=args.port if _port_free(args.port) else None).start()
    settings = cli_settings("tandem-up", nats_url=server.url, log_json=False)
    setup_logging(level=settings.log_level, json=False)
    setup_tracing("tandem", otlp_endpoint=settings.otlp_endpoint)
    stack = LocalStack(settings, fleet=fleet, allocators=args.allocators)
    try:
        await stack.start()
        await stack.wait_ready()
        print(f"Tandem is up: {len(stack.agents)} simulated nodes; NATS at {server.url}")
        print(f"  export TANDEM_NATS_URL={server.url}; tandem status; tandem submit --gpus 4 --rdma 4")
        stop = asyncio.Event()
        install_signal_handlers(stop)
        await stop.wait()
    finally:
        await stack.stop()
        server.stop()
    return 0


def _new_request(args: argparse.Namespace) -> AllocationRequest:
    namespace, _, name = (args.pod or f"default/pod-{uuid.uuid4().hex[:6]}").rpartition("/")
    uid = str(uuid.uuid4())
    return AllocationRequest(
        request_id=f"{uid}.1",
        pod=PodRef(namespace=namespace or "default", name=name, uid=uid),
        gpus=args.gpus,
        rdma=args.rdma,
        scope=args.scope,
        policy=args.policy,
        pairing=args.pairing,
        device_class=args.device_class,
        priority=args.priority,
        network=NetworkSpec(mtu=args.mtu) if args.mtu else None,
    )


async def _submit(client: TandemClient, args: argparse.Namespace) -> int:
    try:
        req = codec.validated(_new_request(args))
    except msgspec.ValidationError as exc:
        raise CliError(f"invalid request: {exc}") from exc
    await client.submit(req)
    try:
        outcome = await client.wait_for(req.request_id, timeout=args.timeout)
    except TimeoutError as exc:
        raise CliError(f"no answer for {req.request_id} within {args.timeout:g}s") from exc
    if isinstance(outcome, AllocationFailed):
        print(f"{req.request_id}: pending: {outcome.reason}")
        return 1
    assert isinstance(outcome, Assignment)
    print(f"request {req.request_id} → node {outcome.node} (scope {outcome.scope})")
    print(render_table(assignment_rows([outcome]), ASSIGNMENT_HEADERS))
    return 0


async def _release(client: TandemClient, args: argparse.Namespace) -> int:
    await client.release(args.request_id, node=args.node)
    print(f"release of {args.request_id} sent")
    return 0


async def _explain(client: TandemClient, args: argparse.Namespace) -> int:
    rec = await client.request_record(args.request_id)
    if rec is None:
        raise CliError(f"no request {args.request_id!r} is known to the allocator")
    req = rec.request
    print(f"request  {req.request_id}  pod {req.pod.namespace}/{req.pod.name}")
    wanted = f"{req.gpus} GPUs + {req.rdma} NICs, class {req.device_class}"
    print(f"asks     {wanted}, scope {req.scope or 'class default'} ({req.policy or 'class default'})")
    print(f"state    {rec.state}" + (f" on {rec.node}" if rec.node else ""))
    if rec.reason:
        print(f"reason   {rec.reason}")
    if rec.node:
        for allocs in await client.allocations([rec.node]):
            held = allocs.allocations.get(req.request_id)
            if held is not None:
                print(render_table(assignment_rows([held.assignment]), ASSIGNMENT_HEADERS))
    return 0


async def _dlq(client: TandemClient, args: argparse.Namespace) -> int:
    letters = await client.dead_letters(limit=args.limit)
    rows = [
        [
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d.ts)),
            d.service,
            d.subject,
            f"{len(d.data)} B",
            d.error if len(d.error) <= 100 else d.error[:97] + "...",
        ]
        for d in letters
    ]
    print(render_table(rows, ["time (UTC)", "service", "subject", "size", "error"]))
    return 0


async def _device(client: TandemClient, args: argparse.Namespace) -> int:
    ev = await client.command(args.node, args.device, args.action, reason=args.reason)
    state = "healthy" if ev.healthy else "unhealthy"
    print(f"{ev.node}/{ev.device}: {state}{', cordoned' if ev.cordoned else ''} ({ev.reason})")
    return 0


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


async def _status(client: TandemClient, args: argparse.Namespace) -> int:
    nodes = await client.nodes()
    allocs = {a.node: a for a in await client.allocations()}
    rows = []
    device_rows = []
    for rec in sorted(nodes, key=lambda r: r.node):
        used = allocs[rec.node].used() if rec.node in allocs else set()
        gpus = [g.id for g in rec.topology.gpus()]
        nics = [n.id for n in rec.topology.nics()]
        bad = rec.unavailable()
        rows.append(
            [
                rec.node,
                rec.status,
                f"{len([g for g in gpus if g in used])}/{len(gpus)}",
                f"{len([n for n in nics if n in used])}/{len(nics)}",
                ",".join(sorted(bad)) or "-",
                str(len(allocs[rec.node].allocations) if rec.node in allocs else 0),
            ]
        )
        for dev in gpus + nics:
            h = rec.health.get(dev)
            state = "used" if dev in used else "free"
            if h and h.cordoned:
                state += ", cordoned"
            if h and not h.healthy:
                state += f", unhealthy ({h.reason})"
            device_rows.append([rec.node, dev, state])
    print(render_table(rows, ["node", "status", "gpus used", "nics used", "unavailable", "allocations"]))
    if args.devices:
        print()
        print(render_table(device_rows, ["node", "device", "state"]))
    assignments = [r.assignment for a in allocs.values() for r in a.allocations.values()]
    if assignments:
        print()
        print(render_table(assignment_rows(assignments), ASSIGNMENT_HEADERS))
    return 0
