"""``python -m services.loadtest.fleet --config FILE --nodes N``: one process speaking for N nodes.

What it does for every node of :func:`~services.loadtest.mix.fleet_plan` (``N`` nodes), over
the same subjects and with the same messages as a node agent:

* publishes the node's ``NodeInventory`` (JetStream, ``tandem.node.<node>.inventory``) once at
  start — all nodes at once, many publishes in flight, so thousands of nodes join in seconds;
* publishes a ``Heartbeat`` per node every ``heartbeat_interval`` on core NATS, spread evenly
  over the interval (one slice of the nodes every 20 ms) rather than in one burst;
* follows every node's allocation record (KV ``tandem-allocs``, the node's desired state) with
  one :class:`~services.nodeagent.follow.AllocationsFollower` over the wildcard subject and, as
  :func:`~services.nodeagent.follow.node_actions` says, publishes ``Applied`` for each new
  allocation and ``Cleaned(ok=True)`` for each allocation being released, with the agent's
  ``Nats-Msg-Id`` and the allocation's ``traceparent``.

How it differs from N node agents: one NATS connection and one wildcard subscription instead
of N (the server fans out one message per write instead of routing to N clients), one
direct-get resync loop for all nodes, and publishes batched through one window
(:class:`~services.loadtest.publisher.AsyncPublisher`) instead of one awaited publish per
message. "Applying" and "cleaning up" do nothing (``--apply-ms`` adds a fixed delay before
``Applied``); there is no discovery, health monitoring, device command service
(``tandem.node.<node>.command``), state file, kubelet device plugin or netns hand-off. So the
fleet costs the server and the services what N agents cost them in messages, but not in
connections.

It tells the harness on stdout, one JSON object a line: ``{"event": "ready", ...}`` once every
inventory is stored, and ``{"event": "stats", ...}`` when it stops (SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

from schemas import codec, subjects
from schemas.messages import Applied, Cleaned, DeviceHealth, Heartbeat, NodeAllocations, NodeInventory
from schemas.topology import Gpu, Nic, locate
from services.loadtest.mix import FLEET_MIX, NodeSpec, fleet_plan, node_topology
from services.loadtest.publisher import AsyncPublisher
from services.nodeagent.follow import AllocationsFollower, node_actions
from services.runtime.bus import Bus
from services.runtime.errors import SettingsError
from services.runtime.lifecycle import run
from services.runtime.logging import get_logger
from services.runtime.settings import Settings, load_settings
from services.runtime.tasks import Service, Supervisor

log = get_logger(__name__)

HEARTBEAT_TICK_S = 0.02
INVENTORY_FLUSH_S = 300.0


def emit(event: str, **fields: Any) -> None:
    """One JSON line to the harness on stdout."""
    sys.stdout.write(codec.to_json({"event": event, **fields}).decode() + "\n")
    sys.stdout.flush()


class _Node:
    __slots__ = ("applied", "cleaning")

    def __init__(self) -> None:
        self.applied: set[str] = set()
        self.cleaning: set[str] = set()


class Fleet(Service):
    def __init__(
        self,
        bus: Bus,
        *,
        plan: list[NodeSpec],
        heartbeat_interval: float,
        apply_delay: float = 0.0,
    ) -> None:
        self.bus = bus
        self.plan = plan
        self.names = [spec.name for spec in plan]
        self.heartbeat_interval = heartbeat_interval
        self.apply_delay = apply_delay
        self.nodes = {name: _Node() for name in self.names}
        self.publisher = AsyncPublisher(bus.acks, window=2048)
        self.follower = AllocationsFollower(bus, on_record=self._on_record, nodes=lambda: self.names)
        self.counts = {"records": 0, "applied": 0, "cleaned": 0, "heartbeats": 0}
        # Inventory msg ids are unique to this start (as an agent's are), stable across retries.
        self._boot = time.time_ns()
        self._tasks = Supervisor("loadtest-fleet")

    async def start(self) -> None:
        self._tasks.spawn("publish", self.publisher.run)
        started = time.monotonic()
        # Inventories out first (that is what the services wait for); the follower's first
        # full read of the records runs meanwhile.
        self._publish_inventories()
        await self.follower.start()
        if not await self.publisher.flush(timeout=INVENTORY_FLUSH_S):
            raise RuntimeError(
                f"inventories not stored after {INVENTORY_FLUSH_S:g}s: {self.publisher.stats.last_error}"
            )
        self._tasks.spawn("heartbeats", self._heartbeats)
        emit("ready", nodes=len(self.plan), seconds=round(time.monotonic() - started, 3))

    async def stop(self) -> None:
        await self.follower.stop()
        await self.publisher.flush(timeout=5.0)
        await self._tasks.aclose()
        stats = self.publisher.stats
        emit("stats", **self.counts, publish_retried=stats.retried, publish_failed=stats.failed)

    def _publish_inventories(self) -> None:
        health_of: dict[str, dict[str, DeviceHealth]] = {}
        for spec in self.plan:
            topology = node_topology(spec)
            if spec.kind not in health_of:  # what an agent reports: every device, healthy
                ids = [i for loc in locate(topology) for i in _device_ids(loc.device)]
                health_of[spec.kind] = {i: DeviceHealth() for i in ids}
            inv = NodeInventory(
                node=spec.name,
                topology=topology,
                generation=1,
                health=health_of[spec.kind],
                agent="loadtest-fleet",
            )
            self.publisher.submit(
                subjects.node_inventory(spec.name),
                codec.encode(inv),
                msg_id=subjects.msg_id(spec.name, "inventory", self._boot),
            )

    async def _heartbeats(self) -> None:
        """Every node once per interval, one slice per tick, on an absolute schedule."""
        loop = asyncio.get_running_loop()
        ticks = max(1, round(self.heartbeat_interval / HEARTBEAT_TICK_S))
        tick_s = self.heartbeat_interval / ticks
        slices = [self.names[k::ticks] for k in range(ticks)]
        seq = 0
        next_at = loop.time()
        while True:
            seq += 1
            for names in slices:
                for name in names:
                    beat = Heartbeat(node=name, seq=seq, generation=1)
                    await self.bus.nc.publish(subjects.node_heartbeat(name), codec.encode(beat))
                self.counts["heartbeats"] += len(names)
                next_at += tick_s
                await asyncio.sleep(max(0.0, next_at - loop.time()))

    async def _on_record(self, node: str, record: NodeAllocations | None, revision: int) -> None:
        state = self.nodes.get(node)
        if state is None:  # a node of another run on the same server
            return
        self.counts["records"] += 1
        actions = node_actions(record, applied=state.applied, cleaning=state.cleaning)
        loop = asyncio.get_running_loop()
        for rec in actions.apply:
            rid = rec.assignment.request_id
            state.applied.add(rid)
            if self.apply_delay > 0:
                loop.call_later(self.apply_delay, self._applied, node, rid, rec.traceparent)
            else:
                self._applied(node, rid, rec.traceparent)
        for rec in actions.cleanup:
            rid = rec.assignment.request_id
            state.cleaning.add(rid)
            cleaned = Cleaned(request_id=rid, node=node, ok=True, devices=rec.assignment.device_ids())
            self.publisher.submit(
                subjects.node_cleaned(node),
                codec.encode(cleaned),
                msg_id=subjects.msg_id(rid, "cleaned", "ok"),
                headers=_trace(rec.traceparent),
            )
            self.counts["cleaned"] += 1
        for rid in actions.gone:
            state.applied.discard(rid)
            state.cleaning.discard(rid)

    def _applied(self, node: str, rid: str, traceparent: str) -> None:
        self.publisher.submit(
            subjects.node_applied(node),
            codec.encode(Applied(request_id=rid, node=node)),
            msg_id=subjects.msg_id(rid, "applied"),
            headers=_trace(traceparent),
        )
        self.counts["applied"] += 1


def _trace(traceparent: str) -> dict[str, str] | None:
    return {"traceparent": traceparent} if traceparent else None


def _device_ids(device: Gpu | Nic) -> list[str]:
    """A device's allocatable ids: the device and its SR-IOV VFs (as the agent reports them)."""
    return [device.id, *(vf.name for vf in getattr(device, "vfs", []))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.loadtest.fleet")
    parser.add_argument("--config", help="YAML/JSON settings file (nats_url, heartbeat_interval)")
    parser.add_argument("--nodes", type=int, required=True, help="how many nodes to simulate")
    parser.add_argument("--apply-ms", type=float, default=0.0, help="simulated apply time per allocation")
    parser.add_argument(
        "--kind",
        choices=sorted(k for k, _ in FLEET_MIX),
        help="every node of this kind (default: the mixed fleet)",
    )
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    plan = fleet_plan(args.nodes, mix=((args.kind, 1.0),)) if args.kind else fleet_plan(args.nodes)
    try:
        settings: Settings = load_settings("loadtest-fleet", config=args.config)
    except SettingsError as exc:
        print(f"loadtest-fleet: {exc}", file=sys.stderr)
        return 2

    async def fleet_main(stop: asyncio.Event) -> None:
        bus = await Bus.open(settings, provision_streams=False)
        try:
            fleet = Fleet(
                bus,
                plan=plan,
                heartbeat_interval=settings.heartbeat_interval,
                apply_delay=args.apply_ms / 1000,
            )
            await fleet.run(stop)
        finally:
            await bus.close()

    run(fleet_main, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
