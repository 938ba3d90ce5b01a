"""``python -m tools.loadtest.fleet --config FILE --nodes N``: one process speaking for N nodes.

What it does for every node of :func:`~tools.loadtest.mix.fleet_plan` (``N`` nodes), over
the same subjects and with the same messages as a node agent:

* publishes the node's ``NodeInventory`` (JetStream, ``tandem.node.<node>.inventory``) once at
  start — all nodes at once, many publishes in flight, so thousands of nodes join in seconds;
* publishes a ``Heartbeat`` per node every ``heartbeat_interval`` on core NATS, spread evenly
  over the interval (one slice of the nodes every 20 ms) rather than in one burst;
* follows every node's allocation record (KV ``tandem-allocs``, the node's desired state) with
  one :class:`~services.nodeagent.follow.AllocationsFollower` over the wildcard subject and, as
  :func:`~services.nodeagent.follow.node_actions` says, publishes ``Applied`` for each new
  allocation and ``Cleaned`` for each allocation being released, with the agent's
  ``Nats-Msg-Id`` and the allocation's ``traceparent``.

Two things it does so that the load exercises what a node agent guards against:

* **Overlap refused at apply.** Before it applies an allocation it checks that none of its
  devices is held by an allocation the node has applied and not seen leave its record
  (:class:`~tools.loadtest.ledger.DeviceHolds`: shares of one GPU may share it). An
  overlap is refused, as a node that cannot apply: ``Applied(ok=False)`` naming the devices
  and the holder, and one ``{"event": "overlap", ...}`` line to the harness, which counts
  them (``overlap_at_apply``). The record is taken as handed over: allocations that left it
  are let go before new ones are applied, so a device freed and given again in one coalesced
  revision is no overlap.
* **Cleanups that fail first** (``--cleanup-fail-share``, 0 by default; the harness passes
  its ``--cleanup-fail-share``, 2 %). For a share of the releases — chosen by a hash of the
  request id, so a fleet started again chooses the same — the first cleanup is reported
  unverified, as the agent reports one (``services.nodeagent.service``): ``Cleaned(ok=False)``
  with a problem, msg id ``<id>:cleaned:failed``; the allocator keeps the devices held and
  marks the request record ``releasing``. After the agent's first retry delay
  (``services.nodeagent.cleanup.retry_delay``, 1 s) the retry is verified: ``Cleaned(ok=True)``,
  msg id ``<id>:cleaned:ok``, unless the allocation left the record meanwhile. Each injected
  failure is one ``{"event": "cleanup_failed", ...}`` line. Unlike the agent, the fleet does
  not mark the devices unhealthy (no health events: the allocator would stop placing on them
  until their clean period passed, and the fleet has no device health at all).

How it differs from N node agents: by default one NATS connection and one wildcard
subscription instead of N (the server fans out one message per write instead of routing to N
clients), one direct-get resync loop for all nodes, and publishes batched through one window
(:class:`~tools.loadtest.publisher.AsyncPublisher`) instead of one awaited publish per
message. With ``--token-dir DIR`` (the harness's production profile) every node has a
connection of its own instead, made with its own token (``DIR/<node>``, bound to a pod on that
node), which the auth callout turns into that node's permissions: it publishes, follows its
own record (a subscription to its own subject, direct gets of its own key) and receives its
acks on that connection, as an agent does — N connections, N subscriptions, N resync loops,
one window each. "Applying" and "cleaning up" do nothing (``--apply-ms`` adds a fixed delay before
``Applied``); there is no discovery, health monitoring, device command service
(``tandem.node.<node>.command``), state file, kubelet device plugin or netns hand-off. So the
fleet costs the server and the services what N agents cost them in messages, but not in
connections.

It tells the harness on stdout, one JSON object a line: ``{"event": "ready", ...}`` once every
inventory is stored, ``overlap`` and ``cleanup_failed`` as they happen, and
``{"event": "stats", ...}`` when it stops (SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from schemas import codec, subjects
from schemas.messages import (
    AllocRecord,
    Applied,
    Cleaned,
    DeviceHealth,
    Heartbeat,
    NodeAllocations,
    NodeInventory,
)
from schemas.topology import Gpu, Nic, locate
from services.nodeagent.cleanup import retry_delay
from services.nodeagent.follow import AllocationsFollower, node_actions
from services.runtime.errors import SettingsError
from services.runtime.nats.bus import Bus
from services.runtime.observe.logging import get_logger
from services.runtime.process.lifecycle import run
from services.runtime.process.tasks import Service, Supervisor
from services.runtime.settings import Settings, load_settings
from tools.loadtest.ledger import DeviceHolds
from tools.loadtest.mix import FLEET_MIX, KINDS, NodeSpec, fleet_plan, node_topology, parse_mix
from tools.loadtest.publisher import AsyncPublisher

log = get_logger(__name__)

HEARTBEAT_TICK_S = 0.02
CONNECT_CONCURRENCY = 16  # per-node connections being made at once (--token-dir)
# Followers starting at once. With a connection per node, each start asks JetStream for the
# allocation bucket's stream info before its first read: 10,000 of them at once timed the
# JetStream API out (a DaemonSet's rollout starts agents a few at a time).
FOLLOWER_START_CONCURRENCY = 64
INVENTORY_FLUSH_S = 300.0
# The problem an injected cleanup failure reports (the allocator writes it into the request record).
INJECTED_PROBLEM = "cleanup not verified: failed on purpose by the load harness (--cleanup-fail-share)"


def emit(event: str, **fields: Any) -> None:
    """One JSON line to the harness on stdout."""
    sys.stdout.write(codec.to_json({"event": event, **fields}).decode() + "\n")
    sys.stdout.flush()


def fails_first(request_id: str, share: float) -> bool:
    """Whether the first cleanup of ``request_id`` is to fail: a hash of the id below
    ``share`` of its range, so the same requests fail whoever asks, and whenever."""
    return share > 0 and zlib.crc32(request_id.encode()) < share * 2**32


class _Node:
    __slots__ = ("applied", "cleaning", "holds")

    def __init__(self) -> None:
        self.applied: set[str] = set()  # applied (or refused: never offered again)
        self.cleaning: set[str] = set()
        self.holds = DeviceHolds()  # the devices of what it applied, until they leave the record


class _Link:
    """One connection and what rides on it: every node's traffic (one shared connection) or
    one node's (a connection per node, each with its own identity)."""

    __slots__ = ("bus", "follower", "publisher")

    def __init__(self, bus: Bus, publisher: AsyncPublisher, follower: AllocationsFollower) -> None:
        self.bus = bus
        self.publisher = publisher
        self.follower = follower


