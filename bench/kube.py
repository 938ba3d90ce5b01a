"""``make bench-kube``: pods from create to bound through the real API server, Tandem's path
beside kube-scheduler alone, in one run on one control plane (docs/benchmarks.md, "Through the
real API").

One configuration = N kwok nodes of 8 GPUs + 8 NICs (``dgx-h100``) and M pods asking 1, 2, 4 or
8 GPUs with as many NICs (a quarter each), created through the API by 16 client threads:

1. **kube-scheduler alone**: the pods ask ``tandem.io/gpu`` / ``tandem.io/rdma`` as extended
   resources and nothing else runs: the scheduler fits them by count (which devices a pod gets
   would be the kubelet's choice, which kwok does not make: no alignment is measured here).
2. **Tandem**: the chart installed (one allocator, one inventory, the default two admission
   replicas, run as local processes as in tests/cluster), a simulated fleet of the same N nodes
   speaking NATS (tools/loadtest/fleet.py), the same pods created in a namespace Tandem
   manages: webhook → bridge → allocator → gate removed with node affinity → the same
   scheduler binds.

Both phases use the same scheduler and controller-manager with their client rate limits raised
(``--kube-api-qps 2000``; the defaults, 50 and 20 QPS, would cap both near 50 pods/s). Reported
per phase: pods/s from the first create to the last bind, create → bound p50/p99, and how long
the API server took to answer a create (admission included); for Tandem also the share of pods
whose every GPU has its NIC under the same PCIe switch, and where a pod's time goes (p50/p99 of:
the create's answer, the webhook inside it; answer → request published by the bridge; request
→ assigned; assigned → gate removed; gate removed → bound). Each phase also reports where the
machine's CPU went (bench/cpu.py): each program's CPU per pod beyond its idle rate (measured for
8 s before the phase), its idle cores, and the share of all cores busy; ``--profile DIR`` keeps
the API server's CPU profile of each phase. kwok plays kubelets with their default heartbeats
(a node Lease every 10 s, the Node's status every 5 minutes). One JSON line per configuration;
the ratio is Tandem's pods/s over the scheduler's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from bench import cpu
from schemas import codec, subjects
from services.admission import names
from services.client import ClientError, TandemClient
from services.runtime.process.embedded import EmbeddedNats
from tests.cluster.build import build_all
from tests.cluster.controlplane import CONTROL_PLANE, ControlPlane, node_body
from tests.cluster.kubelet import LocalKubelet, RunningPod, publish_endpoints
from tests.cluster.release import install, uninstall
from tools.cli.conn import CliConnection
from tools.loadtest.mix import NodeSpec, fleet_plan, kind_topology

KIND = "dgx-h100"
SIZES = (1, 2, 4, 8)
CLIENTS = 16
# kwok plays each node's kubelet as a kubelet runs by default: a Lease renewed every 10 s
# (40 s duration), the Node's status patched every 5 min when nothing changed
# (nodeStatusReportFrequency). A status patch per node every 20 s, 50/s at 1,000 nodes, kept
# this machine's two cores nearly busy before any pod was created.
KUBELET_LEASE_S, KUBELET_STATUS_S = 40, 300
IDLE_S = 8.0  # how long each phase first measures the machine idle
RELEASE, NAMESPACE = "tandem", "tandem-system"
VALUES: dict[str, Any] = {
    "nats": {"bundled": False, "auth": {"mode": "none"}, "tls": {"enabled": False}},
    "nodeagent": {
        "backend": "simulated",
        "topologyFile": KIND,
        "nodeSelector": {"tandem-bench/none": "true"},
    },
    "allocator": {"replicas": 1},
    "inventory": {"replicas": 1},
    "admission": {"replicas": 2},
}
# The chart's default: the webhook on both replicas, the bridge on the Lease holder.
ADMISSION_REPLICAS = 2


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(values: list[float]) -> dict[str, float | None]:
    """p50 and p99 in ms; None for no values (a stage that bound nothing), as JSON has no NaN."""
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": round(percentile(values, 0.5) * 1000, 1), "p99": round(percentile(values, 0.99) * 1000, 1)}


class PodWatch:
    """A watch on one namespace's pods in a thread: when each pod was first seen without the
    Tandem gate and with a node, and its last object."""

    def __init__(self, cp: ControlPlane, namespace: str) -> None:
        self.cp, self.namespace = cp, namespace
        self.ungated: dict[str, float] = {}
        self.bound: dict[str, float] = {}
        self.last: dict[str, dict[str, Any]] = {}
        self._resp: Any = None
        self._rv = ""
        self.stopped = False
        self.restarts: list[str] = []  # why the watch had to start again
        self._thread = threading.Thread(target=self._run, name=f"watch-{namespace}", daemon=True)

    def start(self) -> PodWatch:
        self._rv = self._now()
        self._thread.start()
        return self

    def _now(self) -> str:
        return str(
            self.cp.request("GET", f"/api/v1/namespaces/{self.namespace}/pods?limit=1")["metadata"][
                "resourceVersion"
            ]
        )

    def _run(self) -> None:
        # The API server closes a watch whose reader falls behind (a busy machine): watch
        # again from the last version seen, so no event is missed.
        while not self.stopped:
            query = f"watch=1&resourceVersion={self._rv}&timeoutSeconds=900"
            path = f"/api/v1/namespaces/{self.namespace}/pods?{query}"
            try:
                self._resp = self.cp._opener().open(self.cp.url + path, timeout=900)
                for line in self._resp:
                    if self.stopped:
                        return
                    self._on(json.loads(line), time.monotonic())
            except Exception as exc:  # a broken connection: watch again
                self.restarts.append(repr(exc)[:200])
                time.sleep(0.2)

    def _on(self, event: dict[str, Any], now: float) -> None:
        pod = event["object"]
        if event["type"] == "ERROR":  # 410 Gone: go on from now (not expected in a short phase)
            self.restarts.append(str(pod.get("message", ""))[:200])
            self._rv = self._now()
            return
        self._rv = pod["metadata"]["resourceVersion"]
        name = pod["metadata"]["name"]
        self.last[name] = pod
        gates = pod["spec"].get("schedulingGates") or []
        if name not in self.ungated and not any(g["name"] == names.GATE for g in gates):
            self.ungated[name] = now
        if name not in self.bound and pod["spec"].get("nodeName"):
            self.bound[name] = now

    def stop(self) -> None:
        """Stop recording. The connection is left to the server's timeout: closing it from
        this thread while the reader blocks in it deadlocks on the buffer's lock."""
        self.stopped = True


