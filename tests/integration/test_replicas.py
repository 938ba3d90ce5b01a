"""Allocator replicas learn of each other over a real nats-server: a replica that starts knows
its peers within a round trip, not at their next heartbeats, so it never decides on every node
(and on the same fullest nodes as the others) for the first seconds of its life."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from services.allocator import replicas as replicas_mod
from services.allocator.core import Cluster
from services.allocator.readmodel import ReadModel
from services.allocator.replicas import Replicas
from services.runtime.process.tasks import Supervisor
from tests.conftest import BusFactory
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

Start = Callable[[str], Awaitable[Replicas]]


@contextlib.asynccontextmanager
async def _replicas(bus_factory: BusFactory, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Start]:
    """Replicas whose beats are an hour apart: each announces itself once, when it starts, so
    only the answer to a new replica's first beat can tell it about the others."""
    monkeypatch.setattr(replicas_mod, "MEMBER_INTERVAL_S", 3600.0)
    monkeypatch.setattr(replicas_mod, "MEMBER_LOST_S", 7200.0)
    tasks = Supervisor("test-replicas")
    started: list[Replicas] = []

    async def start(name: str) -> Replicas:
        replica = Replicas(await bus_factory(name), instance=name, model=ReadModel(Cluster()))
        await replica.start(tasks)
        started.append(replica)
        return replica

    try:
        yield start
    finally:
        for replica in started:
            await replica.stop()
        await tasks.aclose()


async def test_a_replica_that_starts_splits_the_nodes_with_its_peers_at_once(
    bus_factory: BusFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _replicas(bus_factory, monkeypatch) as start:
        started: list[Replicas] = []
        for name in ("allocator-b", "allocator-a", "allocator-c"):
            started.append(await start(name))
            await wait_until(lambda: all(r.model.shards == len(started) for r in started), timeout=5)
        # Sorted by name: a, b, c take shards 0, 1, 2 whatever the order they started in.
        assert {r.instance: r.shard for r in started} == {
            "allocator-a": "0",
            "allocator-b": "1",
            "allocator-c": "2",
        }


async def test_a_replica_that_restarts_under_its_name_learns_its_peers_at_once(
    bus_factory: BusFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A replica SIGKILLed and started again is still counted alive by its peers for
    # MEMBER_LOST_S; its beats carry a new start time, so they answer it all the same.
    async with _replicas(bus_factory, monkeypatch) as start:
        a = await start("allocator-a")
        first_b = await start("allocator-b")
        await wait_until(lambda: a.shard == "0" and first_b.shard == "1", timeout=5)
        await first_b.stop()
        again_b = await start("allocator-b")
        await wait_until(lambda: again_b.shard == "1" and again_b.model.shards == 2, timeout=5)
        assert a.shard == "0" and a.model.shards == 2
