"""``python -m bench.plan_fill``: alignment and refusals of ``tandem plan`` near full, per node order.

Figures of the *core* alone: each run is the real ``tandem plan`` command (a process of its
own, ``tools/cli/plan.py``), which replays a trace through the allocator core — no NATS, no
service. Fleet: the mixed fleets of :mod:`bench.fleet` (``builtin``: ``MIX``; ``real``:
``REAL_MIX``, with two imported ``nvidia-smi topo -m`` servers), written as a ``--cluster``
file; requests: the seeded stream of the quality benchmark (:func:`bench.fleet.requests`:
1/2/4/8 GPUs, 70 % as many NICs, 20 % GPU-only, 20 % ``required``, the class's
``pcie-switch`` scope otherwise ``preferred``).

The trace cannot see the planner's answers, so it holds the *offered* load: requests are
added until the GPUs they ask reach the fill (``--fills``) of the fleet's GPUs; then, for
``--decisions`` measured requests, a random earlier request is freed while the offered
GPUs are above the fill, and the next one asked. A refused request still counts as offered
until it is freed (its ``free`` line prints ``was not allocated``), so the GPUs actually held
are below the fill: reported per run as the mean over the measured requests.

The same trace runs once per device class file (``--classes``: the ``default`` class with
``node_order`` ``used-first`` — the default before issue 26, item 8 — and ``alignment-first``),
and once without one, the default. Reported over the measured requests: placed, refused,
the share of placed pods with NICs whose every GPU/NIC pair is on one PCIe switch (scope
``pcie-switch``), and the share of pairs on one.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.fleet import MATRICES, MIXES, REAL, _topology, requests

ORDERS = ("used-first", "alignment-first", "")  # "": no --classes, the default class
TANDEM = Path(sys.executable).with_name("tandem")


def cluster_entries(mix: tuple[tuple[str, float], ...], n: int) -> tuple[list[dict[str, Any]], int]:
    """``tandem plan --cluster`` entries of ``n`` nodes in ``mix`` proportions (the rounding of
    :func:`bench.fleet.fleet`), and the fleet's GPUs."""
    entries: list[dict[str, Any]] = []
    gpus = 0
    left = n
    for pos, (name, share) in enumerate(mix):
        count = left if pos == len(mix) - 1 else round(n * share)
        left -= count
        topo = str(MATRICES / REAL[name][0]) if name in REAL else name
        entries.append({"topology": topo, "count": count, "prefix": f"{name}-"})
        gpus += count * len(_topology(name).gpus())
    return entries, gpus


def trace(total_gpus: int, fill: float, *, decisions: int, seed: int) -> list[dict[str, Any]]:
    """Fill to ``fill`` of the offered GPUs (ids ``f-<n>``), then ``decisions`` measured
    requests (``m-<n>``) with random frees holding the offered load at the fill."""
    stream = requests(seed)
    rng = random.Random(seed + 1)
    live: list[tuple[str, int]] = []
    offered = 0
    lines: list[dict[str, Any]] = []

    def ask(prefix: str) -> None:
        nonlocal offered
        req = stream.next()
        rid = f"{prefix}-{stream.n}"
        line: dict[str, Any] = {"kind": "alloc", "id": rid, "gpus": req.gpus, "rdma": req.rdma}
        if req.policy:
            line["policy"] = req.policy
        lines.append(line)
        live.append((rid, req.gpus))
        offered += req.gpus

    while offered < fill * total_gpus:
        ask("f")
    for _ in range(decisions):
        while live and offered > fill * total_gpus:
            i = rng.randrange(len(live))
            live[i], live[-1] = live[-1], live[i]
            rid, g = live.pop()
            lines.append({"kind": "free", "id": rid})
            offered -= g
        ask("m")
    return lines


