"""Waiting in tests: for a condition, with a deadline — never for a fixed time.

``wait_until`` polls ``predicate`` (a plain function, or one returning an awaitable, for
conditions read over NATS) until it is true, and fails the test naming ``what`` when the
deadline passes. A fixed sleep either wastes time or, on a loaded machine, is too short.
:func:`wait_until_sync` is the same for code that runs outside an event loop (fixtures that
start processes)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

POLL_S = 0.02
T = TypeVar("T")


async def wait_until(
    predicate: Callable[[], object | Awaitable[object]],
    *,
    timeout: float = 10.0,
    what: str = "condition",
    poll: float = POLL_S,
) -> None:
    async def check() -> bool:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        return bool(result)

    async def loop() -> None:
        while not await check():
            await asyncio.sleep(poll)

    try:
        await asyncio.wait_for(loop(), timeout)
    except TimeoutError:
        pytest.fail(f"timed out after {timeout}s waiting for {what}")


def wait_until_sync(
    predicate: Callable[[], T],
    *,
    timeout: float = 10.0,
    what: str = "condition",
    poll: float = 0.1,
    details: Callable[[], object] | None = None,
) -> T:
    """:func:`wait_until` without an event loop; ``details`` adds to the failure message
    (e.g. the logs of the processes waited for). Returns what the predicate returned when it
    held (the pod, the record waited for)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            extra = f": {details()}" if details is not None else ""
            pytest.fail(f"timed out after {timeout}s waiting for {what}{extra}")
        time.sleep(poll)
    return value
