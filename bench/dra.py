"""``make bench-dra``: DRA claims allocated by kube-scheduler alone beside Tandem, on one control
plane in one run (docs/benchmarks.md, "DRA side by side").

One configuration = N kwok nodes of a mix of 8-GPU servers (:data:`MIX`, or ``--mix`` /
``--kind``): the built-in ``dgx-h100`` (4 PCIe switches of 2 GPUs + 2 NICs, each switch under a
root complex of its own) and ``dgx-a100`` (the same, plus 2 NICs of their own and SR-IOV VFs),
and three real servers imported from their ``nvidia-smi topo -m`` captures
(:data:`tools.loadtest.mix.REAL_KINDS`: an H200 with one switch per GPU, an A100 and an
NV18 (H100 class) DGX with 2 GPUs + 2 NICs a switch and spare NICs). Every kind has a NIC for
each GPU under the GPU's own switch, so a claim of k GPUs + k NICs can be switch-aligned on
any node that has the room. The captures with fewer NICs than GPUs are left out of the
default mix: a claim asks one NIC per GPU, so their GPUs could not be filled at all.
Each node has the ResourceSlice its node agent would publish
(:func:`services.nodeagent.dra.slices.resource_slices`), and a seeded stream of pods, each with
one claim from a ResourceClaimTemplate for k GPUs + k NICs (k = 1, 2, 4 or 8), goes through
the real API server:

* **fill**: pods are created (16 client threads) until they ask 85 % of the fleet's GPUs; the
  phase waits until each is bound or refused (the scheduler's ``Unschedulable``, Tandem's
  Warning Event) and nothing has moved for ``SETTLE_S``, or nothing has moved for ``QUIET_S``;
* **churn**: a tenth of the bound pods is deleted (their claims deallocated), then pods are
  created until the fleet is asked 95 % of its GPUs, and the phase settles again.

The two ways, each on the same fleet and the same pods:

(a) **kube-scheduler alone**: the templates ask ``gpu.tandem.io`` / ``nic.tandem.io`` with
    ``matchAttribute: resource.kubernetes.io/pcieRoot`` (what a pod author writes today to keep
    a GPU near its NIC); the scheduler's allocator picks the devices, Tandem is not installed
    (its DeviceClasses are created from the chart).
(b) **Tandem**: the chart installed with ``dra.enabled`` (one allocator, one inventory, two
    admission replicas, as local processes), the simulated fleet of the same nodes over NATS,
    the templates without the constraint (Tandem pairs each GPU with a NIC of its own switch);
    the webhook gates each pod, the bridge allocates its claim, kube-scheduler binds.

The same seeded stream serves both ways: the fill stage's pods are the same; the churn stage
deletes a tenth of what each way bound and tops the fleet up from the same stream again, so its
batch differs by as many pods as the ways' fills did.

Reported per way and stage: pods bound and pods/s (first create of the stage to its last bind),
create → bound p50/p99, the pods left unbound ("refused") and how many of them a single node
still had the free GPUs and NICs (physical functions, what ``nic.tandem.io`` selects) for
("refused with room": fragmentation, or a constraint the layout cannot meet), the same two
counts over every pod still waiting, earlier stages' included (``waiting_all``), the share of
bound pods whose every GPU has a NIC of its own under the same PCIe switch (counted over the
pods whose node's layout has that many aligned pairs at all), and the CPU per pod of the bench's
processes (bench/cpu.py). One JSON line per configuration: a fleet size and a way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

from bench import cpu
from bench.kube import (
    CLIENTS,
    KUBELET_LEASE_S,
    KUBELET_STATUS_S,
    PodWatch,
    add_nodes,
    clear,
    ms,
    start_tandem,
)
from bench.kube import VALUES as KUBE_VALUES
from services.admission.names import DRA_FINALIZER, EVENT_REASON_FAILED, EVENT_REASON_INVALID
from services.nodeagent.dra.slices import DRIVER, resource_slices
from services.runtime.process.embedded import EmbeddedNats
from tests.cluster.build import build_all
from tests.cluster.controlplane import CONTROL_PLANE, ControlPlane
from tests.cluster.release import CHART, NAMESPACE, RELEASE
from tools.loadtest.mix import KINDS, NodeSpec, fleet_plan, node_topology, parse_mix

SIZES = (1, 2, 4, 8)
# The default fleet: built-in kinds and real servers (tools/loadtest/mix.py), 8 GPUs each.
MIX = "dgx-h100=0.30,dgx-a100=0.25,h200-10nic=0.15,a100-10nic=0.15,nv18-13nic=0.15"
FILL, CHURN_FILL, CHURN_SHARE = 0.85, 0.95, 0.10
WAYS = ("scheduler", "tandem")
# A stage is over when every pod is bound, or each is bound or refused and none was bound for
# SETTLE_S (a pod not yet tried is not refused: the scheduler may still be busy with others),
# or none was bound for QUIET_S whatever the verdicts.
SETTLE_S, QUIET_S = 20.0, 300.0
RESOURCE = "/apis/resource.k8s.io/v1"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
SWITCH = f"{DRIVER}/pcieSwitch"
Obj = dict[str, Any]


def device_classes() -> list[Obj]:
    """Tandem's DeviceClasses as the chart renders them with ``dra.enabled``."""
    with helm.Chart.load(CHART) as chart:
        files = chart.render({"dra": {"enabled": True}}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = [
        d for name, text in files.items() if not name.endswith("NOTES.txt") for d in yaml.safe_load_all(text)
    ]
    return [d for d in docs if d and d.get("kind") == "DeviceClass"]


def template(size: int, *, constrained: bool) -> Obj:
    """The ResourceClaimTemplate ``g<size>``: ``size`` GPUs and as many NICs; with
    ``constrained``, every device under one PCIe root (the scheduler's only way to say it)."""
    devices: Obj = {
        "requests": [
            {"name": "gpus", "exactly": {"deviceClassName": "gpu.tandem.io", "count": size}},
            {"name": "nics", "exactly": {"deviceClassName": "nic.tandem.io", "count": size}},
        ]
    }
    if constrained:
        devices["constraints"] = [{"requests": ["gpus", "nics"], "matchAttribute": PCIE_ROOT}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": f"g{size}"},
        "spec": {"spec": {"devices": devices}},
    }


def pod_body(name: str, size: int) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "devices", "resourceClaimTemplateName": f"g{size}"}],
            "containers": [
                {"name": "train", "image": "trainer:1", "resources": {"claims": [{"name": "devices"}]}}
            ],
        },
    }


