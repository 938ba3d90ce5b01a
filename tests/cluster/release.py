"""Tandem installed into the real control plane with the Helm SDK, its workloads running.

:func:`install` is ``helm install`` as a user runs it (CRDs from ``crds/``, the release
namespace created, hooks); the objects go through the real API server's validation, admission
and RBAC. :class:`Release` then runs the pods the real controllers made from the chart's
workloads and the real scheduler bound to kwok nodes, each as a local process
(:mod:`.kubelet`) with the settings and the service-account tokens the cluster gives it, and
publishes the admission pods' addresses for the webhook Service, so that the API server calls
the webhook itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import helm_python as helm

from schemas.messages import HealthEvent, PodRef, RequestRecord
from services.admission import names
from services.client import TandemClient
from services.runtime.process.embedded import EmbeddedNats
from services.runtime.process.jaeger import Jaeger
from tests.cluster.controlplane import ControlPlane, node_body
from tests.cluster.kubelet import LocalKubelet, RunningPod, publish_endpoints
from tests.waiting import wait_until_sync
from tools.cli.conn import CliConnection

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "tandem"
RELEASE, NAMESPACE = "tandem", "tandem-system"
GPU_LABEL = {"nvidia.com/gpu.present": "true"}
DONE = ("freed", "cancelled", "rejected")
T = TypeVar("T")


def eventually(fn: Callable[[], Any], *, timeout: float = 60.0, what: str = "condition") -> Any:
    """:func:`~tests.waiting.wait_until_sync` for the API: what ``fn`` returned once truthy; a
    404 on the way counts as not yet (the object waited for does not exist yet)."""
    last: list[Any] = [None]

    def check() -> Any:
        try:
            last[0] = fn()
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
            last[0] = None
        return last[0]

    return wait_until_sync(check, timeout=timeout, what=what, poll=0.2, details=lambda: str(last[0])[:2000])


def install(
    cp: ControlPlane, values: dict[str, Any], *, name: str = RELEASE, namespace: str = NAMESPACE
) -> Any:
    """``helm install NAME deploy/helm/tandem -n NAMESPACE --create-namespace`` as the admin."""
    with helm.Config(kubeconfig_path=cp.admin_kubeconfig, namespace=namespace) as cfg:
        return cfg.install(CHART, name, values, namespace=namespace, create_namespace=True, timeout=180)


def uninstall(cp: ControlPlane, *, name: str = RELEASE, namespace: str = NAMESPACE) -> None:
    with helm.Config(kubeconfig_path=cp.admin_kubeconfig, namespace=namespace) as cfg:
        cfg.uninstall(name, timeout=120)


@dataclass
class Release:
    cp: ControlPlane
    nats: EmbeddedNats
    kubelet: LocalKubelet
    jaeger: Jaeger | None = None
    namespace: str = NAMESPACE
    name: str = RELEASE
    nodes: list[str] = field(default_factory=list)
    pods: dict[str, list[RunningPod]] = field(default_factory=dict)

    def add_gpu_nodes(self, count: int, *, topology_gpus: int = 8, topology_nics: int = 8) -> list[str]:
        made = []
        for _ in range(count):
            i = len(self.nodes)
            node = f"gpu-{i}"
            body = node_body(
                node, gpus=topology_gpus, nics=topology_nics, ip=self.cp.node_ip(i), labels=GPU_LABEL
            )
            self.cp.request("POST", "/api/v1/nodes", body)
            self.nodes.append(node)
            made.append(node)
        return made

    def workload_pods(self, component: str, *, count: int) -> list[dict[str, Any]]:
        """The ``count`` pods of a chart component once the scheduler has bound them."""
        selector = f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component={component}"

        def bound() -> list[dict[str, Any]]:
            items = self.cp.request(
                "GET", f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={selector}"
            )["items"]
            live = [
                p for p in items if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
            ]
            return live if len(live) >= count else []

        return list(eventually(bound, timeout=90, what=f"{count} {component} pod(s) bound"))[:count]

    def start(self, component: str, *, count: int, env: dict[str, str] | None = None) -> list[RunningPod]:
        running = [self.kubelet.run(p, env=env) for p in self.workload_pods(component, count=count)]
        self.pods.setdefault(component, []).extend(running)
        return running

    def serve_webhook(self) -> None:
        pods = self.pods["admission"]
        for p in pods:
            p.wait_ready(timeout=60)
        svc = self.cp.request("GET", f"/api/v1/namespaces/{self.namespace}/services/{self.name}-admission")
        publish_endpoints(self.cp, svc, pods)

    def logs(self) -> str:
        return "\n".join(
            f"--- pod {p.name} (rc={p.popen.poll()})\n{p.tail()}" for ps in self.pods.values() for p in ps
        )

    def logged(self, component: str, event: str, **fields: Any) -> bool:
        """Whether a running pod of ``component`` wrote the JSON log line ``event`` with these
        fields: how a test waits for a service to have *seen* something that changes nothing
        visible (its whole log, not the tail :meth:`logs` prints)."""
        for p in self.pods.get(component, []):
            with contextlib.suppress(OSError):
                for line in p.log.read_text(errors="replace").splitlines():
                    if f'"{event}"' not in line:
                        continue
                    with contextlib.suppress(ValueError):
                        got = json.loads(line)
                        if got.get("event") == event and all(got.get(k) == v for k, v in fields.items()):
                            return True
        return False

    # --- Tandem's own records, read over NATS as the CLI reads them ---------------------------
    def _read(self, read: Callable[[TandemClient], Awaitable[T]]) -> T:
        async def go() -> T:
            conn = await CliConnection.open(self.nats.url)
            try:
                return await read(TandemClient(conn))
            finally:
                await conn.close()

        return asyncio.run(go())

    def command(self, node: str, device: str, action: str, *, reason: str = "") -> HealthEvent:
        """An operator's device command (``tandem device cordon|uncordon|...``) over NATS."""
        return self._read(lambda client: client.command(node, device, action, reason=reason))

    def requests_of(self, namespace: str, name: str) -> list[RequestRecord]:
        return self._read(lambda client: client.requests_of_pod(PodRef(namespace=namespace, name=name)))

    def live_requests_in(self, namespace: str) -> list[RequestRecord]:
        """Requests of the namespace's pods that still hold or wait for devices."""
        records = self._read(lambda client: client.request_records()).values()
        return [r for r in records if r.request.pod.namespace == namespace and r.state not in DONE]

    def empty_namespace(self, namespace: str) -> None:
        """Delete the namespace's Tandem pods and wait until their devices are freed."""
        self.cp.request(
            "DELETE", f"/api/v1/namespaces/{namespace}/pods?labelSelector={names.MANAGED_SELECTOR}"
        )
        eventually(lambda: not self.live_requests_in(namespace), what=f"every request of {namespace} freed")


