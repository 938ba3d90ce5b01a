"""The main of a harness helper process that answers commands on its stdin: the snapshot
checker (:mod:`tools.loadtest.checker`) and the ledger (:mod:`tools.loadtest.ledgerwatch`).

Each reads its settings (``--config``, the environment), logs like a service, and runs its
``serve(settings, stdin)`` until stdin closes; a bad settings file is one line and exit 2.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence

from services.runtime.observe.logging import setup_logging
from services.runtime.process.lifecycle import run_loop, settings_from_argv
from services.runtime.settings import Settings

__all__ = ["child_main"]

Serve = Callable[[Settings, asyncio.StreamReader], Awaitable[None]]


async def _stdin() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


def child_main(
    module: str,
    service: str,
    serve: Serve,
    argv: Sequence[str] | None,
    *,
    before: Callable[[], None] = lambda: None,
) -> int:
    """Run ``serve`` as ``python -m tools.loadtest.<module>`` (settings service name
    ``service``); ``before``: what to do once logging is set up (e.g. lower the priority)."""
    settings = settings_from_argv(f"python -m tools.loadtest.{module}", service, argv)
    if settings is None:
        return 2
    setup_logging(level=settings.log_level, json=settings.log_json, service=settings.service)
    before()

    async def child() -> None:
        await serve(settings, await _stdin())

    run_loop(child())
    return 0
