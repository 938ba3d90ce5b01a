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
from schemas.topology import BusId, DeviceName, MigProfile, NodeTopology, ScopeName

__all__ = [
    "AllocRecord",
    "AllocationFailed",
    "AllocationRequest",
    "AllocatorHeartbeat",
    "Applied",
    "AssignedGpu",
    "AssignedMig",
    "AssignedNic",
    "Assignment",
    "ClaimMarker",
    "ClaimRecord",
    "Cleaned",
    "DeadLetter",
    "DeviceCommand",
    "DeviceHealth",
    "Freed",
    "HealthEvent",
    "Heartbeat",
    "InventoryQuery",
    "InventoryReply",
    "JobRecord",
    "JobRequest",
    "NetworkSpec",
    "NodeAllocations",
    "NodeInventory",
    "NodeLabels",
    "NodeRecord",
    "Pair",
    "PodRef",
    "PreemptionMode",
    "PreemptionPlan",
    "Release",
    "RequestRecord",
    "Victim",
    "now",
]

# Names that go into subjects and KV keys: Kubernetes names are DNS subdomains, so this
# pattern accepts every real node name and rejects what would break a subject.
NodeName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=253, pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$")
]
# What a submitter names a request or a job with; an allocation's id is that, or ``JOB/INDEX``
# for pod INDEX of a job (so a job's pods can never collide with a request's id).
SubmitId = Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_=.-]+$")]
RequestId = Annotated[
    str, msgspec.Meta(min_length=1, max_length=210, pattern=r"^[A-Za-z0-9_=.-]+(/[0-9]{1,4})?$")
]
Count = Annotated[int, msgspec.Meta(ge=0, le=64)]
# Free-form text (reasons, errors) and the other bounded strings (schemas.limits).
Text = Annotated[str, msgspec.Meta(max_length=limits.TEXT)]
ShortText = Annotated[str, msgspec.Meta(max_length=limits.K8S_NAME)]
LabelKey = Annotated[str, msgspec.Meta(min_length=1, max_length=limits.LABEL_KEY)]
LabelValue = Annotated[str, msgspec.Meta(max_length=limits.LABEL_VALUE)]
DeviceList = Annotated[list[DeviceName], msgspec.Meta(max_length=limits.MAX_DEVICES)]
Policy = Literal["required", "preferred"]
# A fabric tier's name (``tandem.io/fabric-<tier>`` labels; allocator config orders them).
TierName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=40, pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
]
PreemptionMode = Literal["never", "lower-priority"]
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
    request_id: SubmitId
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
    # A DeviceClaim's request (docs/sharing.md "Claims"): held until the claim is released,
    # not until a pod ends. ``None`` for a pod's own request.
    claim: ClaimMarker | None = None
    # Fractional GPUs (docs/sharing.md): a share of each of the ``gpus`` GPUs instead of the
    # whole GPU. Either or both; a class with ``sharing: none`` refuses them.
    gpu_memory_mib: Annotated[int, msgspec.Meta(ge=1, le=2**24)] | None = None
    gpu_cores_percent: Annotated[int, msgspec.Meta(ge=1, le=100)] | None = None
    # May this request evict allocations of lower priority when it cannot be placed
    # (docs/sharing.md, "Preemption")? None: the device class says (default "never").
    preemption: PreemptionMode | None = None
    # MIG (docs/sharing.md, "MIG"): ``gpus`` existing MIG instances of this profile
    # ("1g.10gb") instead of whole GPUs; not together with shares.
    mig_profile: MigProfile | None = None

    @property
    def shared(self) -> bool:
        """Asks shares of GPUs, not whole GPUs."""
        return self.gpu_memory_mib is not None or self.gpu_cores_percent is not None


