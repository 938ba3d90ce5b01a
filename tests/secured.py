"""A Tandem stack on a nats-server whose only users are the least-privilege ones that
``tandem nats-config`` generates, shared by the permission tests and the hostile-input suite.

The server's users come from the CLI itself (the file an operator would include), so the
tests cover the CLI, the rendered config and the permissions together. Every component
connects as its own user with ``nats://user:password@...``: inventory, allocator, one node
agent per node, the admission user playing the bridge's part on the bus, and the ``cli`` user.
:func:`connect_as` gives a test a node agent's credentials in someone else's hands.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import structlog.testing
import yaml
from nats.aio.client import Client as NATS

from schemas import codec, permissions, subjects
from services.allocator.service import Allocator
from services.client import TandemClient
from services.inventory.service import Inventory
from services.nodeagent.backends.simulated import SimulatedApplier, SimulatedBackend
from services.nodeagent.service import NodeAgent
from services.runtime.nats.bus import Bus, Delivery
from services.runtime.process.embedded import EmbeddedNats
from services.runtime.process.tasks import Supervisor
from services.topology import load_topology
from tests.conftest import make_settings
from tests.waiting import wait_until

NODES = ("gpu-a.example", "gpu-b.example")  # dots: node names are DNS subdomains
DENIED_TIMEOUT = 0.5  # a denied request is dropped by the server: it can only time out

Secured = tuple[EmbeddedNats, dict[str, str]]


@contextlib.contextmanager
def secured_server(directory: Path, *, nodes: tuple[str, ...] = NODES) -> Iterator[Secured]:
    """A nats-server whose only users are the ones ``tandem nats-config`` wrote."""
    conf, creds = directory / "auth.conf", directory / "credentials.yaml"
    args = ["nats-config", "--out", str(conf), "--credentials", str(creds), "--server", "nats://x:1"]
    args += [a for n in nodes for a in ("--node", n)]
    # As an operator runs it (a process of its own: the CLI sets up logging for its process).
    subprocess.run([sys.executable, "-m", "tools.cli.main", *args], check=True, timeout=60)
    assert conf.stat().st_mode & 0o077 == 0 and creds.stat().st_mode & 0o077 == 0
    passwords = {u: e["password"] for u, e in yaml.safe_load(creds.read_text()).items()}
    with EmbeddedNats(config_file=str(conf)) as server:
        yield server, passwords


def url(secured: Secured, user: str) -> str:
    server, passwords = secured
    return f"nats://{user}:{passwords[user]}@127.0.0.1:{server.port}"


def server_violations(server: EmbeddedNats) -> list[str]:
    lines = server.log_lines
    assert len(lines) < 200, "server log beyond what EmbeddedNats keeps: violations could hide"
    return [ln for ln in lines if "Violation" in ln]


@dataclass
class Stack:
    inventory: Inventory
    allocator: Allocator
    agents: dict[str, NodeAgent]
    appliers: dict[str, SimulatedApplier]
    admission: Bus
    client: TandemClient
    outcomes: list[tuple[str, object]] = field(default_factory=list)
    buses: list[Bus] = field(default_factory=list)
    tasks: Supervisor = field(default_factory=lambda: Supervisor("test-bridge"))

    async def close(self) -> None:
        await self.tasks.aclose()
        await self.client.close()
        for agent in self.agents.values():
            await agent.stop()
        await self.allocator.stop()
        await self.inventory.stop()
        for b in self.buses:
            await b.close()


# How a component connects: its NATS URL and extra settings, given its user name.
Credentials = Callable[[str], tuple[str, dict[str, Any]]]


def password_credentials(secured: Secured) -> Credentials:
    return lambda user: (url(secured, user), {})


async def start_stack(
    secured: Secured | Credentials,
    *,
    nodes: tuple[str, ...] = NODES,
    lost_after: float = 5.0,
    allocator_options: dict[str, Any] | None = None,
) -> Stack:
    """The whole system, each component as its own user: ``secured`` is a server with the
    generated users, or a function giving each user's URL and settings (tokens, TLS)."""
    buses: list[Bus] = []
    credentials = secured if callable(secured) else password_credentials(secured)

    async def bus(service: str, user: str, *, provision: bool, **kw: Any) -> Bus:
        nats_url, extra = credentials(user)
        settings = make_settings(nats_url, service, heartbeat_interval=0.2, **extra, **kw)
        b = await Bus.open(settings, provision_streams=provision)
        buses.append(b)
        return b

    inventory = Inventory(await bus("inventory", "inventory", provision=True), lost_after=lost_after)
    await inventory.start()
    allocator = Allocator(
        await bus("allocator", "allocator", provision=True),
        instance="allocator-0",
        retry_interval=0.3,
        **(allocator_options or {}),
    )
    await allocator.start()
    agents, appliers = {}, {}
    topology = load_topology("pcie-4gpu-2nic")
    for node in nodes:
        user = permissions.user_name("nodeagent", node)
        appliers[node] = SimulatedApplier()
        agents[node] = NodeAgent(
            await bus("nodeagent", user, provision=False, node_name=node),
            node=node,
            backend=SimulatedBackend(topology, node=node),
            applier=appliers[node],
            heartbeat_interval=0.2,
        )
        await agents[node].start()
    admission = await bus("admission", "admission", provision=True)
    client = await TandemClient(await bus("cli", "cli", provision=False)).start()
    s = Stack(inventory, allocator, agents, appliers, admission, client, buses=buses)

    # The bridge's two durables, as services.admission.bridge runs them.
    async def outcome(event: object, d: Delivery) -> None:
        s.outcomes.append((d.subject, event))

    for durable, subject in (
        (subjects.CONSUMER_BRIDGE, subjects.ALLOC_ASSIGNED_ALL),
        (subjects.CONSUMER_BRIDGE_FAILED, subjects.ALLOC_FAILED),
    ):
        s.tasks.spawn(
            durable,
            lambda d=durable, f=subject: admission.consume(  # type: ignore[misc]
                stream=subjects.ALLOC_STREAM,
                durable=d,
                filter_subject=f,
                decoder=codec.ALLOC_EVENT,
                handler=outcome,
            ),
        )
    await wait_until(
        lambda: all(n in allocator.nodes and allocator.nodes[n].status == "ready" for n in nodes),
        what="every node ready in the allocator's view",
    )
    return s


