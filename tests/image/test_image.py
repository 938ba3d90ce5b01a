"""The container image, built here and run as the chart runs it.

``make image-test`` (marker ``image``; not part of ``make test``): the Dockerfile is built with
``make image`` on a locally bootstrapped Debian base (tests/image/host.py), then the chart is
rendered with the Helm SDK and every workload runs from that image under podman exactly as
rendered (tests/image/pods.py): NATS from the image's own ``nats-server``, inventory and
allocator (their rendered replicas), two simulated node agents from the DaemonSet, and the
admission service talking to the Kubernetes API emulator over its in-cluster service account.
A pod then goes through the webhook and the API: assigned, applied, bound, deleted, released,
cleaned, freed. Every container must answer its rendered readiness probe and ``/readyz``, and
stop with status 0 on SIGTERM. Containers are removed whatever happens.

Twice: with NATS security off (``nats.auth.mode=none``, no TLS), which observes every message,
and with the chart's default security against an external NATS: the install hook's Job runs
first and writes its Secret through the API emulator, NATS runs with that Secret's
``server.conf`` and TLS, the auth callout's replicas review every component's projected token
through the emulator's TokenReview, and the components connect over TLS with the rendered CA.
(The bundled NATS StatefulSet itself runs the official nats image, which is not built here; its
rendered config is run on real nats-servers in tests/chart/test_chart_nats.py.)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import secrets
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import jsonpatch
import kmock
import nats
import pytest
from aiohttp.test_utils import RawTestServer

from schemas import codec, messages, permissions
from services.admission import names
from services.authcallout.service import NODE_NAME_EXTRA, POD_NAME_EXTRA
from services.runtime.process.embedded import free_ports
from tests.chart.test_chart import NAMESPACE, RELEASE, component, one, render, workloads
from tests.image import host
from tests.image.conftest import VERSION, BuiltImage
from tests.image.pods import ApiAccess, Pod, TokenIssuer, podman_run_args
from tests.integration.test_bridge import Apiserver
from tests.unit.test_admission_helpers import deployment_pod, review, write_self_signed

pytestmark = [pytest.mark.image, pytest.mark.timeout(1800)]

T = TypeVar("T")
NODES = ("gpu-node-a", "gpu-node-b")  # the DaemonSet's pods, one per simulated node
TOPOLOGY = "dgx-h100"
READY_TIMEOUT = 120.0  # 9 containers starting on a 2-core machine
# python:3.11-slim is ~125 MB (amd64, uncompressed); what Tandem adds must stay under this for
# the image to stay under 250 MB there. Measured here on the Debian base: docs/benchmarks.md.
LAYERS_BUDGET = 125 * 1_000_000


def free_port() -> int:
    return free_ports(1)[0]


async def podman(*args: str, check: bool = True, timeout: float = 120, stderr: bool = False) -> str:
    """Run podman; its stdout (plus stderr with ``stderr=True``: container logs go there)."""
    proc = await asyncio.create_subprocess_exec(
        "podman", *args, env=host.podman_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"podman {' '.join(args[:3])} … exited {proc.returncode}: {err.decode()[-2000:]}"
        )
    return out.decode() + (err.decode() if stderr else "")


async def eventually(fn: Callable[[], Awaitable[T | None]], *, timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = await fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.2)


def test_image_is_labelled_non_root_small_and_has_no_build_tools(built_image: BuiltImage) -> None:
    info = json.loads(host.run(["podman", "image", "inspect", built_image.ref]).stdout)[0]
    labels = info["Config"]["Labels"]
    assert labels["org.opencontainers.image.version"] == VERSION
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.source"].startswith("https://github.com/")
    assert info["Config"]["User"] == "65532:65532"  # numeric: kubelet can check runAsNonRoot
    layers = built_image.size - built_image.base_size
    assert layers < LAYERS_BUDGET, f"Tandem adds {layers / 1e6:.0f} MB to its base"

    probe = (
        "import importlib.util, shutil, os;"
        "print([t for t in ('pip', 'pip3', 'gcc', 'cc', 'strip', 'apt-get') if shutil.which(t) and"
        " not shutil.which(t).startswith(('/usr/bin/apt', '/bin/apt'))],"
        " importlib.util.find_spec('pip') is not None, os.getuid(), os.path.exists('/root/.cache'))"
    )
    out = host.run(["podman", "run", "--rm", "--network", "host", built_image.ref, "python", "-c", probe])
    assert out.stdout.split() == ["[]", "False", "65532", "False"], out.stdout
    nats_version = host.run(["podman", "run", "--rm", built_image.ref, "nats-server", "--version"])
    assert nats_version.stdout.startswith("nats-server: v"), nats_version.stdout


class Cluster:
    """The containers of one run: started in order, probed, stopped and removed."""

    def __init__(self, image: BuiltImage, workdir: Path) -> None:
        self.image = image
        self.workdir = workdir
        self.run_id = uuid.uuid4().hex[:8]
        self.containers: dict[str, Pod | None] = {}  # container name -> pod (None: NATS)
        self.started_at: dict[str, float] = {}  # pod name -> `podman run` issued
        self.ready_at: dict[str, float] = {}  # pod name -> first seen ready
        self.image_user = host.run(
            ["podman", "image", "inspect", "--format", "{{.Config.User}}", image.ref]
        ).stdout.strip()

    def name(self, pod: str) -> str:
        return f"tandem-image-test-{self.run_id}-{pod}"

    async def start_nats(self, port: int, monitor: int, *, config_dir: Path | None = None) -> None:
        """The image's nats-server; with ``config_dir``, its ``nats.conf`` (mounted at /etc/nats)."""
        name = self.name("nats")
        config = ["--volume", f"{config_dir}:/etc/nats:ro"] if config_dir else []
        conf_args = ["--config", "/etc/nats/nats.conf"] if config_dir else []
        await podman(
            "run", "--detach", "--init", "--name", name, "--network", "host",
            "--label", f"tandem-image-test={self.run_id}", "--tmpfs", "/data:rw,mode=1777", *config,
            self.image.ref, "nats-server", *conf_args, "--jetstream", "--addr", "127.0.0.1",
            "--port", str(port), "--http_port", str(monitor), "--store_dir", "/data",
        )  # fmt: skip
        self.containers[name] = None

    async def start(self, pod: Pod, api: ApiAccess | None = None, tokens: TokenIssuer | None = None) -> None:
        name = self.name(pod.name)
        args = podman_run_args(
            pod,
            image_user=self.image_user,
            workdir=self.workdir,
            container_name=name,
            labels={"tandem-image-test": self.run_id},
            api=api,
            tokens=tokens,
        )
        self.containers[name] = pod
        self.started_at[pod.name] = time.monotonic()
        await podman("run", *args)

    async def run_job(self, pod: Pod, api: ApiAccess) -> tuple[int, str]:
        """Run a Job's pod to its end, as the Job controller would once: (exit code, logs)."""
        await self.start(pod, api)
        name = self.name(pod.name)
        code = int((await podman("wait", name, timeout=120)).strip() or -1)
        return code, await podman("logs", name, check=False, stderr=True)

    async def start_all(
        self, pods: list[Pod], api: ApiAccess | None = None, tokens: TokenIssuer | None = None
    ) -> None:
        """Start pods concurrently; every start has finished (so cleanup sees it) before a
        failure is raised."""
        results = await asyncio.gather(*(self.start(p, api, tokens) for p in pods), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def running(self, name: str) -> bool:
        out = await podman("inspect", "--format", "{{.State.Status}}", name, check=False)
        return out.strip() == "running"

    async def logs(self) -> str:
        parts = []
        for name in self.containers:
            out = await podman("logs", "--tail", "25", name, check=False, stderr=True)
            parts.append(f"--- {name}\n{out}")
        return "\n".join(parts)

    async def stop(self) -> dict[str, int]:
        """SIGTERM the services (what kubelet does on delete), then NATS; return exit codes."""
        names = list(self.containers)
        services = [n for n, pod in self.containers.items() if pod is not None]
        await podman("stop", "--time", "20", *services, check=False, timeout=90)
        await podman("stop", "--time", "20", *names, check=False, timeout=90)
        codes = {}
        for name in names:
            out = await podman("inspect", "--format", "{{.State.ExitCode}}", name, check=False)
            codes[name] = int(out.strip() or -1)
        return codes

    async def remove(self) -> None:
        names = list(self.containers)
        if names:
            # --ignore: a container whose `podman run` failed does not exist, and without it
            # podman would refuse to remove the others.
            await podman("rm", "--force", "--ignore", "--time", "5", *names, check=False, timeout=90)
        # And anything else this run labelled (only this run's: the label carries its id).
        label = f"label=tandem-image-test={self.run_id}"
        await podman("rm", "--force", "--time", "5", "--filter", label, check=False, timeout=90)


async def http_status(url: str, *, ssl_ctx: Any = None) -> int:
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.get(url, ssl=ssl_ctx, timeout=aiohttp.ClientTimeout(3)) as r,
        ):
            return r.status
    except (aiohttp.ClientError, TimeoutError):
        return 0


