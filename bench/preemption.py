"""``python -m bench.preemption`` (``make bench-preempt``): how long a preemption plan takes.

Figures of the *core* in one process (``services.allocator.core.preempt.plan`` on a
:class:`~services.allocator.core.Cluster`), not of the running system. For each fleet size:

1. the built-in mixed fleet (:func:`bench.fleet.fleet`) is filled with the default request
   stream (:func:`bench.fleet.requests`) until 200 requests in a row are refused — every
   allocation held preemptible with a random priority 0-3 (about 95 %+ of the GPUs in use);
2. then ``--plans`` requests of priority 10 that may preempt, drawn from the same stream, are
   decided: ``decide`` first (a refusal is what triggers preemption), then ``plan``; each plan
   is applied (victims released, the request held) so the next one sees the new state, the
   way the allocator's evictions would change it.

Printed as one JSON line per size: plan latency (the first plan — every group of alike nodes
searched, nothing cached yet — then p50 / p90 / p99 / max, wall and thread CPU; a plan here is
``decide`` + ``plan``), the
victims per plan, the plans that found none, and the process's peak RSS so far (the driver
included; sizes run in increasing order, so each figure is the peak up to that size).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time

from bench.fleet import fleet, requests
from schemas.messages import AllocationRequest
from services.allocator.core import Cluster, Placement


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(size: int, plans: int, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    cluster = Cluster()
    for name, topo in fleet(size):
        cluster.set_node(name, topo)
    stream = requests(seed)
    refused = 0
    held = 0
    t0 = time.perf_counter()
    while refused < 200:
        req = stream.next()
        res = cluster.decide(req)
        if isinstance(res, Placement):
            prio = rng.randint(0, 3)
            cluster.hold(res.node, req.request_id, res.devices(), priority=prio, preemptible=True)
            held += 1
            refused = 0
        else:
            refused += 1
    fill_s = time.perf_counter() - t0
    totals = cluster.totals()
    wall: list[float] = []
    cpu: list[float] = []
    victims: list[int] = []
    none = 0
    fits = 0
    for i in range(plans):
        base = stream.next()
        req = AllocationRequest(
            request_id=f"hi-{i}",
            pod=base.pod,
            gpus=base.gpus,
            rdma=base.rdma,
            policy=base.policy,
            priority=10,
            preemption="lower-priority",
            created_at=0.0,
        )
        w0, c0 = time.perf_counter(), time.thread_time()
        res = cluster.decide(req)
        plan = None if isinstance(res, Placement) else cluster.preempt(res.spec)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.thread_time() - c0)
        if isinstance(res, Placement):
            fits += 1
            cluster.hold(res.node, req.request_id, res.devices(), priority=10)
            continue
        if plan is None:
            none += 1
            continue
        victims.append(len(plan.victims))
        for v in plan.victims:
            cluster.release(plan.node, v.request_id)
        cluster.hold(plan.node, req.request_id, plan.placement.devices(), priority=10)
    ms = 1000.0
    return {
        "nodes": size,
        "allocations": held,
        "gpu_utilisation": round(1 - totals["free_gpus"] / max(1, totals["gpus"]), 3),
        "fill_s": round(fill_s, 2),
        "plans": len(victims),
        "fit_without_preemption": fits,
        "no_plan": none,
        "victims_mean": round(sum(victims) / len(victims), 2) if victims else 0,
        "victims_max": max(victims, default=0),
        "first_plan_ms": round(wall[0] * ms, 2) if wall else 0.0,
        "plan_ms_p50": round(_pct(wall, 0.5) * ms, 2),
        "plan_ms_p90": round(_pct(wall, 0.9) * ms, 2),
        "plan_ms_p99": round(_pct(wall, 0.99) * ms, 2),
        "plan_ms_max": round(max(wall, default=0.0) * ms, 2),
        "plan_cpu_ms_p50": round(_pct(cpu, 0.5) * ms, 2),
        "plan_cpu_ms_p90": round(_pct(cpu, 0.9) * ms, 2),
        "plan_cpu_ms_p99": round(_pct(cpu, 0.99) * ms, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.preemption", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--plans", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    for size in sorted(args.sizes):
        print(json.dumps(run(size, args.plans, args.seed)), flush=True)


if __name__ == "__main__":
    main()
