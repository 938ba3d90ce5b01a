"""``python -m bench.claims`` (``make bench-claims``): claims and reservations in the core.

Figures of the *core in one process* with the planner's claim book
(:class:`tools.cli.plan_claims.ClaimBook`, the rules ``tandem plan`` replays), not of the
running system: no NATS, no bridge, no Kubernetes. A claim is an ordinary request to the core
(the allocator does not know claims), so what this measures is what claims add on top: a claim
decided and held, a pod bound to a claim's devices (no decision), a reservation expiring on a
clock tick, next to plain requests on the same fleet.

The fleet (``bench.fleet.MIX``, default 10,000 nodes) is filled with plain requests to about
50 % of its GPUs (not timed); then a seeded stream of lines is timed one by one: 30 % claims
(half of them reservations expiring after 60 to 600 s), 20 % pods on a live claim, 30 % plain
requests, 15 % frees of a random live id (claim, pod on a claim, or plain request), 5 % ticks
of 60 s; above the target utilisation (85 %) most lines are frees instead, as the churn of
``bench.run`` does. Latency is per line (the claim book's ``handle`` or ``decide`` + ``hold`` /
``release`` for plain lines); decisions/s is decision lines (claims and plain requests) over
the time spent in them. Peak RSS is the process's (interpreter + fleet + core + book).
``--baseline`` replays the same stream with every claim as a plain request (no pods on claims,
no ticks), for comparison on the same machine. Times are wall clock and, as ``cpu_*``, the
thread's CPU time (which other processes on a shared machine do not inflate). One JSON line on
stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from typing import Any

from bench.fleet import fleet as build_fleet
from bench.fleet import requests as request_stream
from schemas.config import default_device_classes
from services.allocator.core import Cluster, Placement
from tools.cli.plan import _ALLOC_KEYS, _line, _no_extra, _request
from tools.cli.plan_claims import ClaimBook


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(nodes: int, lines: int, seed: int, *, target: float = 0.85, claims: bool = True) -> dict[str, Any]:
    t0 = time.perf_counter()
    cluster = Cluster(node_policy="binpack", device_classes=default_device_classes())
    for name, topo in build_fleet(nodes):
        cluster.set_node(name, topo)
    build_s = time.perf_counter() - t0
    live: dict[str, str] = {}
    book = ClaimBook(
        cluster,
        alloc_keys=_ALLOC_KEYS,
        make_request=_request,
        make_line=_line,
        no_extra=_no_extra,
        is_live=live.__contains__,
    )
    stream = request_stream(seed)
    _fill(cluster, stream, live=live)
    rng = random.Random(seed)
    lat: dict[str, list[float]] = {"claim": [], "pod_on_claim": [], "plain": [], "free": [], "tick": []}
    cpu: dict[str, list[float]] = {k: [] for k in lat}
    outcomes = {"claimed": 0, "assigned": 0, "unschedulable": 0, "expired": 0}
    ids = list(live)
    over = False
    for n in range(lines):
        if n % 50 == 0:
            totals = cluster.totals()
            over = totals["free_gpus"] < totals["gpus"] * (1 - target)
        picked = _next_line(n, rng=rng, stream=stream, book=book, ids=ids, over=over, claims=claims)
        if picked is None:
            continue
        obj, kind = picked
        t, c = time.perf_counter(), time.thread_time()
        out = _play(obj, n, book=book, cluster=cluster, live=live)
        lat[kind].append((time.perf_counter() - t) * 1e6)
        cpu[kind].append((time.thread_time() - c) * 1e6)
        for line in out:
            status = line["status"]
            if status in outcomes:
                outcomes[status] += 1
            if status in ("claimed", "assigned") and obj.get("id"):
                ids.append(obj["id"])
    totals = cluster.totals()
    return {
        "nodes": nodes,
        "lines": lines,
        "build_s": round(build_s, 2),
        "util": round(1 - totals["free_gpus"] / totals["gpus"], 3),
        **_figures(lat, cpu, claims=claims),
        "outcomes": outcomes,
        "live_claims": len(book.claims),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def _fill(cluster: Cluster, stream: Any, *, live: dict[str, str]) -> None:
    """Plain requests until half the fleet's GPUs are held (not timed)."""
    totals = cluster.totals()
    while totals["free_gpus"] > totals["gpus"] * 0.5:
        req = stream.next()
        result = cluster.decide(req)
        if isinstance(result, Placement):
            cluster.hold(result.node, req.request_id, result.devices())
            live[req.request_id] = result.node
        totals = cluster.totals()