class Fleet:
    """What each node's pool holds: device name → (type, PCIe switch), from the slices; a NIC's
    virtual functions are of type ``nic-vf`` (``nic.tandem.io`` selects physical functions)."""

    def __init__(self, plan: list[NodeSpec]) -> None:
        self.plan = plan
        self.slices = {
            spec.name: resource_slices(node_topology(spec), node=spec.name, generation=1) for spec in plan
        }
        self.devices: dict[tuple[str, str], tuple[str, str]] = {}
        for node, slices in self.slices.items():
            for s in slices:
                for dev in s["spec"]["devices"]:
                    attrs = dev.get("attributes") or {}
                    kind = (attrs.get("type") or {}).get("string", "")
                    if (attrs.get("function") or {}).get("string") == "vf":
                        kind = "nic-vf"
                    switch = (attrs.get("pcieSwitch") or {}).get("string", "")
                    self.devices[(node, dev["name"])] = (kind, switch)
        self.gpus = sum(1 for kind, _ in self.devices.values() if kind == "gpu")
        # The most GPUs of one pod that the node's layout can give each a NIC of its switch.
        self.pairs: Counter[str] = Counter()
        per_switch: dict[tuple[str, str], Counter[str]] = {}
        for (node, _), (kind, switch) in self.devices.items():
            if switch:
                per_switch.setdefault((node, switch), Counter())[kind] += 1
        for (node, _), count in per_switch.items():
            self.pairs[node] += min(count["gpu"], count["nic"])

    def kinds(self) -> dict[str, int]:
        return dict(Counter(spec.kind for spec in self.plan))

    def publish(self, cp: ControlPlane) -> None:
        bodies = [s for slices in self.slices.values() for s in slices]
        with ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(lambda b: cp.request("POST", f"{RESOURCE}/resourceslices", b), bodies))

    def free(self, held: set[tuple[str, str]]) -> dict[str, Counter[str]]:
        """Free devices of each node by type."""
        out: dict[str, Counter[str]] = {spec.name: Counter() for spec in self.plan}
        for key, (kind, _) in self.devices.items():
            if key not in held:
                out[key[0]][kind] += 1
        return out

    def aligned(self, node: str, results: list[Obj]) -> bool:
        """Every GPU of the claim has a NIC of its own under the same PCIe switch."""
        by_type: dict[str, Counter[str]] = {"gpu": Counter(), "nic": Counter()}
        for r in results:
            kind, switch = self.devices.get((node, r["device"]), ("", ""))
            if kind in by_type:
                by_type[kind][switch] += 1
        return all(by_type["nic"][s] >= n for s, n in by_type["gpu"].items())