async def pod_ready(pod: Pod) -> list[str]:
    """What is not ready yet: the rendered readinessProbe (as kubelet runs it) and ``/readyz``."""
    problems = []
    probe = pod.container.get("readinessProbe", {}).get("httpGet")
    assert probe, f"{pod.name}: the chart renders no httpGet readinessProbe"
    scheme = probe.get("scheme", "HTTP").lower()
    url = f"{scheme}://127.0.0.1:{pod.port(probe['port'])}{probe['path']}"
    # kubelet does not verify the certificate of an HTTPS probe.
    if (status := await http_status(url, ssl_ctx=False if scheme == "https" else None)) != 200:
        problems.append(f"{pod.name} readinessProbe {url}: {status or 'no answer'}")
    readyz = f"http://127.0.0.1:{pod.port('ops')}/readyz"
    if (status := await http_status(readyz)) != 200:
        problems.append(f"{pod.name} {readyz}: {status or 'no answer'}")
    return problems


async def wait_ready(cluster: Cluster, pods: list[Pod]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        problems = []
        for pod in pods:
            if not await cluster.running(cluster.name(pod.name)):
                raise AssertionError(f"{pod.name} exited:\n{await cluster.logs()}")
            pod_problems = await pod_ready(pod)
            if not pod_problems:
                cluster.ready_at.setdefault(pod.name, time.monotonic())
            problems += pod_problems
        if not problems:
            return
        if time.monotonic() > deadline:
            raise AssertionError("not ready: " + "; ".join(problems))
        await asyncio.sleep(0.5)


class TlsServer(RawTestServer):
    """aiohttp's raw test server (what kmock serves with) over TLS: ``ssl`` is a start option."""

    def __init__(self, handler: Any, *, ssl_context: ssl.SSLContext, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.ssl_context = ssl_context

    async def start_server(self, loop: Any = None, **kwargs: Any) -> None:
        await super().start_server(loop, ssl=self.ssl_context, **kwargs)


class ReviewingApiserver(Apiserver):
    """The emulator plus the API server's TokenReview, for the projected tokens this test's
    kubelet stand-in hands out (``issue``): a 1.30+ API server's answer for pod-bound tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: dict[str, tuple[str, dict[str, Any]]] = {}  # token -> (audience, status.user)
        self.authenticated: list[str] = []  # the user of every review answered "authenticated"

    def issue(self, pod: Pod, audience: str) -> str:
        token = secrets.token_urlsafe(32)
        account = f"system:serviceaccount:{pod.namespace}:{pod.spec['serviceAccountName']}"
        extra = {POD_NAME_EXTRA: [pod.name], NODE_NAME_EXTRA: [pod.node]}
        self.tokens[token] = (audience, {"username": account, "extra": extra})
        return token

    async def __call__(self, raw_request: Any) -> Any:
        if raw_request.method == "POST" and raw_request.path == "/apis/authentication.k8s.io/v1/tokenreviews":
            spec = (await raw_request.json())["spec"]
            audience, user = self.tokens.get(spec.get("token", ""), ("", None))
            status: dict[str, Any] = {"authenticated": False, "error": "invalid bearer token"}
            if user is not None and audience in spec.get("audiences", []):
                status = {"authenticated": True, "user": user, "audiences": [audience]}
                self.authenticated.append(user["username"])
            body = {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": spec,
                "status": status,
            }
            return aiohttp.web.json_response(body, status=201)
        return await super().__call__(raw_request)


@contextlib.asynccontextmanager
async def api_emulator(tmp_path: Path) -> AsyncIterator[tuple[Any, int, bytes]]:
    """kmock's Kubernetes emulator over HTTPS on 127.0.0.1, as an in-cluster client reaches it."""
    cert, key = write_self_signed(tmp_path, host="127.0.0.1")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))

    def client(url: Any) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(ssl=client_ctx))

    server_cls = functools.partial(TlsServer, ssl_context=server_ctx)
    async with (
        ReviewingApiserver() as emu,
        kmock.Server(emu, server_cls=server_cls, client_fct=client) as srv,
    ):
        for resource in ("v1/pods", "v1/events", "v1/secrets", "coordination.k8s.io/v1/leases"):
            emu.resources[resource] = {}
        assert srv.url.scheme == "https"
        yield emu, int(srv.url.port), cert.read_bytes()