@contextlib.contextmanager
def client_errors() -> Iterator[list[str]]:
    """What the services' NATS error callbacks reported (Bus.connect logs ``nats_error``)."""
    with structlog.testing.capture_logs() as logs:
        errors: list[str] = []
        yield errors
        errors += [str(e.get("error")) for e in logs if e.get("event") in ("nats_error", "task_failed")]


@dataclass
class Intruder:
    """A node's credentials in someone else's hands: a raw client that records its errors."""

    nc: NATS
    errors: list[str]

    async def violations(self, expected: int) -> list[str]:
        # The server's -ERR arrives asynchronously.
        await wait_until(lambda: len(self.errors) >= expected, timeout=2, what=f"{expected} server errors")
        # nats-py lower-cases the server's error text, subjects included.
        return [e.lower() for e in self.errors if "permissions violation" in e.lower()]


async def connect_as(secured: Secured, node: str) -> Intruder:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    user = permissions.user_name("nodeagent", node)
    nc = await nats.connect(
        url(secured, user), inbox_prefix=permissions.inbox_prefix(user), error_cb=on_error
    )
    return Intruder(nc, errors)


async def connect_user(secured: Secured, user: str) -> NATS:
    """A raw client as one of the generated service users (e.g. ``admission``)."""
    return await nats.connect(url(secured, user), inbox_prefix=permissions.inbox_prefix(user))
