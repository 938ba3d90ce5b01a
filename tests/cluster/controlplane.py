"""A real Kubernetes control plane on this machine: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok, as processes built by :mod:`tests.cluster.build`.

What is real: the API server with its authentication (client certificates, service-account
tokens it signs and reviews itself), RBAC and Node authorisation, CRD structural schemas,
admission webhooks it calls itself, ValidatingAdmissionPolicies whose CEL it compiles, watches
that end in 410 Gone; the controllers (ReplicaSets, DaemonSets, Jobs, garbage collection,
namespaces, service-account tokens, disruption budgets, binding claims to the persistent
volumes a test provisions); the scheduler that honours scheduling gates, node affinity and
extended resources.

What is played, and by whom:

* **kubelets**: kwok (``kwok-stages.yaml``) makes Nodes labelled ``type=kwok`` Ready with the
  capacity the test gives them, runs their pods as far as the API can see (IP, phase, readiness)
  and finishes Jobs' pods. No container runs; the test runs the workloads it needs as local
  processes with the settings and tokens the cluster gives them.
* **the pod network**: a network namespace joined to this machine by a veth pair
  (:class:`~services.runtime.process.podnet.PodNetwork`), with IPv4 forwarding on while the
  control plane runs (pods reach each other through this machine). The API server and NATS
  listen on the host end's address; a workload
  that must be reached *by* the API server (the admission webhook) runs inside the namespace,
  and the test publishes its address in an EndpointSlice of the workload's Service, as the
  endpoint-slice controller would for a pod. The API server routes to endpoints, not to the
  Service's cluster IP (``--enable-aggregator-routing``: no kube-proxy here), and the
  controller-manager's endpoint controllers are off so that kwok's made-up pod IPs never land in
  a slice.
"""

from __future__ import annotations

import base64
import contextlib
import json
import random
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from services.runtime.process.embedded import free_ports, terminate
from services.runtime.process.podnet import PodNetwork, forwarding_back, forwarding_on
from tests.pki import Authority, Pair
from tests.waiting import wait_until_sync

HERE = Path(__file__).resolve().parent
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
POD_CIDR = "10.97.0.0/16"  # kwok's made-up pod IPs; never routed, never in an EndpointSlice
ISSUER = "https://kubernetes.default.svc.cluster.local"
CONTROL_PLANE = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"]


class ControlPlaneError(RuntimeError):
    """A component did not start; the message has the end of its log."""


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


# The pods' addresses: /30s of 10.231.0.0/16 (this test's own), names starting "tc".
POD_NET_SECOND = 231