def render_pod_values(*, nats_url: str, secure: bool = False) -> dict[str, Any]:
    """Chart values for one pod: free ports (host network), the built image, simulated nodes,
    and an external NATS at ``nats_url``: with ``secure``, the chart's default auth callout and
    TLS (CA in Secret ``nats-ca``); without, ``nats.auth.mode=none`` and no TLS."""
    nats_values: dict[str, Any] = {"bundled": False, "url": nats_url}
    if secure:  # the chart's default auth (callout), TLS verified with the CA of Secret nats-ca
        nats_values["tls"] = {"caSecret": {"name": "nats-ca"}}
    else:
        nats_values |= {"auth": {"mode": "none"}, "tls": {"enabled": False}}
    return {
        "image": {"repository": host.IMAGE_REPOSITORY},
        "nats": nats_values,
        "metrics": {"port": free_port(), "nodeagentPort": free_port()},
        "admission": {"port": free_port()},
        "nodeagent": {"backend": "simulated", "topologyFile": TOPOLOGY},
    }


def plan_pods(*, nats_url: str, secure: bool = False) -> dict[str, list[Pod]]:
    """Every pod the chart would run, by component, each from its own render."""
    plan: dict[str, list[Pod]] = {}
    default = render(render_pod_values(nats_url=nats_url, secure=secure))
    for w in workloads(default):
        comp = component(w)
        count = len(NODES) if w["kind"] == "DaemonSet" else int(w["spec"]["replicas"])
        for i in range(count):
            docs = render(render_pod_values(nats_url=nats_url, secure=secure))
            (workload,) = [d for d in workloads(docs) if component(d) == comp]
            node = NODES[i] if w["kind"] == "DaemonSet" else "control-plane-0"
            pod_name = f"{workload['metadata']['name']}-{node if w['kind'] == 'DaemonSet' else i}"
            plan.setdefault(comp, []).append(
                Pod(name=pod_name, namespace=NAMESPACE, node=node, workload=workload, objects=docs)
            )
    return plan


