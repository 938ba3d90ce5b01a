"""Inventory: node events in, cluster device state (JetStream KV ``tandem-nodes``) out.

* ``NodeInventory`` replaces a node's topology and device health (older snapshots — by the
  agent's timestamp — are ignored, so a redelivery never rolls a node back);
* ``HealthEvent`` updates one device's health/cordon;
* heartbeats (core NATS, seen by every replica) keep a node ``ready``; a node silent for
  ``lost_after`` seconds is marked ``lost`` and marked ``ready`` again on its next heartbeat.
  Only transitions are written, so 10,000 nodes beating every 2 s cost no KV writes.

Every write is a compare-and-set on the record's revision (:func:`update_record`), so several
replicas can run. Queries (``tandem.query.inventory``) are answered from KV.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Literal

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge

from schemas import codec, subjects
from schemas.messages import (
    DeviceHealth,
    HealthEvent,
    Heartbeat,
    InventoryQuery,
    InventoryReply,
    NodeInventory,
    NodeRecord,
)
from services.runtime.bus import Bus, Delivery
from services.runtime.logging import get_logger
from services.runtime.tasks import Service, Supervisor

log = get_logger(__name__)

NODE_TRANSITIONS = Counter("tandem_inventory_node_transitions_total", "Nodes marked lost or back", ["to"])
NODES = Gauge("tandem_inventory_nodes", "Nodes known to this inventory replica by status", ["status"])

Mutation = Callable[[NodeRecord | None], NodeRecord | None]


async def update_record(
    kv: KeyValue, node: str, mutate: Mutation, *, attempts: int = 20
) -> NodeRecord | None:
    """Read-modify-write one node record with compare-and-set; ``mutate`` returning None
    means "no change". Retries on a lost race with the fresh value."""
    key = subjects.kv_key(node)
    for _ in range(attempts):
        try:
            entry = await kv.get(key)
            current: NodeRecord | None = codec.NODE_RECORD.decode(entry.value or b"")
            revision = entry.revision
        except KeyNotFoundError:
            current, revision = None, None
        new = mutate(current)
        if new is None:
            return current
        try:
            if revision is None:
                await kv.create(key, codec.encode(new))
            else:
                await kv.update(key, codec.encode(new), last=revision)
            return new
        except KeyWrongLastSequenceError:
            continue
    raise RuntimeError(f"node record {node}: gave up after {attempts} compare-and-set conflicts")


def apply_inventory(current: NodeRecord | None, inv: NodeInventory, *, now: float) -> NodeRecord | None:
    if current is not None and inv.ts < current.updated_at:
        return None  # an older snapshot redelivered: never roll back
    return NodeRecord(
        node=inv.node,
        topology=inv.topology,
        health=dict(inv.health),
        status="ready",
        generation=inv.generation,
        last_heartbeat=now,
        updated_at=inv.ts,
    )


def apply_health(current: NodeRecord | None, ev: HealthEvent) -> NodeRecord | None:
    if current is None:
        return None
    old = current.health.get(ev.device, DeviceHealth())
    if ev.ts < old.since:
        return None
    health = dict(current.health)
    health[ev.device] = DeviceHealth(healthy=ev.healthy, cordoned=ev.cordoned, reason=ev.reason, since=ev.ts)
    return msgspec.structs.replace(current, health=health, updated_at=max(current.updated_at, ev.ts))


def set_status(
    current: NodeRecord | None, status: Literal["ready", "lost"], *, now: float
) -> NodeRecord | None:
    if current is None or current.status == status:
        return None
    return msgspec.structs.replace(current, status=status, last_heartbeat=now)


class Inventory(Service):
    def __init__(
        self,
        bus: Bus,
        *,
        lost_after: float = 8.0,
        check_interval: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.bus = bus
        self.lost_after = lost_after
        self.check_interval = check_interval or max(lost_after / 4, 0.2)
        self.clock = clock
        self.last_seen: dict[str, float] = {}
        self.status: dict[str, str] = {}
        self._kv: KeyValue | None = None
        self._tasks = Supervisor("inventory")

    @property
    def kv(self) -> KeyValue:
        assert self._kv is not None, "Inventory.start() first"
        return self._kv

    async def start(self) -> None:
        self._kv = await self.bus.kv(subjects.KV_NODES)
        now = self.clock()
        for node in await self._keys():
            entry = await self.kv.get(node)
            rec = codec.NODE_RECORD.decode(entry.value or b"")
            # A restarted inventory gives every node a full grace period before calling it lost.
            self.last_seen[rec.node] = now
            self.status[rec.node] = rec.status
        await self.bus.serve(
            subjects.NODE_HEARTBEAT_ALL, decoder=codec.NODE_EVENT, handler=self._on_heartbeat
        )
        await self.bus.serve(
            subjects.QUERY_INVENTORY, decoder=codec.QUERY, handler=self._on_query, queue="inventory"
        )
        self._tasks.spawn(
            "node-events",
            lambda: self.bus.consume(
                stream=subjects.NODE_STREAM,
                durable=subjects.CONSUMER_INVENTORY,
                filter_subject=subjects.NODE_EVENTS_ALL,
                decoder=codec.NODE_EVENT,
                handler=self._on_node_event,
            ),
        )
        self._tasks.spawn("liveness", self._liveness_loop)
        log.info("inventory_started", nodes=len(self.last_seen))

    async def stop(self) -> None:
        await self._tasks.aclose()

    async def _keys(self) -> list[str]:
        try:
            return list(await self.kv.keys())
        except NoKeysError:  # nats-py's answer for an empty bucket
            return []

    async def _on_node_event(self, event: object, _: Delivery) -> None:
        now = self.clock()
        if isinstance(event, NodeInventory):
            rec = await update_record(self.kv, event.node, lambda cur: apply_inventory(cur, event, now=now))
            self.last_seen[event.node] = now
            self.status[event.node] = rec.status if rec else "ready"
            self._count_nodes()
            log.info("node_inventory", node=event.node, generation=event.generation)
        elif isinstance(event, HealthEvent):
            await update_record(self.kv, event.node, lambda cur: apply_health(cur, event))

    async def _on_heartbeat(self, beat: object, _: Delivery) -> None:
        if not isinstance(beat, Heartbeat):
            return
        now = self.clock()
        self.last_seen[beat.node] = now
        if self.status.get(beat.node) == "lost":
            await update_record(self.kv, beat.node, lambda cur: set_status(cur, "ready", now=now))
            self.status[beat.node] = "ready"
            NODE_TRANSITIONS.labels("ready").inc()
            self._count_nodes()
            log.info("node_back", node=beat.node)

    async def check_liveness(self) -> list[str]:
        """Mark nodes lost whose heartbeats stopped; return the nodes marked now."""
        now = self.clock()
        lost = [
            n
            for n, seen in self.last_seen.items()
            if now - seen > self.lost_after and self.status.get(n) != "lost"
        ]
        for node in lost:
            await update_record(self.kv, node, lambda cur: set_status(cur, "lost", now=now))
            self.status[node] = "lost"
            NODE_TRANSITIONS.labels("lost").inc()
            log.warning("node_lost", node=node, silent_for=round(now - self.last_seen[node], 1))
        if lost:
            self._count_nodes()
        return lost

    def _count_nodes(self) -> None:
        for status in ("ready", "lost"):
            NODES.labels(status).set(sum(1 for s in self.status.values() if s == status))

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            await self.check_liveness()

    async def _on_query(self, query: InventoryQuery, _: Delivery) -> InventoryReply:
        keys = [query.node] if query.node else await self._keys()
        nodes = []
        for key in keys:
            try:
                entry = await self.kv.get(subjects.kv_key(key))
            except KeyNotFoundError:
                if query.node:
                    return InventoryReply(error=f"unknown node {query.node!r}")
                continue
            nodes.append(codec.NODE_RECORD.decode(entry.value or b""))
        return InventoryReply(nodes=nodes)