class NatsTimes:
    """Arrival times of each request and each assignment on NATS, keyed by request id."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.requested: dict[str, float] = {}
        self.assigned: dict[str, float] = {}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="nats-times", daemon=True)

    def start(self) -> NatsTimes:
        self._thread.start()
        self._ready.wait(30)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        import nats

        nc = await nats.connect(self.url)
        self._stop = asyncio.Event()

        async def on_request(msg: Any) -> None:
            req = codec.ALLOC_EVENT.decode(msg.data)
            self.requested.setdefault(getattr(req, "request_id", ""), time.monotonic())

        async def on_assigned(msg: Any) -> None:
            a = codec.ALLOC_EVENT.decode(msg.data)
            self.assigned.setdefault(getattr(a, "request_id", ""), time.monotonic())

        await nc.subscribe(subjects.ALLOC_REQUEST, cb=on_request)
        await nc.subscribe(subjects.ALLOC_ASSIGNED_ALL, cb=on_assigned)
        self._ready.set()
        await self._stop.wait()
        await nc.close()

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def pods(count: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(f"p{i:05d}", rng.choice(SIZES)) for i in range(count)]


def pod_body(name: str, gpus: int) -> dict[str, Any]:
    limits = {names.RESOURCE_GPU: str(gpus), names.RESOURCE_RDMA: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "train", "image": "trainer:1", "resources": {"limits": limits}}],
        },
    }


def run_phase(
    cp: ControlPlane,
    namespace: str,
    workload: list[tuple[str, int]],
    *,
    timeout: float,
    profile: Path | None = None,
) -> dict[str, Any]:
    """Create the pods, wait until every one is bound; the timings. With ``profile``, the API
    server's CPU profile of the run's steady part is written there (``<namespace>.pprof``)."""
    cp.request(
        "POST",
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
    )
    watch = PodWatch(cp, namespace).start()
    created: dict[str, float] = {}
    admitted: dict[str, float] = {}  # the create's answer: admission (the webhook) done

    def create(item: tuple[str, int]) -> None:
        name, gpus = item
        created[name] = time.monotonic()
        cp.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod_body(name, gpus))
        admitted[name] = time.monotonic()

    # What every program spends with nothing to do (heartbeats, leases, open watches), to tell
    # the cost of the pods from the background.
    idle = cpu.measure(IDLE_S)
    meter = cpu.CpuMeter().start()
    started = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        if profile is not None:
            pprof = pool.submit(apiserver_profile, cp, profile / f"{namespace}.pprof")
        list(pool.map(create, workload))
    deadline = time.monotonic() + timeout
    while len(watch.bound) < len(workload) and time.monotonic() < deadline:
        time.sleep(0.1)
    use = meter.stop()
    watch.stop()
    if profile is not None:
        pprof.result()
    bound = {n: t for n, t in watch.bound.items() if n in created}
    latency = [bound[n] - created[n] for n in bound]
    last = max(bound.values(), default=started)
    return {
        "watch": watch,
        "created": created,
        "admitted": admitted,
        "create_answered_ms": ms([admitted[n] - created[n] for n in admitted]),
        "bound": len(bound),
        "pods_per_s": round(len(bound) / max(1e-9, last - started), 1),
        "create_to_bound_ms": ms(latency),
        "wall_s": round(last - started, 2),
        "watch_restarts": len(watch.restarts),
        # Where the machine's CPU went from the first create to the last bind: the share of
        # its cores busy, each program's CPU per pod beyond its idle rate, and the idle rates.
        "cpu": {
            "busy_share": use.busy_share,
            "ms_per_pod": round(1000 * sum(use.seconds.values()) / max(1, len(bound)), 1),
            "beyond_idle_ms_per_pod": use.beyond(idle, per=len(bound)),
            "idle_cores": {k: v for k, v in idle.cores().items() if v >= 0.005},
        },
    }


def apiserver_profile(cp: ControlPlane, out: Path, *, warmup: float = 2.0, seconds: int = 10) -> None:
    """The API server's CPU profile (``/debug/pprof/profile``) for ``seconds`` after ``warmup``;
    read it with ``go tool pprof -top <file>``."""
    time.sleep(warmup)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(cp.get_raw(f"/debug/pprof/profile?seconds={seconds}", timeout=seconds + 30))


def clear(cp: ControlPlane, namespace: str) -> None:
    """Every pod of the namespace deleted and gone (kwok removes them at once)."""
    # One by one, in parallel: a delete-collection of thousands of pods outlasts the API
    # server's own one-minute request timeout on this machine.
    doomed = [
        p["metadata"]["name"] for p in cp.request("GET", f"/api/v1/namespaces/{namespace}/pods")["items"]
    ]
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(lambda n: cp.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{n}"), doomed))
    deadline = time.monotonic() + 300
    while cp.request("GET", f"/api/v1/namespaces/{namespace}/pods?limit=1")["items"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"pods of {namespace} not gone after 300 s")
        time.sleep(0.5)


def add_nodes(
    cp: ControlPlane, count: int, *, kind: str = KIND, specs: list[NodeSpec] | None = None
) -> list[str]:
    """``count`` kwok nodes of ``kind`` (or the nodes of ``specs``, a mixed plan), each with its
    kind's GPUs and NICs as extended resources; returns once all are Ready."""
    specs = specs if specs is not None else fleet_plan(count, mix=((kind, 1.0),))
    plan = [spec.name for spec in specs]
    labels = {"nvidia.com/gpu.present": "true"}

    def body(spec: NodeSpec) -> dict[str, Any]:
        topo = kind_topology(spec.kind)
        return node_body(spec.name, gpus=len(topo.gpus()), nics=len(topo.nics()), labels=labels)

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(lambda spec: cp.request("POST", "/api/v1/nodes", body(spec)), specs))

    def ready() -> int:
        items = cp.request("GET", "/api/v1/nodes?labelSelector=type%3Dkwok")["items"]
        return sum(
            any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in n.get("status", {}).get("conditions", [])
            )
            for n in items
        )

    deadline = time.monotonic() + 600
    while ready() < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {ready()} of {count} kwok nodes Ready")
        time.sleep(1)
    return plan