class Fleet(Service):
    def __init__(
        self,
        buses: Bus | dict[str, Bus],
        *,
        plan: list[NodeSpec],
        heartbeat_interval: float,
        apply_delay: float = 0.0,
        cleanup_fail_share: float = 0.0,
        cleanup_retry_s: float | None = None,
    ) -> None:
        self.plan = plan
        self.names = [spec.name for spec in plan]
        self.heartbeat_interval = heartbeat_interval
        self.apply_delay = apply_delay
        self.cleanup_fail_share = cleanup_fail_share
        # The agent's delay before its first retry of an unverified cleanup.
        self.cleanup_retry_s = retry_delay(1) if cleanup_retry_s is None else cleanup_retry_s
        self.nodes = {name: _Node() for name in self.names}
        if isinstance(buses, Bus):  # one connection: one window, one wildcard follower
            shared = _Link(
                buses,
                AsyncPublisher(buses.acks, window=2048),
                AllocationsFollower(buses, on_record=self._on_record, nodes=lambda: self.names),
            )
            self.links = dict.fromkeys(self.names, shared)
            self._all = [shared]
        else:  # a connection per node, each following its own record
            self.links = {
                name: _Link(
                    buses[name],
                    AsyncPublisher(buses[name].acks, window=64),
                    AllocationsFollower(buses[name], on_record=self._on_record, node=name),
                )
                for name in self.names
            }
            self._all = list(self.links.values())
        self.counts = {
            "records": 0,
            "applied": 0,
            "cleaned": 0,
            "heartbeats": 0,
            "overlap_refused": 0,
            "cleanup_failed": 0,
            "cleanup_retried": 0,
        }
        # Inventory msg ids are unique to this start (as an agent's are), stable across retries.
        self._boot = time.time_ns()
        self._tasks = Supervisor("loadtest-fleet")

    async def start(self) -> None:
        for i, link in enumerate(self._all):
            self._tasks.spawn(f"publish-{i}", link.publisher.run)
        started = time.monotonic()
        # Inventories out first (that is what the services wait for); the followers' first
        # full read of the records runs meanwhile.
        self._publish_inventories()
        gate = asyncio.Semaphore(FOLLOWER_START_CONCURRENCY)

        async def follow(link: _Link) -> None:
            async with gate:
                await link.follower.start()

        await asyncio.gather(*(follow(link) for link in self._all))
        flushed = await asyncio.gather(
            *(link.publisher.flush(timeout=INVENTORY_FLUSH_S) for link in self._all)
        )
        if not all(flushed):
            errors = {link.publisher.stats.last_error for link in self._all} - {""}
            raise RuntimeError(f"inventories not stored after {INVENTORY_FLUSH_S:g}s: {', '.join(errors)}")
        self._tasks.spawn("heartbeats", self._heartbeats)
        emit("ready", nodes=len(self.plan), seconds=round(time.monotonic() - started, 3))

    async def stop(self) -> None:
        await asyncio.gather(*(link.follower.stop() for link in self._all))
        await asyncio.gather(*(link.publisher.flush(timeout=5.0) for link in self._all))
        await self._tasks.aclose()
        retried = sum(link.publisher.stats.retried for link in self._all)
        failed = sum(link.publisher.stats.failed for link in self._all)
        emit(
            "stats", **self.counts, connections=len(self._all), publish_retried=retried, publish_failed=failed
        )

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
            self.links[spec.name].publisher.submit(
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
                    await self.links[name].bus.nc.publish(subjects.node_heartbeat(name), codec.encode(beat))
                self.counts["heartbeats"] += len(names)
                next_at += tick_s
                await asyncio.sleep(max(0.0, next_at - loop.time()))

    async def _on_record(self, node: str, record: NodeAllocations | None, revision: int) -> None:
        state = self.nodes.get(node)
        if state is None:  # a node of another run on the same server
            return
        self.counts["records"] += 1
        actions = node_actions(record, applied=state.applied, cleaning=state.cleaning)
        # What left the record first: its devices are free for what this revision adds.
        for rid in actions.gone:
            state.applied.discard(rid)
            state.cleaning.discard(rid)
            state.holds.remove(rid)
        loop = asyncio.get_running_loop()
        for rec in actions.apply:
            rid = rec.assignment.request_id
            state.applied.add(rid)
            clashes = state.holds.clashes(rid, rec.assignment)
            if clashes:
                self._refuse(node, rec, clashes)
                continue
            state.holds.add(rid, rec.assignment)
            if self.apply_delay > 0:
                loop.call_later(self.apply_delay, self._applied, node, rid, rec.traceparent)
            else:
                self._applied(node, rid, rec.traceparent)
        for rec in actions.cleanup:
            rid = rec.assignment.request_id
            state.cleaning.add(rid)
            if fails_first(rid, self.cleanup_fail_share):
                self._cleaned(node, rec, ok=False)
                self.counts["cleanup_failed"] += 1
                emit("cleanup_failed", node=node, request_id=rid)
                loop.call_later(self.cleanup_retry_s, self._retry_cleanup, node, rec)
            else:
                self._cleaned(node, rec, ok=True)

    def _refuse(self, node: str, rec: AllocRecord, clashes: list[tuple[str, str]]) -> None:
        """An allocation that overlaps devices this node applied: not applied, reported as a
        failed apply and to the harness."""
        rid = rec.assignment.request_id
        held = ", ".join(f"{device} (held by {other})" for device, other in clashes)
        log.error("overlap_at_apply", node=node, request_id=rid, devices=held)
        self.counts["overlap_refused"] += 1
        emit("overlap", node=node, request_id=rid, devices=[[d, other] for d, other in clashes])
        refused = Applied(request_id=rid, node=node, ok=False, error=f"overlaps applied devices: {held}")
        self.links[node].publisher.submit(
            subjects.node_applied(node),
            codec.encode(refused),
            msg_id=subjects.msg_id(rid, "applied"),
            headers=_trace(rec.traceparent),
        )

    def _cleaned(self, node: str, rec: AllocRecord, *, ok: bool) -> None:
        rid = rec.assignment.request_id
        cleaned = Cleaned(
            request_id=rid,
            node=node,
            ok=ok,
            devices=rec.assignment.device_ids(),
            problems=[] if ok else [INJECTED_PROBLEM],
        )
        self.links[node].publisher.submit(
            subjects.node_cleaned(node),
            codec.encode(cleaned),
            msg_id=subjects.msg_id(rid, "cleaned", "ok" if ok else "failed"),
            headers=_trace(rec.traceparent),
        )
        if ok:
            self.counts["cleaned"] += 1

    def _retry_cleanup(self, node: str, rec: AllocRecord) -> None:
        """The agent's retry of an unverified cleanup: verified this time, unless the
        allocation left the record meanwhile (then there is nothing left to report)."""
        if rec.assignment.request_id in self.nodes[node].cleaning:
            self.counts["cleanup_retried"] += 1
            self._cleaned(node, rec, ok=True)

    def _applied(self, node: str, rid: str, traceparent: str) -> None:
        self.links[node].publisher.submit(
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


async def _connect(
    settings: Settings, plan: list[NodeSpec], *, token_dir: Path | None, opened: list[Bus]
) -> Bus | dict[str, Bus]:
    """One connection for all nodes, or (``token_dir``) one per node as its own node agent,
    a few at a time (each is a TLS handshake and a callout review)."""
    if token_dir is None:
        opened.append(await Bus.open(settings, provision_streams=False))
        return opened[0]
    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)
    buses: dict[str, Bus] = {}

    async def one(name: str) -> None:
        own = msgspec.structs.replace(
            settings, service="nodeagent", node_name=name, nats_token_file=str(token_dir / name)
        )
        async with gate:
            bus = await Bus.open(own, provision_streams=False)
        opened.append(bus)
        buses[name] = bus

    await asyncio.gather(*(one(spec.name) for spec in plan))
    return buses


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.loadtest.fleet")
    parser.add_argument("--config", help="YAML/JSON settings file (nats_url, heartbeat_interval)")
    parser.add_argument("--nodes", type=int, required=True, help="how many nodes to simulate")
    parser.add_argument("--apply-ms", type=float, default=0.0, help="simulated apply time per allocation")
    parser.add_argument(
        "--cleanup-fail-share",
        type=float,
        default=0.0,
        help="share of releases whose first cleanup is reported unverified, then retried (default 0)",
    )
    kinds = parser.add_mutually_exclusive_group()
    kinds.add_argument("--kind", choices=KINDS, help="every node of this kind (default: the mixed fleet)")
    kinds.add_argument(
        "--mix",
        metavar="KIND=SHARE,...",
        help="the fleet in these proportions (the plan of tools.loadtest.mix.fleet_plan)",
    )
    parser.add_argument(
        "--token-dir",
        type=Path,
        help="a connection per node, with the token in DIR/<node> (default: one connection for all)",
    )
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    if not 0 <= args.cleanup_fail_share <= 1:
        parser.error("--cleanup-fail-share must be in [0, 1]")
    try:
        mix = parse_mix(args.mix) if args.mix else ((args.kind, 1.0),) if args.kind else FLEET_MIX
    except ValueError as exc:
        parser.error(f"--mix: {exc}")
    plan = fleet_plan(args.nodes, mix=mix)
    try:
        settings: Settings = load_settings("loadtest-fleet", config=args.config)
    except SettingsError as exc:
        print(f"loadtest-fleet: {exc}", file=sys.stderr)
        return 2

    async def fleet_main(stop: asyncio.Event) -> None:
        opened: list[Bus] = []
        try:
            buses = await _connect(settings, plan, token_dir=args.token_dir, opened=opened)
            fleet = Fleet(
                buses,
                plan=plan,
                heartbeat_interval=settings.heartbeat_interval,
                apply_delay=args.apply_ms / 1000,
                cleanup_fail_share=args.cleanup_fail_share,
            )
            await fleet.run(stop)
        finally:
            await asyncio.gather(*(bus.close() for bus in opened))

    run(fleet_main, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
