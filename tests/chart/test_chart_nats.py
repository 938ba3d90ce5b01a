"""The chart's secure default, run: the bundled NATS exactly as rendered (two servers, TLS for
clients and routes, the accounts and auth callout block the install hook makes) on real
nats-servers, the auth callout with the settings the chart gives it, and every component
connecting as the chart connects it: over ``tls://`` with the rendered CA, with a token of the
service account its pod runs as.

What is not the cluster's: the files are written to a temp dir instead of mounted (paths in the
config are rewritten from the mount paths, nothing else), servers listen on free local ports
and route to each other as ``localhost`` (a name the chart's certificate carries, for
``kubectl port-forward``), and the TokenReview API is a small fake answering as a 1.30+ API
server does for pod-bound tokens (tests/integration/test_auth_callout.py has the same).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest

from schemas import permissions
from schemas.messages import Assignment, Freed
from services.authcallout import natsjwt
from services.authcallout.service import AuthCallout, Reviewer
from services.kube.client import KubeClient
from services.runtime.nats.bus import Bus, ConnectError
from services.runtime.process.embedded import free_ports
from services.runtime.settings import Settings, load_settings
from tests.chart.test_chart import NAMESPACE, RELEASE, component, one, render, workloads
from tests.conftest import make_settings
from tests.kube_tokens import TokenReviews, token_review_server
from tests.secured import NODES, Stack, start_stack
from tests.waiting import wait_until, wait_until_sync

pytestmark = pytest.mark.integration

NATS_BIN = Path(sys.executable).parent / "nats-server"
SERVERS = 2  # enough for routes; the default is 3



@dataclass
class Rendered:
    docs: list[dict[str, Any]]
    root: Path  # where the mounted files are

    def settings(self, comp: str, **env: str) -> Settings:
        """A component's settings as its container loads them: the rendered config file and
        its rendered environment, mount paths mapped into ``root``."""
        (w,) = [w for w in workloads(self.docs) if component(w) == comp]
        container = w["spec"]["template"]["spec"]["containers"][0]
        rendered = {
            e["name"]: self.local(e["value"]) for e in container["env"] if e["name"].startswith("TANDEM_")
        }
        rendered.pop("TANDEM_CONFIG")
        rendered.pop("TANDEM_INSTANCE", None)
        config = self.root / "tandem.yaml"
        text = one(self.docs, "ConfigMap", f"{RELEASE}-config")["data"]["tandem.yaml"]
        config.write_text(self.local(text))
        return load_settings(comp, config=config, environ={**rendered, **env})

    def local(self, text: str) -> str:
        for mount in ("/etc/tandem/nats-ca", "/etc/tandem/nats-auth", "/var/run/secrets/tandem.io/nats"):
            text = text.replace(mount, str(self.root / mount.lstrip("/")))
        return text


def secret_files(docs: list[dict[str, Any]], name: str) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in one(docs, "Secret", name)["data"].items()}


def write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    root = tmp_path_factory.mktemp("mounts")
    docs = render({"nats": {"replicas": SERVERS}})
    # The install hook's command, as the Job runs it (without --secret: files are enough here).
    hook = [sys.executable, "-m", "tools.cli.main", "nats-config", "--auth-callout", str(root / "hook")]
    subprocess.run(hook, check=True, timeout=60)
    write(root / "etc/tandem/nats-ca/ca.crt", secret_files(docs, f"{RELEASE}-nats-tls")["ca.crt"])
    for key in ("issuer.nk", "auth.nk"):
        write(root / "etc/tandem/nats-auth" / key, (root / "hook" / key).read_bytes())
    return Rendered(docs, root)


@pytest.fixture(scope="module")
def cluster(rendered: Rendered) -> Iterator[list[tuple[int, int]]]:
    """The StatefulSet's servers: (client port, monitoring port) each."""
    docs, root = rendered.docs, rendered.root
    sts = one(docs, "StatefulSet")
    name = sts["metadata"]["name"]
    conf = one(docs, "ConfigMap", f"{name}-config")["data"]["nats.conf"]
    tls = root / "etc/nats-tls"
    for key, data in secret_files(docs, f"{RELEASE}-nats-tls").items():
        write(tls / key, data)
    # All at once: ports picked one by one (bound, released, picked again) can repeat, and a
    # route port that is another server's client port kept the cluster from forming.
    flat = free_ports(3 * SERVERS)
    ports = [(flat[3 * i], flat[3 * i + 1], flat[3 * i + 2]) for i in range(SERVERS)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, (client, route, monitor) in enumerate(ports):
            d = root / f"{name}-{i}"
            # The projected config volume: nats.conf next to the hook Secret's server.conf.
            write(d / "etc/nats/auth.conf", (root / "hook" / "server.conf").read_bytes())
            text = (
                conf.replace("/etc/nats-tls", str(tls))
                .replace("0.0.0.0:4222", f"127.0.0.1:{client}")
                .replace("0.0.0.0:6222", f"127.0.0.1:{route}")
                .replace("0.0.0.0:8222", f"127.0.0.1:{monitor}")
                .replace("/data/jetstream", str(d / "data"))
                .replace("/tmp/nats.pid", str(d / "nats.pid"))
            )
            text = re.sub(
                rf"nats://{name}-(\d+)\.[^\s]+:6222",
                lambda m: f"nats://localhost:{ports[int(m[1])][1]}",
                text,
            )
            write(d / "etc/nats/nats.conf", text)
            log = (d / "log").open("wb")
            procs.append(
                subprocess.Popen(
                    [str(NATS_BIN), "--config", str(d / "etc/nats/nats.conf")],
                    env={**os.environ, "POD_NAME": f"{name}-{i}"},
                    stderr=log,
                    stdout=log,
                )
            )
        wait_until_sync(
            lambda: all(healthy(monitor) for _, _, monitor in ports),
            timeout=30,
            what="every server healthy",
            poll=0.2,
            details=lambda: [(root / f"{name}-{i}/log").read_text() for i in range(SERVERS)],
        )
        yield [(c, m) for c, _, m in ports]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=20)