def measure(out: Path, total_gpus: int) -> dict[str, Any]:
    """The measured requests' outcomes in ``tandem plan``'s output."""
    held: dict[str, int] = {}
    used = placed = refused = with_nics = at_switch = pairs = pairs_switch = 0
    held_sum = 0
    for raw in out.read_text().splitlines():
        doc = json.loads(raw)
        if "summary" in doc:
            continue
        rid, status = doc["id"], doc["status"]
        if status == "freed":
            used -= held.pop(rid, 0)
            continue
        if status == "assigned":
            held[rid] = len(doc["gpus"])
            used += held[rid]
        if not rid.startswith("m-"):
            continue
        held_sum += used
        if status != "assigned":
            refused += 1
            continue
        placed += 1
        scopes = [p["scope"] for p in doc["pairs"]]
        if scopes:
            with_nics += 1
            at_switch += all(s == "pcie-switch" for s in scopes)
            pairs += len(scopes)
            pairs_switch += sum(s == "pcie-switch" for s in scopes)
    measured = placed + refused
    return {
        "measured": measured,
        "placed": placed,
        "refused": refused,
        "refused_pct": round(100 * refused / max(measured, 1), 2),
        "pods_with_nics": with_nics,
        "pods_at_switch_pct": round(100 * at_switch / max(with_nics, 1), 1),
        "pairs_at_switch_pct": round(100 * pairs_switch / max(pairs, 1), 1),
        "gpus_held_pct": round(100 * held_sum / max(measured, 1) / total_gpus, 1),
    }


def run(
    mix: str, *, nodes: int, fills: list[float], decisions: int, seed: int, work: Path
) -> list[dict[str, Any]]:
    entries, total = cluster_entries(MIXES[mix], nodes)
    cluster = work / f"{mix}-cluster.json"
    cluster.write_text(json.dumps(entries))
    rows = []
    for fill in fills:
        reqs = work / f"{mix}-{fill}.jsonl"
        reqs.write_text(
            "".join(json.dumps(line) + "\n" for line in trace(total, fill, decisions=decisions, seed=seed))
        )
        for order in ORDERS:
            cmd = [str(TANDEM), "plan", "--cluster", str(cluster), "--requests", str(reqs)]
            if order:
                classes = work / f"{order}.json"
                classes.write_text(json.dumps({"default": {"node_order": order}}))
                cmd += ["--classes", str(classes)]
            out = work / f"{mix}-{fill}-{order or 'default'}.out"
            subprocess.run([*cmd, "-o", str(out)], check=True)
            row = {"mix": mix, "fill": fill, "node_order": order or "(default)", **measure(out, total)}
            rows.append(row)
            print(f"  {mix} {fill:.0%} {row['node_order']} done", file=sys.stderr)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| fleet | fill | node order | measured | refused | pods with NICs at switch scope "
        "| pairs at switch | GPUs held |\n|---|---:|---|---:|---:|---:|---:|---:|"
    )
    body = [
        f"| {r['mix']} | {r['fill']:.0%} | {r['node_order']} | {r['measured']} | {r['refused']} "
        f"({r['refused_pct']}%) | {r['pods_at_switch_pct']}% | {r['pairs_at_switch_pct']}% "
        f"| {r['gpus_held_pct']}% |"
        for r in rows
    ]
    return "\n".join([head, *body])


def _fills(text: str) -> list[float]:
    try:
        fills = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of fractions: {text!r}") from None
    if not all(0.0 < f < 1.0 for f in fills):
        raise argparse.ArgumentTypeError(f"fills are fractions between 0 and 1: {text!r}")
    return fills


def _mixes(text: str) -> list[str]:
    mixes = text.split(",")
    unknown = [m for m in mixes if m not in MIXES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fleet {unknown[0]!r} (known: {', '.join(MIXES)})")
    return mixes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plan_fill", description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--decisions", type=int, default=3000, help="measured requests per fill")
    ap.add_argument("--fills", type=_fills, default=[0.85, 0.95], help="offered GPU fills (0.85,0.95)")
    ap.add_argument("--mixes", type=_mixes, default=["builtin", "real"], help="fleets of bench.fleet.MIXES")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="plan-fill-") as tmp:
        for mix in args.mixes:
            rows += run(
                mix,
                nodes=args.nodes,
                fills=args.fills,
                decisions=args.decisions,
                seed=args.seed,
                work=Path(tmp),
            )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