def start_tandem(
    cp: ControlPlane,
    workdir: Path,
    server: EmbeddedNats,
    nodes: int,
    undo: contextlib.ExitStack,
    *,
    values: dict[str, Any] = VALUES,
    kind: str = KIND,
    mix: str | None = None,
) -> None:
    """Install and run Tandem (the chart with ``values``, a simulated fleet of ``nodes`` nodes of
    ``kind``, or of the ``mix`` as ``tools.loadtest.fleet --mix`` reads it); ``undo`` stops and
    removes each part it started, in reverse."""
    install(cp, {**values, "nats": {**values["nats"], "url": server.url}})
    undo.callback(lambda: uninstall(cp))
    kubelet = LocalKubelet(cp, workdir)
    undo.callback(kubelet.stop_all)
    running: list[RunningPod] = []
    for component, replicas in (("inventory", 1), ("allocator", 1), ("admission", ADMISSION_REPLICAS)):
        selector = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}"
        deadline = time.monotonic() + 120
        while True:
            items = cp.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={selector}")[
                "items"
            ]
            bound = [p for p in items if p["spec"].get("nodeName")]
            if len(bound) >= replicas:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {component} pod bound")
            time.sleep(0.2)
        running += [kubelet.run(pod) for pod in bound[:replicas]]
    config = workdir / "fleet.yaml"
    config.write_text(yaml.safe_dump({"nats_url": server.url, "heartbeat_interval": 2, "log_json": True}))
    fleet = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tools.loadtest.fleet",
            "--config",
            str(config),
            "--nodes",
            str(nodes),
            *(("--mix", mix) if mix else ("--kind", kind)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=(workdir / "fleet.log").open("wb"),
    )

    def stop_fleet() -> None:
        fleet.send_signal(signal.SIGTERM)
        try:
            fleet.wait(20)
        except subprocess.TimeoutExpired:
            fleet.kill()
            fleet.wait()

    undo.callback(stop_fleet)
    admission = running[-ADMISSION_REPLICAS:]
    for pod in admission:
        pod.wait_ready(timeout=60)
    svc = cp.request("GET", f"/api/v1/namespaces/{NAMESPACE}/services/{RELEASE}-admission")
    publish_endpoints(cp, svc, admission)
    asyncio.run(_wait_nodes_ready(server.url, nodes))