class ClaimMarker(msgspec.Struct, gc=False, omit_defaults=True, kw_only=True):
    """What marks an ``AllocationRequest`` as a ``DeviceClaim``'s (the request's ``pod`` names
    the claim: namespace, name, uid). ``expires_at`` is a reservation's deadline (Unix
    seconds; ``None``: held until the claim is deleted); the pod bridge enforces it."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=limits.K8S_NAME)]
    shareable: bool = False
    expires_at: float | None = None


class JobRequest(_Msg, tag="job.request"):
    """A whole job: ``pods`` identical pods placed all-or-nothing (see ``core.gang``).

    Each pod asks the per-pod template (``gpus`` … ``node_selector``, the same fields and
    bounds as :class:`AllocationRequest`). ``fabric`` names a fabric tier (``leaf``) the job
    wants to stay within: ``required`` never spans above it, ``preferred`` falls back to the
    smallest tier that can take the job. ``nvlink_domain``: all pods in one multi-node NVLink
    domain (same cluster UUID and clique id), required or preferred; None ignores domains.
    Pod ``i`` (0-based) is held under :meth:`pod_id` (``JOB/i``).
    """

    job_id: SubmitId
    pods: Annotated[int, msgspec.Meta(ge=1, le=limits.MAX_JOB_PODS)]
    gpus: Count
    namespace: Annotated[str, msgspec.Meta(max_length=limits.K8S_NAMESPACE)] = ""
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
    fabric: TierName | None = None
    fabric_policy: Policy = "preferred"
    nvlink_domain: Policy | None = None
    created_at: float = msgspec.field(default_factory=now)
    # The job's pods in index order, when known (the bridge knows them: it requests a job
    # once all its pods exist); pod ``i``'s assignment names ``members[i]``.
    members: Annotated[list[PodRef], msgspec.Meta(max_length=limits.MAX_JOB_PODS)] = []

    def member(self, index: int) -> PodRef:
        """Pod ``index``'s reference: ``members[index]`` or, without members, a name
        ``JOB-INDEX`` in the job's namespace (the planner, the CLI)."""
        if index < len(self.members):
            return self.members[index]
        return PodRef(namespace=self.namespace, name=f"{self.job_id}-{index}")

    def pod_id(self, index: int) -> str:
        """The hold / request id of pod ``index``: ``JOB/INDEX``."""
        return f"{self.job_id}/{index}"

    def template(self) -> AllocationRequest:
        """One pod's request (``request_id`` = the job id; the core reads only the template)."""
        return AllocationRequest(
            request_id=self.job_id,
            pod=PodRef(namespace=self.namespace, name=self.job_id),
            gpus=self.gpus,
            rdma=self.rdma,
            scope=self.scope,
            policy=self.policy,
            pairing=self.pairing,
            device_class=self.device_class,
            priority=self.priority,
            node_selector=self.node_selector,
            network=self.network,
            created_at=self.created_at,
        )


class AssignedGpu(msgspec.Struct, gc=False, omit_defaults=True):
    """One GPU handed to the pod: whole, or a share when ``memory_mib`` / ``cores_percent``
    is set (the share's memory, 0 when only compute was asked, and compute percent)."""

    index: int
    uuid: str
    pci_bus_id: BusId | None = None
    memory_mib: int | None = None
    cores_percent: int | None = None
    # Set when the pod gets a MIG instance of this GPU (a MIG request), not the GPU itself.
    mig: AssignedMig | None = None

    @property
    def shared(self) -> bool:
        return self.memory_mib is not None or self.cores_percent is not None

    @property
    def device_id(self) -> str:
        """The held device: ``gpu<index>``, or the MIG instance's id (``gpu<index>-mig<gi>-<ci>``)."""
        return self.mig.device if self.mig is not None else f"gpu{self.index}"


class AssignedMig(msgspec.Struct, gc=False, omit_defaults=True, frozen=True):
    """The MIG instance of an :class:`AssignedGpu`: profile, ``MIG-`` UUID (what
    ``NVIDIA_VISIBLE_DEVICES`` names), device id, and NVML's GPU / compute instance ids."""

    profile: MigProfile
    uuid: Annotated[str, msgspec.Meta(min_length=5, max_length=96, pattern=r"^MIG-[A-Za-z0-9/-]+$")]
    device: DeviceName
    gpu_instance_id: int = 0
    compute_instance_id: int = 0


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
    # Why the pairs are coarser than the request's scope, for people (``tandem explain``);
    # empty when the scope was met.
    scope_note: Text = ""

    def device_ids(self) -> list[str]:
        return [g.device_id for g in self.gpus] + [n.name for n in self.nics]

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


class Victim(msgspec.Struct, gc=False, omit_defaults=True):
    """One allocation to evict: its request, its pod, where it runs and its priority."""

    request_id: RequestId
    pod: PodRef
    node: NodeName
    priority: int = 0


class PreemptionPlan(_Msg, tag="alloc.preempt"):
    """The allocator's intent to evict ``victims`` so that ``request_id`` (of ``priority``)
    can be placed on ``node`` once their devices are cleaned. The pod bridge evicts the
    victims' pods through the Kubernetes Eviction API (respecting PodDisruptionBudgets);
    their normal release then frees the devices."""

    request_id: RequestId
    pod: PodRef
    node: NodeName
    priority: int = 0
    victims: Annotated[list[Victim], msgspec.Meta(max_length=limits.MAX_DEVICES)] = []
    ts: float = msgspec.field(default_factory=now)


