"""Node topology: the tree a node agent discovers and the allocator reasons about.

A node is a tree ``node → socket → NUMA node → PCIe root complex → (PCIe switch) → device``.
The tree is the contract between the node agent's discovery backends (NVML + sysfs, or a
topology file for simulated nodes) and the allocator; it is also the on-disk *topology file
format* (JSON or YAML, validated by :class:`NodeTopology`; see ``docs/topology.md``).

Devices hang either under a PCIe switch (``PcieSwitch.gpus`` / ``.nics``) or directly under a
root complex (``PcieRoot.gpus`` / ``.nics``, the ``PHB`` relation of ``nvidia-smi topo -m``).
Every device has a stable ``id``: ``gpu<index>`` for GPUs and the RDMA device name
(``mlx5_0``) for NICs and their virtual functions, so health events, cordons and allocation
records can name a device without repeating its location.

:func:`locate` flattens the tree into :class:`DeviceLocation` rows, the form every consumer
actually needs (which switch / root / NUMA node / socket a device is under).
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec

__all__ = [
    "MIG_PROFILE_PATTERN",
    "SCOPES",
    "DeviceLocation",
    "Gpu",
    "LinkType",
    "MigInstance",
    "MigProfile",
    "Nic",
    "NodeTopology",
    "NumaNode",
    "NvlinkDomain",
    "PcieRoot",
    "PcieSwitch",
    "Scope",
    "Socket",
    "TopologyError",
    "VirtualFunction",
    "locate",
    "mig_device_id",
    "scope_between",
]


class Scope(enum.IntEnum):
    """Alignment scopes, finest first. The integer order is the quality order."""

    PCIE_SWITCH = 0
    PCIE_ROOT = 1
    NUMA = 2
    SOCKET = 3
    NODE = 4

    @property
    def wire(self) -> str:
        return SCOPE_NAMES[self]

    @classmethod
    def parse(cls, name: str) -> Scope:
        try:
            return _SCOPE_BY_NAME[name]
        except KeyError:
            raise ValueError(
                f"unknown scope {name!r}; expected one of {', '.join(SCOPE_NAMES.values())}"
            ) from None


SCOPE_NAMES: dict[Scope, str] = {
    Scope.PCIE_SWITCH: "pcie-switch",
    Scope.PCIE_ROOT: "pcie-root",
    Scope.NUMA: "numa",
    Scope.SOCKET: "socket",
    Scope.NODE: "node",
}
_SCOPE_BY_NAME = {v: k for k, v in SCOPE_NAMES.items()}
SCOPES: tuple[str, ...] = tuple(SCOPE_NAMES.values())

ScopeName = Literal["pcie-switch", "pcie-root", "numa", "socket", "node"]
LinkType = Literal["infiniband", "ethernet"]
BusId = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")]
DeviceName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]


class TopologyError(ValueError):
    """A topology tree that parses but is inconsistent (duplicate ids, bad NVLink peers)."""


# A MIG profile as NVIDIA names it: "<compute slices>g.<memory>gb", optionally with a media
# or extended-memory suffix ("1g.10gb", "3g.40gb", "1g.12gb+me", "1g.20gb", "7g.80gb").
MIG_PROFILE_PATTERN = r"^[1-8]g\.[0-9]{1,4}gb(\+[a-z]{1,8})?$"
MigProfile = Annotated[str, msgspec.Meta(pattern=MIG_PROFILE_PATTERN)]
MigUuid = Annotated[str, msgspec.Meta(min_length=5, max_length=96, pattern=r"^MIG-[A-Za-z0-9/-]+$")]


class MigInstance(msgspec.Struct, gc=False, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """One MIG device of a GPU in MIG mode: a (GPU instance, compute instance) pair that
    CUDA sees as a device named by ``uuid`` (``MIG-...``). It sits where its GPU sits (same
    PCIe switch, root, NUMA node), so a NIC aligned with the GPU is aligned with it.

    ``id`` (``gpu<parent>-mig<gi>-<ci>``) is its device id in holds and allocation records,
    like ``gpu<index>`` for a whole GPU; Tandem never creates or destroys instances."""

    profile: MigProfile
    uuid: MigUuid
    gpu_instance_id: Annotated[int, msgspec.Meta(ge=0, le=255)]
    compute_instance_id: Annotated[int, msgspec.Meta(ge=0, le=255)] = 0
    memory_mib: Annotated[int, msgspec.Meta(ge=0)] = 0


def mig_device_id(gpu_index: int, gpu_instance_id: int, compute_instance_id: int) -> str:
    """The device id of a MIG instance: ``gpu<parent index>-mig<gi>-<ci>``."""
    return f"gpu{gpu_index}-mig{gpu_instance_id}-{compute_instance_id}"


class Gpu(msgspec.Struct, gc=False, forbid_unknown_fields=False, omit_defaults=True):
    index: Annotated[int, msgspec.Meta(ge=0)]
    uuid: str
    model: str = "unknown"
    memory_mib: Annotated[int, msgspec.Meta(ge=0)] = 0
    minor: int | None = None
    pci_bus_id: BusId | None = None
    nvlink_peers: list[int] = []
    # MIG (docs/sharing.md, "MIG"): a GPU in MIG mode is never handed out whole (nor shared);
    # its existing instances are, one request each.
    mig_mode: bool = False
    mig_instances: list[MigInstance] = []

    @property
    def id(self) -> str:
        return f"gpu{self.index}"

    def mig_ids(self) -> list[tuple[str, MigInstance]]:
        """(device id, instance) of each MIG instance, in listed order."""
        i = self.index
        return [(mig_device_id(i, m.gpu_instance_id, m.compute_instance_id), m) for m in self.mig_instances]


class VirtualFunction(msgspec.Struct, gc=False, omit_defaults=True):
    """An SR-IOV VF of an RDMA NIC. ``name`` is its own RDMA device name (e.g. ``mlx5_12``)."""

    index: Annotated[int, msgspec.Meta(ge=0)]
    name: DeviceName
    pci_bus_id: BusId | None = None
    netdev: str | None = None


class Nic(msgspec.Struct, gc=False, omit_defaults=True):
    """An RDMA NIC (physical function). ``name`` is the RDMA device name (``mlx5_0``)."""

    name: DeviceName
    pci_bus_id: BusId | None = None
    netdev: str | None = None
    link_type: LinkType = "infiniband"
    speed_gbps: Annotated[int, msgspec.Meta(ge=0)] = 0
    port_state: Literal["active", "down", "init", "unknown"] = "active"
    vfs: list[VirtualFunction] = []

    @property
    def id(self) -> str:
        return self.name


class PcieSwitch(msgspec.Struct, gc=False, omit_defaults=True):
    id: DeviceName
    gpus: list[Gpu] = []
    nics: list[Nic] = []


class PcieRoot(msgspec.Struct, gc=False, omit_defaults=True):
    id: DeviceName
    switches: list[PcieSwitch] = []
    gpus: list[Gpu] = []
    nics: list[Nic] = []


class NumaNode(msgspec.Struct, gc=False, omit_defaults=True):
    id: Annotated[int, msgspec.Meta(ge=0)]
    roots: list[PcieRoot] = []


class Socket(msgspec.Struct, gc=False, omit_defaults=True):
    id: Annotated[int, msgspec.Meta(ge=0)]
    numa_nodes: list[NumaNode] = []


class NvlinkDomain(msgspec.Struct, gc=False, omit_defaults=True, frozen=True, forbid_unknown_fields=True):
    """The multi-node NVLink domain a node's GPUs belong to (GB200 NVL72: 18 trays, one
    domain), as NVML's GPU fabric info reports it (``nvmlDeviceGetGpuFabricInfo``:
    ``clusterUuid``, ``cliqueId``). Nodes with equal ``cluster_uuid`` *and* ``clique_id`` can
    reach each other's GPUs over NVLink; a job may require or prefer one domain."""

    cluster_uuid: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9-]+$")]
    clique_id: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)] = 0

    @property
    def key(self) -> str:
        """One string naming the domain: ``<cluster uuid>/<clique id>``."""
        return f"{self.cluster_uuid}/{self.clique_id}"


