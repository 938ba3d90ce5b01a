"""``tandem device`` and ``tandem topology show --live``: every device of a node and who holds it,
and the agent's commands (fail, recover, cordon, uncordon).

A device's state is read from two records: the node record (KV ``tandem-nodes``: hardware and
health) and the node's allocation record (KV ``tandem-allocs``). A GPU may have several
holders: the shares on it, each with its size, or its MIG instances, each with its profile.
``tandem status --devices`` shows the same rows (:mod:`.status`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from schemas.messages import ClaimRecord, NodeAllocations, NodeRecord
from services.client import TandemClient
from tools.cli.errors import CliError, CliFailure
from tools.cli.table import render_table
from tools.cli.views import emit, share_size


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
    states = {d["device"]: device_state_text(d) for d in device_states(record, allocs.get(record.node))}
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


def device_state_text(d: dict[str, Any]) -> str:
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


async def read_state(
    client: TandemClient,
) -> tuple[list[NodeRecord], dict[str, NodeAllocations], list[ClaimRecord]]:
    """The nodes (by name), each node's allocations and the claims (by namespace and name)."""
    nodes = sorted((await client.node_records()).values(), key=lambda r: r.node)
    allocs = {a.node: a for a in await client.allocations()}
    claims = sorted((await client.claim_records()).values(), key=lambda c: (c.namespace, c.name))
    return nodes, allocs, claims


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
        nodes, allocs, _ = await read_state(client)
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
                    [[d["node"], d["device"], d["kind"], device_state_text(d)] for d in devices],
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