class Observer:
    """Every Tandem message about one request, as published on NATS (core subscription)."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    async def handler(self, msg: Any) -> None:
        with contextlib.suppress(Exception):  # heartbeats etc. of other shapes
            self.seen.append(codec.ANY_MESSAGE.decode(msg.data))

    def about(self, request_id: str) -> list[Any]:
        return [m for m in self.seen if getattr(m, "request_id", None) == request_id]

    def first(self, request_id: str, kind: type[T]) -> T | None:
        return next((m for m in self.about(request_id) if isinstance(m, kind)), None)


async def test_rendered_chart_runs_from_the_image(built_image: BuiltImage, tmp_path: Path) -> None:
    nats_port, nats_monitor = free_port(), free_port()
    nats_url = f"nats://127.0.0.1:{nats_port}"
    plan = plan_pods(nats_url=nats_url)
    assert set(plan) == {"inventory", "allocator", "admission", "nodeagent"}, set(plan)
    assert len(plan["allocator"]) == 2 and len(plan["nodeagent"]) == len(NODES)
    for pods in plan.values():
        for pod in pods:
            assert pod.container["image"] == built_image.ref  # chart default tag = built tag
            assert pod.container["command"][:2] == ["python", "-m"]

    cluster = Cluster(built_image, tmp_path / "pods")
    started = time.monotonic()
    ok = False
    try:
        async with api_emulator(tmp_path) as (emu, api_port, api_ca):
            api = ApiAccess(host="127.0.0.1", port=api_port, token="image-test-token", ca_pem=api_ca)
            await cluster.start_nats(nats_port, nats_monitor)
            await eventually(
                lambda: _ok(http_status(f"http://127.0.0.1:{nats_monitor}/healthz?js-enabled-only=true")),
                timeout=30,
                what="nats-server from the image",
            )
            # The control plane provisions streams and buckets; node agents never do (their NATS
            # user may not), so they start once it is ready, as a DaemonSet pod would restart.
            control = plan["inventory"] + plan["allocator"]
            await cluster.start_all(control)
            await wait_ready(cluster, control)
            edge = plan["admission"] + plan["nodeagent"]
            await cluster.start_all(edge, api)
            everything = control + edge
            await wait_ready(cluster, everything)
            ready_seconds = time.monotonic() - started

            await check_users(cluster, everything)
            await one_pod_through_the_system(emu, plan["admission"][0], nats_url)
            await wait_ready(cluster, everything)  # all still up and ready afterwards
            each = sorted(cluster.ready_at[p.name] - cluster.started_at[p.name] for p in everything)
            print(
                f"\nimage-test: {len(cluster.containers)} containers ready {ready_seconds:.1f} s after the "
                f"first start; `podman run` to ready per service container (polled every 0.5 s): "
                f"min {each[0]:.1f} s, median {each[len(each) // 2]:.1f} s, max {each[-1]:.1f} s"
            )
            codes = await cluster.stop()
            assert codes == dict.fromkeys(codes, 0), f"exit codes after SIGTERM: {codes}"
            ok = True
    finally:
        if not ok:
            print(await cluster.logs())
        await cluster.remove()
    leftovers = await podman(
        "ps", "--all", "--quiet", "--filter", f"label=tandem-image-test={cluster.run_id}"
    )
    assert leftovers.strip() == ""


async def test_secure_render_runs_from_the_image(built_image: BuiltImage, tmp_path: Path) -> None:
    nats_port, nats_monitor = free_port(), free_port()
    nats_url = f"tls://127.0.0.1:{nats_port}"
    plan = plan_pods(nats_url=nats_url, secure=True)
    assert set(plan) == {"inventory", "allocator", "admission", "nodeagent", "authcallout"}, set(plan)
    everything = [p for pods in plan.values() for p in pods]
    docs = everything[0].objects
    (job,) = [d for d in docs if d["kind"] == "Job"]
    hook = Pod(
        name=f"{job['metadata']['name']}-0",
        namespace=NAMESPACE,
        node="control-plane-0",
        workload=job,
        objects=docs,
    )

    # The external NATS's certificate, and the Secret the chart is told holds its CA.
    tls_dir = tmp_path / "nats"
    tls_dir.mkdir()
    cert, _ = write_self_signed(tls_dir)  # tls.crt and tls.key in tls_dir
    ca_secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "nats-ca", "namespace": NAMESPACE},
        "data": {"ca.crt": base64.b64encode(cert.read_bytes()).decode()},
    }
    cluster = Cluster(built_image, tmp_path / "pods")
    ok = False
    try:
        async with api_emulator(tmp_path) as (emu, api_port, api_ca):
            api = ApiAccess(host="127.0.0.1", port=api_port, token="image-test-token", ca_pem=api_ca)
            # 1. The install hook, before anything else (Helm's pre-install), through the API.
            code, logs = await cluster.run_job(hook, api)
            assert code == 0, logs
            secret = dict(emu.objects["v1/secrets", NAMESPACE, f"{RELEASE}-nats-auth"].raw)
            assert set(secret["data"]) == {"server.conf", "issuer.nk", "auth.nk"}, logs
            for pod in everything:
                pod.objects = [*pod.objects, secret, ca_secret]
            # 2. NATS configured as docs/kubernetes.md tells an operator: the hook's server.conf + TLS.
            (tls_dir / "auth.conf").write_bytes(base64.b64decode(secret["data"]["server.conf"]))
            tls_block = "tls {\n  cert_file: /etc/nats/tls.crt\n  key_file: /etc/nats/tls.key\n}\n"
            (tls_dir / "nats.conf").write_text("include ./auth.conf\n" + tls_block)
            for f in tls_dir.iterdir():
                f.chmod(0o644)
            await cluster.start_nats(nats_port, nats_monitor, config_dir=tls_dir)
            await eventually(
                lambda: _ok(http_status(f"http://127.0.0.1:{nats_monitor}/healthz?js-enabled-only=true")),
                timeout=30,
                what="nats-server with the hook's auth callout config",
            )
            # 3. The callout, then the control plane, then the edge; each with its own token.
            await cluster.start_all(plan["authcallout"], api)
            await wait_ready(cluster, plan["authcallout"])
            control = plan["inventory"] + plan["allocator"]
            await cluster.start_all(control, tokens=emu.issue)
            await wait_ready(cluster, control)
            edge = plan["admission"] + plan["nodeagent"]
            await cluster.start_all(edge, api, tokens=emu.issue)
            await wait_ready(cluster, everything)

            await secure_pod_through_the_system(emu, plan["admission"][0], nats_url, cert)
            await wait_ready(cluster, everything)
            # The callout reviewed every component's own token (nothing gets in without one).
            reviewed = {u.rsplit(":", 1)[1] for u in emu.authenticated}
            accounts = {f"{RELEASE}-{c}" for c in ("allocator", "inventory", "admission", "nodeagent", "cli")}
            assert reviewed == accounts, reviewed
            codes = await cluster.stop()
            assert codes == dict.fromkeys(codes, 0), f"exit codes after SIGTERM: {codes}"
            ok = True
    finally:
        if not ok:
            print(await cluster.logs())
        await cluster.remove()


async def secure_pod_through_the_system(emu: Any, admission: Pod, nats_url: str, ca: Path) -> None:
    """One pod through webhook, bridge, allocator and node agent, watched as an operator can:
    with a token of the release's CLI account, which sees assignments, cleanups and frees."""
    observer = Observer()
    cli = Pod(
        name="operator", namespace=NAMESPACE, node="laptop", workload=_account(f"{RELEASE}-cli"), objects=[]
    )
    user = permissions.user_name("cli")
    nc = await nats.connect(
        nats_url,
        token=emu.issue(cli, "tandem-nats"),
        tls=ssl.create_default_context(cafile=str(ca)),
        inbox_prefix=permissions.inbox_prefix(user),
    )
    try:
        for subject in permissions.for_role("cli").subscribe:
            if not subject.startswith("_INBOX"):
                await nc.subscribe(subject, cb=observer.handler)
        pod = await admit_through_webhook(admission, deployment_pod(gpu="2", rdma="2"))
        pod["metadata"].update(name="trainer-1", uid=str(uuid.uuid4()))
        resp = await emu.post("/api/v1/namespaces/ml/pods", json=pod)
        assert resp.status == 200, await resp.text()

        async def bound() -> dict[str, Any] | None:
            obj = dict(emu.objects["v1/pods", "ml", "trainer-1"].raw)
            gated = obj["spec"].get("schedulingGates")
            return obj if not gated and names.ASSIGNMENT in obj["metadata"].get("annotations", {}) else None

        obj = await eventually(bound, timeout=30, what="the pod to be bound (gate removed, assignment)")
        assignment = json.loads(obj["metadata"]["annotations"][names.ASSIGNMENT])
        rid, node = assignment["request_id"], assignment["node"]
        assert node in NODES and len(assignment["gpus"]) == 2

        async def seen(kind: type[T]) -> T | None:
            return observer.first(rid, kind)

        assigned = await eventually(lambda: seen(messages.Assignment), timeout=10, what="alloc.assigned")
        assert assigned.node == node and assigned.pod.uid == pod["metadata"]["uid"]
        resp = await emu.delete("/api/v1/namespaces/ml/pods/trainer-1")
        assert resp.status == 200, await resp.text()
        cleaned = await eventually(lambda: seen(messages.Cleaned), timeout=30, what="node.cleaned")
        assert cleaned.ok and cleaned.node == node, cleaned
        freed = await eventually(lambda: seen(messages.Freed), timeout=20, what="alloc.freed")
        assert freed.node == node and sorted(freed.devices) == sorted(assigned.device_ids())
    finally:
        await nc.close()