class NodeTopology(msgspec.Struct, gc=False, omit_defaults=True):
    """One node's hardware tree; also the topology file format.

    ``nvlink_partitions`` lists GPU index sets that form NVLink domains or partitions the
    allocator prefers to keep whole (for an 8-GPU Hopper board ``[[0,1],[2,3],...,[0..7]]``);
    empty means "derive from ``nvlink_peers``".
    """

    name: DeviceName
    sockets: list[Socket]
    description: str = ""
    labels: dict[str, str] = {}
    nvlink_partitions: list[list[int]] = []
    # Added later (defaults keep older files and messages valid): the node's multi-node
    # NVLink domain, when its GPUs are in one (NVML fabric info, or set in the file).
    nvlink_domain: NvlinkDomain | None = None

    def gpus(self) -> list[Gpu]:
        return [loc.device for loc in locate(self) if isinstance(loc.device, Gpu)]

    def nics(self) -> list[Nic]:
        return [loc.device for loc in locate(self) if isinstance(loc.device, Nic)]

    def validate(self) -> NodeTopology:
        """Check cross-references msgspec cannot (unique ids, NVLink peers exist)."""
        seen: set[str] = set()
        indices: set[int] = set()
        for loc in locate(self):
            dev = loc.device
            names = [dev.id]
            if isinstance(dev, Nic):
                names += [vf.name for vf in dev.vfs]
            for n in names:
                if n in seen:
                    raise TopologyError(f"{self.name}: device id {n!r} appears twice")
                seen.add(n)
            if isinstance(dev, Gpu):
                indices.add(dev.index)
                self._validate_mig(dev, seen)
        for gpu in self.gpus():
            bad = [p for p in gpu.nvlink_peers if p not in indices or p == gpu.index]
            if bad:
                raise TopologyError(f"{self.name}: gpu{gpu.index} has unknown NVLink peers {bad}")
        for i, part in enumerate(self.nvlink_partitions):
            bad = [g for g in part if g not in indices]
            if bad:
                raise TopologyError(f"{self.name}: nvlink_partitions[{i}] names unknown GPUs {bad}")
        return self

    def _validate_mig(self, gpu: Gpu, seen: set[str]) -> None:
        """MIG instances only on a GPU in MIG mode; unique device ids and UUIDs node-wide."""
        if gpu.mig_instances and not gpu.mig_mode:
            raise TopologyError(f"{self.name}: gpu{gpu.index} lists MIG instances but mig_mode is false")
        for dev_id, inst in gpu.mig_ids():
            for key in (dev_id, inst.uuid):
                if key in seen:
                    what = "MIG instance" if key == dev_id else "MIG UUID"
                    raise TopologyError(f"{self.name}: {what} {key!r} appears twice")
                seen.add(key)


