"""Running a command against a Tandem system: the settings, one connection, the command, closed.

Every command that talks to a running system (:mod:`.stack_cmd` declares them) goes through
:func:`with_client`: its argument check runs first (input that is wrong whatever the system
says is refused before connecting), then it gets a :class:`~services.client.TandemClient` on
the CLI's own connection (:mod:`.conn`), and every library error it meets becomes one line
(:mod:`.errors`). A command that starts a request's trace (submit, release) calls
:func:`traced`; only those pay for OpenTelemetry's SDK. They export where the user says, else
where the running ``tandem up`` exports (:mod:`.localtraces`), from a thread of their own: a
collector that is down or does not answer costs the command at most :data:`CLI_FLUSH_S`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from services.client import ClientError, TandemClient
from tools.cli.conn import CliConnection
from tools.cli.errors import CliError, CliFailure, describe

if TYPE_CHECKING:
    from services.runtime.settings import Settings

# One export of a command's spans, retries included, in the background. Below the OTLP
# exporter's first backoff (0.8-1.2 s), so a refused connection is given up at once, not retried.
CLI_EXPORT_S = 0.5
# The most a command waits at its end for its spans still being exported (they are lost then),
# and for the collector to take a connection before its exporter is even made.
CLI_FLUSH_S = 0.25

Command = Callable[[TandemClient, argparse.Namespace], Awaitable[int]]
Check = Callable[[argparse.Namespace], None]


def cli_settings(
    service: str, *, config: str | None = None, defaults: dict[str, Any] | None = None, **overrides: Any
) -> Settings:
    """The settings of a command (``service`` names it in them), or one line naming where
    they came from when they are wrong."""
    from services.runtime.errors import SettingsError
    from services.runtime.settings import load_settings

    try:
        return load_settings(service, config=config, defaults=defaults, **overrides)
    except SettingsError as exc:
        where = "--config" if config else "$TANDEM_CONFIG"
        raise CliError(str(exc), hint=f"check {where} and the TANDEM_* variables") from None


async def with_client(args: argparse.Namespace, fn: Command, *, check: Check | None = None) -> int:
    """Check the arguments (``check``), connect, run ``fn``, close; the errors a command can
    meet become one line. Input that is wrong whatever the system says is refused before
    connecting."""
    if check is not None:
        check(args)
    settings = cli_settings("cli", nats_url=args.nats)
    conn = await CliConnection.open(settings.nats_url, settings=settings)
    args.settings = settings
    try:
        client = await TandemClient(conn).start()
        try:
            return await fn(client, args)
        finally:
            await client.close()
    except ClientError as exc:
        raise CliFailure(str(exc)) from None
    except (CliError, KeyboardInterrupt, BrokenPipeError, asyncio.CancelledError):
        raise
    except Exception as exc:
        known = describe(exc, nats_url=conn.url)
        if known is None:
            raise
        raise known from None
    finally:
        await conn.close()
        if "services.runtime.observe.tracing" in sys.modules:  # a command that traced (see traced)
            sys.modules["services.runtime.observe.tracing"].shutdown_tracing(timeout_s=CLI_FLUSH_S)


def traced(settings: Settings) -> None:
    """Set up tracing for a command that starts a request's trace (submit, release): its
    spans are exported to :func:`.localtraces.choose_endpoint`'s choice; without one the
    command makes no span of its own (the allocator's first starts the trace) and prints the
    trace id the allocator's answer carries. Only those commands pay for importing
    OpenTelemetry's SDK (docs/benchmarks.md, "Measurements behind the code")."""
    from services.runtime.observe.tracing import setup_command_tracing
    from tools.cli.localtraces import choose_endpoint, published_endpoint

    endpoint = choose_endpoint(
        settings.otlp_endpoint, published=lambda: published_endpoint(settings.nats_url)
    )
    if endpoint:
        setup_command_tracing(
            "cli", otlp_endpoint=endpoint, export_timeout=CLI_EXPORT_S, connect_timeout=CLI_FLUSH_S
        )
