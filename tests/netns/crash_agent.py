"""A node agent that dies (SIGKILL) at a named step: run as a subprocess by test_vf_crash.py.

argv: state-file  netns-dir  assignment-json  mode(apply|cleanup)  step
In ``cleanup`` mode the assignment is first applied in full, then cleanup dies at ``step``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import msgspec

from schemas.messages import Assignment
from services.nodeagent.netns import NamedNetnsResolver, VfApplier
from services.nodeagent.state import StateFile


async def main() -> None:
    state_path, netns_dir, raw, mode, step = sys.argv[1:6]
    assignment = msgspec.json.decode(raw, type=Assignment)
    armed = {"on": mode == "apply"}

    def checkpoint(name: str) -> None:
        if armed["on"] and name == step:
            os.kill(os.getpid(), signal.SIGKILL)

    applier = VfApplier(
        StateFile(state_path), resolver=NamedNetnsResolver(netns_dir, template="{uid}"), checkpoint=checkpoint
    )
    await applier.load()
    await applier.apply(assignment)
    if mode == "cleanup":
        armed["on"] = True
        await applier.cleanup(assignment)
    print("finished without crashing", flush=True)


asyncio.run(main())
