"""``tandem up``: an embedded nats-server, every service and simulated nodes in one process,
until Ctrl-C. The fleet (``--node TOPOLOGY[:COUNT[:PREFIX]]``) and the configuration
(``--config FILE`` or ``TANDEM_CONFIG``) are checked before anything starts, so a typo is one
line and exit 2, not a traceback from a half-started system.

It serves the device classes docs/sharing.md uses (``default``, ``shared``, ``shared-mps``:
:func:`tools.localstack.local_device_classes`) unless the configuration names others, and
says at start which ones. Without Kubernetes it also plays the pod bridge's evictions and
claims (:mod:`tools.localstack`), so preemption, DeviceClaims and reservations can be
tried with the CLI alone. When it exports traces (``--jaeger``, or
``OTEL_EXPORTER_OTLP_ENDPOINT``) it says where, and leaves a record of it for the CLI
(:mod:`tools.cli.localtraces`), so a command's spans join the system's unasked."""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from tools.cli import localtraces
from tools.cli.errors import CliError
from tools.cli.session import cli_settings

if TYPE_CHECKING:
    from schemas.config import DeviceClass
    from services.runtime.process.embedded import EmbeddedNats
    from services.runtime.process.jaeger import Jaeger
    from services.runtime.settings import Settings
    from tools.localstack import LocalStack

MAX_NODES = 10_000
# schemas.messages.NodeName: node names become subject tokens and KV keys.
NODE_NAME = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$")


def check_fleet(specs: list[str]) -> None:
    """Raise :class:`CliError` naming the first bad ``--node`` spec."""
    from services.topology import TopologyFileError, load_topology
    from tools.localstack import parse_fleet

    total = 0
    for spec in specs:
        parts = spec.split(":")
        if len(parts) > 3 or not parts[0]:
            raise CliError(
                f"--node {spec!r}: expected TOPOLOGY[:COUNT[:PREFIX]]", hint="e.g. --node dgx-h100:2:h100"
            )
        if len(parts) > 1 and parts[1]:
            if not parts[1].isdigit() or int(parts[1]) < 1:
                raise CliError(f"--node {spec!r}: COUNT must be a whole number >= 1, got {parts[1]!r}")
            total += int(parts[1])
        try:
            load_topology(parts[0])
        except TopologyFileError as exc:
            raise CliError(
                f"--node {spec!r}: {exc}", hint="`tandem topology list` names the built-in ones"
            ) from None
        except UnicodeDecodeError:
            raise CliError(
                f"--node {spec!r}: {parts[0]} is not a text file", hint="give a topology YAML/JSON file"
            ) from None
    if total > MAX_NODES:
        raise CliError(f"--node: {total} simulated nodes is more than {MAX_NODES}")
    for entry in parse_fleet(specs):
        name = f"{entry.prefix}-{max(entry.count - 1, 0)}"
        if not NODE_NAME.match(name) or len(name) > 253:
            raise CliError(
                f"--node: node names such as {name!r} are not valid Kubernetes node names",
                hint="give a PREFIX of lowercase letters, digits, '-' and '.'",
            )


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def check_port(port: int) -> None:
    """Refuse a NATS port something already listens on: moving to another one quietly would
    leave ``TANDEM_NATS_URL`` (and every command that follows it) pointed at the other system."""
    if port and not _port_free(port):
        raise CliError(
            f"--port {port}: 127.0.0.1:{port} is already in use (another `tandem up` or nats-server?); "
            "commands using that address would reach it, not this system",
            hint="stop it, or choose another port: --port N, or --port 0 for any free one",
        )


def run_up(args: argparse.Namespace) -> int:
    if args.node:
        check_fleet(args.node)
    check_port(args.port)
    return asyncio.run(_up(args))


