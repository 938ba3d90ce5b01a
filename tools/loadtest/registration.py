"""What the load harness and the chaos runner read off the running system besides the load:
when every simulated node is registered, how many requests to keep in flight, which requests
were lost. Shared by both (``tools.loadtest.harness``, ``tools.chaos.runner``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import nats
from nats.js import JetStreamContext

from schemas import subjects
from tools.loadtest.driver import Req
from tools.loadtest.errors import LoadtestError
from tools.loadtest.mix import Workload


async def wait_registered(
    js: JetStreamContext,
    names: list[str],
    *,
    deadline: float,
    alive: Callable[[], None],
    why: str = "in time",
) -> None:
    """Until every node of ``names`` has a record in KV ``tandem-nodes`` (written by the
    inventory); ``deadline`` on the loop's clock; ``alive`` raises when a child died."""
    loop = asyncio.get_running_loop()
    wanted = set(names)
    seen: set[str] = set()
    kv = await js.key_value(subjects.KV_NODES)
    watcher = await kv.watchall(meta_only=True, ignore_deletes=True)
    try:
        while not wanted <= seen:
            if loop.time() > deadline:
                got = len(seen & wanted)
                raise LoadtestError(f"only {got} of {len(wanted)} nodes registered {why}")
            alive()
            try:
                entry = await watcher.updates(timeout=0.5)  # type: ignore[no-untyped-call]
            except nats.errors.TimeoutError:
                continue
            if entry is not None and entry.operation is None:
                seen.add(entry.key)
    finally:
        await watcher.stop()  # type: ignore[no-untyped-call]


def auto_in_flight(fleet_gpus: int, workload: Workload) -> int:
    """The open loop's default bound: requests worth 5 % of the fleet's GPUs (8 to 1024), so
    the queue does not empty a fleet kept at its target (see tools.loadtest.driver)."""
    return max(8, min(1024, round(0.05 * fleet_gpus / workload.mean_gpus())))


def lost_requests(reqs: Mapping[str, Req], placed: Mapping[str, str]) -> list[str]:
    """Requests the system lost, each with how (``placed``: request id -> the node whose
    record holds it at the end): a release that never completed, a request never answered
    and not placed, an assigned request never released that no node holds."""
    lost: list[str] = []
    for rid, r in reqs.items():
        held_now = rid in placed
        if r.released is not None:
            if r.freed is None and held_now:  # the release never completed
                lost.append(f"{rid} (released, still on {placed[rid]})")
        elif r.first is None and not held_now:  # never answered, not placed either
            lost.append(f"{rid} (no answer)")
        elif r.assigned is not None and not held_now:  # assigned, never released, gone
            lost.append(f"{rid} (assigned to {r.node}, held by no node)")
    return lost
