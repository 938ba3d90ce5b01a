"""``python -m bench.shares`` (``make bench-shares``): decision speed and memory of the allocator
core with fractional GPUs (shares), at fleet scale.

Like the speed part of :mod:`bench.run` these are figures of the *core* in one process — no
NATS, no service — and each configuration runs in a *fresh Python process*, so its peak RSS
is the allocator's own (interpreter, per-node topologies, core index and caches, driver).

The fleet is :data:`bench.fleet.MIX` (10,000 nodes by default). The request stream is the
core benchmark's whole-GPU stream (:func:`bench.fleet.requests`) with 30 % of the requests
replaced by share requests of device class ``shared`` (HAMi-style sharing, at most 8 shares
per GPU): 1 GPU (80 %) or 2, GPU-only (70 %) or one NIC per GPU paired like whole GPUs,
memory 4-20 GiB and compute 10-50 % per GPU, ``preferred`` policy. Utilisation is counted in
GPU-equivalents (a whole GPU is 1, a share its compute percent / 100). The driver fills the
fleet to 50 % and measures churn (release a random live allocation while above the target,
else decide + hold a new request) for a fixed number of decisions; then fills on to 85 % and
measures again. Latency is ``Cluster.decide`` alone, wall and thread CPU time; decisions/s is
decisions over the time spent in the core (decide + hold + release). Two configurations:
*plain* (no node selectors) and *service* (every node labelled with its hostname, 10 % of
requests pinned to a random node, as the allocator service runs), and *plain-mixed*: plain
with 16 distinct share sizes instead of 4 (see SIZES).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.fleet import HOSTNAME_LABEL, fleet, requests
from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, PodRef
from services.allocator.core import Cluster, Placement
from services.runtime.process.lifecycle import GC_THRESHOLDS
from tools.loadtest.mix import Workload

ROOT = Path(__file__).resolve().parent
UTILS = (0.50, 0.85)
SHARE_FRACTION = 0.30
PINNED = 0.10
# Share sizes (memory MiB, compute %). "profiles": a few standard sizes, as sharing setups
# usually offer (HAMi users typically define a handful of gpumem / gpucores presets);
# "mixed": every combination of four memory and four compute sizes, 16 distinct sizes.
SIZES: dict[str, tuple[tuple[int, int], ...]] = {
    "profiles": ((4096, 10), (8192, 25), (10240, 25), (20480, 50)),
    "mixed": tuple((m, c) for m in (4096, 8192, 10240, 20480) for c in (10, 20, 25, 50)),
}
# plain / service as in bench.run (service: hostname labels, 10 % pinned); -mixed: "mixed" sizes.
# plain-whole: plain with no share at all, the same driver's baseline.
CONFIGS = ("plain", "service", "plain-mixed", "plain-whole")
CLASSES = {"default": DeviceClass(), "shared": DeviceClass(sharing="hami", max_shares_per_gpu=8)}


class ShareStream:
    """The core benchmark's whole-GPU stream with ``fraction`` of it replaced by shares."""

    def __init__(
        self,
        seed: int,
        *,
        fraction: float,
        pinned: float,
        nodes: list[str],
        profiles: tuple[tuple[int, int], ...],
    ) -> None:
        self.profiles = profiles
        self.whole = requests(seed, Workload(pinned=pinned), pin_to=nodes)
        self.rng = random.Random(seed + 17)
        self.fraction = fraction
        self.pinned = pinned
        self.nodes = nodes
        self.n = 0

    def next(self) -> AllocationRequest:
        req = self.whole.next()
        rng = self.rng
        if rng.random() >= self.fraction:
            return req
        self.n += 1
        rid = f"share-{self.n}"
        g = 1 if rng.random() < 0.8 else 2
        mem, cores = rng.choice(self.profiles)
        selector = {}
        if self.pinned and rng.random() < self.pinned:
            selector = {HOSTNAME_LABEL: rng.choice(self.nodes)}
        return AllocationRequest(
            request_id=rid,
            pod=PodRef("bench", rid, rid),
            gpus=g,
            rdma=0 if rng.random() < 0.7 else g,
            device_class="shared",
            gpu_memory_mib=mem,
            gpu_cores_percent=cores,
            node_selector=selector,
            created_at=0.0,
        )


