"""The whole system in one process: inventory, allocator replicas and simulated node agents.

``tandem up``, ``make demo`` and the end-to-end tests run this. Every component gets its own
NATS connection, exactly as separate processes would, so nothing here shortcuts the bus: the
only difference from a cluster is that the services share an event loop.

A fleet is a list of ``FleetEntry(topology, count, prefix)``; the default fleet mixes every
built-in kind of node (:data:`DEFAULT_FLEET`).

There is no Kubernetes here, so the pod bridge's parts that need none are played here for
``tandem up``:

* nothing would evict the victims of a preemption: with ``evict=True`` :class:`LocalEvictor`
  does, on the bridge's own durable consumer, and releases each victim at once (no
  PodDisruptionBudget can hold an eviction back here);
* a ``DeviceClaim`` has no object to live in: with ``claims=True`` a claim is its allocation
  request alone (``tandem submit --claim``, request id ``claim-<uid>`` with the claim marker),
  and :class:`LocalClaims` keeps what the bridge keeps for it — its record in KV
  ``tandem-claims`` (what ``tandem status`` and ``tandem requests`` show) and the
  reservation's deadline, at which it releases the claim (no pod can use a claim here).

:func:`local_device_classes` are the classes ``tandem up`` serves unless its configuration
names others: the ones docs/sharing.md uses, so every command there works on one machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.js.errors import KeyNotFoundError

from schemas import codec, subjects
from schemas.config import DeviceClass, default_device_classes
from schemas.messages import Assignment, ClaimRecord, PreemptionPlan, Release, RequestRecord
from services.admission import claims
from services.allocator.metrics import AllocatorState
from services.allocator.service import Allocator
from services.client import TandemClient
from services.inventory.metrics import InventoryState
from services.inventory.service import Inventory
from services.nodeagent.backends.simulated import SimulatedApplier, SimulatedBackend
from services.nodeagent.service import NodeAgent
from services.runtime.kv.watch import watch_bucket
from services.runtime.nats.bus import Bus, Delivery
from services.runtime.nats.consumerlag import watch_consumers
from services.runtime.observe.metrics import service_registry
from services.runtime.observe.opsserver import OpsServer
from services.runtime.process.tasks import Supervisor
from services.runtime.settings import Settings
from services.topology import load_topology


@dataclass(frozen=True)
class FleetEntry:
    topology: str  # built-in name or topology file
    count: int
    prefix: str


DEFAULT_FLEET = (
    FleetEntry("dgx-h100", 2, "h100"),
    FleetEntry("dgx-a100", 2, "a100"),
    FleetEntry("pcie-4gpu-2nic", 2, "pcie"),
    FleetEntry("gpu-only-8", 1, "gpuonly"),
)


def local_device_classes() -> dict[str, DeviceClass]:
    """The device classes of docs/sharing.md ("Device classes"): ``default`` (whole GPUs),
    ``shared`` (shares limited by HAMi-core, at most 4 a GPU) and ``shared-mps`` (CUDA MPS,
    at most 2). ``tests/unit/test_local_classes.py`` holds them to the page."""
    return {
        **default_device_classes(),
        "shared": DeviceClass(sharing="hami", max_shares_per_gpu=4),
        "shared-mps": DeviceClass(sharing="mps", max_shares_per_gpu=2),
    }


def describe_classes(classes: dict[str, DeviceClass]) -> str:
    """One line for people: ``default (whole GPUs), shared (GPU shares: hami, at most 4 a GPU)``."""

    def one(name: str, c: DeviceClass) -> str:
        if c.sharing == "none":
            return f"{name} (whole GPUs)"
        return f"{name} (GPU shares: {c.sharing}, at most {c.max_shares_per_gpu} a GPU)"

    return ", ".join(one(name, c) for name, c in classes.items())


def parse_fleet(specs: list[str]) -> list[FleetEntry]:
    """``TOPOLOGY[:COUNT[:PREFIX]]`` per spec, e.g. ``dgx-h100:4:h100``."""
    out = []
    for spec in specs:
        parts = spec.split(":")
        topo = parts[0]
        count = int(parts[1]) if len(parts) > 1 and parts[1] else 1
        prefix = parts[2] if len(parts) > 2 else topo.rsplit("/", 1)[-1].split(".")[0]
        out.append(FleetEntry(topo, count, prefix))
    return out


class LocalStack:
    def __init__(
        self,
        settings: Settings,
        *,
        fleet: list[FleetEntry] | tuple[FleetEntry, ...] = DEFAULT_FLEET,
        allocators: int = 1,
        retry_interval: float = 1.0,
        evict: bool = False,
        claims: bool = False,
    ) -> None:
        self.settings = settings
        self.evict = evict
        self.claims = claims
        self.fleet = fleet
        self.allocator_count = allocators
        self.retry_interval = retry_interval
        self.buses: list[Bus] = []
        self.inventory: Inventory | None = None
        self.allocators: list[Allocator] = []
        self.agents: dict[str, NodeAgent] = {}
        self.backends: dict[str, SimulatedBackend] = {}
        self.appliers: dict[str, SimulatedApplier] = {}
        self.ops: dict[str, OpsServer] = {}
        self._tasks = Supervisor("localstack")

    async def _bus(self, service: str, *, provision_streams: bool = True, **changes: object) -> Bus:
        settings = msgspec.structs.replace(self.settings, service=service, **changes)
        bus = await Bus.open(settings, provision_streams=provision_streams)
        self.buses.append(bus)
        return bus

    async def start(self) -> LocalStack:
        s = self.settings
        self.inventory = Inventory(await self._bus("inventory"), lost_after=s.node_lost_after)
        await self.inventory.start()
        for i in range(self.allocator_count):
            instance = f"allocator-{i}"
            allocator = Allocator(
                await self._bus("allocator", instance=instance),
                instance=instance,
                node_policy=s.node_policy,
                device_classes=s.device_classes,
                retry_interval=self.retry_interval,
            )
            await allocator.start()
            self.allocators.append(allocator)
        for entry in self.fleet:
            topology = load_topology(entry.topology)
            for n in range(entry.count):
                await self.add_node(f"{entry.prefix}-{n}", topology)
        if self.evict:
            evictor = LocalEvictor(await self._bus("admission"))
            self._tasks.spawn("evictor", evictor.run)
        if self.claims:
            keeper = LocalClaims(await self._bus("admission"))
            self._tasks.spawn("claims-watch", keeper.watch)
            self._tasks.spawn("claims", keeper.run)
        return self

    async def add_node(self, name: str, topology: object) -> NodeAgent:
        backend = SimulatedBackend(topology, node=name)  # type: ignore[arg-type]
        applier = SimulatedApplier()
        agent = NodeAgent(
            # Like the real agent, it does not provision (its NATS user may not create streams).
            await self._bus("nodeagent", provision_streams=False, node_name=name),
            node=name,
            backend=backend,
            applier=applier,
            heartbeat_interval=self.settings.heartbeat_interval,
            clean_period=self.settings.health_clean_period,
        )
        await agent.start()
        self.agents[name], self.backends[name], self.appliers[name] = agent, backend, applier
        return agent

    async def serve_ops(self, *, port: int, host: str = "127.0.0.1") -> dict[str, OpsServer]:
        """``/metrics``, ``/healthz``, ``/readyz`` per service, on ``port``, ``port + 1``...:
        inventory, each allocator replica, then all node agents together (their counters are
        process-wide). Port 0, or a port that is taken, means any free one. Also polls the
        consumers' lag (``tandem_consumer_pending_messages``)."""
        assert self.inventory is not None, "LocalStack.start() first"
        inventory = self.inventory
        services: list[tuple[str, str, Bus | None, list[Any]]] = [
            ("inventory", "inventory", inventory.bus, [InventoryState(inventory)])
        ]
        for a in self.allocators:
            services.append((a.instance, "allocator", a.bus, [AllocatorState(a)]))
        agent_buses = [agent.bus for agent in self.agents.values()]
        services.append(("nodeagents", "nodeagent", agent_buses[0] if agent_buses else None, []))
        for i, (name, service, bus, collectors) in enumerate(services):

            def ready(bus: Bus | None = bus) -> bool:
                return bus is not None and bus.nc.is_connected

            want = port + i if port else 0
            registry = service_registry(service, ready=ready, collectors=collectors)
            try:
                ops = await OpsServer(port=want, host=host, ready=ready, registry=registry).start()
            except OSError:  # taken: any free one, printed by the caller
                ops = await OpsServer(port=0, host=host, ready=ready, registry=registry).start()
            self.ops[name] = ops
        buses = list(self.buses)
        self._tasks.spawn("consumer-lag", lambda: watch_consumers(buses))
        return self.ops

    async def wait_ready(self, *, timeout: float = 20.0) -> None:
        """Until every allocator sees every node as ready."""
        names = set(self.agents)

        async def seen() -> None:
            # The allocators' read models have no "changed" event; poll them briefly.
            while not all(  # noqa: ASYNC110
                names <= {n for n, r in a.nodes.items() if r.status == "ready"} for a in self.allocators
            ):
                await asyncio.sleep(0.05)

        await asyncio.wait_for(seen(), timeout)

    async def stop(self) -> None:
        await self._tasks.aclose()
        for ops in self.ops.values():
            await ops.stop()
        for agent in self.agents.values():
            await agent.stop()
        for allocator in self.allocators:
            await allocator.stop()
        if self.inventory is not None:
            await self.inventory.stop()
        for bus in self.buses:
            await bus.close()


