"""Every message on the wire and every record in JetStream KV.

Messages are msgspec Structs tagged on an explicit, stable ``kind`` field, so one decoder per
stream handles a union of message types and a reader can always tell what it holds. Rules
that keep versions rolling (see DESIGN.md "Messaging contract"):

* new fields always get defaults; unknown fields are ignored on decode;
* ``kind`` values never change once published;
* an allocation is identified by ``request_id`` (pod UID + request generation), which every
  handler uses as its idempotency key and every publisher uses to build ``Nats-Msg-Id``.

The flow of one pod: ``AllocationRequest`` → ``Assignment`` (or ``AllocationFailed``) →
``Applied`` → ``Release`` → ``Cleaned`` → ``Freed``.  Node agents also publish
``NodeInventory``, ``HealthEvent`` and ``Heartbeat``; operators and the demo send
``DeviceCommand``.  Records kept in KV (``NodeRecord``, ``NodeAllocations``,
``RequestRecord``) are Structs too, encoded with the same codecs.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

import msgspec

from schemas import limits
from schemas.topology import BusId, DeviceName, NodeTopology, ScopeName

__all__ = [
    "AllocRecord",
    "AllocationFailed",
    "AllocationRequest",
    "AllocatorHeartbeat",
    "Applied",
    "AssignedGpu",
    "AssignedNic",
    "Assignment",
    "Cleaned",
    "DeadLetter",
    "DeviceCommand",
    "DeviceHealth",
    "Freed",
    "HealthEvent",
    "Heartbeat",
    "InventoryQuery",
    "InventoryReply",
    "NetworkSpec",
    "NodeAllocations",
    "NodeInventory",
    "NodeRecord",
    "Pair",
    "PodRef",
    "Release",
    "RequestRecord",
    "now",
]

# Names that go into subjects and KV keys: Kubernetes names are DNS subdomains, so this
# pattern accepts every real node name and rejects what would break a subject.
NodeName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=253, pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$")
]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_=.-]+$")]
Count = Annotated[int, msgspec.Meta(ge=0, le=64)]
# Free-form text (reasons, errors) and the other bounded strings (schemas.limits).
Text = Annotated[str, msgspec.Meta(max_length=limits.TEXT)]
ShortText = Annotated[str, msgspec.Meta(max_length=limits.K8S_NAME)]
LabelKey = Annotated[str, msgspec.Meta(min_length=1, max_length=limits.LABEL_KEY)]
LabelValue = Annotated[str, msgspec.Meta(max_length=limits.LABEL_VALUE)]
DeviceList = Annotated[list[DeviceName], msgspec.Meta(max_length=limits.MAX_DEVICES)]
Policy = Literal["required", "preferred"]
Pairing = Literal["per-gpu", "shared"]


def now() -> float:
    return time.time()


class _Msg(msgspec.Struct, gc=False, tag_field="kind", omit_defaults=True, kw_only=True):
    """Base of every wire message: tagged on ``kind``, unknown fields ignored."""


class PodRef(msgspec.Struct, gc=False, omit_defaults=True):
    namespace: Annotated[str, msgspec.Meta(max_length=limits.K8S_NAMESPACE)]
    name: Annotated[str, msgspec.Meta(max_length=limits.K8S_NAME)]
    uid: Annotated[str, msgspec.Meta(max_length=limits.K8S_UID)] = ""


# ---------------------------------------------------------------------------------------------
# node → inventory


class DeviceHealth(msgspec.Struct, gc=False, omit_defaults=True):
    healthy: bool = True
    cordoned: bool = False
    reason: Text = ""
    since: float = 0.0


class NodeInventory(_Msg, tag="node.inventory"):
    """Full snapshot of one node: topology plus the health of each device by id."""

    node: NodeName
    topology: NodeTopology
    generation: int
    health: Annotated[dict[DeviceName, DeviceHealth], msgspec.Meta(max_length=limits.MAX_DEVICES)] = {}
    agent: ShortText = ""
    ts: float = msgspec.field(default_factory=now)


class HealthEvent(_Msg, tag="node.health"):
    node: NodeName
    device: DeviceName
    healthy: bool
    cordoned: bool = False
    reason: Text = ""
    ts: float = msgspec.field(default_factory=now)


class Heartbeat(_Msg, tag="node.heartbeat"):
    node: NodeName
    seq: int
    generation: int = 0
    ts: float = msgspec.field(default_factory=now)


class DeviceCommand(_Msg, tag="node.command"):
    """An operator's (or the demo's) command to a node agent about one device."""

    node: NodeName
    device: DeviceName
    action: Literal["fail", "recover", "cordon", "uncordon"]
    reason: Text = ""


# ---------------------------------------------------------------------------------------------
# allocation flow


class NetworkSpec(msgspec.Struct, gc=False, omit_defaults=True):
    """How the pod wants its RDMA netdevs: interface names ``<prefix><n>``, MTU, addresses.

    ``addresses`` are CIDRs assigned in NIC order (one per NIC; fewer leaves the rest bare).
    """

    ifname_prefix: Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9]{0,10}$")] = "net"
    mtu: Annotated[int, msgspec.Meta(ge=576, le=9216)] | None = None
    addresses: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=64)]], msgspec.Meta(max_length=limits.MAX_ADDRESSES)
    ] = []


class AllocationRequest(_Msg, tag="alloc.request"):
    request_id: RequestId
    pod: PodRef
    gpus: Count
    rdma: Count = 0
    scope: ScopeName | None = None
    policy: Policy | None = None
    pairing: Pairing | None = None
    device_class: Annotated[str, msgspec.Meta(min_length=1, max_length=limits.LABEL_VALUE)] = "default"
    priority: Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)] = 0
    node_selector: Annotated[
        dict[LabelKey, LabelValue], msgspec.Meta(max_length=limits.MAX_SELECTOR_TERMS)
    ] = {}
    network: NetworkSpec | None = None
    created_at: float = msgspec.field(default_factory=now)
    # Fractional GPUs (docs/sharing.md): a share of each of the ``gpus`` GPUs instead of the
    # whole GPU. Either or both; a class with ``sharing: none`` refuses them.
    gpu_memory_mib: Annotated[int, msgspec.Meta(ge=1, le=2**24)] | None = None
    gpu_cores_percent: Annotated[int, msgspec.Meta(ge=1, le=100)] | None = None

    @property
    def shared(self) -> bool:
        """Asks shares of GPUs, not whole GPUs."""
        return self.gpu_memory_mib is not None or self.gpu_cores_percent is not None


class AssignedGpu(msgspec.Struct, gc=False, omit_defaults=True):
    """One GPU handed to the pod: whole, or a share when ``memory_mib`` / ``cores_percent``
    is set (the share's memory, 0 when only compute was asked, and compute percent)."""

    index: int
    uuid: str
    pci_bus_id: BusId | None = None
    memory_mib: int | None = None
    cores_percent: int | None = None

    @property
    def shared(self) -> bool:
        return self.memory_mib is not None or self.cores_percent is not None


class AssignedNic(msgspec.Struct, gc=False, omit_defaults=True):
    """One NIC handed to the pod. ``pf`` is the physical NIC; ``vf`` set when a VF is used."""

    name: DeviceName
    pf: DeviceName
    vf: int | None = None
    pci_bus_id: BusId | None = None
    netdev: str | None = None
    ifname: str | None = None
    mtu: int | None = None
    mac: str | None = None
    addresses: list[str] = []


class Pair(msgspec.Struct, gc=False):
    gpu: int
    nic: DeviceName
    scope: ScopeName


class Assignment(_Msg, tag="alloc.assigned"):
    request_id: RequestId
    pod: PodRef
    node: NodeName
    gpus: list[AssignedGpu]
    nics: list[AssignedNic] = []
    pairs: list[Pair] = []
    scope: ScopeName = "node"
    candidates: int = 0
    allocator: ShortText = ""
    requested_at: float = 0.0
    decided_at: float = msgspec.field(default_factory=now)
    # How the node agent limits shared GPUs (the device class's ``sharing`` and
    # ``memory_limit``); empty for whole GPUs.
    sharing: Literal["", "hami", "mps"] = ""
    memory_limit: Literal["hard", "soft"] = "hard"

    def device_ids(self) -> list[str]:
        return [f"gpu{g.index}" for g in self.gpus] + [n.name for n in self.nics]

    def shares(self) -> dict[str, tuple[int, int]]:
        """Shared GPUs by device id: (memory MiB, compute percent), 0 for what was not asked."""
        return {f"gpu{g.index}": (g.memory_mib or 0, g.cores_percent or 0) for g in self.gpus if g.shared}


class AllocationFailed(_Msg, tag="alloc.failed"):
    """The request could not be placed now; ``reason`` is written for the pod author."""

    request_id: RequestId
    pod: PodRef
    reason: Text
    retrying: bool = True
    ts: float = msgspec.field(default_factory=now)


class Applied(_Msg, tag="node.applied"):
    request_id: RequestId
    node: NodeName
    ok: bool = True
    error: Text = ""
    ts: float = msgspec.field(default_factory=now)


class Release(_Msg, tag="alloc.release"):
    request_id: RequestId
    pod: PodRef
    node: NodeName | None = None
    reason: Text = ""
    ts: float = msgspec.field(default_factory=now)


class Cleaned(_Msg, tag="node.cleaned"):
    """Cleanup verdict. ``ok`` only when every device was verified clean; else ``problems``."""

    request_id: RequestId
    node: NodeName
    ok: bool = True
    devices: DeviceList = []
    problems: Annotated[list[Text], msgspec.Meta(max_length=limits.MAX_PROBLEMS)] = []
    ts: float = msgspec.field(default_factory=now)


class Freed(_Msg, tag="alloc.freed"):
    request_id: RequestId
    node: NodeName | None = None
    devices: DeviceList = []
    ts: float = msgspec.field(default_factory=now)


class AllocatorHeartbeat(_Msg, tag="allocator.heartbeat"):
    """An allocator replica saying it is alive (core NATS). The replicas seen alive split the
    nodes between them, so that they rarely decide on the same node."""

    instance: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    ts: float = msgspec.field(default_factory=now)


class DeadLetter(_Msg, tag="dlq"):
    """A message a service refused: why, where it came from, and what it was. ``data`` holds
    at most the first ``limits.DEAD_LETTER_SAMPLE_BYTES`` of it; ``size`` and ``digest`` name
    the whole payload (a dead letter is always small, whatever arrived)."""

    service: str
    subject: str
    error: str
    data: bytes
    size: int = 0
    digest: str = ""
    headers: dict[str, str] = {}
    ts: float = msgspec.field(default_factory=now)


# ---------------------------------------------------------------------------------------------
# queries (request/reply, core NATS)


class InventoryQuery(_Msg, tag="query.inventory"):
    node: NodeName | None = None


class InventoryReply(_Msg, tag="reply.inventory"):
    nodes: list[NodeRecord] = []
    error: str = ""


# ---------------------------------------------------------------------------------------------
# KV records


class NodeRecord(msgspec.Struct, gc=False, omit_defaults=True, kw_only=True):
    """Inventory's view of a node (bucket ``KV_NODES``, key = node name)."""

    node: str
    topology: NodeTopology
    health: dict[str, DeviceHealth] = {}
    status: Literal["ready", "lost"] = "ready"
    generation: int = 0
    last_heartbeat: float = 0.0
    updated_at: float = msgspec.field(default_factory=now)
    # The stream sequence of the last node event applied (what orders them, not clocks).
    event_seq: int = 0

    def unavailable(self) -> set[str]:
        return {d for d, h in self.health.items() if not h.healthy or h.cordoned}


class AllocRecord(msgspec.Struct, gc=False, omit_defaults=True, kw_only=True):
    """One allocation in its node's record. ``traceparent`` is the W3C trace context of the
    allocation: the record is what the node agent acts on (one write may carry several
    allocations), so the apply and cleanup spans join the allocation's trace through it."""

    assignment: Assignment
    state: Literal["assigned", "applied", "releasing"] = "assigned"
    priority: int = 0
    traceparent: str = ""
    updated_at: float = msgspec.field(default_factory=now)


class NodeAllocations(msgspec.Struct, gc=False, omit_defaults=True, kw_only=True):
    """The unit of atomicity (bucket ``KV_ALLOCS``, key = node): every device held on a node.

    Written only with compare-and-set on the KV revision, so two allocators can never both
    hand out one device.
    """

    node: str
    allocations: dict[str, AllocRecord] = {}

    def used(self) -> set[str]:
        return {d for rec in self.allocations.values() for d in rec.assignment.device_ids()}


class RequestRecord(msgspec.Struct, gc=False, omit_defaults=True, kw_only=True):
    """Where one request stands (bucket ``KV_REQUESTS``, key = request id)."""

    request: AllocationRequest
    state: Literal["pending", "deciding", "assigned", "releasing", "freed", "cancelled", "rejected"]
    node: str | None = None
    owner: str = ""
    reason: str = ""
    updated_at: float = msgspec.field(default_factory=now)
    # The W3C trace context the request arrived with (its submitter's span): every later
    # decision about it, on any replica, joins that trace instead of starting a new one.
    traceparent: str = ""
