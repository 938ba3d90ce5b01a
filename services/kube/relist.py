"""List, then watch from the list's version, and do it again whenever the watch ends.

The loop every cache of Kubernetes objects in Tandem runs (the DeviceClaim and the DRA
ResourceClaim halves of the bridge): each round reads what the caller needs first
(``listed``: its own state and the list, in that order), hands the whole list over for a
resync, sets ``synced``, then feeds every watch event to ``on_event`` until the watch ends or
fails. A resource the API server does not serve (404: no CRD, no DRA) is looked for again every
30 s with ``synced`` set, so nothing waiting on it is held up; any other API error starts the
next round after ``backoff`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from services.kube.errors import KubeError, NotFound
from services.runtime.observe.logging import get_logger

log = get_logger(__name__)

Obj = dict[str, Any]
ABSENT_BACKOFF_S = 30.0


async def list_then_watch(
    stop: asyncio.Event,
    *,
    listed: Callable[[], Awaitable[tuple[list[Obj], str]]],
    resync: Callable[[list[Obj]], Awaitable[None]],
    watch: Callable[[str], AsyncIterator[tuple[str, Obj]]],
    on_event: Callable[[str, Obj], Awaitable[None]],
    synced: asyncio.Event,
    backoff: float,
    name: str,
    absent_hint: str,
) -> None:
    """Run until ``stop``; ``name`` prefixes the log events (``<name>s_off``,
    ``<name>_watch_restart``), ``absent_hint`` says what a 404 means."""
    while not stop.is_set():
        wait = backoff
        try:
            items, version = await listed()
            await resync(items)
            synced.set()
            async for kind, obj in watch(version):
                await on_event(kind, obj)
        except NotFound as exc:
            log.warning(f"{name}s_off", error=str(exc), hint=absent_hint)
            synced.set()
            wait = ABSENT_BACKOFF_S
        except KubeError as exc:
            log.warning(f"{name}_watch_restart", error=str(exc))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), wait)
