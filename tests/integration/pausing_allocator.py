"""An allocator replica that stops half-way through a job commit, for a crash test.

``python -m tests.integration.pausing_allocator --config FILE`` runs the ordinary allocator
(``services.allocator``) with one fault installed from outside: the prepare step of a job
commit (:meth:`services.allocator.jobplacement.Jobs.prepare`) writes the first node's pods, then
waits ``PAUSE_S`` before the other nodes', so the test can SIGKILL the replica with the job
half-prepared (tests/integration/test_job_commit.py).
"""

from __future__ import annotations

import asyncio
import sys

from schemas.messages import AllocRecord
from services.allocator.__main__ import build
from services.allocator.jobplacement import Jobs
from services.runtime.observe.logging import get_logger
from services.runtime.process.lifecycle import service_main

log = get_logger(__name__)

PAUSE_S = 120.0

_prepare = Jobs.prepare


async def _paused_prepare(self: Jobs, by_node: dict[str, dict[str, AllocRecord]]) -> None:
    items = list(by_node.items())
    if len(items) > 1:
        await _prepare(self, dict(items[:1]))
        log.warning("fault_job_prepare_pause", node=items[0][0], seconds=PAUSE_S)
        await asyncio.sleep(PAUSE_S)
        items = items[1:]
    await _prepare(self, dict(items))


if __name__ == "__main__":
    Jobs.prepare = _paused_prepare  # type: ignore[method-assign]
    sys.exit(service_main("allocator", build))