def _account(name: str) -> dict[str, Any]:
    """A workload-shaped stand-in whose pod runs as service account ``name``."""
    return {"spec": {"template": {"spec": {"serviceAccountName": name, "containers": [{}]}}}}


async def _ok(status: Awaitable[int]) -> bool:
    return await status == 200


async def check_users(cluster: Cluster, pods: list[Pod]) -> None:
    """Non-root everywhere but the node agent, whose DaemonSet opts into root."""
    for pod in pods:
        uid = await podman("exec", cluster.name(pod.name), "python", "-c", "import os; print(os.getuid())")
        expected = "0" if component(pod.workload) == "nodeagent" else "65532"
        assert uid.strip() == expected, (pod.name, uid)


async def one_pod_through_the_system(emu: Any, admission: Pod, nats_url: str) -> None:
    observer = Observer()
    nc = await nats.connect(nats_url)
    try:
        await nc.subscribe("tandem.>", cb=observer.handler)
        pod = await admit_through_webhook(admission, deployment_pod(gpu="4", rdma="4"))
        pod["metadata"].update(name="trainer-0", uid=str(uuid.uuid4()))
        resp = await emu.post("/api/v1/namespaces/ml/pods", json=pod)
        assert resp.status == 200, await resp.text()

        async def bound() -> dict[str, Any] | None:
            obj = dict(emu.objects["v1/pods", "ml", "trainer-0"].raw)
            gated = obj["spec"].get("schedulingGates")
            return obj if not gated and names.ASSIGNMENT in obj["metadata"].get("annotations", {}) else None

        obj = await eventually(bound, timeout=30, what="the pod to be bound (gate removed, assignment)")
        assignment = json.loads(obj["metadata"]["annotations"][names.ASSIGNMENT])
        rid, node = assignment["request_id"], assignment["node"]
        assert node in NODES and len(assignment["gpus"]) == 4 and len(assignment["nics"]) == 4

        async def seen(kind: type[T]) -> T | None:
            return observer.first(rid, kind)

        assigned = await eventually(lambda: seen(messages.Assignment), timeout=10, what="alloc.assigned")
        assert assigned.node == node and assigned.pod.uid == pod["metadata"]["uid"]
        applied = await eventually(lambda: seen(messages.Applied), timeout=20, what="node.applied")
        assert applied.ok and applied.node == node, applied

        resp = await emu.delete("/api/v1/namespaces/ml/pods/trainer-0")
        assert resp.status == 200, await resp.text()
        release = await eventually(lambda: seen(messages.Release), timeout=20, what="alloc.release")
        assert release.node == node
        cleaned = await eventually(lambda: seen(messages.Cleaned), timeout=20, what="node.cleaned")
        assert cleaned.ok and cleaned.node == node, cleaned
        freed = await eventually(lambda: seen(messages.Freed), timeout=20, what="alloc.freed")
        assert freed.node == node and sorted(freed.devices) == sorted(assigned.device_ids())

        # The node record's commit, not the alloc.assigned event, is what the agent applies, so
        # those two may be seen in either order; everything else is causal.
        order = [type(m) for m in observer.about(rid)]
        at = {k: order.index(k) for k in set(order)}
        assert at[messages.AllocationRequest] == 0, order
        assert max(at[messages.Assignment], at[messages.Applied]) < at[messages.Release], order
        assert at[messages.Release] < at[messages.Cleaned] < at[messages.Freed], order
        assert observer.first(rid, messages.AllocationFailed) is None
    finally:
        await nc.close()


async def admit_through_webhook(admission: Pod, pod: dict[str, Any]) -> dict[str, Any]:
    """POST an AdmissionReview as kube-apiserver does: TLS checked against the rendered caBundle,
    for the Service name the MutatingWebhookConfiguration names."""
    (webhook,) = one(admission.objects, "MutatingWebhookConfiguration")["webhooks"]
    ref = webhook["clientConfig"]["service"]
    ctx = ssl.create_default_context(cadata=base64.b64decode(webhook["clientConfig"]["caBundle"]).decode())
    url = f"https://127.0.0.1:{admission.port('webhook')}{ref['path']}"
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            url, json=review(pod), ssl=ctx, server_hostname=f"{ref['name']}.{ref['namespace']}.svc"
        ) as resp,
    ):
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    response = body["response"]
    assert response["allowed"] is True, response
    patch = json.loads(base64.b64decode(response["patch"]))
    admitted: dict[str, Any] = jsonpatch.apply_patch(pod, patch)
    assert names.GATE in [g["name"] for g in admitted["spec"]["schedulingGates"]]
    return admitted
