"""Inventory: node events in, cluster device state (JetStream KV ``tandem-nodes``) out.

* ``NodeInventory`` replaces a node's topology and device health;
* ``HealthEvent`` updates one device's health/cordon;
* both are ordered by their sequence in the stream, which the server stamps: the record keeps
  the last one applied (``event_seq``) and an earlier one (a redelivery) is ignored. The
  agent's own timestamps order nothing: a wrong clock, or a lie, cannot make a snapshot
  "newer" than the ones after it. The subject names the node (``Bus.consume`` refuses a body
  naming another), so one node's agent can never write another node's record;
* heartbeats (core NATS, seen by every replica) keep a node ``ready``; a node silent for
  ``lost_after`` seconds is marked ``lost`` and marked ``ready`` again on its next heartbeat.
  Only transitions are written, so 10,000 nodes beating every few seconds cost no KV writes.
  A heartbeat is taken from its subject, which names the node (NATS permissions let only
  that node's agent publish there); its body is not even decoded, which keeps 10,000 nodes'
  heartbeats a small share of one core.

Liveness through a NATS outage: while the inventory's own connection is down no heartbeat
can reach it, so silence says nothing about the nodes: no node is judged then, and once it is
back every node gets a full grace period (as after a restart) rather than being marked lost
for the inventory's own outage. A transition decided but not written (KV unavailable: a stream
without a leader, a server that stopped answering) is kept and written again at the next pass,
with a growing delay, until it lands; the outage is one warning (``liveness_outage``) and one
info when it ends (``liveness_recovered``), and the inventory reports itself not ready
meanwhile (:meth:`Inventory.unready`, its ``/readyz``) — it is not a crashed task: nothing
about the inventory is wrong, and restarting it would mend nothing.

Records are held in memory and written with compare-and-set by the shared
:class:`~services.runtime.kv.records.RecordStore` (a watch keeps them current with other
replicas' writes), so several replicas can run, writes to different nodes run concurrently
(the node-event consumer hands over many at once) and no write reads first: a fleet of
thousands of nodes joins in seconds. Queries (``tandem.query.inventory``) are answered from
KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import msgspec
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter

from schemas import codec, subjects
from schemas.messages import (
    DeviceHealth,
    HealthEvent,
    InventoryQuery,
    InventoryReply,
    NodeInventory,
    NodeRecord,
)
from services.runtime.kv.records import RecordStore
from services.runtime.kv.watch import read_bucket, watch_raw
from services.runtime.nats.bus import TRANSIENT_NATS_ERRORS, Bus, Delivery
from services.runtime.observe.logging import get_logger
from services.runtime.process.tasks import Service, Supervisor

log = get_logger(__name__)

NODE_TRANSITIONS = Counter("tandem_inventory_node_transitions_total", "Nodes marked lost or back", ["to"])
for _to in ("ready", "lost"):
    NODE_TRANSITIONS.labels(_to)  # shown from 0
# Node events handled at once (each writes its own node's record; one node's stay in order).
EVENT_CONCURRENCY = 64
# The longest wait between liveness passes while node records cannot be written (the delay
# doubles from ``check_interval`` at each failed pass; each pass's writes have already
# retried for Bus.publish_retry_for).
LIVENESS_BACKOFF_MAX_S = 10.0

Status = Literal["ready", "lost"]


def apply_inventory(
    current: NodeRecord | None, inv: NodeInventory, *, seq: int, now: float
) -> NodeRecord | None:
    """The node's record after snapshot ``inv``, the stream's message number ``seq``; None
    when the record already holds a later event of the node (a redelivery never rolls a node
    back, and a sender's clock cannot order its messages: the server's sequence does)."""
    if current is not None and seq <= current.event_seq:
        return None
    return NodeRecord(
        node=inv.node,
        topology=inv.topology,
        health=dict(inv.health),
        status="ready",
        generation=inv.generation,
        last_heartbeat=now,
        updated_at=now,
        event_seq=seq,
    )


def apply_health(current: NodeRecord | None, ev: HealthEvent, *, seq: int, now: float) -> NodeRecord | None:
    if current is None or seq <= current.event_seq:
        return None
    health = dict(current.health)
    health[ev.device] = DeviceHealth(healthy=ev.healthy, cordoned=ev.cordoned, reason=ev.reason, since=ev.ts)
    return msgspec.structs.replace(current, health=health, updated_at=now, event_seq=seq)


def set_status(current: NodeRecord | None, status: Status, *, now: float) -> NodeRecord | None:
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
        self.records: RecordStore[NodeRecord] = RecordStore(
            bus, subjects.KV_NODES, codec.NODE_RECORD, on_change=self._on_record
        )
        self._kv: KeyValue | None = None
        self._frozen_at = 0  # nodes known at the last gc.freeze
        self._tasks = Supervisor("inventory")
        # Transitions decided (``status`` says them) but not in KV yet: written again at each
        # liveness pass until they land (module docstring, "Liveness through a NATS outage").
        self.unwritten: dict[str, Status] = {}
        # Why node records cannot be kept current now (None: they can), and since when.
        self.outage: str | None = None
        self._outage_since = 0.0

    @property
    def kv(self) -> KeyValue:
        assert self._kv is not None, "Inventory.start() first"
        return self._kv

    async def start(self) -> None:
        self._kv = await self.bus.kv(subjects.KV_NODES)
        ready = asyncio.Event()

        def watch() -> Awaitable[None]:
            return watch_raw(self.bus.js, subjects.KV_NODES, self.records.observe, ready=ready)

        self._tasks.spawn("watch-nodes", watch)
        await asyncio.wait_for(ready.wait(), 60)
        now = self.clock()
        for node in self.status:
            # A restarted inventory gives every node a full grace period before calling it lost.
            self.last_seen[node] = now
        self._subs = [
            await self.bus.nc.subscribe(subjects.NODE_HEARTBEAT_ALL, cb=self._on_heartbeat),
        ]
        await self.bus.serve(
            subjects.QUERY_INVENTORY,
            decoder=codec.QUERY,
            handler=self._on_query,
            queue="inventory",
            error_reply=lambda reason: InventoryReply(error=reason),
        )
        self._tasks.spawn(
            "node-events",
            lambda: self.bus.consume(
                stream=subjects.NODE_STREAM,
                durable=subjects.CONSUMER_INVENTORY,
                filter_subject=subjects.INVENTORY_NODE_FILTERS,
                decoder=codec.NODE_EVENT,
                handler=self._on_node_event,
                concurrency=EVENT_CONCURRENCY,
                batch=EVENT_CONCURRENCY * 2,
                confirm_acks=False,  # every write is idempotent: a lost ack is a redelivery
            ),
        )
        self._tasks.spawn("liveness", self._liveness_loop)
        log.info("inventory_started", nodes=len(self.status))

    async def stop(self) -> None:
        for sub in getattr(self, "_subs", []):
            # A connection closed already (for good, or by an outage) took its subscriptions.
            with contextlib.suppress(NatsError):
                await sub.unsubscribe()
        await self._tasks.aclose()
        await self.records.aclose()

    def unready(self) -> str | None:
        """Why this replica should not count as ready (its ``/readyz``): node records it
        cannot keep current; None when it can."""
        return self.outage

    def _on_record(self, node: str, record: NodeRecord | None, _: int) -> None:
        if record is None:
            self.status.pop(node, None)
            self.last_seen.pop(node, None)
            self.unwritten.pop(node, None)
        else:
            self.status[node] = record.status

    async def _on_node_event(self, event: object, delivery: Delivery) -> None:
        now = self.clock()
        # Bus.consume checked that the node in the body is the one the subject names (only
        # that node's agent may publish there), and the kind is the subject's.
        seq = delivery.stream_seq
        if isinstance(event, NodeInventory):
            # The cache holds every record (the watch loaded them): a node not in it is new.
            rec = await self.records.update(
                event.node, lambda cur: apply_inventory(cur, event, seq=seq, now=now), assume_absent=True
            )
            self.last_seen[event.node] = now
            self.status[event.node] = rec.status if rec else "ready"
            log.debug("node_inventory", node=event.node, generation=event.generation)
        elif isinstance(event, HealthEvent):
            await self.records.update(event.node, lambda cur: apply_health(cur, event, seq=seq, now=now))

    async def _on_heartbeat(self, msg: Msg) -> None:
        node = subjects.node_of(msg.subject)
        if node not in self.status:
            return  # not registered yet (its inventory comes first) or not a node at all
        now = self.clock()
        self.last_seen[node] = now
        # Also a loss decided but not written yet (NATS was unavailable): what is written next
        # must be that the node is back, whatever the watch said of it meanwhile.
        if self.status[node] == "lost" or self.unwritten.get(node) == "lost":
            self.status[node] = "ready"
            self.unwritten[node] = "ready"
            log.info("node_back", node=node)
            self._tasks.spawn(f"back:{node}", lambda: self._write_back(node, now), restart=False)

    async def _write_back(self, node: str, now: float) -> None:
        """A node back is written at once, not at the next pass; when NATS cannot take it,
        the liveness loop writes it (and reports the outage) — not an error of this task."""
        with contextlib.suppress(*TRANSIENT_NATS_ERRORS):
            await self._write_marks([node], now)

    async def _mark(self, node: str, status: Status, now: float) -> None:
        await self.records.update(node, lambda cur: set_status(cur, status, now=now))
        NODE_TRANSITIONS.labels(status).inc()

    async def _write_marks(self, nodes: list[str], now: float) -> None:
        """Write the unwritten transitions of ``nodes``; those that fail stay unwritten for
        the next pass, and the first failure is raised once all were tried."""
        marks = [(n, self.unwritten[n]) for n in nodes if n in self.unwritten]
        results = await asyncio.gather(
            *(self._mark(node, status, now) for node, status in marks), return_exceptions=True
        )
        failed: Exception | None = None
        for (node, status), result in zip(marks, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result  # cancelled: stopping
                failed = failed or result
            elif self.unwritten.get(node) == status:  # not decided otherwise meanwhile
                del self.unwritten[node]
        if failed is not None:
            raise failed

    async def check_liveness(self) -> list[str]:
        """Mark nodes lost whose heartbeats stopped and write every transition not written
        yet; return the nodes marked now. Raises the first write that failed (the others
        were tried, and every failed one is tried again at the next call)."""
        now = self.clock()
        lost = [
            n
            for n, seen in self.last_seen.items()
            if now - seen > self.lost_after and self.status.get(n) != "lost"
        ]
        for node in lost:
            self.status[node] = "lost"
            self.unwritten[node] = "lost"
            log.warning("node_lost", node=node, silent_for=round(now - self.last_seen[node], 1))
        await self._write_marks(list(self.unwritten), now)
        return lost

    def _give_grace(self) -> None:
        """Every node a full grace period from now (after a restart, or an outage of the
        inventory's own connection, during which no heartbeat could arrive)."""
        now = self.clock()
        for node in self.last_seen:
            self.last_seen[node] = now

    def _outage_began(self, why: str) -> None:
        if self.outage is None:
            self._outage_since = time.monotonic()
            log.warning("liveness_outage", reason=why, unwritten=len(self.unwritten))
        self.outage = why

    def _outage_ended(self) -> None:
        if self.outage is not None:
            lasted = round(time.monotonic() - self._outage_since, 1)
            log.info("liveness_recovered", outage=self.outage, lasted_s=lasted)
            self.outage = None

    async def _liveness_loop(self) -> None:
        delay = self.check_interval
        reconnects = self.bus.nc.stats["reconnects"]
        while True:
            await asyncio.sleep(delay)
            if not self.bus.nc.is_connected:
                self._outage_began("NATS unreachable: no heartbeat can arrive, no record be written")
                continue
            if self.bus.nc.stats["reconnects"] != reconnects:
                # Counted, not seen: an outage shorter than a pass also lost heartbeats.
                reconnects = self.bus.nc.stats["reconnects"]
                self._give_grace()
            try:
                await self.check_liveness()
            except TRANSIENT_NATS_ERRORS as exc:
                delay = min(delay * 2, LIVENESS_BACKOFF_MAX_S)
                if self.outage is not None:
                    log.info("liveness_retry", unwritten=len(self.unwritten), delay=delay, error=repr(exc))
                self._outage_began(f"node records cannot be written: {exc!r}")
                continue
            self._outage_ended()
            delay = self.check_interval
            if len(self.status) > self._frozen_at * 1.1 + 10:
                # The node records of a fleet that joined are long-lived: out of the
                # collector's way (see services.runtime.process.lifecycle.GC_THRESHOLDS).
                gc.freeze()
                self._frozen_at = len(self.status)

    async def _on_query(self, query: InventoryQuery, _: Delivery) -> InventoryReply:
        if not query.node:
            # Every record in one pass, complete even when the server says early that nothing
            # is pending (a listing of keys then a get per key could miss nodes).
            every = await read_bucket(self.bus.js, subjects.KV_NODES, codec.NODE_RECORD)
            return InventoryReply(nodes=[every[k] for k in sorted(every)])
        try:
            entry = await self.kv.get(subjects.kv_key(query.node))
        except KeyNotFoundError:
            return InventoryReply(error=f"unknown node {query.node!r}")
        return InventoryReply(nodes=[codec.NODE_RECORD.decode(entry.value or b"")])