@contextlib.contextmanager
def running_release(
    cp: ControlPlane,
    workdir: Path,
    values: dict[str, Any],
    *,
    gpu_nodes: int = 2,
    jaeger: Jaeger | None = None,
) -> Iterator[Release]:
    """The chart installed against an embedded NATS on the cluster's address (and exporting
    traces to ``jaeger``), GPU nodes added, every replica of every component running; all
    stopped and uninstalled afterwards."""
    with EmbeddedNats(host=cp.host) as server:
        merged = {**values, "nats": {**values.get("nats", {}), "url": server.url}}
        if jaeger is not None:
            merged["otlp"] = {"endpoint": jaeger.otlp_endpoint}
        install(cp, merged)
        rel = Release(cp=cp, nats=server, kubelet=LocalKubelet(cp, workdir), jaeger=jaeger)
        try:
            rel.add_gpu_nodes(gpu_nodes)
            for component, count in (("inventory", 2), ("allocator", 2), ("admission", 2)):
                rel.start(component, count=count)
            rel.start("nodeagent", count=gpu_nodes)
            rel.serve_webhook()
            yield rel
        except BaseException:
            print(rel.logs())
            print(cp.logs())
            raise
        finally:
            rel.kubelet.stop_all()
            with contextlib.suppress(Exception):
                uninstall(cp)
            for node in rel.nodes:
                with contextlib.suppress(urllib.error.HTTPError):
                    cp.request("DELETE", f"/api/v1/nodes/{node}")