async def _up(args: argparse.Namespace) -> int:
    import msgspec

    from services.runtime.observe.logging import setup_logging
    from services.runtime.observe.tracing import setup_tracing, shutdown_tracing
    from services.runtime.process.embedded import EmbeddedNats
    from services.runtime.process.jaeger import Jaeger
    from services.runtime.process.lifecycle import install_signal_handlers
    from tools.localstack import DEFAULT_FLEET, LocalStack, local_device_classes, parse_fleet

    fleet = parse_fleet(args.node) if args.node else list(DEFAULT_FLEET)
    # Everything that can be refused is checked before anything starts, so a refusal leaves
    # no process behind.
    documented = local_device_classes()
    settings = cli_settings(
        "tandem-up",
        config=args.config,
        defaults={"device_classes": msgspec.to_builtins(documented)},
        log_json=False,
    )
    jaeger_binary = _jaeger_binary(args.jaeger) if args.jaeger is not None else None
    jaeger: Jaeger | None = None
    server: EmbeddedNats | None = None
    stack: LocalStack | None = None
    record: Path | None = None  # where the CLI finds the OTLP endpoint (localtraces)
    try:
        if jaeger_binary is not None:
            jaeger = Jaeger(jaeger_binary).start()
            settings = msgspec.structs.replace(settings, otlp_endpoint=jaeger.otlp_endpoint)
        server = EmbeddedNats(port=args.port or None).start()
        settings = msgspec.structs.replace(settings, nats_url=server.url)
        setup_logging(level=settings.log_level, json=False)
        setup_tracing("tandem", otlp_endpoint=settings.otlp_endpoint)
        # No Kubernetes here: the stack evicts preemption victims itself (LocalEvictor) and
        # keeps the claims' records and reservations' deadlines (LocalClaims).
        stack = LocalStack(settings, fleet=fleet, allocators=args.allocators, evict=True, claims=True)
        await stack.start()
        await stack.wait_ready()
        ops = await stack.serve_ops(port=args.ops_port)
        ports = {name: ops_server.port for name, ops_server in ops.items()}
        record = localtraces.publish(server.url, settings.otlp_endpoint or None)
        _say_up(
            stack,
            settings,
            nats_url=server.url,
            documented=documented,
            ports=ports,
            jaeger=jaeger,
            told_cli=record is not None,
        )
        stop = asyncio.Event()
        install_signal_handlers(stop)
        await stop.wait()
    finally:
        localtraces.withdraw(record)  # first: a command from now on does not export to a Jaeger stopping
        if stack is not None:
            await stack.stop()
        shutdown_tracing()  # the last spans reach Jaeger before it stops
        if server is not None:
            server.stop()
        if jaeger is not None:
            jaeger.stop()
    return 0


def _say_up(
    stack: LocalStack,
    settings: Settings,
    *,
    nats_url: str,
    documented: Mapping[str, DeviceClass],
    ports: Mapping[str, int],
    jaeger: Jaeger | None,
    told_cli: bool,
) -> None:
    """What runs and where: NATS, the device classes served, each service's ops port, where
    the traces go (``told_cli``: the CLI learns it without a variable), and the commands to
    go on with."""
    from tools.localstack import describe_classes

    print(f"Tandem is up: {len(stack.agents)} simulated nodes; NATS at {nats_url}", flush=True)
    source = (
        "the classes of docs/sharing.md; TANDEM_CONFIG or --config FILE names others"
        if settings.device_classes == documented
        else "from the configuration"
    )
    print(f"  device classes: {describe_classes(settings.device_classes)}  ({source})", flush=True)
    for name, port in ports.items():
        print(f"  {name}: http://127.0.0.1:{port}/metrics  (/healthz, /readyz)", flush=True)
    if jaeger is not None:
        print(f"  Jaeger UI and query API: {jaeger.ui_url}  (traces of every service)", flush=True)
    if settings.otlp_endpoint:
        cli = (
            "`tandem submit` and `release` to this system export there too"
            if told_cli
            else f"for the CLI's spans: export OTEL_EXPORTER_OTLP_ENDPOINT={settings.otlp_endpoint}"
        )
        print(f"  traces: exported to {settings.otlp_endpoint} (OTLP/HTTP); {cli}", flush=True)
    else:
        print(
            "  traces: not exported (`tandem up --jaeger` starts a local Jaeger; "
            "or set OTEL_EXPORTER_OTLP_ENDPOINT)",
            flush=True,
        )
    print(
        f"  export TANDEM_NATS_URL={nats_url}; tandem status; tandem submit --gpus 4 --rdma 4",
        flush=True,
    )


def _jaeger_binary(explicit: str) -> str:
    from services.runtime.errors import EmbeddedServerError
    from services.runtime.process.jaeger import find_jaeger

    try:
        return find_jaeger(explicit or None)
    except EmbeddedServerError as exc:
        raise CliError(str(exc)) from None