class LocalEvictor:
    """What the pod bridge does with a preemption plan, without Kubernetes: each victim is
    released on its node's release subject, with the bridge's message id (so a redelivered
    plan releases nothing twice), as the bridge does once the Eviction API removed the pod."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def run(self) -> None:
        await self.bus.consume(
            stream=subjects.ALLOC_STREAM,
            durable=subjects.CONSUMER_BRIDGE_PREEMPT,
            filter_subject=subjects.ALLOC_PREEMPT,
            decoder=codec.ALLOC_EVENT,
            handler=self.on_plan,
        )

    async def on_plan(self, msg: Any, _: Delivery) -> None:
        if not isinstance(msg, PreemptionPlan):
            return
        for victim in msg.victims:
            subject = subjects.alloc_release(victim.node)
            release = Release(
                request_id=victim.request_id,
                pod=victim.pod,
                node=victim.node,
                reason=f"preempted by {msg.request_id} (priority {msg.priority})",
            )
            msg_id = subjects.msg_id("release", victim.request_id, subject)
            await self.bus.publish(subject, release, msg_id=msg_id)


class LocalClaims:
    """What the pod bridge does for a ``DeviceClaim`` no pod uses, without Kubernetes.

    A claim here is its allocation request alone (``tandem submit --claim NS/NAME``). The keeper
    follows the claim requests in KV ``tandem-requests`` and, with the bridge's own rules
    (:mod:`services.admission.claims`), writes each claim's :class:`ClaimRecord` to
    ``tandem-claims`` when it changes (Pending with the allocator's reason, Allocated with its
    node and devices, Released, Invalid) and releases a reservation when its deadline passes —
    at once, since no pod can use a claim here. It waits for a change or the next deadline,
    never polls; an assignment whose node record has not landed yet is looked at again
    shortly."""

    AGAIN_S = 0.1  # an assigned claim whose node record has not landed yet

    def __init__(self, bus: Bus, *, clock: Callable[[], float] = time.time) -> None:
        self.bus = bus
        self.clock = clock
        self.requests: dict[str, RequestRecord] = {}  # claim requests, by KV key
        self.written: dict[str, ClaimRecord] = {}
        self.released: dict[str, str] = {}  # request id -> why this keeper released it
        # request id -> (node, its assignment there), once read: every settle looks at every
        # claim, and an assignment does not change while its record stays assigned there
        self._held: dict[str, tuple[str, Assignment]] = {}
        self._changed = asyncio.Event()

    def on_record(self, key: str, record: RequestRecord | None, _: int) -> None:
        if record is not None and record.request.claim is None:
            return  # a pod's request
        if record is None:
            if self.requests.pop(key, None) is None:
                return
        else:
            self.requests[key] = record
        self._changed.set()

    async def watch(self) -> None:
        await watch_bucket(self.bus.js, subjects.KV_REQUESTS, codec.REQUEST_RECORD, self.on_record)

    async def run(self) -> None:
        while True:
            self._changed.clear()
            wait = await self.settle()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait)

    async def settle(self) -> float | None:
        """Bring every claim's record up to date and release the reservations that are due;
        returns how long until something is due without a change (None: nothing is)."""
        now = self.clock()
        kv = await self.bus.kv(subjects.KV_CLAIMS)
        for key in [k for k in self.written if k not in self.requests]:
            del self.written[key]  # its request record is gone (finished and expired)
            with contextlib.suppress(KeyNotFoundError):
                await kv.delete(key)
        waits: list[float] = []
        for key, record in list(self.requests.items()):
            state = await self._state(record)
            if state.phase == "Pending" and record.state == "assigned":
                waits.append(self.AGAIN_S)
            if claims.expiry_due(state, now=now) and state.request_id not in self.released:
                await self._release(record, reason="reservation expired")
                state.released, state.phase, state.reason = True, "Released", "reservation expired"
            elif state.expires_at is not None and not state.released and state.phase != "Invalid":
                waits.append(max(0.0, state.expires_at - now))
            claim = claims.claim_record(state, now=now)
            if msgspec.structs.replace(claim, updated_at=0.0) != _unstamped(self.written.get(key)):
                await kv.put(key, codec.encode(claim))
                self.written[key] = claim
        return min(waits) if waits else None

    async def _state(self, record: RequestRecord) -> claims.ClaimState:
        req = record.request
        marker = req.claim
        assert marker is not None
        view = claims.ClaimView(
            namespace=req.pod.namespace,
            name=req.pod.name,
            uid=req.pod.uid,
            created=req.created_at,
            spec=claims.ClaimSpec(shareable=marker.shareable),
        )
        state = claims.ClaimState(view=view, request=req, reason=record.reason)
        if record.state != "assigned":
            self._held.pop(req.request_id, None)
        if record.state in ("freed", "cancelled"):
            why = self.released.get(req.request_id, "released")
            state.phase, state.released, state.reason = "Released", True, why
        elif record.state == "rejected":
            state.phase = "Invalid"
        elif record.state == "assigned" and record.node:
            held = self._held.get(req.request_id)
            if held is None or held[0] != record.node:
                found = await self._assignment(record.node, req.request_id)
                held = (record.node, found) if found is not None else None
                if held is not None:
                    self._held[req.request_id] = held
            state.assignment = held[1] if held is not None else None
            if state.assignment is not None:
                state.phase, state.reason = "Allocated", ""
            else:
                state.reason = f"being placed on {record.node}"
        return state

    async def _assignment(self, node: str, rid: str) -> Assignment | None:
        for record in await TandemClient(self.bus).allocations([node]):
            held = record.allocations.get(rid)
            if held is not None:
                return held.assignment
        return None

    async def _release(self, record: RequestRecord, *, reason: str) -> None:
        rid = record.request.request_id
        self.released[rid] = reason
        subject = subjects.alloc_release(record.node)
        release = Release(request_id=rid, pod=record.request.pod, node=record.node, reason=reason)
        await self.bus.publish(subject, release, msg_id=subjects.msg_id("release", rid, subject))


def _unstamped(record: ClaimRecord | None) -> ClaimRecord | None:
    return msgspec.structs.replace(record, updated_at=0.0) if record is not None else None
