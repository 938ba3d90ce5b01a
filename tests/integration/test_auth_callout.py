"""Per-component and per-node NATS identities through auth callout, on a real nats-server.

The server is configured as ``schemas.permissions.callout_block`` writes it: every connection
goes to Tandem's callout (``services.authcallout``), which asks a TokenReview endpoint who the
token is and answers with a user JWT carrying that role's permissions. The TokenReview endpoint
is the one boundary faked (no kube-apiserver here): an aiohttp server answering
``POST /apis/authentication.k8s.io/v1/tokenreviews`` with the API's own JSON, as a 1.30+ API
server does for pod-bound service-account tokens (``extra`` names the pod and its node).

The whole flow runs with tokens only; a node agent's token gives it its own node's subjects
and nothing else; unknown tokens, other service accounts and unbound tokens are refused with
the reason.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import nats.errors
import pytest

from schemas import permissions, subjects
from schemas.messages import Assignment, Freed
from services.authcallout import natsjwt
from services.authcallout.service import AuthCallout, Denied, Reviewer
from services.kube.client import KubeClient
from services.runtime.nats.bus import Bus, ConnectError
from services.runtime.process.embedded import EmbeddedNats
from tests.conftest import make_settings
from tests.kube_tokens import TokenReviews, token_review_server
from tests.secured import NODES, Stack, start_stack
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

NAMESPACE = "tandem"
AUDIENCE = "tandem-nats"


@pytest.fixture(scope="module")
async def apiserver() -> AsyncIterator[tuple[TokenReviews, str]]:
    reviews = TokenReviews(namespace=NAMESPACE, audience=AUDIENCE)
    async with token_review_server(reviews) as url:
        yield reviews, url


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedNats, bytes, str]]:
    """A nats-server configured by ``tandem nats-config --auth-callout``, as an operator runs it."""
    d = tmp_path_factory.mktemp("nats-callout")
    cmd = [sys.executable, "-m", "tools.cli.main", "nats-config", "--auth-callout", str(d)]
    subprocess.run(cmd, check=True, timeout=60)
    assert all((d / f).stat().st_mode & 0o077 == 0 for f in ("server.conf", "issuer.nk", "auth.nk"))
    with EmbeddedNats(config_file=str(d / "server.conf")) as s:
        yield s, (d / "issuer.nk").read_bytes(), str(d / "auth.nk")


@pytest.fixture(scope="module")
async def callout(
    server: tuple[EmbeddedNats, bytes, str], apiserver: tuple[TokenReviews, str]
) -> AsyncIterator[AuthCallout]:
    nats_server, seed, auth_seed_file = server
    nc = await nats.connect(f"nats://127.0.0.1:{nats_server.port}", nkeys_seed=auth_seed_file)
    reviewer = Reviewer(
        KubeClient.for_host(apiserver[1]),
        namespace=NAMESPACE,
        identities=make_settings("nats://x", "authcallout").auth_identities,
        audiences=[AUDIENCE],
    )
    service = AuthCallout(nc, issuer=natsjwt.keypair(seed), account="TANDEM", reviewer=reviewer)
    await service.start()
    yield service
    await service.stop()
    await nc.close()


def token_file(directory: Path, token: str) -> str:
    path = directory / secrets.token_hex(4)
    path.write_text(token + "\n")
    return str(path)


@pytest.fixture(scope="module")
async def stack(
    server: tuple[EmbeddedNats, bytes, str],
    apiserver: tuple[TokenReviews, str],
    callout: AuthCallout,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Stack]:
    reviews, _ = apiserver
    d = tmp_path_factory.mktemp("tokens")
    accounts = {r: f"tandem-{r}" for r in ("allocator", "inventory", "admission", "cli")}
    files = {user: token_file(d, reviews.issue(account)) for user, account in accounts.items()}
    for node in NODES:
        token = reviews.issue("tandem-nodeagent", node=node, pod=f"tandem-nodeagent-{node}")
        files[permissions.user_name("nodeagent", node)] = token_file(d, token)
    url = f"nats://127.0.0.1:{server[0].port}"
    s = await start_stack(lambda user: (url, {"nats_token_file": files[user]}))
    yield s
    await s.close()


async def test_the_whole_flow_runs_on_service_account_tokens(
    stack: Stack, apiserver: tuple[TokenReviews, str]
) -> None:
    from tests.chaos.test_hostile_input import request

    req = request(gpus=2)
    await stack.client.submit(req)
    assigned = await stack.client.wait_for(req.request_id)
    assert isinstance(assigned, Assignment)
    await wait_until(lambda: req.request_id in stack.appliers[assigned.node].applied, what="the apply")
    await stack.client.release(req.request_id)
    freed = await stack.client.wait_for(req.request_id, (Freed,))
    assert isinstance(freed, Freed) and freed.node == assigned.node
    reviewed = [r["spec"]["audiences"] for r in apiserver[0].reviews]
    assert len(reviewed) >= 4 + len(
        NODES
    )  # inventory, allocator, admission, cli, agents and all(a == [AUDIENCE] for a in reviewed)


async def test_a_node_agents_token_gives_it_its_own_node_only(
    stack: Stack, server: tuple[EmbeddedNats, bytes, str], apiserver: tuple[TokenReviews, str]
) -> None:
    a, b = NODES
    token = apiserver[0].issue("tandem-nodeagent", node=a, pod=f"tandem-nodeagent-{a}")
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    user = permissions.user_name("nodeagent", a)
    nc = await nats.connect(
        f"nats://127.0.0.1:{server[0].port}",
        token=token,
        inbox_prefix=permissions.inbox_prefix(user),
        error_cb=on_error,
    )
    try:
        await nc.publish(subjects.node_heartbeat(b), b"forged")
        await nc.publish(subjects.node_heartbeat(a), b"own")
        await nc.subscribe(subjects.node_allocs(b))
        await nc.flush()
        await wait_until(lambda: len(errors) >= 2, timeout=5, what="the server's two -ERR")
    finally:
        await nc.close()
    violations = [e for e in errors if "permissions violation" in e]
    assert len(violations) == 2, errors
    assert any(subjects.node_heartbeat(b).lower() in v and "publish" in v for v in violations)
    assert any(subjects.node_allocs(b).lower() in v and "subscription" in v for v in violations)
    assert not any(subjects.node_heartbeat(a).lower() in v for v in violations)


@pytest.mark.parametrize(
    ("account", "why"),
    [
        (None, "token not accepted"),
        ("default", "has no Tandem role"),
        ("tandem-nodeagent", "bound to its pod"),  # a token not bound to a pod on a node
    ],
)
async def test_tokens_that_prove_no_tandem_identity_are_refused(
    callout: AuthCallout,
    server: tuple[EmbeddedNats, bytes, str],
    apiserver: tuple[TokenReviews, str],
    tmp_path: Path,
    account: str | None,
    why: str,
) -> None:
    token = apiserver[0].issue(account) if account else "not-a-token"
    settings = make_settings(
        f"nats://127.0.0.1:{server[0].port}",
        "nodeagent",
        nats_token_file=token_file(tmp_path, token),
        node_name=NODES[0],
    )
    with pytest.raises(ConnectError, match="not authorized"):
        await Bus.open(settings, provision_streams=False)
    with pytest.raises(Denied, match=why):  # the reason the callout gave the server
        await callout.reviewer.identify(token)
