"""``python -m bench.gang`` (``make bench-gang``): whole jobs across a fabric, against baselines.

Figures of the *core* in one process (``services.allocator.core``: ``place_job`` for whole
jobs, ``Cluster.decide`` for pods), driven through the same job book as ``tandem plan``
(:mod:`tools.cli.plan_jobs`); no NATS, no service, no commit protocol. As in the allocator
service, the loaded fleet is frozen out of the garbage collector (``gc.freeze``) and the
service's GC thresholds apply.

Fleet: ``--nodes`` (2,000) 8-GPU servers — DGX H100 (50 %), DGX A100 (30 %) and a real
8x H200 with 10 NICs (20 %, an imported ``nvidia-smi topo -m``), shuffled — in four fabric
tiers: 20 nodes per ``leaf``, 5 leaves per ``spine``, 4 spines per ``pod``, pods split into
two ``zone`` blocks (labels ``tandem.io/fabric-<tier>``).

Load: one seeded stream of items, the same for every mode: half are jobs of 2-64 pods of
8 GPUs + 8 NICs (2: 30 %, 4: 25 %, 8: 20 %, 16: 12 %, 32: 8 %, 64: 5 %; ``fabric: leaf``,
preferred), half are single pods of 1, 2 or 4 GPUs with as many NICs (``Cluster.decide`` in
every mode). The *offered load* is the GPUs held plus the GPUs waiting items still miss, over
the fleet's GPUs: while it is below the target (``--loads``: 70 %, 90 %, 110 %) the next item
is submitted and tried at once, else a random running item leaves and every waiting item is
tried again, oldest first, those that still do not fit keeping their place (backfill, as a
Kubernetes scheduler retries every pending pod). The first ``--warmup`` job submissions
fill the fleet; the next ``--jobs`` are measured.

Modes (``tandem plan --jobs``): ``gang`` — Tandem, whole jobs in the finest fabric block;
``gang-no-fabric`` — all-or-nothing but blind to the fabric; ``per-pod`` — each pod placed
alone as today: a job whose later pods do not fit keeps the pods already placed and waits
for the rest (retried like any waiting item); the GPUs it holds meanwhile are *idle*.

Reported per load and mode, over the measured jobs: share placed whole when submitted, share
placed by the end of the run, share that were ever partially placed, GPUs held and GPUs idle
(mean over the measured steps, as a share of the fleet's GPUs; idle peak in GPUs), the
highest tier each placed multi-pod job spans, the share of the jobs' GPU/NIC pairs on one
PCIe switch, and the decision time per attempt (``place_job`` + holds, or the pods'
``decide`` + holds) as this thread's CPU time (what other processes on a shared machine do
not inflate; wall time's p99 in brackets), over all attempts and the 64-pod ones. In the
gang modes a 64-pod job is also decided (not held) after every measured step: its CPU time
is the second table.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec

from bench.fleet import _topology
from schemas.messages import AllocationRequest, JobRequest, PodRef
from services.allocator.core import Cluster, Placement
from services.allocator.core.gang import fabric_label, fabric_span, place_job
from services.runtime.process.lifecycle import GC_THRESHOLDS
from tools.cli.plan_jobs import JobBook, JobMode

ROOT = Path(__file__).resolve().parent
TIERS = ("leaf", "spine", "pod", "zone")
SERVERS = (("dgx-h100", 0.5), ("dgx-a100", 0.3), ("h200-10nic", 0.2))
JOB_SIZES = ((2, 0.30), (4, 0.25), (8, 0.20), (16, 0.12), (32, 0.08), (64, 0.05))
MODES: tuple[JobMode, ...] = ("gang", "gang-no-fabric", "per-pod")


def build_fleet(nodes: int, seed: int) -> Cluster:
    rng = random.Random(seed)
    kinds = [name for name, share in SERVERS for _ in range(round(share * nodes))]
    kinds = (kinds + [SERVERS[0][0]] * nodes)[:nodes]
    rng.shuffle(kinds)
    topos = {name: _topology(name) for name, _ in SERVERS}
    cluster = Cluster()
    for i, kind in enumerate(kinds):
        leaf = i // 20
        spine = leaf // 5
        pod = spine // 4
        zone = 0 if pod < max(1, (nodes // 400 + 1) // 2) else 1
        labels = {
            fabric_label("leaf"): f"leaf-{leaf}",
            fabric_label("spine"): f"spine-{spine}",
            fabric_label("pod"): f"pod-{pod}",
            fabric_label("zone"): f"zone-{zone}",
        }
        cluster.set_node(f"n{i:05d}", topos[kind], labels=labels)
    return cluster


def stream(seed: int) -> Any:
    """Items forever: ("job", obj) or ("pod", request)."""
    rng = random.Random(seed)
    sizes = [s for s, _ in JOB_SIZES]
    weights = [w for _, w in JOB_SIZES]
    k = 0
    while True:
        k += 1
        if rng.random() < 0.5:
            pods = rng.choices(sizes, weights)[0]
            yield "job", {"kind": "job", "id": f"j{k}", "pods": pods, "gpus": 8, "rdma": 8, "fabric": "leaf"}
        else:
            g = rng.choice((1, 2, 4))
            yield "pod", AllocationRequest(request_id=f"p{k}", pod=PodRef("bench", f"p{k}"), gpus=g, rdma=g)


def run_mode(mode: JobMode, *, nodes: int, load: float, jobs: int, seed: int, warmup: int) -> dict[str, Any]:
    cluster = build_fleet(nodes, seed)
    # As the allocator service runs: its GC thresholds, and the loaded fleet frozen out of
    # the collector (bench.run measures what a full collection costs without it).
    gc.set_threshold(*GC_THRESHOLDS)
    gc.collect()
    gc.freeze()
    run = _Run(mode, cluster, seed=seed)
    run.loop(load=load, jobs=jobs, warmup=warmup)
    gc.unfreeze()  # the next run's fleet replaces this one
    return run.row(load=load)


class _Run:
    """One mode at one load: the fleet and its job book, what runs and what waits, and the
    figures gathered over the measured jobs (see the module docstring)."""

    def __init__(self, mode: JobMode, cluster: Cluster, *, seed: int) -> None:
        self.mode = mode
        self.cluster = cluster
        self.book = JobBook(cluster, tiers=TIERS, mode=mode)
        self.total = cluster.totals()["gpus"]
        self.rng = random.Random(seed + 1)
        self.items = stream(seed + 2)
        self.running: list[tuple[str, str, str | None]] = []  # (kind, id, node for pods): may depart
        self.pending: deque[tuple[str, Any]] = deque()  # FIFO of items waiting (jobs or pods)
        self.waiting_gpus = 0  # GPUs the pending items still miss
        self.submitted = 0  # jobs submitted (warm-up included)
        self.measured: set[str] = set()
        self.at_submit = self.completed = 0
        self.ever_partial: set[str] = set()
        self.steps = 0
        self.idle_sum = self.held_sum = 0.0
        self.idle_peak = 0
        self.times: list[float] = []
        self.times64: list[float] = []
        self.cpus: list[float] = []
        self.cpus64: list[float] = []
        self.probes: list[float] = []
        fabric = "leaf" if mode == "gang" else None
        self.probe = JobRequest(job_id="probe", pods=64, gpus=8, rdma=8, fabric=fabric)
        self.tiers = dict.fromkeys(("node", *TIERS, "cluster"), 0)
        self.pairs_before: dict[str, int] | None = None

    def loop(self, *, load: float, jobs: int, warmup: int) -> None:
        """Submit while the offered load is below ``load``, else let a running item leave and
        try every waiting one again; until ``warmup + jobs`` jobs were submitted."""
        while self.submitted < warmup + jobs:
            used = self.total - self.cluster.totals()["free_gpus"]
            if used + self.waiting_gpus < load * self.total:
                self.submit(next(self.items), warmup=warmup)
                continue
            if not self.running:
                break
            self.depart()
            self.drain()
            if self.submitted > warmup:
                self.sample()

    def submit(self, item: tuple[str, Any], *, warmup: int) -> None:
        kind, obj = item
        if kind == "job":
            self.submitted += 1
            if self.submitted > warmup:
                self.measured.add(obj["id"])
                if self.pairs_before is None:
                    self.pairs_before = dict(self.book.alignment)
        if self.attempt(kind, obj):
            if kind == "job" and obj["id"] in self.measured:
                self.at_submit += 1
        else:
            self.pending.append((kind, obj))
            self.waiting_gpus += self.missing(kind, obj)

    def depart(self) -> None:
        """A random running item leaves."""
        kind, rid, node = self.running.pop(self.rng.randrange(len(self.running)))
        if kind == "job":
            self.book.free(rid)
        else:
            assert node is not None
            self.cluster.release(node, rid)

    def drain(self) -> None:
        """Try every waiting item, oldest first; those that still do not fit keep waiting
        (backfill, as a Kubernetes scheduler retries every pending pod)."""
        keep: deque[tuple[str, Any]] = deque()
        while self.pending:
            kind, obj = self.pending.popleft()
            before = self.missing(kind, obj)
            done = self.attempt(kind, obj)
            self.waiting_gpus -= before - (0 if done else self.missing(kind, obj))
            if not done:
                keep.append((kind, obj))
        self.pending.extend(keep)

    def sample(self) -> None:
        """After a measured step: the 64-pod probe (gang modes) and the GPUs held and idle."""
        if self.mode != "per-pod":
            # A 64-pod job decided (not held) on the state after every measured step.
            c0 = time.thread_time()
            place_job(self.cluster, self.probe, tiers=TIERS if self.mode == "gang" else ())
            self.probes.append(time.thread_time() - c0)
        self.steps += 1
        idle = sum(self.book.idle.values())
        self.idle_sum += idle
        self.held_sum += self.total - self.cluster.totals()["free_gpus"]
        self.idle_peak = max(self.idle_peak, idle)

    def missing(self, kind: str, obj: Any) -> int:
        if kind == "pod":
            return int(obj.gpus)
        have = len(self.book.live.get(obj["id"], ()))
        return (obj["pods"] - have) * 8

    def attempt(self, kind: str, obj: Any) -> bool:
        """Try the item once; True when it is now running whole."""
        if kind == "pod":
            res = self.cluster.decide(obj)
            if not isinstance(res, Placement):
                return False
            self.cluster.hold(res.node, obj.request_id, res.devices())
            self.running.append(("pod", obj.request_id, res.node))
            return True
        return self._attempt_job(obj)

    def _attempt_job(self, obj: dict[str, Any]) -> bool:
        jid = obj["id"]
        n_before = len(self.book.times)
        if jid in self.book.waiting:
            status = self.book.resume(jid)
        else:
            status = self.book.place(obj, "bench")[-1]["status"]
        dt, cpu = self.book.times[n_before], self.book.cpu_times[n_before]
        if jid in self.measured:
            self.times.append(dt)
            self.cpus.append(cpu)
            if obj["pods"] == 64:
                self.times64.append(dt)
                self.cpus64.append(cpu)
            if status == "partial":
                self.ever_partial.add(jid)
        if status != "assigned":
            return False
        self.running.append(("job", jid, None))
        if jid in self.measured:
            self.completed += 1
            pods = self.book.live[jid]
            nodes = dict.fromkeys(n for n, _ in pods)
            level_tier = fabric_span([self.cluster.labels(n) for n in nodes], TIERS)
            if len(pods) > 1:
                self.tiers[level_tier[1]] += 1
        return True

    def row(self, *, load: float) -> dict[str, Any]:
        """The figures over the measured jobs (one row of the tables)."""
        n, steps, total = len(self.measured), self.steps, self.total
        multi = sum(self.tiers.values())
        pairs = {k: v - (self.pairs_before or {}).get(k, 0) for k, v in self.book.alignment.items()}
        pairs_all = sum(pairs.values())
        pairs_switch = pairs["pcie-switch"]
        return {
            "mode": self.mode,
            "load": load,
            "jobs": n,
            "placed_at_submit": round(self.at_submit / n, 4) if n else None,
            "completed": round(self.completed / n, 4) if n else None,
            "ever_partial": round(len(self.ever_partial) / n, 4) if n else None,
            "held_gpus_mean_share": round(self.held_sum / steps / total, 4) if steps else 0.0,
            "idle_gpus_mean_share": round(self.idle_sum / steps / total, 4) if steps else 0.0,
            "idle_gpus_peak": self.idle_peak,
            "tier": {k: round(v / multi, 4) if multi else 0.0 for k, v in self.tiers.items()},
            "pairs_on_switch": round(pairs_switch / pairs_all, 4) if pairs_all else None,
            "decision_ms": _pct(self.times),
            "decision_ms_64": _pct(self.times64),
            "decision_cpu_ms": _pct(self.cpus),
            "decision_cpu_ms_64": _pct(self.cpus64),
            "probe64_cpu_ms": _pct(self.probes),
            "probes": len(self.probes),
            "attempts": len(self.times),
            "attempts_64": len(self.times64),
        }


def _pct(times: list[float]) -> dict[str, float | None]:
    s = sorted(times)

    def q(p: float) -> float | None:
        return round(s[min(len(s) - 1, int(p * len(s)))] * 1e3, 2) if s else None

    return {"p50": q(0.5), "p99": q(0.99), "max": round(s[-1] * 1e3, 2) if s else None}


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| load | mode | jobs placed at once | placed by the end | ever partial | GPUs held | "
        "idle GPUs mean / peak | tier spanned % (node/leaf/spine/pod/zone/cluster) | job pairs on a "
        "switch | decision CPU ms p50 / p99 (wall p99) | 64-pod CPU ms p50 / p99 (wall p99) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    out = [head]
    for r in rows:
        t = r["tier"]
        tiers = "/".join(f"{100 * t[k]:.0f}" for k in ("node", *TIERS, "cluster"))
        c, c64 = r["decision_cpu_ms"], r["decision_cpu_ms_64"]
        w, w64 = r["decision_ms"], r["decision_ms_64"]
        out.append(
            f"| {100 * r['load']:.0f} % | {r['mode']} | {100 * (r['placed_at_submit'] or 0):.1f} % | "
            f"{100 * (r['completed'] or 0):.1f} % | {100 * (r['ever_partial'] or 0):.1f} % | "
            f"{100 * r['held_gpus_mean_share']:.1f} % | {100 * r['idle_gpus_mean_share']:.1f} % / "
            f"{r['idle_gpus_peak']} | {tiers} | {100 * (r['pairs_on_switch'] or 0):.1f} % | "
            f"{c['p50']} / {c['p99']} ({w['p99']}) | {c64['p50']} / {c64['p99']} ({w64['p99']}, "
            f"n={r['attempts_64']}) |"
        )
    probe = ["", "64-pod job decided after every measured step (not held), CPU ms:", ""]
    probe.append("| load | mode | p50 | p99 | max | decisions |\n|---|---|---|---|---|---|")
    for r in rows:
        if r["probes"]:
            p = r["probe64_cpu_ms"]
            probe.append(
                f"| {100 * r['load']:.0f} % | {r['mode']} | {p['p50']} | {p['p99']} | {p['max']} "
                f"| {r['probes']} |"
            )
    return "\n".join(out + probe)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gang", description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=1000, help="job submissions measured per run")
    ap.add_argument("--warmup", type=int, default=200, help="job submissions before measuring")
    ap.add_argument("--loads", default="0.7,0.9,1.1", help="offered GPU load (held + waiting)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "gang_results.json")
    args = ap.parse_args(argv)
    rows = []
    for load in (float(x) for x in args.loads.split(",")):
        for mode in args.modes.split(","):
            if mode not in MODES:
                ap.error(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
            t0 = time.perf_counter()
            row = run_mode(
                mode,  # type: ignore[arg-type]
                nodes=args.nodes,
                load=load,
                jobs=args.jobs,
                seed=args.seed,
                warmup=args.warmup,
            )
            print(f"# {mode} at {load:.0%}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            rows.append(row)
    print(table(rows))
    doc = {
        "nodes": args.nodes,
        "tiers": TIERS,
        "jobs_measured": args.jobs,
        "seed": args.seed,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "rows": rows,
    }
    args.out.write_text(msgspec.json.format(msgspec.json.encode(doc), indent=2).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