def healthy(monitor: int) -> bool:
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true", timeout=2
        ) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
async def apiserver(rendered: Rendered) -> AsyncIterator[tuple[TokenReviews, str]]:
    reviews = TokenReviews(namespace=NAMESPACE, audience=rendered.settings("authcallout").auth_audience)
    async with token_review_server(reviews) as url:
        yield reviews, url


def urls(cluster: list[tuple[int, int]]) -> str:
    return ",".join(f"tls://localhost:{client}" for client, _ in cluster)


@pytest.fixture(scope="module")
async def callout(
    rendered: Rendered, cluster: list[tuple[int, int]], apiserver: tuple[TokenReviews, str]
) -> AsyncIterator[AuthCallout]:
    # The Deployment's settings: the AUTH user's seed, the issuer seed, the CA.
    settings = rendered.settings("authcallout", TANDEM_NATS_URL=urls(cluster))
    assert settings.nats_nkey_seed and settings.nats_tls_ca and settings.auth_issuer_seed_file
    bus = await Bus.open(settings, provision_streams=False)
    reviewer = Reviewer(
        KubeClient.for_host(apiserver[1]),
        namespace=settings.auth_namespace,
        identities=settings.auth_identities,
        audiences=[settings.auth_audience],
    )
    seed = await asyncio.to_thread(Path(settings.auth_issuer_seed_file).read_bytes)
    service = AuthCallout(
        bus.nc, issuer=natsjwt.keypair(seed), account=settings.auth_account, reviewer=reviewer
    )
    await service.start()
    yield service
    await service.stop()
    await bus.close()


async def test_every_component_runs_over_tls_with_its_service_account_token(
    rendered: Rendered,
    cluster: list[tuple[int, int]],
    apiserver: tuple[TokenReviews, str],
    callout: AuthCallout,
    tmp_path: Path,
) -> None:
    reviews, _ = apiserver
    accounts = {
        comp: w["spec"]["template"]["spec"]["serviceAccountName"]
        for w in workloads(rendered.docs)
        if (comp := component(w)) in ("allocator", "inventory", "admission", "nodeagent")
    }
    accounts["cli"] = next(
        sa for sa, role in rendered.settings("authcallout").auth_identities.items() if role == "cli"
    )
    ca = rendered.settings("allocator").nats_tls_ca

    def credentials(user: str) -> tuple[str, dict[str, Any]]:
        node = next((n for n in NODES if permissions.user_name("nodeagent", n) == user), None)
        token = reviews.issue(accounts["nodeagent" if node else user], node=node)
        path = tmp_path / f"{user}.token"
        path.write_text(token)
        return urls(cluster), {"nats_token_file": str(path), "nats_tls_ca": ca}

    stack: Stack = await start_stack(credentials)
    try:
        from tests.chaos.test_hostile_input import request

        req = request(gpus=2)
        await stack.client.submit(req)
        assigned = await stack.client.wait_for(req.request_id)
        assert isinstance(assigned, Assignment) and assigned.node in NODES
        await wait_until(lambda: req.request_id in stack.appliers[assigned.node].applied, what="the apply")
        await stack.client.release(req.request_id)
        freed = await stack.client.wait_for(req.request_id, (Freed,))
        assert isinstance(freed, Freed) and freed.node == assigned.node
    finally:
        await stack.close()


def test_servers_require_tls_of_clients_and_routes(cluster: list[tuple[int, int]]) -> None:
    for _, monitor in cluster:
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=2) as r:
            varz = json.load(r)
        assert varz["tls_required"] is True, varz
        assert varz["cluster"].get("tls_required") is True, varz["cluster"]
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/routez", timeout=2) as r:
            assert json.load(r)["num_routes"] >= 1  # routed to the other server, over TLS


async def test_connections_without_tls_or_token_are_refused(
    rendered: Rendered, cluster: list[tuple[int, int]], callout: AuthCallout, tmp_path: Path
) -> None:
    client, _ = cluster[0]
    # Plain TCP: the server wants TLS first; without the CA the certificate is not trusted.
    with pytest.raises(ssl.SSLCertVerificationError):
        await nats.connect(f"nats://127.0.0.1:{client}", allow_reconnect=False, connect_timeout=3)
    # TLS with the CA but a token the API server does not know.
    token = tmp_path / "token"
    token.write_text("not-a-service-account-token")
    settings = make_settings(
        f"tls://localhost:{client}",
        "nodeagent",
        nats_token_file=str(token),
        nats_tls_ca=rendered.settings("nodeagent").nats_tls_ca,
        node_name=NODES[0],
    )
    with pytest.raises(ConnectError, match="not authorized"):
        await Bus.open(settings, provision_streams=False)
