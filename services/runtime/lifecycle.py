"""Process lifecycle: logging + tracing set up once, graceful shutdown on SIGTERM/SIGINT.

``run(service_main, settings)`` runs ``service_main(stop)`` where ``stop`` is an
:class:`asyncio.Event` set on SIGTERM or SIGINT; the service finishes in-flight work, closes
its consumers and returns. Tracing is flushed on the way out.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from services.runtime.logging import setup_logging
from services.runtime.settings import Settings
from services.runtime.tracing import setup_tracing, shutdown_tracing


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def run(main: Callable[[asyncio.Event], Awaitable[None]], settings: Settings) -> None:
    setup_logging(level=settings.log_level, json=settings.log_json, service=settings.service)
    setup_tracing(settings.service, otlp_endpoint=settings.otlp_endpoint)

    async def _runner() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        await main(stop)

    try:
        asyncio.run(_runner())
    finally:
        shutdown_tracing()