def pod_network() -> PodNetwork:
    return PodNetwork.create(second=POD_NET_SECOND, prefix="tc")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _write_kubeconfig(path: Path, *, server: str, ca: Path, user: dict[str, Any]) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "tandem-test", "cluster": {"server": server, "certificate-authority": str(ca)}}
                ],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "c", "context": {"cluster": "tandem-test", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    path.chmod(0o600)
    return path


@dataclass
class ControlPlane:
    """``with ControlPlane(workdir, bins) as cp:`` — everything stopped and removed on exit."""

    workdir: Path
    bins: dict[str, Path]
    procs: list[Proc] = field(default_factory=list)
    net: PodNetwork | None = None
    forwarding_was: str = ""  # IPv4 forwarding before start, put back by stop
    api_port: int = 0
    etcd_port: int = 0
    # kwok's node heartbeat (kubelet's nodeStatusUpdateFrequency); thousands of nodes in a
    # benchmark use a longer one, with the node lifecycle's grace period to match.
    heartbeat_s: int = 20
    # With a value, kwok also renews each node's Lease (kube-node-lease) as a kubelet does:
    # every quarter of this duration (kubelet's default: 40 s). A kubelet then patches its
    # Node's status only every nodeStatusReportFrequency (5 min) when nothing changed, which a
    # benchmark plays with ``heartbeat_s=300``.
    node_lease_s: int = 0
    # The scheduler's and controllers' client rate limits (their defaults, 50 and 20 QPS, are
    # what a default install has; a benchmark raises them for both sides of a comparison).
    client_qps: int | None = None
    # The API server's /debug/pprof (bench-kube --profile reads where its CPU goes).
    profiling: bool = False
    # Host-network pods of several simulated nodes share this machine: each node gets an
    # address of its own in a loopback /24 drawn per control plane (node_ip).
    node_net: str = field(default_factory=lambda: f"127.{random.randrange(2, 250)}.{random.randrange(256)}")
    _admin_opener: urllib.request.OpenerDirector | None = None

    # --- access -----------------------------------------------------------------------------
    @property
    def host(self) -> str:
        assert self.net is not None
        return self.net.host_ip

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.api_port}"

    @property
    def ca_file(self) -> Path:
        return self.ca.ca_file

    @property
    def ca_pem(self) -> bytes:
        return self.ca.ca_file.read_bytes()

    def node_ip(self, i: int) -> str:
        """The InternalIP of the ``i``-th simulated node (0-based, at most 253)."""
        return f"{self.node_net}.{i + 1}"

    def kubeconfig_for_token(self, token: str, name: str) -> Path:
        return _write_kubeconfig(
            self.workdir / f"kubeconfig-{name}", server=self.url, ca=self.ca_file, user={"token": token}
        )

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(str(self.admin.cert), str(self.admin.key))
        return ctx

    def _opener(self) -> urllib.request.OpenerDirector:
        # Straight to the test's addresses, never through an http_proxy from the environment.
        if self._admin_opener is None:
            self._admin_opener = urllib.request.build_opener(
                urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=self.ssl_context())
            )
        return self._admin_opener

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> Any:
        """One call as the cluster admin (system:masters); JSON in and out."""
        data = None if body is None else json.dumps(body).encode()
        return json.loads(
            self._call(method, path, data, content_type=content_type, timeout=timeout) or b"null"
        )

    def get_raw(self, path: str, *, timeout: float = 30.0) -> bytes:
        """A GET as the cluster admin whose answer is not JSON (/debug/pprof, /metrics)."""
        return self._call("GET", path, None, content_type="application/json", timeout=timeout)

    def _call(
        self, method: str, path: str, data: bytes | None, *, content_type: str, timeout: float
    ) -> bytes:
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", content_type)
        req.add_header("Accept", "application/json")
        with self._opener().open(req, timeout=timeout) as resp:
            answer: bytes = resp.read()
            return answer

    def request_as(self, token: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One call with a bearer ``token`` (a component's identity): ``(status, JSON body)``,
        refusals included, so a test can assert what the real authorisation answered."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {token}")
        req.add_header("Accept", "application/json")
        if body is not None:
            ctype = "application/merge-patch+json" if method == "PATCH" else "application/json"
            req.add_header("Content-Type", ctype)
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx)
        )
        try:
            with opener.open(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def token(
        self,
        namespace: str,
        account: str,
        *,
        audiences: list[str] | None = None,
        pod: tuple[str, str] | None = None,
        seconds: int = 3600,
    ) -> str:
        """A token of ``namespace/account`` from the real TokenRequest API, bound to the pod
        ``(name, uid)`` when given (what kubelet asks for a projected token)."""
        spec: dict[str, Any] = {"expirationSeconds": seconds}
        if audiences:
            spec["audiences"] = audiences
        if pod:
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": pod[0], "uid": pod[1]}
        out = self.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        return str(out["status"]["token"])

    # --- life -------------------------------------------------------------------------------
    def __enter__(self) -> ControlPlane:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.forwarding_was = forwarding_on()
        self.net = pod_network()
        self._pki()
        self.etcd_port, peer_port, self.api_port = free_ports(3)
        self._start_etcd(peer_port)
        self._start_apiserver()
        admin = _write_kubeconfig(
            self.workdir / "kubeconfig-admin",
            server=self.url,
            ca=self.ca_file,
            user={"client-certificate": str(self.admin.cert), "client-key": str(self.admin.key)},
        )
        self.admin_kubeconfig = admin
        self._spawn(
            "kube-controller-manager",
            [
                str(self.bins["kube-controller-manager"]),
                *self._client_flags(admin),
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={self.workdir / 'sa.key'}",
                f"--root-ca-file={self.ca_file}",
                "--controllers=*,-endpoints-controller,-endpointslice-controller,"
                "-endpointslice-mirroring-controller,-service-lb-controller,-node-ipam-controller,"
                "-cloud-node-lifecycle-controller",
                "--concurrent-gc-syncs=5",
                f"--node-monitor-grace-period={max(50, 3 * self.heartbeat_s)}s",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                str(self.bins["kube-scheduler"]),
                *self._client_flags(admin),
            ],
        )
        self._spawn(
            "kwok",
            [
                str(self.bins["kwok"]),
                f"--kubeconfig={admin}",
                f"--config={self._kwok_stages()}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-label-selector=type=kwok",
                f"--cidr={POD_CIDR}",
                f"--node-ip={self.host}",
                "--server-address=",
                *([f"--node-lease-duration-seconds={self.node_lease_s}"] if self.node_lease_s else []),
            ],
        )
        self._wait_default_service_account()

    def stop(self) -> None:
        for proc in reversed(self.procs):  # all told first, so they stop together
            if proc.popen.poll() is None:
                proc.popen.terminate()
        for proc in reversed(self.procs):
            terminate(proc.popen, timeout=10)
        self.procs.clear()
        if self.net is not None:
            self.net.delete()
            self.net = None
        forwarding_back(self.forwarding_was)
        shutil.rmtree(self.workdir / "etcd", ignore_errors=True)

    def logs(self) -> str:
        """The end of every component's log, for a failing test's report."""
        return "\n".join(f"--- {p.name} (rc={p.popen.poll()})\n{p.tail()}" for p in self.procs)

    # --- pieces -----------------------------------------------------------------------------
    def _pki(self) -> None:
        pki = self.workdir / "pki"
        pki.mkdir(exist_ok=True)
        self.ca = Authority(pki, "tandem-cluster-ca")
        self.serving = self.ca.issue(
            "kube-apiserver",
            server=True,
            ips=(self.host, KUBERNETES_SERVICE_IP, "127.0.0.1"),
            dns=(
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
                "localhost",
            ),
        )
        self.admin: Pair = self.ca.issue("tandem-test-admin", server=False, org="system:masters")
        key = ec.generate_private_key(ec.SECP256R1())
        (self.workdir / "sa.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        (self.workdir / "sa.pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )

    def _client_flags(self, kubeconfig: Path) -> list[str]:
        """What the controller-manager and the scheduler share: the admin's kubeconfig, their
        own serving on a free loopback port, no leader election, the client rate limits."""
        flags = [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_ports(1)[0]}",
            "--leader-elect=false",
        ]
        if self.client_qps is not None:
            flags += [f"--kube-api-qps={self.client_qps}", f"--kube-api-burst={2 * self.client_qps}"]
        return flags

    def _kwok_stages(self) -> Path:
        text = (HERE / "kwok-stages.yaml").read_text()
        if self.heartbeat_s != 20:
            old = "delay: {durationMilliseconds: 20000, jitterDurationMilliseconds: 5000}"
            assert old in text, "kwok-stages.yaml: the heartbeat stage's delay changed"
            ms = self.heartbeat_s * 1000
            text = text.replace(
                old, f"delay: {{durationMilliseconds: {ms}, jitterDurationMilliseconds: {ms // 4}}}"
            )
        path = self.workdir / "kwok-stages.yaml"
        path.write_text(text)
        return path

    def _spawn(self, name: str, cmd: list[str]) -> Proc:
        log = self.workdir / f"{name}.log"
        with log.open("ab") as out:  # a restarted component goes on in the same log
            popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def _start_etcd(self, peer_port: int) -> None:
        client, peer = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{peer_port}"
        proc = self._spawn(
            "etcd",
            [
                str(self.bins["etcd"]),
                "--name=tandem",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=tandem={peer}",
                "--log-level=warn",
                "--unsafe-no-fsync",  # a test cluster: losing it on a power cut is fine
            ],
        )
        self._wait(proc, lambda: _get(f"{client}/health").get("health") == "true", timeout=30)

    def restart_apiserver(self) -> None:
        """Stop the API server (SIGTERM, as a rolling update does) and start it again on the
        same etcd, address and port once it has exited: every client's connection and watch
        ends, each must reconnect, and the new server's watch cache starts from now."""
        (old,) = [p for p in self.procs if p.name == "kube-apiserver"]
        terminate(old.popen, timeout=30)
        self.procs.remove(old)
        self._start_apiserver()

    def etcd_revision(self) -> int:
        """etcd's current revision (its v3 JSON gateway)."""
        body = json.dumps({"key": base64.b64encode(b"/").decode()}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.etcd_port}/v3/kv/range", data=body, method="POST"
        )
        with _DIRECT.open(req, timeout=10) as resp:
            return int(json.loads(resp.read())["header"]["revision"])

    def compact_etcd(self) -> int:
        """Compact etcd's history up to now, as the API server does every 5 minutes: a watch
        or list from an older resourceVersion is then answered 410 Gone. The revision."""
        revision = self.etcd_revision()
        body = json.dumps({"revision": str(revision), "physical": True}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.etcd_port}/v3/kv/compaction", data=body, method="POST"
        )
        with _DIRECT.open(req, timeout=30) as resp:
            resp.read()
        return revision

    def _start_apiserver(self) -> None:
        proc = self._spawn(
            "kube-apiserver",
            [
                str(self.bins["kube-apiserver"]),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                f"--bind-address={self.host}",
                f"--advertise-address={self.host}",
                f"--secure-port={self.api_port}",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--tls-cert-file={self.serving.cert}",
                f"--tls-private-key-file={self.serving.key}",
                f"--client-ca-file={self.ca_file}",
                f"--service-account-issuer={ISSUER}",
                f"--service-account-key-file={self.workdir / 'sa.pub'}",
                f"--service-account-signing-key-file={self.workdir / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--enable-aggregator-routing=true",
                "--allow-privileged=true",
                f"--profiling={str(self.profiling).lower()}",
                "--event-ttl=1h",
            ],
        )
        self._wait(proc, self._api_ready, timeout=90)

    def _api_ready(self) -> bool:
        try:
            with self._opener().open(f"{self.url}/readyz", timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _wait_default_service_account(self) -> None:
        """The controllers are up once the token controller has made ``default/default``."""

        def ok() -> bool:
            with contextlib.suppress(urllib.error.HTTPError):
                return bool(self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default"))
            return False

        (kcm,) = [p for p in self.procs if p.name == "kube-controller-manager"]
        self._wait(kcm, ok, timeout=60)

    def _wait(self, proc: Proc, ok: Any, *, timeout: float) -> None:
        def ready() -> bool:
            if proc.popen.poll() is not None:
                raise ControlPlaneError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
            try:
                return bool(ok())
            except (urllib.error.URLError, OSError, ValueError):
                return False

        wait_until_sync(ready, timeout=timeout, what=f"{proc.name} ready", poll=0.2, details=proc.tail)


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str) -> Any:
    with _DIRECT.open(url, timeout=5) as resp:
        return json.loads(resp.read())


def node_body(
    name: str,
    *,
    gpus: int,
    nics: int,
    ip: str | None = None,
    labels: dict[str, str] | None = None,
    extra: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Node that kwok plays, with Tandem's extended resources as the device plugin would
    advertise them (kubelet puts a plugin's devices into capacity and allocatable).

    ``ip`` is its InternalIP, the address its host-network pods bind: several nodes share this
    machine, so each gets its own loopback address (ControlPlane.node_ip) and their node agents' ports
    do not collide."""
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    if gpus:
        resources["tandem.io/gpu"] = str(gpus)
    if nics:
        resources["tandem.io/rdma"] = str(nics)
    resources.update(extra or {})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                **(labels or {}),
            },
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "status": {
            "capacity": resources,
            "allocatable": resources,
            **(
                {"addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}]}
                if ip
                else {}
            ),
        },
    }


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@contextlib.contextmanager
def started(workdir: Path, bins: dict[str, Path]) -> Iterator[ControlPlane]:
    with ControlPlane(workdir, bins) as cp:
        yield cp