class Stream:
    """The seeded pods: names and sizes, and how many GPUs the live ones ask."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.count = 0

    def until(self, asked: int, target: int) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        while asked < target:
            size = self.rng.choice(SIZES)
            out.append((f"p{self.count:05d}", size))
            self.count += 1
            asked += size
        return out


def claims(cp: ControlPlane, namespace: str) -> list[Obj]:
    items: list[Obj] = cp.request("GET", f"{RESOURCE}/namespaces/{namespace}/resourceclaims")["items"]
    return items


def settle(
    watch: PodWatch, names: Callable[[], set[str]], *, timeout: float, refused: Callable[[], set[str]]
) -> str:
    """Until every pod in ``names()`` is bound (``"all_bound"``), or each is bound or refused
    (``refused()``: a verdict seen) and none was bound for ``SETTLE_S`` (``"verdicts"``), or
    none was bound for ``QUIET_S`` (``"quiet"``), or ``timeout`` passed (``"limit"``): why it
    ended, which the stage reports."""
    deadline = time.monotonic() + timeout
    last, moved, looked = -1, time.monotonic(), 0.0
    decided: set[str] = set()
    while time.monotonic() < deadline:
        pods = names()
        bound = {n for n in pods if n in watch.bound}
        if len(bound) == len(pods):
            return "all_bound"
        if len(bound) != last:
            last, moved = len(bound), time.monotonic()
        quiet = time.monotonic() - moved
        if quiet > SETTLE_S and time.monotonic() - looked > 2.0:
            decided, looked = refused(), time.monotonic()
            if pods <= bound | decided:
                return "verdicts"
        if quiet > QUIET_S:
            return "quiet"
        time.sleep(0.2)
    return "limit"


def verdicts(cp: ControlPlane, namespace: str, watch: PodWatch) -> set[str]:
    """Pods told they cannot be placed: kube-scheduler's ``Unschedulable`` (it tried the pod
    and found no node), or Tandem's Warning Event on the pod (``tandem explain``'s words)."""
    out = {
        name
        for name, pod in watch.last.items()
        if any(
            c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
            for c in (pod.get("status") or {}).get("conditions") or []
        )
    }
    for reason in (EVENT_REASON_FAILED, EVENT_REASON_INVALID):
        query = f"fieldSelector=reason%3D{reason}"
        for event in cp.request("GET", f"/api/v1/namespaces/{namespace}/events?{query}")["items"]:
            if event["involvedObject"].get("kind") == "Pod":
                out.add(event["involvedObject"]["name"])
    return out


def stage(
    cp: ControlPlane,
    namespace: str,
    fleet: Fleet,
    watch: PodWatch,
    batch: list[tuple[str, int]],
    live: dict[str, int],
    *,
    timeout: float,
) -> Obj:
    """Create ``batch``, settle, and measure it."""
    created: dict[str, float] = {}

    def create(item: tuple[str, int]) -> None:
        name, size = item
        created[name] = time.monotonic()
        cp.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod_body(name, size))

    idle = cpu.measure(4.0)
    meter = cpu.CpuMeter().start()
    started = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(create, batch))
    live.update(dict(batch))
    ended = settle(
        watch, lambda: set(created), timeout=timeout, refused=lambda: verdicts(cp, namespace, watch)
    )
    use = meter.stop()
    settled = time.monotonic() - started
    bound = {n: watch.bound[n] for n in created if n in watch.bound}
    last = max(bound.values(), default=started)
    counts: Counter[str] = Counter()
    by_pod, held = _allocated(cp, namespace, counts=counts)
    free = fleet.free(held)
    unbound = [(n, live[n]) for n in created if n not in bound]
    # Pods of earlier stages still waiting count at the stage's fill too.
    waiting = [(n, k) for n, k in live.items() if n not in watch.bound]

    def with_room(pods: list[tuple[str, int]]) -> int:
        return sum(1 for _, k in pods if any(f["gpu"] >= k and f["nic"] >= k for f in free.values()))

    # Over the pods whose node has as many GPUs with a NIC of their switch as the pod asks.
    aligned = [
        fleet.aligned(*by_pod[n]) for n in bound if n in by_pod and fleet.pairs[by_pod[n][0]] >= live[n]
    ]
    return {
        "pods": len(batch),
        "bound": len(bound),
        "pods_per_s": round(len(bound) / max(1e-9, last - started), 1),
        "create_to_bound_ms": ms([bound[n] - created[n] for n in bound]),
        "settled_s": round(settled, 1),
        # "limit": cut at --stage-limit with pods neither bound nor refused, so pods_per_s
        # is what the way bound in that time, and "refused" counts pods it had not decided.
        "ended": ended,
        "refused": len(unbound),
        "refused_with_room": with_room(unbound),
        "waiting_all": len(waiting),
        "waiting_all_with_room": with_room(waiting),
        "switch_aligned": round(sum(aligned) / len(aligned), 4) if aligned else None,
        "alignable": len(aligned),
        "gpus_held": sum(1 for key in held if fleet.devices[key][0] == "gpu"),
        # Claims allocated at the end of the stage, and how many of them by Tandem (which
        # puts its finalizer on every claim it allocates): (b) must be all, (a) none.
        "claims_allocated": counts["allocated"],
        "claims_by_tandem": counts["by_tandem"],
        "cpu": {
            "busy_share": use.busy_share,
            "ms_per_pod": round(1000 * sum(use.seconds.values()) / max(1, len(bound)), 1),
            "beyond_idle_ms_per_pod": use.beyond(idle, per=max(1, len(bound))),
        },
    }


def _allocated(
    cp: ControlPlane, namespace: str, *, counts: Counter[str] | None = None
) -> tuple[dict[str, tuple[str, list[Obj]]], set[tuple[str, str]]]:
    """Each pod's (node, results) from its claim's allocation, and every device held;
    ``counts`` gets the allocated claims and those Tandem allocated (its finalizer on them)."""
    by_pod: dict[str, tuple[str, list[Obj]]] = {}
    held: set[tuple[str, str]] = set()
    for claim in claims(cp, namespace):
        alloc = (claim.get("status") or {}).get("allocation")
        if not alloc:
            continue
        if counts is not None:
            counts["allocated"] += 1
            counts["by_tandem"] += DRA_FINALIZER in (claim["metadata"].get("finalizers") or [])
        results = [r for r in alloc["devices"]["results"] if r["driver"] == DRIVER]
        held |= {(r["pool"], r["device"]) for r in results}
        # A claim made from a template is owned by its pod.
        refs = claim["metadata"].get("ownerReferences") or []
        pod = next((r["name"] for r in refs if r.get("kind") == "Pod"), None)
        if pod and results:
            by_pod[pod] = (results[0]["pool"], results)
    return by_pod, held


def churn(
    cp: ControlPlane, namespace: str, watch: PodWatch, live: dict[str, int], rng: random.Random
) -> None:
    """Delete a tenth of the bound pods and wait until their devices are free again."""
    bound = sorted(n for n in live if n in watch.bound)
    doomed = rng.sample(bound, max(1, int(len(bound) * CHURN_SHARE))) if bound else []
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(lambda n: cp.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{n}"), doomed))
    for n in doomed:
        del live[n]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        owners = {pod for pod in _allocated(cp, namespace)[0]}
        if not owners & set(doomed):
            return
        time.sleep(2.0)  # each look lists every claim: thousands at 5,000 nodes
    raise RuntimeError(f"claims of deleted pods still allocated after 300 s in {namespace}")


def run_way(
    cp: ControlPlane, namespace: str, fleet: Fleet, *, seed: int, constrained: bool, timeout: float
) -> Obj:
    """One way (a or b) through both stages, in a namespace of its own."""
    cp.request(
        "POST",
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
    )
    for size in SIZES:
        cp.request(
            "POST",
            f"{RESOURCE}/namespaces/{namespace}/resourceclaimtemplates",
            template(size, constrained=constrained),
        )
    watch = PodWatch(cp, namespace).start()
    stream, live = Stream(seed), dict[str, int]()
    out: Obj = {}
    try:
        out["fill"] = stage(
            cp, namespace, fleet, watch, stream.until(0, int(fleet.gpus * FILL)), live, timeout=timeout
        )
        churn(cp, namespace, watch, live, random.Random(seed + 1))
        asked = sum(live.values())
        out["churn"] = stage(
            cp,
            namespace,
            fleet,
            watch,
            stream.until(asked, int(fleet.gpus * CHURN_FILL)),
            live,
            timeout=timeout,
        )
    finally:
        watch.stop()
        out["watch_restarts"] = len(watch.restarts)
    return out


def configuration(
    nodes: int,
    *,
    mix: str,
    seed: int,
    workdir: Path,
    emit: Callable[[Obj], None],
    ways: tuple[str, ...] = WAYS,
    stage_limit: float | None = None,
) -> None:
    """Both ways (or ``ways``) on one control plane with ``nodes`` kwok nodes of ``mix`` (as
    :func:`tools.loadtest.mix.parse_mix` reads it; the simulated fleet reads the same text);
    ``emit`` gets one line per way as soon as it is done. ``stage_limit``: a stage's longest
    wait in seconds (default: long enough for every pod, which at 5,000 nodes takes the
    scheduler alone hours)."""
    bins = build_all(CONTROL_PLANE, log=False)
    plan = fleet_plan(nodes, mix=parse_mix(mix))
    fleet = Fleet(plan)
    timeout = stage_limit or max(600.0, fleet.gpus / 5)  # a stage's longest wait
    with ControlPlane(
        workdir / "cp", bins, heartbeat_s=KUBELET_STATUS_S, node_lease_s=KUBELET_LEASE_S, client_qps=2000
    ) as cp:
        t0 = time.monotonic()
        add_nodes(cp, nodes, specs=plan)
        fleet.publish(cp)
        head: Obj = {"nodes": nodes, "kinds": fleet.kinds(), "gpus": fleet.gpus, "seed": seed}
        head["stage_limit_s"] = timeout
        head["nodes_ready_s"] = round(time.monotonic() - t0, 1)
        if "scheduler" in ways:
            for body in device_classes():
                cp.request("POST", f"{RESOURCE}/deviceclasses", body)
            ns = "bench-dra-scheduler"
            emit(
                {
                    **head,
                    "way": "scheduler_alone",
                    **run_way(cp, ns, fleet, seed=seed, constrained=True, timeout=timeout),
                }
            )
            clear(cp, ns)
            wait_no_claims(cp, ns, timeout=max(300.0, fleet.gpus / 20))
            for body in device_classes():  # the chart installs its own
                cp.request("DELETE", f"{RESOURCE}/deviceclasses/{body['metadata']['name']}")
        if "tandem" in ways:
            with EmbeddedNats(host=cp.host) as server, contextlib.ExitStack() as undo:
                values = {**KUBE_VALUES, "dra": {"enabled": True}}
                start_tandem(cp, workdir / "tandem", server, nodes, undo, values=values, mix=mix)
                ns = "bench-dra-tandem"
                emit(
                    {
                        **head,
                        "way": "tandem",
                        **run_way(cp, ns, fleet, seed=seed, constrained=False, timeout=timeout),
                    }
                )


def wait_no_claims(cp: ControlPlane, namespace: str, *, timeout: float = 300.0) -> None:
    """Until the garbage collector has deleted the claims of the namespace's deleted pods, so
    the next way starts with every device free."""
    deadline = time.monotonic() + timeout
    while claims(cp, namespace):
        if time.monotonic() > deadline:
            raise RuntimeError(f"claims of {namespace} not gone {timeout:.0f} s after their pods")
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dra", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, action="append", help="fleet sizes (default: 500 and 5000)")
    fleet = p.add_mutually_exclusive_group()
    fleet.add_argument("--mix", default=MIX, metavar="KIND=SHARE,...", help=f"the fleet (default: {MIX})")
    fleet.add_argument("--kind", choices=KINDS, help="every node of this one kind instead of the mix")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--only", choices=WAYS, help="run one way only (default: both, side by side)")
    p.add_argument("--keep", type=Path, metavar="DIR", help="work (and keep the logs) in DIR")
    p.add_argument(
        "--stage-limit",
        type=float,
        metavar="S",
        help="end a stage after S seconds whatever is still pending (the line says so: ended=limit)",
    )
    args = p.parse_args(argv)
    mix = f"{args.kind}=1" if args.kind else args.mix
    try:
        parse_mix(mix)
    except ValueError as exc:
        p.error(f"--mix: {exc}")
    if any(n < 1 for n in args.nodes or []):
        p.error("--nodes must be at least 1")
    if args.stage_limit is not None and args.stage_limit <= 0:
        p.error("--stage-limit must be more than 0 seconds")
    if os.geteuid() != 0:
        print("bench.dra: needs root (the pod network is a network namespace)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    for n in args.nodes or [500, 5000]:
        workdir = args.keep / str(n) if args.keep else Path(tempfile.mkdtemp(prefix="tandem-bench-dra-"))
        ways = (args.only,) if args.only else WAYS
        try:
            configuration(
                n,
                mix=mix,
                seed=args.seed,
                workdir=workdir,
                ways=ways,
                stage_limit=args.stage_limit,
                emit=lambda line: print(json.dumps(line), flush=True),
            )
        finally:
            if not args.keep:
                shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
