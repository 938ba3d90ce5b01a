"""Long-running commands (`tandem loadtest`, `tandem chaos`) under Ctrl-C and SIGTERM: the first
signal cancels the run, which then stops its processes gracefully; a second one kills them at
once. Imports nothing at load time (``tandem --help`` stays fast)."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Killable(Protocol):
    def kill_now(self) -> None: ...


async def until_interrupted(work: Coroutine[Any, Any, T], runner: Killable) -> T | None:
    """``work``'s result, or None when a signal interrupted it."""
    import asyncio
    import signal

    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    interrupted = False

    def on_signal() -> None:
        nonlocal interrupted
        if interrupted:  # a second Ctrl-C: do not wait for a graceful stop
            runner.kill_now()
            return
        interrupted = True
        task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        return await work
    except asyncio.CancelledError:
        if interrupted:
            return None
        raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