def _next_line(
    n: int, *, rng: random.Random, stream: Any, book: ClaimBook, ids: list[str], over: bool, claims: bool
) -> tuple[dict[str, Any], str] | None:
    """The next line of the stream and its kind; None for a line the baseline skips."""
    pick = rng.random()
    obj: dict[str, Any]
    if over and ids and pick < 0.8:
        obj, kind = {"kind": "free", "id": ids.pop(rng.randrange(len(ids)))}, "free"
    elif pick < 0.30:
        req = stream.next()
        obj = {"kind": "claim", "id": f"c{n}", "gpus": req.gpus, "rdma": req.rdma}
        expires = rng.randint(60, 600) if rng.random() < 0.5 else None
        if expires is not None:
            obj["expires_after"] = expires
        kind = "claim"
        if not claims:  # the baseline: the same request as a plain one
            obj, kind = {"kind": "alloc", "id": f"c{n}", "gpus": req.gpus, "rdma": req.rdma}, "plain"
    elif pick < 0.50 and (book.claims or not claims):
        if not claims:
            return None
        cid = rng.choice(list(book.claims))
        obj, kind = {"kind": "alloc", "id": f"u{n}", "claim": cid}, "pod_on_claim"
    elif pick < 0.80:
        req = stream.next()
        obj, kind = {"kind": "alloc", "id": f"p{n}", "gpus": req.gpus, "rdma": req.rdma}, "plain"
    elif pick < 0.95 and ids:
        obj, kind = {"kind": "free", "id": ids.pop(rng.randrange(len(ids)))}, "free"
    else:
        obj, kind = {"kind": "tick", "seconds": 60}, "tick"
    if obj["kind"] == "tick" and not claims:
        return None
    return obj, kind


def _play(
    obj: dict[str, Any], n: int, *, book: ClaimBook, cluster: Cluster, live: dict[str, str]
) -> list[dict[str, Any]]:
    """One line through the claim book, or straight to the core for plain lines."""
    if book.wants(obj):
        return list(book.handle(obj, where=f"line {n}"))
    if obj["kind"] == "alloc":
        result = cluster.decide(_request(obj, f"line {n}"))
        if isinstance(result, Placement):
            cluster.hold(result.node, obj["id"], result.devices())
            live[obj["id"]] = result.node
            return [{"status": "assigned"}]
        return [{"status": "unschedulable"}]
    # a free of a plain request
    node = live.pop(obj["id"], None)
    if node is not None:
        cluster.release(node, obj["id"])
    return []


def _figures(lat: dict[str, list[float]], cpu: dict[str, list[float]], *, claims: bool) -> dict[str, Any]:
    """Decision counts, rates and per-kind latency percentiles (µs)."""
    decisions = lat["claim"] + lat["plain"]
    decisions_cpu = cpu["claim"] + cpu["plain"]
    return {
        "decisions": len(decisions),
        "claims": claims,
        "decisions_per_s": round(len(decisions) / (sum(decisions) / 1e6)) if decisions else None,
        "cpu_decisions_per_s": round(len(decisions) / (sum(decisions_cpu) / 1e6)) if decisions_cpu else None,
        "latency_us": {
            k: {"n": len(v), "p50": round(percentile(v, 0.5), 1), "p99": round(percentile(v, 0.99), 1)}
            for k, v in lat.items()
        },
        "cpu_latency_us": {
            k: {"p50": round(percentile(v, 0.5), 1), "p99": round(percentile(v, 0.99), 1)}
            for k, v in cpu.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.claims", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--lines", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=12)
    p.add_argument("--target", type=float, default=0.85, help="GPU utilisation the churn keeps")
    p.add_argument(
        "--baseline", action="store_true", help="the same stream without claims (claims as plain requests)"
    )
    args = p.parse_args(argv)
    print(json.dumps(run(args.nodes, args.lines, args.seed, target=args.target, claims=not args.baseline)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
