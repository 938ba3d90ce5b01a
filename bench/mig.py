"""``python -m bench.mig``: decision speed of the allocator core for MIG requests, by fleet size.

Figures of the *core* in one process (no NATS, no service), like :mod:`bench.shares`. The
fleet is ``N`` copies of the documented MIG node (``docs/examples/mig/dgx-h100-mig.yaml``: a
DGX H100 whose GPUs 0-3 are in MIG mode with 20 instances of three profiles, GPUs 4-7 whole).
The stream is churn: with probability 0.4 a random live allocation is released, else a MIG
request is decided and held: 1 instance (2/3) or 2, no NIC (2/3) or one, ``pairing: shared``,
profile ``1g.10gb`` (half), ``2g.20gb`` or ``3g.40gb``. Latency is ``Cluster.decide`` alone
(wall clock); decisions/s is decisions over the time spent deciding.

What it shows: a decision costs O(groups of alike MIG nodes with a free instance of the
profile) (:mod:`services.allocator.core.mig`), so the rate stays flat as the fleet grows.
One JSON line per size.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from schemas.messages import AllocationRequest, PodRef
from services.allocator.core import Cluster, Placement
from services.topology import load_topology

NODE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "mig" / "dgx-h100-mig.yaml"
PROFILES = ("1g.10gb", "1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb", "3g.40gb")


def run(nodes: int, steps: int, seed: int) -> dict[str, object]:
    topo = load_topology(str(NODE))
    cluster = Cluster()
    t0 = time.perf_counter()
    for i in range(nodes):
        cluster.set_node(f"mig-{i:05d}", topo)
    build_s = time.perf_counter() - t0
    rng = random.Random(seed)
    live: list[tuple[str, str]] = []
    lat: list[float] = []
    placed = 0
    for k in range(steps):
        if live and rng.random() < 0.4:
            node, rid = live.pop(rng.randrange(len(live)))
            cluster.release(node, rid)
            continue
        req = AllocationRequest(
            request_id=f"r{k}",
            pod=PodRef("bench", f"r{k}"),
            gpus=rng.choice((1, 1, 2)),
            rdma=rng.choice((0, 0, 1)),
            pairing="shared",
            mig_profile=rng.choice(PROFILES),
        )
        t = time.perf_counter()
        got = cluster.decide(req)
        lat.append(time.perf_counter() - t)
        if isinstance(got, Placement):
            placed += 1
            cluster.hold(got.node, req.request_id, got.devices())
            live.append((got.node, req.request_id))
    lat.sort()
    return {
        "nodes": nodes,
        "build_s": round(build_s, 2),
        "decisions": len(lat),
        "placed": placed,
        "decisions_per_s": round(len(lat) / sum(lat)),
        "p50_us": round(lat[len(lat) // 2] * 1e6, 1),
        "p99_us": round(lat[int(len(lat) * 0.99)] * 1e6, 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.mig", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10,100,1000,10000", help="fleet sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=3000, help="churn steps per size")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    for n in (int(x) for x in args.sizes.split(",") if x):
        print(json.dumps(run(n, args.steps, args.seed)), flush=True)


if __name__ == "__main__":
    main()