async def _wait_nodes_ready(url: str, count: int) -> None:
    conn = await CliConnection.open(url)
    try:
        client = TandemClient(conn)
        deadline = time.monotonic() + 300
        ready: list[Any] = []
        while True:
            # From the KV bucket, as the allocators see it (the inventory's query answers with
            # every node's record in one message, over NATS's payload limit at this size).
            with contextlib.suppress(ClientError):
                ready = [n for n in (await client.node_records()).values() if n.status == "ready"]
            if len(ready) >= count:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(ready)} of {count} nodes ready in Tandem's inventory")
            await asyncio.sleep(1)
    finally:
        await conn.close()


def tandem_breakdown(phase: dict[str, Any], times: NatsTimes) -> dict[str, Any]:
    watch: PodWatch = phase["watch"]
    created: dict[str, float] = phase["created"]
    admitted: dict[str, float] = phase["admitted"]
    steps: dict[str, list[float]] = {
        "create_answered": [],  # the API server's create, the webhook's admission inside it
        "answered_to_requested": [],  # the bridge's watch sees the pod, publishes its request
        "requested_to_assigned": [],  # the allocator decides and commits
        "assigned_to_ungated": [],  # the bridge patches affinity + assignment, removes the gate
        "ungated_to_bound": [],  # kube-scheduler binds
    }
    aligned = total = 0
    for name, pod in watch.last.items():
        if name not in created or name not in watch.bound:
            continue
        rid = f"{pod['metadata']['uid']}.1"
        raw = (pod["metadata"].get("annotations") or {}).get(names.ASSIGNMENT)
        if raw:
            total += 1
            aligned += json.loads(raw).get("scope") == "pcie-switch"
        if rid in times.requested and rid in times.assigned and name in watch.ungated:
            steps["create_answered"].append(admitted[name] - created[name])
            steps["answered_to_requested"].append(times.requested[rid] - admitted[name])
            steps["requested_to_assigned"].append(times.assigned[rid] - times.requested[rid])
            steps["assigned_to_ungated"].append(watch.ungated[name] - times.assigned[rid])
            steps["ungated_to_bound"].append(watch.bound[name] - watch.ungated[name])
    return {
        "switch_aligned": round(aligned / total, 4) if total else None,
        "steps_ms": {k: ms(v) for k, v in steps.items()},
    }