class AllocatorHeartbeat(_Msg, tag="allocator.heartbeat"):
    """An allocator replica saying it is alive (core NATS). The replicas seen alive split the
    nodes between them, so that they rarely decide on the same node."""

    instance: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    ts: float = msgspec.field(default_factory=now)
    # When this replica's process started (the same in all its beats): a new value under a
    # known name is a replica that restarted. 0: a sender that does not say.
    started: float = 0.0


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


class ForwardReply(_Msg, tag="reply.forward"):
    """The answer of the replica a request was handed to (``tandem.allocator.forward.<name>``):
    ``outcome`` is what its placement ended in — ``assigned``, ``duplicate`` (placed or in
    hand already), ``rejected``, ``pending`` (recorded so there), or ``no_room`` (its shard
    cannot take the request and it recorded nothing: the sender decides itself) — or
    ``error`` says why it could not try."""

    outcome: Annotated[str, msgspec.Meta(max_length=32)] = ""
    error: Text = ""


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
    # ``prepared``: a job's pod reserved by the first phase of a job commit
    # (services/allocator/jobplacement.py); it holds its devices but no agent acts on it until the
    # job record says ``committed`` and the allocator turns it ``assigned``. (Whether the
    # node applied it is an event, ``Applied``, not a state of the record: docs/architecture.md.)
    state: Literal["prepared", "assigned", "releasing"] = "assigned"
    priority: int = 0
    traceparent: str = ""
    updated_at: float = msgspec.field(default_factory=now)
    # The job this allocation is a pod of, and the job commit attempt (the job record's
    # ``epoch``) that prepared it; "" / 0 for a single request.
    job: str = ""
    epoch: int = 0
    # False: never evicted to make room for a request of higher priority (a claim, unless
    # it allows it; docs/sharing.md, "Preemption").
    preemptible: bool = True


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
    # A pending request that preempts: the allocations being evicted for it and the node it
    # goes to once they are freed (services/allocator/evictionplans.py).
    victims: Annotated[list[RequestId], msgspec.Meta(max_length=limits.MAX_DEVICES)] = []
    preempt_node: str | None = None
    # The devices kept for it there meanwhile (every replica reserves them).
    preempt_devices: DeviceList = []


class JobRecord(msgspec.Struct, gc=False, omit_defaults=True, kw_only=True):
    """Where one job stands (bucket ``KV_JOBS``, key = job id); the commit point of a job.

    A job is committed in two phases (services/allocator/jobplacement.py): the replica that claims it
    writes ``committing`` with a new ``epoch`` and the ``nodes`` it will prepare on, reserves
    every pod as a ``prepared`` allocation on its node's record, then moves this record from
    ``committing`` to ``committed`` with one compare-and-set — the moment the job is placed.
    A ``committing`` record whose owner stopped renewing it is aborted (``aborted``), and
    every ``prepared`` allocation of an epoch that is not committing or committed is dropped.
    """

    job: JobRequest
    state: Literal["pending", "committing", "committed", "aborted", "rejected", "cancelled", "released"]
    epoch: int = 0
    owner: str = ""
    nodes: list[str] = []
    # Pod index → node, once committed (what a redelivery republishes from).
    placement: list[str] = []
    reason: str = ""
    updated_at: float = msgspec.field(default_factory=now)
    traceparent: str = ""


class NodeLabels(msgspec.Struct, gc=False, omit_defaults=True, kw_only=True):
    """A node's labels from the Kubernetes Node object that the allocator places by (bucket
    ``KV_NODE_LABELS``, key = node; written by the pod bridge, which watches Nodes): the
    fabric blocks (``tandem.io/fabric-<tier>``). They join the labels of the node's topology."""

    node: str
    labels: Annotated[dict[LabelKey, LabelValue], msgspec.Meta(max_length=limits.MAX_SELECTOR_TERMS)] = {}
    updated_at: float = msgspec.field(default_factory=now)


class ClaimRecord(msgspec.Struct, gc=False, omit_defaults=True, kw_only=True):
    """A ``DeviceClaim`` as the pod bridge sees it (bucket ``KV_CLAIMS``, key = the claim's
    request id): its phase, devices and the pods using it, for the CLI (which reads NATS only)
    and for a restarted bridge. The claim's status in Kubernetes says the same."""

    request_id: str
    namespace: str
    name: str
    uid: str = ""
    phase: Literal["Pending", "Allocated", "Released", "Invalid"] = "Pending"
    node: str | None = None
    devices: list[str] = []
    pods: list[str] = []
    shareable: bool = False
    expires_at: float | None = None
    reason: str = ""
    updated_at: float = msgspec.field(default_factory=now)
