"""``python -m bench.run`` (``make bench``): speed, quality and optimality of the allocator core.

These are figures of the *core* (``services.allocator.core``) in one process, not of the
running system: no NATS, no service, no node agents (``tandem loadtest`` measures that).

Four parts, each printed as a Markdown table and written to ``bench/results.json``:

1. **speed** — for each fleet size a *fresh Python process* (so its peak RSS is the
   allocator's own: interpreter + per-node topologies + core index and caches + this driver)
   builds a mixed fleet (``bench.fleet.MIX``), fills it with requests to about 50 % GPU
   utilisation, then runs churn (release a random live allocation while above the target,
   else decide + hold a new request) for a fixed number of decisions; then fills on to about
   85 % and measures again. Latency is ``Cluster.decide`` alone; decisions/s is decisions over
   the time spent in the allocator (decide + hold + release), not in the driver. Both also
   as the thread's CPU time, which other processes on a shared machine do not inflate.
2. **quality** — the same churn on one fleet for Tandem and the three baselines of
   :mod:`bench.baselines`, with the same seeded request stream: share of GPU/NIC pairs at each
   scope, share of placements with every pair on a PCIe switch, refusals, and refusals
   although the cluster had enough free GPUs and NICs in total (fragmentation).
3. **optimality** — random small clusters (:mod:`bench.randtopo`): Tandem's decision against
   the exhaustive search of :mod:`bench.exhaustive` on every node.
4. **16-GPU servers** — uncached decisions on one HGX-2 / DGX-2 class server (16 GPUs with 16
   or 8 NICs, :func:`bench.fleet.sixteen_gpu`): latency, and the choice checked against the
   previous exact search (:mod:`bench.enumeration`) where that finishes in reasonable time.

Speed runs twice per size: *plain* (nodes labelled only with their topology's labels, no node
selectors) and *service* (the allocator service's configuration: every node labelled with
``kubernetes.io/hostname``, 10 % of requests pinned to a random node by a hostname selector).

Options: ``--quick`` for a smoke run (small sizes), ``--sizes``, ``--decisions``,
``--big-samples`` (decisions per 16-GPU server).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import enumeration, exhaustive
from bench.baselines import BASELINES, Baseline, Pick
from bench.fleet import HOSTNAME_LABEL, MIX, MIXES, REAL_MIX, Workload, fleet, requests, sixteen_gpu
from bench.randtopo import all_device_ids, random_cluster, random_request
from bench.report import machine, markdown
from schemas.config import DeviceClass, default_device_classes
from schemas.messages import AllocationRequest, PodRef
from schemas.topology import SCOPES, NodeTopology
from services.allocator.core import Cluster, Placement, Unschedulable, normalise
from services.allocator.core.model import compile_shape, shape_signature
from services.allocator.core.search import Refusal, cross_key

ROOT = Path(__file__).resolve().parent
UTILS = (0.50, 0.85)  # speed and quality
STRESS = (0.90, 0.95)  # extra quality points where the fleet runs out of aligned capacity
PROBE_EVERY = 100  # quality runs: sample the aligned capacity left every this many decisions
CLASSES = default_device_classes()


# ---------------------------------------------------------------------------------------------
# adapters: one interface over Tandem and the baselines


@dataclass(slots=True)
class Outcome:
    node: str
    devices: list[str]
    gpus: int
    nics: int
    scopes: list[int]
    met: bool


class TandemAdapter:
    name = "tandem"
    label = "Tandem: joint exact search, (shape, free-mask) index"

    def __init__(
        self,
        nodes: list[tuple[str, NodeTopology]],
        *,
        policy: str = "binpack",
        hostname: bool = False,
        node_order: str | None = None,
    ) -> None:
        # node_order: the default class's (--node-order), else the core's default.
        classes = {"default": DeviceClass(node_order=node_order)} if node_order else None  # type: ignore[arg-type]
        self.cluster = Cluster(node_policy=policy, device_classes=classes)
        for name, topo in nodes:
            # hostname: label every node as the allocator service does (_sync_node).
            labels = {**topo.labels, HOSTNAME_LABEL: name} if hostname else None
            self.cluster.set_node(name, topo, labels=labels)

    def decide(self, req: AllocationRequest) -> Outcome | None:
        res = self.cluster.decide(req)
        if isinstance(res, Unschedulable):
            return None
        return _outcome(res)

    def hold(self, node: str, rid: str, devices: list[str]) -> None:
        self.cluster.hold(node, rid, devices)

    def release(self, node: str, rid: str) -> None:
        self.cluster.release(node, rid)


_SCOPE_INDEX = {s: i for i, s in enumerate(SCOPES)}


def _outcome(p: Placement) -> Outcome:
    return Outcome(
        p.node, p.devices(), len(p.gpus), len(p.nics), [_SCOPE_INDEX[x.scope] for x in p.pairs], p.met
    )


class BaselineAdapter:
    def __init__(self, impl: Baseline) -> None:
        self.impl = impl
        self.name = impl.name
        self.label = impl.label

    def decide(self, req: AllocationRequest) -> Outcome | None:
        spec = normalise(req, CLASSES)
        pick: Pick | None = self.impl.decide(
            req, scope=int(spec.scope), required=spec.required, per_gpu=spec.per_gpu
        )
        if pick is None:
            return None
        return Outcome(
            pick.node, pick.gpus + pick.nics, len(pick.gpus), len(pick.nics), pick.scopes, pick.met
        )

    def hold(self, node: str, rid: str, devices: list[str]) -> None:
        self.impl.hold(node, rid, devices)

    def release(self, node: str, rid: str) -> None:
        self.impl.release(node, rid)


# ---------------------------------------------------------------------------------------------
# churn


@dataclass
class ChurnStats:
    decisions: int = 0
    placed: int = 0
    refused: int = 0
    frag_refused: int = 0
    pairs: list[int] = field(default_factory=lambda: [0] * 5)
    all_switch: int = 0  # placements with pairs, every pair on a PCIe switch
    with_pairs: int = 0
    required: int = 0
    required_met: int = 0
    latencies_ns: list[int] = field(default_factory=list)
    # The same in this thread's CPU time: what the core costs, whatever else the shared
    # machine runs (wall time includes the moments another process had the core).
    cpu_ns: list[int] = field(default_factory=list)
    allocator_cpu_s: float = 0.0
    pinned_ns: list[int] = field(default_factory=list)  # the pinned decisions among them
    pinned_placed: int = 0
    allocator_s: float = 0.0
    util: float = 0.0
    # Aligned capacity left, averaged over samples taken during the measured decisions: nodes
    # that could still take an 8-GPU + 8-NIC (4 + 4) job with every pair on a PCIe switch.
    cap_samples: int = 0
    cap_8x8: int = 0
    cap_4x4: int = 0


class Churn:
    """Drives one allocator: a seeded request stream, random releases, utilisation target."""

    def __init__(
        self,
        alloc: Any,
        nodes: list[tuple[str, NodeTopology]],
        *,
        seed: int,
        probe_every: int = 0,
        pinned: float = 0.0,
    ) -> None:
        self.alloc = alloc
        # A probe: a second Tandem index mirroring this allocator's holds, used only to count
        # the nodes that could still take a large aligned job (the same count for every
        # allocator, whatever its own data structures).
        self.probe: Cluster | None = None
        self.probe_every = probe_every
        if probe_every:
            self.probe = Cluster()
            for name, topo in nodes:
                self.probe.set_node(name, topo)
        self.total_gpus = sum(len(t.gpus()) for _, t in nodes)
        self.total_nics = sum(len(t.nics()) for _, t in nodes)
        self.used_gpus = 0
        self.used_nics = 0
        self.stream = requests(seed, Workload(pinned=pinned), pin_to=[name for name, _ in nodes])
        self.rng = random.Random(seed + 1)
        self.live: list[tuple[str, str, int, int]] = []

    def util(self) -> float:
        return self.used_gpus / self.total_gpus

    def _release_one(self) -> tuple[float, float]:
        """Release a random live allocation; (wall seconds, CPU seconds) in the allocator."""
        i = self.rng.randrange(len(self.live))
        self.live[i], self.live[-1] = self.live[-1], self.live[i]
        node, rid, g, n = self.live.pop()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        self.alloc.release(node, rid)
        dt = time.perf_counter() - t0
        cpu = time.thread_time() - c0
        if self.probe is not None:
            self.probe.release(node, rid)
        self.used_gpus -= g
        self.used_nics -= n
        return dt, cpu

    def _decide(self, stats: ChurnStats | None) -> None:
        req = self.stream.next()
        free_g = self.total_gpus - self.used_gpus
        free_n = self.total_nics - self.used_nics
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        out = self.alloc.decide(req)
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        if out is not None:
            self.alloc.hold(out.node, req.request_id, out.devices)
        t2 = time.perf_counter_ns()
        c2 = time.thread_time_ns()
        if out is not None:
            if self.probe is not None:
                self.probe.hold(out.node, req.request_id, out.devices)
            self.live.append((out.node, req.request_id, out.gpus, out.nics))
            self.used_gpus += out.gpus
            self.used_nics += out.nics
        if stats is None:
            return
        stats.decisions += 1
        if self.probe is not None and stats.decisions % self.probe_every == 0:
            stats.cap_samples += 1
            stats.cap_8x8 += self.probe.fit_count(_PROBE_8X8)
            stats.cap_4x4 += self.probe.fit_count(_PROBE_4X4)
        stats.latencies_ns.append(t1 - t0)
        stats.allocator_s += (t2 - t0) / 1e9
        stats.cpu_ns.append(c1 - c0)
        stats.allocator_cpu_s += (c2 - c0) / 1e9
        if req.node_selector:
            stats.pinned_ns.append(t1 - t0)
            stats.pinned_placed += out is not None
        required = req.policy == "required"
        stats.required += required
        if out is None:
            stats.refused += 1
            if free_g >= req.gpus and free_n >= req.rdma:
                stats.frag_refused += 1
            return
        stats.placed += 1
        stats.required_met += required and out.met
        for s in out.scopes:
            stats.pairs[s] += 1
        if out.scopes:
            stats.with_pairs += 1
            stats.all_switch += all(s == 0 for s in out.scopes)

    def fill(self, target: float, *, limit: int = 10**6) -> int:
        n = 0
        misses = 0
        while self.util() < target and n < limit:
            before = self.used_gpus
            self._decide(None)
            n += 1
            misses = misses + 1 if self.used_gpus == before else 0
            if misses > 500:  # the fleet cannot take more of this mix
                break
        return n

    def measure(self, target: float, decisions: int) -> ChurnStats:
        stats = ChurnStats()
        while stats.decisions < decisions:
            while self.live and self.util() > target:
                wall, cpu = self._release_one()
                stats.allocator_s += wall
                stats.allocator_cpu_s += cpu
            self._decide(stats)
        stats.util = self.util()
        return stats


def _probe_request(n: int) -> AllocationRequest:
    rid = f"probe-{n}x{n}"
    return AllocationRequest(
        request_id=rid, pod=PodRef("bench", rid, rid), gpus=n, rdma=n, scope="pcie-switch", policy="required"
    )


_PROBE_8X8 = _probe_request(8)
_PROBE_4X4 = _probe_request(4)


def _pct(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] / 1e3


# ---------------------------------------------------------------------------------------------
# 1. speed (one subprocess per size)


# The service's configuration: every node labelled with its hostname, this share of requests
# pinned to one (random) node by a hostname node selector.
SERVICE_PINNED = 0.10


def speed_child(
    n_nodes: int,
    decisions: int,
    seed: int,
    *,
    freeze: bool = True,
    service: bool = False,
    node_order: str | None = None,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    nodes = fleet(n_nodes)
    t_fleet = time.perf_counter() - t0
    rss_fleet = _rss_now_mb()
    t0 = time.perf_counter()
    adapter = TandemAdapter(nodes, hostname=service, node_order=node_order)
    t_build = time.perf_counter() - t0
    if freeze:
        # What a long-running allocator does once its inventory is loaded: the ~90 tracked
        # objects per node topology never form cycles, and without this every full
        # collection walks all of them (about 0.7 s at 10,000 nodes) inside some decision.
        gc.freeze()
    churn = Churn(adapter, nodes, seed=seed, pinned=SERVICE_PINNED if service else 0.0)
    del nodes
    rows = []
    for target in UTILS:
        t0 = time.perf_counter()
        filled = churn.fill(target)
        t_fill = time.perf_counter() - t0
        st = churn.measure(target, decisions)
        rows.append(
            {
                "target_util": target,
                "util": round(st.util, 3),
                "fill_decisions": filled,
                "fill_s": round(t_fill, 2),
                "decisions": st.decisions,
                "placed": st.placed,
                "refused": st.refused,
                "decisions_per_s": round(st.decisions / st.allocator_s),
                "p50_us": round(_pct(st.latencies_ns, 0.50), 1),
                "p99_us": round(_pct(st.latencies_ns, 0.99), 1),
                "max_us": round(_pct(st.latencies_ns, 1.0), 1),
                "cpu_decisions_per_s": round(st.decisions / st.allocator_cpu_s),
                "cpu_p50_us": round(_pct(st.cpu_ns, 0.50), 1),
                "cpu_p99_us": round(_pct(st.cpu_ns, 0.99), 1),
                "pinned": len(st.pinned_ns),
                "pinned_placed": st.pinned_placed,
                "pinned_p50_us": round(_pct(st.pinned_ns, 0.50), 1),
                "pinned_p99_us": round(_pct(st.pinned_ns, 0.99), 1),
                "groups": adapter.cluster.group_count(),
                "caches": adapter.cluster.cache_stats(),
            }
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "nodes": n_nodes,
        "config": "service" if service else "plain",
        "gc_freeze": freeze,
        "fleet_decode_s": round(t_fleet, 2),
        "build_s": round(t_build, 2),
        "rss_after_fleet_mb": round(rss_fleet, 1),
        "peak_rss_mb": round(peak, 1),
        "runs": rows,
    }


def _rss_now_mb() -> float:
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def speed(
    sizes: list[int], decisions: int, seed: int, *, node_order: str | None = None
) -> list[dict[str, Any]]:
    out = []
    # Each size plain and in the service's configuration (hostname labels, pinned requests);
    # the largest once more without gc.freeze(), to show what a full collection costs.
    runs = [(n, True, service) for service in (False, True) for n in sizes]
    for n, freeze, service in [*runs, (sizes[-1], False, False)]:
        cmd = [sys.executable, "-m", "bench.run", "--speed-child", str(n), "--decisions", str(decisions)]
        cmd += ["--seed", str(seed), *([] if freeze else ["--no-gc-freeze"])]
        cmd += ["--service"] if service else []
        cmd += ["--node-order", node_order] if node_order else []
        res = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT.parent)
        if res.returncode != 0:
            raise SystemExit(f"speed child for {n} nodes failed:\n{res.stderr}")
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
        config = "service" if service else "plain"
        print(f"  speed {n} nodes ({config}, gc.freeze {freeze}) done", file=sys.stderr)
    return out


# ---------------------------------------------------------------------------------------------
# 2. quality


def quality(
    n_nodes: int, decisions: int, seed: int, *, mix: str = "builtin", node_order: str | None = None
) -> list[dict[str, Any]]:
    nodes = fleet(n_nodes, MIXES[mix])
    rows = []
    makers: list[tuple[str, Any]] = [("tandem", lambda: TandemAdapter(nodes, node_order=node_order))]
    makers += [(b.name, lambda b=b: BaselineAdapter(b(nodes))) for b in BASELINES]
    for target in (*UTILS, *STRESS):
        for name, make in makers:
            alloc = make()
            churn = Churn(alloc, nodes, seed=seed, probe_every=PROBE_EVERY)
            churn.fill(target)
            st = churn.measure(target, decisions)
            total_pairs = sum(st.pairs) or 1
            rows.append(
                {
                    "allocator": name,
                    "label": alloc.label,
                    "target_util": target,
                    "util": round(st.util, 3),
                    "decisions": st.decisions,
                    "placed": st.placed,
                    "refused": st.refused,
                    "frag_refused": st.frag_refused,
                    "frag_refused_pct": round(100 * st.frag_refused / st.decisions, 2),
                    "pairs": dict(zip(SCOPES, st.pairs, strict=True)),
                    "pair_share_pct": {
                        s: round(100 * p / total_pairs, 1) for s, p in zip(SCOPES, st.pairs, strict=True)
                    },
                    "all_switch_pct": round(100 * st.all_switch / max(st.with_pairs, 1), 1),
                    "required": st.required,
                    "required_met": st.required_met,
                    "cap_8x8": round(st.cap_8x8 / max(st.cap_samples, 1), 1),
                    "cap_4x4": round(st.cap_4x4 / max(st.cap_samples, 1), 1),
                }
            )
            print(f"  quality ({mix}) {name} @ {target:.0%} done", file=sys.stderr)
    return rows


# ---------------------------------------------------------------------------------------------
# 3. optimality


def _node_key(
    name: str,
    cross: tuple[int, ...],
    topos: dict[str, NodeTopology],
    blocked: dict[str, set[str]],
    spec: Any,
    policy: str,
) -> tuple[int, ...]:
    """(alignment key, one-sided waste, fresh-node cost), recomputed from the free sets; the
    fresh-node cost first for a class with node order used-first."""
    free = exhaustive.effective_free(topos[name], blocked[name])
    gpus = {g.id for g in topos[name].gpus()}
    pfs = {n.name for n in topos[name].nics()}
    fresh = len(gpus) if policy == "binpack" and not spec.required and (gpus | pfs) <= free else 0
    waste = len(pfs & free) if spec.rdma == 0 else len(gpus & free) if spec.gpus == 0 else 0
    return (fresh, *cross, waste) if spec.dc.node_order == "used-first" else (*cross, waste, fresh)


def optimality(cases: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    equal = placed = refused = 0
    mismatches: list[str] = []
    for i in range(cases):
        cseed = rng.randrange(2**32)
        cluster, topos, blocked = random_cluster(cseed, rng.randint(1, 4))
        req = random_request(random.Random(cseed + 1), f"o{i}")
        spec = cluster.normalise(req)
        refs: dict[str, tuple[int, ...]] = {}
        for name, topo in topos.items():
            labels = cluster.labels(name)
            if not all(labels.get(k) == v for k, v in req.node_selector.items()):
                continue
            ref = exhaustive.best(topo, exhaustive.effective_free(topo, blocked[name]), spec)
            if ref is not None:
                refs[name] = ref[0]
        got = cluster.decide(req)
        if isinstance(got, Placement):
            placed += 1
            ok = bool(refs) and got.quality == refs.get(got.node)
            # Across nodes: the chosen node's alignment key is the best any node offers.
            s = int(spec.scope)
            pol = cluster.node_policy
            ok = ok and _node_key(got.node, cross_key(got.quality, s), topos, blocked, spec, pol) == min(
                _node_key(name, cross_key(k, s), topos, blocked, spec, pol) for name, k in refs.items()
            )
        else:
            refused += 1
            ok = not refs
        equal += ok
        if not ok:
            mismatches.append(f"case {i} seed {cseed}")
    return {
        "cases": cases,
        "placed": placed,
        "refused": refused,
        "equal": equal,
        "equal_pct": round(100 * equal / cases, 2),
        "mismatches": mismatches[:10],
    }


# ---------------------------------------------------------------------------------------------
# 4. 16-GPU servers

BIG_SERVERS = ((2, "16 GPUs + 16 NICs (HGX-2 class, 2 NICs per switch)"), (1, "16 GPUs + 8 NICs (DGX-2)"))
BIG_HELD = (0.0, 0.1, 0.25, 0.5)  # share of devices held before the decision
BIG_CHECK_HELD = 0.5  # the previous search is checked where at least this share is held


def big_nodes(samples: int, seed: int) -> list[dict[str, Any]]:
    """Uncached decisions on one 16-GPU server: every decision on a fresh index (nothing cached:
    class views and in-node search run each time), with a random share of the devices held and
    a request of 1 / 2 / 4 / 8 / 16 GPUs, one NIC per GPU, half as many (shared) or none, scope
    and policy at random. Latency is ``Cluster.decide`` alone (cyclic GC off during the call:
    the driver's fresh indexes are its garbage, not the core's), as wall time and as the
    thread's CPU time (which a shared machine's other load does not inflate). Where half the
    devices are held
    the choice is also compared with the previous exact search (too slow on emptier servers:
    an 8 + 8 on a free 16 + 16 server took it ~14-30 s)."""
    rows = []
    for per_switch, label in BIG_SERVERS:
        topo = sixteen_gpu(per_switch)
        shape = compile_shape(topo, shape_id=0, signature=shape_signature(topo))
        ids = all_device_ids(topo)
        rng = random.Random(seed)
        lat: list[int] = []
        cpu: list[int] = []
        by_size: dict[str, list[int]] = {}
        placed = checked = equal = 0
        for i in range(samples):
            share = rng.choice(BIG_HELD)
            held = [d for d in ids if rng.random() < share]
            g = rng.choice((1, 2, 4, 8, 8, 16))
            r = rng.choice((g, g, 0, max(1, g // 2)))
            rid = f"big-{i}"
            req = AllocationRequest(
                request_id=rid,
                pod=PodRef("bench", rid, rid),
                gpus=g,
                rdma=r,
                scope=rng.choice((None, "pcie-switch", "pcie-root", "numa")),
                policy=rng.choice((None, "required")),
            )
            cluster = Cluster()
            cluster.set_node(topo.name, topo)
            if held:
                cluster.hold(topo.name, "held", held)
            # The driver makes a fresh index per decision; collect its garbage outside the
            # timed call, not in the middle of some decision.
            gc.collect()
            gc.disable()
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            got = cluster.decide(req)
            dt = time.perf_counter_ns() - t0
            cpu.append(time.thread_time_ns() - c0)
            gc.enable()
            lat.append(dt)
            by_size.setdefault(f"{g}+{r}", []).append(cpu[-1])
            placed += isinstance(got, Placement)
            if share >= BIG_CHECK_HELD:
                blocked = 0
                for d in held:
                    blocked |= 1 << shape.slot_of[d]
                ref = enumeration.evaluate(shape, shape.effective_free(blocked), cluster.normalise(req))
                checked += 1
                if isinstance(ref, Refusal):
                    equal += isinstance(got, Unschedulable)
                elif isinstance(got, Placement):
                    mine = sorted(got.devices())
                    theirs = sorted(shape.slot_id[s] for s in (*ref.gpus, *ref.nics))
                    equal += got.quality == ref.key + ref.frag and mine == theirs
        rows.append(
            {
                "server": label,
                "samples": samples,
                "placed": placed,
                "p50_us": round(_pct(lat, 0.50), 1),
                "p99_us": round(_pct(lat, 0.99), 1),
                "max_us": round(_pct(lat, 1.0), 1),
                "cpu_p99_us": round(_pct(cpu, 0.99), 1),
                "cpu_max_us": round(_pct(cpu, 1.0), 1),
                "cpu_p99_us_by_request": {k: round(_pct(v, 0.99), 1) for k, v in sorted(by_size.items())},
                "checked": checked,
                "equal": equal,
            }
        )
        print(f"  16-GPU server ({label}) done", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000,5000,10000", help="fleet sizes for the speed runs")
    ap.add_argument("--decisions", type=int, default=20000, help="measured decisions per speed run")
    ap.add_argument("--quality-nodes", type=int, default=1000)
    ap.add_argument("--quality-decisions", type=int, default=3000)
    ap.add_argument("--optimality-cases", type=int, default=500)
    ap.add_argument("--big-samples", type=int, default=1000, help="decisions per 16-GPU server")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument(
        "--node-order",
        choices=("alignment-first", "used-first"),
        help="the node order of Tandem's default class (default: the core's default)",
    )
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--out", type=Path, default=ROOT / "results.json")
    ap.add_argument("--speed-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--no-gc-freeze", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--service", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.speed_child is not None:
        child = speed_child(
            args.speed_child,
            args.decisions,
            args.seed,
            freeze=not args.no_gc_freeze,
            service=args.service,
            node_order=args.node_order,
        )
        print(json.dumps(child))
        return 0
    if args.quick:
        args.sizes, args.decisions = "300", 2000
        args.quality_nodes, args.quality_decisions, args.optimality_cases = 200, 500, 60
        args.big_samples = 100
    started = time.time()
    sizes = [int(x) for x in args.sizes.split(",")]
    results: dict[str, Any] = {
        "command": "python -m bench.run " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(),
        "mix": dict(MIX),
        "real_mix": dict(REAL_MIX),
        "seed": args.seed,
    }
    print("speed ...", file=sys.stderr)
    results["node_order"] = args.node_order or "default"
    results["speed"] = speed(sizes, args.decisions, args.seed, node_order=args.node_order)
    print("quality ...", file=sys.stderr)
    results["quality_nodes"] = args.quality_nodes
    order = args.node_order
    results["quality"] = quality(args.quality_nodes, args.quality_decisions, args.seed, node_order=order)
    results["quality_real"] = quality(
        args.quality_nodes, args.quality_decisions, args.seed, mix="real", node_order=order
    )
    print("optimality ...", file=sys.stderr)
    results["optimality"] = optimality(args.optimality_cases, args.seed)
    print("16-GPU servers ...", file=sys.stderr)
    results["big_nodes"] = big_nodes(args.big_samples, args.seed)
    results["wall_s"] = round(time.time() - started, 1)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    print(f"\n(total {results['wall_s']} s; results in {args.out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