def configuration(
    nodes: int, count: int, *, seed: int, workdir: Path, profile: Path | None = None
) -> dict[str, Any]:
    bins = build_all(CONTROL_PLANE, log=False)
    workload = pods(count, seed)
    demand = sum(g for _, g in workload)
    if demand > 8 * nodes * 0.6:
        # Throughput, not packing: every pod must fit whatever the scheduler's spreading does.
        raise SystemExit(
            f"bench.kube: {count} pods ask {demand} GPUs, over 60 % of {nodes} nodes' {8 * nodes}"
        )
    timeout = max(300.0, count / 5)
    with ControlPlane(
        workdir / "cp",
        bins,
        heartbeat_s=KUBELET_STATUS_S,
        node_lease_s=KUBELET_LEASE_S,
        client_qps=2000,
        profiling=profile is not None,
    ) as cp:
        t0 = time.monotonic()
        add_nodes(cp, nodes)
        nodes_s = round(time.monotonic() - t0, 1)
        baseline = run_phase(cp, "bench-scheduler", workload, timeout=timeout, profile=profile)
        clear(cp, "bench-scheduler")
        with EmbeddedNats(host=cp.host) as server, contextlib.ExitStack() as undo:
            start_tandem(cp, workdir / "tandem", server, nodes, undo)
            times = NatsTimes(server.url).start()
            undo.callback(times.stop)
            tandem = run_phase(cp, "bench-tandem", workload, timeout=timeout, profile=profile)
            extra = tandem_breakdown(tandem, times)
    for phase in (baseline, tandem):
        del phase["watch"], phase["created"], phase["admitted"]
    return {
        "nodes": nodes,
        "pods": count,
        "nodes_ready_s": nodes_s,
        "scheduler_alone": baseline,
        "tandem": {**tandem, **extra},
        "ratio": round(tandem["pods_per_s"] / baseline["pods_per_s"], 3) if baseline["pods_per_s"] else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kube", description=__doc__.splitlines()[0])
    p.add_argument("--config", action="append", metavar="NODES:PODS", help="default: 1000:1000 and 5000:2000")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="write the API server's CPU profile of each phase there (go tool pprof -top FILE)",
    )
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.kube: needs root (the pod network is a network namespace)", file=sys.stderr)
        return 2
    # SIGTERM (a CI timeout, kill) unwinds like Ctrl-C, so every process and network
    # namespace this started is stopped and removed on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    configs = args.config or ["1000:1000", "5000:2000"]
    for spec in configs:
        n, m = (int(x) for x in spec.split(":"))
        workdir = Path(tempfile.mkdtemp(prefix="tandem-bench-kube-"))
        try:
            print(
                json.dumps(configuration(n, m, seed=args.seed, workdir=workdir, profile=args.profile)),
                flush=True,
            )
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
