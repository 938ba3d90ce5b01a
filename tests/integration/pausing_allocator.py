"""An allocator replica that stops half-way through a job commit, for a crash test.

``python -m tests.integration.pausing_allocator --config FILE`` runs the ordinary allocator
(``services.allocator``) with one fault installed from outside: the prepare step of a job
commit (:meth:`services.allocator.jobplacement.Jobs.prepare`) writes the first node's pods and
then never goes on to the other nodes': it holds until the test, having seen the first node
prepared, SIGKILLs the replica with the job half-prepared (tests/integration/test_job_commit.py).
The hold waits for that kill, not for a time, so it cannot run out on a slow machine.
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

_prepare = Jobs.prepare


async def _paused_prepare(self: Jobs, by_node: dict[str, dict[str, AllocRecord]]) -> None:
    if len(by_node) < 2:
        await _prepare(self, by_node)
        return
    first = next(iter(by_node))
    await _prepare(self, {first: by_node[first]})
    log.warning("fault_job_prepare_hold", node=first)
    await asyncio.Event().wait()  # never set: the test's SIGKILL ends the hold


if __name__ == "__main__":
    Jobs.prepare = _paused_prepare  # type: ignore[method-assign]
    sys.exit(service_main("allocator", build))
