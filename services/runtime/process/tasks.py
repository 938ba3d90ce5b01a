"""Guarded background tasks: no bare ``create_task``; a crashed task is logged, never lost.

A :class:`TaskGroup`-like supervisor: ``spawn(name, coro_fn)`` runs the coroutine and, if it
raises, logs the error and restarts it after a back-off (``restart=True``) or records it so
``wait()`` re-raises (``restart=False``). ``aclose()`` cancels everything and waits.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from services.runtime.observe.logging import get_logger

log = get_logger(__name__)


class Supervisor:
    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed: asyncio.Future[BaseException] | None = None

    def spawn(
        self,
        name: str,
        fn: Callable[[], Awaitable[Any]],
        *,
        restart: bool = True,
        backoff: float = 0.5,
    ) -> asyncio.Task[None]:
        async def guarded() -> None:
            delay = backoff
            while True:
                try:
                    await fn()
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    current = asyncio.current_task()
                    if current is not None and current.cancelling():
                        # A library turned our cancellation into its own error: stop anyway.
                        raise asyncio.CancelledError from exc
                    log.error("task_failed", task=name, owner=self.name, error=repr(exc), exc_info=True)
                    if not restart:
                        if self._failed is not None and not self._failed.done():
                            self._failed.set_result(exc)
                        return
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 10.0)

        task = asyncio.get_running_loop().create_task(guarded(), name=f"{self.name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait_failure(self) -> BaseException:
        """Block until a non-restarting task fails; return its exception."""
        if self._failed is None:
            self._failed = asyncio.get_running_loop().create_future()
        return await self._failed

    async def aclose(self, *, timeout: float = 5.0) -> None:
        """Cancel every task and wait (bounded) for them to finish their cleanup."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if not tasks:
            return
        _, stuck = await asyncio.wait(tasks, timeout=timeout)
        for t in stuck:
            frames = [f"{f.f_code.co_filename}:{f.f_lineno}" for f in t.get_stack()]
            # Not ``stack``: structlog's console renderer takes that key for a formatted
            # traceback string and raised on a list, which made a slow stop a crash.
            log.error("task_did_not_stop", task=t.get_name(), frames=frames)


class Service(abc.ABC):
    """Base of the long-running services: ``start`` spawns, ``stop`` tears down, ``run`` is
    start → wait for the stop signal → stop (what ``python -m services.<x>`` calls)."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()
