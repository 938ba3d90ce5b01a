"""``tandem status`` and ``tandem dlq``: the whole system at a glance.

``status`` prints the nodes (KV ``tandem-nodes``), with ``--devices`` every device
(:mod:`.devices`), then every allocation (KV ``tandem-allocs``) and every claim (KV
``tandem-claims``); ``--watch`` prints it again every ``--interval``. ``dlq`` lists the
messages parked on the dead-letter subjects with the error that parked them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from schemas import codec
from schemas.messages import ClaimRecord
from services.client import TandemClient
from tools.cli.devices import device_state_text, device_states, read_state
from tools.cli.table import render_table
from tools.cli.views import ASSIGNMENT_HEADERS, age, assignment_rows, compact, emit, short

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
    nodes, allocs, claims = await read_state(client)
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
        device_rows += [[d["node"], d["device"], device_state_text(d)] for d in devices]
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