class DeviceLocation(msgspec.Struct, gc=False, frozen=True):
    """Where a device sits: the ids of its ancestors. ``switch`` is None when on the root."""

    device: Gpu | Nic
    socket: int
    numa: int
    root: str
    switch: str | None

    def key(self, scope: Scope) -> tuple[object, ...] | None:
        """The group this device belongs to at ``scope`` (None: no such group, e.g. no switch)."""
        if scope is Scope.PCIE_SWITCH:
            return None if self.switch is None else (self.root, self.switch)
        if scope is Scope.PCIE_ROOT:
            return (self.root,)
        if scope is Scope.NUMA:
            return (self.numa,)
        if scope is Scope.SOCKET:
            return (self.socket,)
        return ()


def locate(topo: NodeTopology) -> list[DeviceLocation]:
    """Flatten the tree, in tree order, into one location row per GPU and NIC (PF)."""
    out: list[DeviceLocation] = []
    for sock in topo.sockets:
        for numa in sock.numa_nodes:
            for root in numa.roots:
                devices: list[Gpu | Nic] = [*root.gpus, *root.nics]
                out.extend(DeviceLocation(d, sock.id, numa.id, root.id, None) for d in devices)
                for sw in root.switches:
                    under: list[Gpu | Nic] = [*sw.gpus, *sw.nics]
                    out.extend(DeviceLocation(d, sock.id, numa.id, root.id, sw.id) for d in under)
    return out


def scope_between(a: DeviceLocation, b: DeviceLocation) -> Scope:
    """The finest scope that holds both devices."""
    for scope in Scope:
        ka = a.key(scope)
        if ka is not None and ka == b.key(scope):
            return scope
    return Scope.NODE
