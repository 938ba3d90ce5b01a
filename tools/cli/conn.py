"""The CLI's NATS connection: what :class:`services.client.TandemClient` needs, and no more.

Why not :class:`services.runtime.nats.bus.Bus`: a service's bus loads structlog and the
OpenTelemetry SDK (most of a second of imports) and rides out a stream leader election by
retrying a publish, which is right for a service and wrong for a person at a prompt
(`tandem submit` against a NATS without Tandem's streams hung for the whole retry budget,
then printed a traceback; docs/benchmarks.md, "Measurements behind the code"). The CLI
connects once, does not reconnect, fails at once with a reason, and imports nats-py only when
a command needs it.
"""

from __future__ import annotations

import asyncio
import sys
import urllib.parse
from typing import TYPE_CHECKING, Any

import msgspec

from schemas import codec
from tools.cli.errors import CliError, CliFailure

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js.kv import KeyValue

    from services.runtime.settings import Settings

SCHEMES = ("nats", "tls", "ws", "wss")
CONNECT_TIMEOUT_S = 2.0
PUBLISH_TIMEOUT_S = 5.0


def server_list(url: str) -> list[str]:
    """The comma-separated URLs in ``url``, each checked (scheme, host, port 1-65535), so a
    typo is a usage error here rather than a traceback from deep inside nats-py."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise CliError(f"no NATS URL in {url!r}", hint="e.g. --nats nats://127.0.0.1:4222")
    for server in servers:
        full = server if "://" in server else f"nats://{server}"
        try:
            parts = urllib.parse.urlsplit(full)
            port = parts.port
        except ValueError as exc:
            raise CliError(f"bad NATS URL {server!r}: {exc}", hint="ports are 1-65535") from None
        if parts.scheme not in SCHEMES:
            raise CliError(f"bad NATS URL {server!r}: scheme must be one of {', '.join(SCHEMES)}")
        if not parts.hostname:
            raise CliError(f"bad NATS URL {server!r}: no host", hint="e.g. nats://127.0.0.1:4222")
        if port == 0:
            raise CliError(f"bad NATS URL {server!r}: port 0", hint="ports are 1-65535")
    return servers


def import_nats(servers: list[str]) -> None:
    """Import nats-py without aiohttp when no server is a websocket URL.

    nats-py imports aiohttp (most of a CLI call's budget: docs/benchmarks.md, "Measurements
    behind the code") only to offer its websocket transport; it falls back to none when the
    import fails. The CLI hides aiohttp for that one import when it will not speak websocket,
    and puts everything back after."""
    if "nats.aio.transport" in sys.modules or "aiohttp" in sys.modules:
        return
    if any(s.startswith(("ws://", "wss://")) for s in servers):
        return
    sys.modules["aiohttp"] = None  # type: ignore[assignment]  # makes `import aiohttp` fail
    try:
        import nats.aio.transport  # noqa: F401
    finally:
        del sys.modules["aiohttp"]


async def _ignore(*_: Any) -> None:
    """nats-py's default callbacks log to stderr; the CLI reports failures itself."""


class CliConnection:
    """A connection of the ``tandem`` CLI; see the module docstring."""

    def __init__(self, nc: Client, *, url: str) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.url = url
        self._kv: dict[str, KeyValue] = {}

    @classmethod
    async def open(cls, url: str, *, settings: Settings | None = None) -> CliConnection:
        """``settings``: credentials and TLS as the services take them (``nats_token_file``
        for ``kubectl create token tandem-cli --audience tandem-nats``, ``nats_tls_ca`` ...)."""
        servers = server_list(url)
        import_nats(servers)
        import nats

        opts: dict[str, Any] = {}
        user = urllib.parse.urlsplit(servers[0] if "://" in servers[0] else f"nats://{servers[0]}").username
        if settings is not None:
            from services.runtime.nats.auth import credentials, tls_context

            opts.update(credentials(settings))
            tls = tls_context(settings)
            if tls is not None:
                opts["tls"] = tls
            if settings.nats_token_file:
                user = "cli"  # the auth callout names the operator's token user after the role
            user = settings.nats_user or user
        if user:
            from schemas.permissions import inbox_prefix

            opts["inbox_prefix"] = inbox_prefix(user)  # the only inbox its NATS user may read
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        try:
            nc = await asyncio.wait_for(
                nats.connect(
                    servers=servers,
                    name="tandem-cli",
                    allow_reconnect=False,
                    # Each server is tried twice (0 would mean: for ever, on the first connect).
                    max_reconnect_attempts=1,
                    reconnect_time_wait=0.1,  # seconds
                    connect_timeout=CONNECT_TIMEOUT_S,  # seconds
                    error_cb=on_error,
                    disconnected_cb=_ignore,
                    closed_cb=_ignore,
                    **opts,
                ),
                timeout=2 * CONNECT_TIMEOUT_S * len(servers) + 1,
            )
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            shown = ",".join(_without_password(s) for s in servers)
            refused = errors and isinstance(exc, nats.errors.NoServersError)
            cause: BaseException = errors[-1] if refused else exc
            reason = f": {_reason(cause)}"
            if any(isinstance(e, nats.errors.AuthorizationError) for e in (exc, *errors)):
                raise CliFailure(f"NATS at {shown} refused the credentials", hint="check --nats") from None
            raise CliFailure(
                f"cannot reach NATS at {shown}{reason}",
                hint="is `tandem up` running? set --nats or $TANDEM_NATS_URL",
            ) from None
        return cls(nc, url=",".join(_without_password(s) for s in servers))

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.close()

    async def kv(self, bucket: str) -> KeyValue:
        if bucket not in self._kv:
            self._kv[bucket] = await self.js.key_value(bucket)
        return self._kv[bucket]

    async def publish(
        self,
        subject: str,
        message: msgspec.Struct,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """JetStream publish, waiting for the stream's ack (no retries: the user is waiting)."""
        hdrs = dict(headers or {})
        if "services.runtime.observe.tracing" in sys.modules:  # a command that traces (submit, release)
            hdrs = sys.modules["services.runtime.observe.tracing"].inject(hdrs)
        if msg_id:
            hdrs["Nats-Msg-Id"] = msg_id
        await self.js.publish(subject, codec.encode(message), headers=hdrs, timeout=PUBLISH_TIMEOUT_S)

    async def request(self, subject: str, message: msgspec.Struct, *, timeout: float = 2.0) -> Msg:
        return await self.nc.request(subject, codec.encode(message), timeout=timeout)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return "no answer (timed out)"
    text = str(exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)
    return " ".join(text.split()) or type(exc).__name__


def _without_password(url: str) -> str:
    parts = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