def _pct(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))] / 1e3, 1)


def child(n_nodes: int, decisions: int, seed: int, *, config: str) -> dict[str, Any]:
    service = config.startswith("service")
    sizes = SIZES["mixed" if config.endswith("-mixed") else "profiles"]
    nodes = fleet(n_nodes)
    names = [name for name, _ in nodes]
    total = float(sum(len(t.gpus()) for _, t in nodes))
    t0 = time.perf_counter()
    cluster = Cluster(device_classes=CLASSES)
    for name, topo in nodes:
        cluster.set_node(name, topo, labels={**topo.labels, HOSTNAME_LABEL: name} if service else None)
    build_s = time.perf_counter() - t0
    del nodes
    # As the allocator service runs: its long-lived state frozen after the inventory load
    # (bench.run does the same) and the services' GC thresholds (services.runtime.process.lifecycle).
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    stream = ShareStream(
        seed,
        fraction=0.0 if config == "plain-whole" else SHARE_FRACTION,
        pinned=PINNED if service else 0.0,
        nodes=names,
        profiles=sizes,
    )
    driver = _Driver(cluster, stream, rng=random.Random(seed + 1), total=total)
    rows = []
    for target in UTILS:
        t0 = time.perf_counter()
        filled = driver.fill(target)
        fill_s = time.perf_counter() - t0
        rec = driver.measure(target, decisions=decisions)
        rows.append(_row(driver, rec, target=target, filled=filled, fill_s=fill_s, names=names))
    return {
        "nodes": n_nodes,
        "config": config,
        "build_s": round(build_s, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "runs": rows,
    }


class _Driver:
    """Decides and holds requests from the stream, releases random live ones, and keeps the
    utilisation in GPU-equivalents (``used`` of ``total``)."""

    def __init__(self, cluster: Cluster, stream: ShareStream, *, rng: random.Random, total: float) -> None:
        self.cluster = cluster
        self.stream = stream
        self.rng = rng
        self.total = total
        self.live: list[tuple[str, str, float]] = []
        self.used = 0.0

    def fill(self, target: float) -> int:
        """Decide (unmeasured) until the target utilisation or 500 misses in a row."""
        filled = misses = 0
        while self.used / self.total < target and misses < 500:
            before = self.used
            self.decide(None)
            filled += 1
            misses = misses + 1 if self.used == before else 0
        return filled

    def measure(self, target: float, *, decisions: int) -> dict[str, Any]:
        """Churn around the target for ``decisions`` measured decisions."""
        rec: dict[str, Any] = {
            "wall": [],
            "cpu": [],
            "share": [],
            "whole": [],
            "core_s": 0.0,
            "placed": 0,
            "share_placed": 0,
            "whole_placed": 0,
        }
        while len(rec["wall"]) < decisions:
            while self.live and self.used / self.total > target:
                rec["core_s"] += self.release_one()
            self.decide(rec)
        return rec

    def release_one(self) -> float:
        live = self.live
        i = self.rng.randrange(len(live))
        live[i], live[-1] = live[-1], live[i]
        node, rid, weight = live.pop()
        t = time.perf_counter()
        self.cluster.release(node, rid)
        self.used -= weight
        return time.perf_counter() - t

    def decide(self, rec: dict[str, Any] | None) -> None:
        cluster = self.cluster
        req = self.stream.next()
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        got = cluster.decide(req)
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        placed = isinstance(got, Placement)
        if isinstance(got, Placement):
            cluster.hold(got.node, req.request_id, got.devices(), shares=got.shares(), sharing=got.sharing)
        t2 = time.perf_counter_ns()
        if isinstance(got, Placement):
            weight = req.gpus * (req.gpu_cores_percent or 100) / 100
            self.live.append((got.node, req.request_id, weight))
            self.used += weight
        if rec is None:
            return
        kind = "share" if req.shared else "whole"
        rec["wall"].append(t1 - t0)
        rec["cpu"].append(c1 - c0)
        rec[kind].append(t1 - t0)
        rec["core_s"] += (t2 - t0) / 1e9
        rec["placed"] += placed
        rec[f"{kind}_placed"] += placed


def _row(
    driver: _Driver, rec: dict[str, Any], *, target: float, filled: int, fill_s: float, names: list[str]
) -> dict[str, Any]:
    """One measured point: the figures of ``rec`` and the fleet's shared GPUs."""
    shared_gpus = shares = 0
    for name in names:
        for _mem, _cores, count in driver.cluster.gpu_shares(name).values():
            shared_gpus += 1
            shares += count
    return {
        "target_util": target,
        "util": round(driver.used / driver.total, 3),
        "fill_decisions": filled,
        "fill_s": round(fill_s, 2),
        "decisions": len(rec["wall"]),
        "share_decisions": len(rec["share"]),
        "placed": rec["placed"],
        "share_placed": rec["share_placed"],
        "decisions_per_s": round(len(rec["wall"]) / rec["core_s"]),
        "p50_us": _pct(rec["wall"], 0.50),
        "p99_us": _pct(rec["wall"], 0.99),
        "max_us": _pct(rec["wall"], 1.0),
        "cpu_p50_us": _pct(rec["cpu"], 0.50),
        "cpu_p99_us": _pct(rec["cpu"], 0.99),
        "share_p50_us": _pct(rec["share"], 0.50),
        "share_p99_us": _pct(rec["share"], 0.99),
        "whole_p50_us": _pct(rec["whole"], 0.50),
        "whole_p99_us": _pct(rec["whole"], 0.99),
        "shared_gpus": shared_gpus,
        "shares_on_them": shares,
        "caches": driver.cluster.cache_stats(),
    }


def markdown(results: list[dict[str, Any]]) -> str:
    head = (
        "| config | nodes | target util | util | decisions (shares) | decisions/s | p50 µs | p99 µs "
        "| max µs | CPU p99 µs | shares p50 / p99 µs | whole p50 / p99 µs | shared GPUs (shares) "
        "| groups | peak RSS MB |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for res in results:
        for r in res["runs"]:
            lines.append(
                f"| {res['config']} | {res['nodes']:,} | {r['target_util']:.0%} | {r['util']:.1%} "
                f"| {r['decisions']:,} ({r['share_decisions']:,}) | {r['decisions_per_s']:,} "
                f"| {r['p50_us']} | {r['p99_us']} | {r['max_us']} | {r['cpu_p99_us']} "
                f"| {r['share_p50_us']} / {r['share_p99_us']} | {r['whole_p50_us']} / {r['whole_p99_us']} "
                f"| {r['shared_gpus']:,} ({r['shares_on_them']:,}) | {r['caches']['groups']:,} "
                f"| {res['peak_rss_mb']} |"
            )
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.shares", description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--decisions", type=int, default=20_000, help="measured decisions per point")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"some of {', '.join(CONFIGS)}")
    ap.add_argument("--out", type=Path, default=ROOT / "results_shares.json")
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        res = child(args.nodes, args.decisions, args.seed, config=args.child)
        print(json.dumps(res))
        return 0
    results = []
    for config in args.configs.split(","):
        cmd = [sys.executable, "-m", "bench.shares", "--child", config]
        cmd += ["--nodes", str(args.nodes), "--decisions", str(args.decisions), "--seed", str(args.seed)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT.parent)
        if proc.returncode != 0:
            raise SystemExit(f"bench.shares {config} run failed:\n{proc.stderr}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"  shares {args.nodes} nodes ({config}) done", file=sys.stderr)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
