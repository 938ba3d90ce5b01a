"""Hardware shapes: a node's topology compiled into bit masks the search can work on fast.

Two nodes with the same hardware (same device ids, models, memory, NIC kinds, and the same
PCIe / NUMA tree) share one :class:`Shape`; UUIDs, bus ids and netdev names are per-node data
and are not part of the shape, so a fleet of 10,000 identical servers compiles once.

Inside a shape every device is a *slot* with one bit in a mask: GPUs first (slot = position
in tree order), then each NIC physical function followed by its SR-IOV virtual functions. A
node's state is then one integer, the mask of free slots, and ``(shape, free mask)`` is the
key the cluster index and the decision cache are built on.

Alignment groups (PCIe switches, roots, NUMA nodes, sockets) are *units*: each unit has a mask
of the slots under it. A pair's scope is the finest level at which both ends share a unit.
Units form a tree (``unit_parent``: a switch lies in one root, a root in one NUMA node, a NUMA
node in one socket), which the in-node search decomposes along; a unit is keyed by its whole
path, so the tree holds even for a file that repeats a root id under two NUMA nodes.
NVLink partitions are GPU-slot masks too (see :func:`nvlink_partitions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.config import DeviceClass
from schemas.topology import Gpu, Nic, NodeTopology, PcieRoot, PcieSwitch, locate

__all__ = [
    "HOPPER_PARTITIONS",
    "LEVELS",
    "ClassView",
    "NicSlot",
    "Shape",
    "compile_shape",
    "device_at",
    "nvlink_partitions",
    "shape_signature",
]

# PCIe levels, finest first; their integer values equal schemas.topology.Scope's.
LEVELS = 4  # pcie-switch, pcie-root, numa, socket (the fifth scope, node, is everything)

# The standard partition table of an 8-GPU NVSwitch baseboard (Fabric Manager's shared-NVSwitch
# partitions: pairs, quads, all eight). Hopper HGX boards use exactly this; A100/A800 HGX
# boards use the same GPU groupings, so they get it too.
HOPPER_PARTITIONS: tuple[tuple[int, ...], ...] = (
    (0, 1),
    (2, 3),
    (4, 5),
    (6, 7),
    (0, 1, 2, 3),
    (4, 5, 6, 7),
    (0, 1, 2, 3, 4, 5, 6, 7),
)
_PARTITIONED_MODELS = ("H100", "H200", "H800", "H20", "GH100", "A100", "A800")


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def nvlink_partitions(topo: NodeTopology) -> list[tuple[int, ...]]:
    """The NVLink GPU groups the allocator prefers to keep whole, as GPU-index tuples.

    ``topo.nvlink_partitions`` wins when set (the per-node override). Otherwise an 8-GPU
    board whose GPUs are all NVLink peers of each other and whose model is a Hopper (or
    A100/A800) NVSwitch part gets :data:`HOPPER_PARTITIONS`; any other board gets its NVLink
    domains, the connected components of ``nvlink_peers`` with at least two GPUs.
    """
    if topo.nvlink_partitions:
        return [tuple(sorted(set(p))) for p in topo.nvlink_partitions if p]
    gpus = topo.gpus()
    indices = {g.index for g in gpus}
    peers = {g.index: set(g.nvlink_peers) for g in gpus}
    fully_connected = len(gpus) > 1 and all(peers[i] >= indices - {i} for i in indices)
    if (
        len(gpus) == 8
        and indices == set(range(8))
        and fully_connected
        and all(any(m in g.model.upper() for m in _PARTITIONED_MODELS) for g in gpus)
    ):
        return list(HOPPER_PARTITIONS)
    seen: set[int] = set()
    domains: list[tuple[int, ...]] = []
    for start in sorted(indices):
        if start in seen:
            continue
        stack, comp = [start], set()
        while stack:
            i = stack.pop()
            if i in comp:
                continue
            comp.add(i)
            # NVLink is symmetric; accept a link listed on either side.
            stack.extend(p for p in peers[i] if p in indices)
            stack.extend(j for j in indices if i in peers[j])
        seen |= comp
        if len(comp) > 1:
            domains.append(tuple(sorted(comp)))
    return domains


def shape_signature(topo: NodeTopology) -> tuple[object, ...]:
    """Everything about the hardware that can change a decision, and nothing per-node."""
    rows: list[tuple[object, ...]] = []
    for loc in locate(topo):
        d = loc.device
        where = (loc.socket, loc.numa, loc.root, loc.switch)
        if isinstance(d, Gpu):
            rows.append(("g", d.index, d.model, d.memory_mib, *where))
        else:
            vfs = tuple((vf.index, vf.name) for vf in d.vfs)
            rows.append(("n", d.name, d.link_type, d.speed_gbps, *where, vfs))
    return (tuple(rows), tuple(nvlink_partitions(topo)))


@dataclass(frozen=True, slots=True)
class NicSlot:
    """One allocatable NIC: a physical function (``vf is None``) or one of its VFs."""

    slot: int
    name: str
    pf_slot: int
    pf_name: str
    vf: int | None
    link_type: str
    speed_gbps: int
    loc: tuple[int, int, int, int]  # unit id per PCIe level (-1: not under a switch)


@dataclass(slots=True)
class ClassView:
    """What one device class may use on one shape (slot masks), computed once per pair."""

    gpu_ok: int
    nic_ok: int  # NIC slots (PFs and/or VFs) the class may take
    nic_mode: str  # "pf" | "vf" | "any"
    filters_gpus: bool
    filters_nics: bool


@dataclass(slots=True)
class Shape:
    """A compiled hardware shape. Immutable after :func:`compile_shape` except view caches."""

    id: int
    signature: tuple[object, ...]
    n_gpus: int
    gpu_index: list[int]  # gpu slot -> GPU index (device id gpu<index>)
    gpu_model: list[str]
    gpu_memory: list[int]
    gpu_loc: list[tuple[int, int, int, int]]
    nics: list[NicSlot]  # NIC slots in slot order (slot = n_gpus + position)
    n_slots: int
    slot_of: dict[str, int]  # device id -> slot
    slot_id: list[str]  # slot -> device id
    unit_level: list[int]  # unit id -> PCIe level
    unit_mask: list[int]  # unit id -> slots under it
    unit_parent: list[int]  # unit id -> the unit one level up (-1 for a socket)
    level_units: list[list[int]]  # level -> unit ids
    gpu_all: int
    pf_all: int
    vf_all: int
    vf_parent: dict[int, int]  # vf slot -> pf slot
    pf_vfs: dict[int, int]  # pf slot -> mask of its vf slots
    partitions: list[tuple[int, int]]  # (gpu slot mask, size)
    maximal_parts: list[int]  # masks of the partitions no other partition contains
    # slot -> where the device sits in any topology of this shape: indices of socket, NUMA
    # node, root, switch (-1: on the root), device in its holder's gpus/nics, VF (-1: the PF)
    paths: list[tuple[int, int, int, int, int, int]]
    aligned: int  # GPUs that can have a NIC (PF) on their own PCIe switch: the shape's capability
    views: dict[str, ClassView] = field(default_factory=dict)
    _aligned_free: dict[int, int] = field(default_factory=dict)
    # Share candidates by (group mask, class, share size): see .shares._candidates.
    share_fits: dict[tuple[object, ...], tuple[int, int]] = field(default_factory=dict)

    def aligned_free(self, free: int) -> int:
        """GPU/NIC pairs that can still sit on a shared PCIe switch with ``free`` slots free:
        ``sum(min(free GPUs, free NIC PFs))`` over the switches (what :attr:`aligned` is for a
        free node). A node with ``aligned_free(free) >= k`` can take a ``k``-GPU + ``k``-NIC
        job with every pair on a switch (bottom-up matching reaches the per-switch minimum)."""
        got = self._aligned_free.get(free)
        if got is None:
            got = 0
            for u in self.level_units[0]:
                m = self.unit_mask[u] & free
                g = (m & self.gpu_all).bit_count()
                n = (m & self.pf_all).bit_count()
                got += g if g < n else n
            if len(self._aligned_free) > 65536:
                self._aligned_free.clear()
            self._aligned_free[free] = got
        return got

    def loc_of(self, slot: int) -> tuple[int, int, int, int]:
        if slot < self.n_gpus:
            return self.gpu_loc[slot]
        return self.nics[slot - self.n_gpus].loc

    def effective_free(self, blocked: int) -> int:
        """Free-slot mask given the blocked (held or unavailable) slots.

        A PF and its VFs exclude each other: a blocked PF blocks its VFs, and a blocked VF
        makes the PF unusable as a whole NIC.
        """
        for pf, vfs in self.pf_vfs.items():
            if blocked & (1 << pf):
                blocked |= vfs
            elif blocked & vfs:
                blocked |= 1 << pf
        return ((1 << self.n_slots) - 1) & ~blocked

    def view(self, name: str, dc: DeviceClass) -> ClassView:
        v = self.views.get(name)
        if v is None:
            v = self.views[name] = _class_view(self, dc)
        return v


def _class_view(shape: Shape, dc: DeviceClass) -> ClassView:
    models = [m.lower() for m in dc.gpu_models]
    gpu_ok = 0
    for s in range(shape.n_gpus):
        model = shape.gpu_model[s].lower()
        if models and not any(m in model for m in models):
            continue
        if shape.gpu_memory[s] < dc.gpu_min_memory_mib:
            continue
        gpu_ok |= 1 << s
    nic_ok = 0
    any_nic = 0
    for n in shape.nics:
        any_nic |= 1 << n.slot
        if dc.nic_link_type is not None and n.link_type != dc.nic_link_type:
            continue
        if n.speed_gbps < dc.nic_min_speed_gbps:
            continue
        is_vf = n.vf is not None
        if dc.nic_function == "pf" and is_vf:
            continue
        if dc.nic_function == "vf" and not is_vf:
            continue
        if dc.nic_function == "any" and not is_vf and shape.pf_vfs.get(n.slot):
            # "any": an SR-IOV-split NIC is handed out by VF, a NIC without VFs as a whole.
            continue
        nic_ok |= 1 << n.slot
    pf_or_vf = shape.pf_all if dc.nic_function == "pf" else shape.vf_all
    if dc.nic_function == "any":
        pf_or_vf = any_nic
    return ClassView(
        gpu_ok=gpu_ok,
        nic_ok=nic_ok,
        nic_mode=dc.nic_function,
        filters_gpus=gpu_ok != shape.gpu_all,
        filters_nics=nic_ok != pf_or_vf,
    )


class _Units:
    """The alignment units of a topology as :func:`compile_shape` builds them: id per path,
    level, slot mask (filled once the slots are known) and parent."""

    __slots__ = ("ids", "level", "level_units", "mask", "parent")

    def __init__(self) -> None:
        self.ids: dict[tuple[object, ...], int] = {}
        self.level: list[int] = []
        self.mask: list[int] = []
        self.parent: list[int] = []
        self.level_units: list[list[int]] = [[] for _ in range(LEVELS)]

    def unit(self, level: int, key: tuple[object, ...], parent: int) -> int:
        k = (level, *key)
        u = self.ids.get(k)
        if u is None:
            u = self.ids[k] = len(self.level)
            self.level.append(level)
            self.mask.append(0)
            self.parent.append(parent)
            self.level_units[level].append(u)
        return u


Where = tuple[int, int, int, int]  # unit id per PCIe level (-1: not under a switch)


def _located(topo: NodeTopology, units: _Units) -> tuple[list[tuple[Gpu, Where]], list[tuple[Nic, Where]]]:
    """The GPUs and NICs in tree order, each with its units."""
    gpu_rows: list[tuple[Gpu, Where]] = []
    nic_rows: list[tuple[Nic, Where]] = []
    for loc in locate(topo):
        # Keyed by the whole path, so that units nest (the search relies on the tree).
        so = units.unit(3, (loc.socket,), -1)
        nu = units.unit(2, (loc.socket, loc.numa), so)
        rt = units.unit(1, (loc.socket, loc.numa, loc.root), nu)
        sw = -1 if loc.switch is None else units.unit(0, (loc.socket, loc.numa, loc.root, loc.switch), rt)
        where = (sw, rt, nu, so)
        if isinstance(loc.device, Gpu):
            gpu_rows.append((loc.device, where))
        else:
            nic_rows.append((loc.device, where))
    return gpu_rows, nic_rows


class _NicTable:
    """The NIC slots (each PF followed by its VFs) and their masks, from slot ``n_gpus`` on."""

    __slots__ = ("nics", "pf_all", "pf_vfs", "slot_id", "vf_all", "vf_parent")

    def __init__(self, nic_rows: list[tuple[Nic, Where]], n_gpus: int) -> None:
        self.nics: list[NicSlot] = []
        self.slot_id: list[str] = []
        self.pf_vfs: dict[int, int] = {}
        self.vf_parent: dict[int, int] = {}
        self.pf_all = self.vf_all = 0
        nics = self.nics
        for nic, where in nic_rows:
            pf = n_gpus + len(nics)
            nics.append(NicSlot(pf, nic.name, pf, nic.name, None, nic.link_type, nic.speed_gbps, where))
            self.slot_id.append(nic.name)
            self.pf_all |= 1 << pf
            vmask = 0
            for vf in nic.vfs:
                s = n_gpus + len(nics)
                nics.append(NicSlot(s, vf.name, pf, nic.name, vf.index, nic.link_type, nic.speed_gbps, where))
                self.slot_id.append(vf.name)
                vmask |= 1 << s
                self.vf_parent[s] = pf
            if vmask:
                self.pf_vfs[pf] = vmask
            self.vf_all |= vmask


def _paths(topo: NodeTopology) -> list[tuple[int, int, int, int, int, int]]:
    """Every slot's path in the topology (GPUs first, then NICs with their VFs)."""
    gpu_paths: list[tuple[int, int, int, int, int, int]] = []
    nic_paths: list[tuple[int, int, int, int, int, int]] = []
    for si, sock in enumerate(topo.sockets):
        for ni, numa in enumerate(sock.numa_nodes):
            for ri, root in enumerate(numa.roots):
                holders: list[tuple[int, PcieRoot | PcieSwitch]] = [(-1, root)]
                holders.extend(enumerate(root.switches))
                for wi, holder in holders:  # the order of locate(): root devices, then switches
                    gpu_paths.extend((si, ni, ri, wi, di, -1) for di in range(len(holder.gpus)))
                    for di, nic in enumerate(holder.nics):
                        nic_paths.append((si, ni, ri, wi, di, -1))
                        nic_paths.extend((si, ni, ri, wi, di, vi) for vi in range(len(nic.vfs)))
    return gpu_paths + nic_paths


def _partitions(
    topo: NodeTopology, gpu_rows: list[tuple[Gpu, Where]]
) -> tuple[list[tuple[int, int]], list[int]]:
    """The NVLink partitions as (GPU slot mask, size), and the masks of the maximal ones."""
    index_slot = {g.index: s for s, (g, _) in enumerate(gpu_rows)}
    partitions = []
    for part in nvlink_partitions(topo):
        m = 0
        for i in part:
            if i in index_slot:
                m |= 1 << index_slot[i]
        if m.bit_count() > 1:
            partitions.append((m, m.bit_count()))
    masks = {m for m, _ in partitions}
    maximal_parts = sorted(m for m in masks if not any(m != o and m & o == m for o in masks))
    return partitions, maximal_parts


def compile_shape(topo: NodeTopology, *, shape_id: int, signature: tuple[object, ...]) -> Shape:
    """Build the slot/unit tables for ``topo`` (whose signature the caller computed)."""
    units = _Units()
    gpu_rows, nic_rows = _located(topo, units)
    n_gpus = len(gpu_rows)
    gpu_loc = [where for _, where in gpu_rows]
    table = _NicTable(nic_rows, n_gpus)
    slot_id = [g.id for g, _ in gpu_rows] + table.slot_id
    n_slots = len(slot_id)
    unit_mask = units.mask
    for s in range(n_slots):
        where = gpu_loc[s] if s < n_gpus else table.nics[s - n_gpus].loc
        for u in where:
            if u >= 0:
                unit_mask[u] |= 1 << s
    partitions, maximal_parts = _partitions(topo, gpu_rows)
    return Shape(
        id=shape_id,
        signature=signature,
        n_gpus=n_gpus,
        gpu_index=[g.index for g, _ in gpu_rows],
        gpu_model=[g.model for g, _ in gpu_rows],
        gpu_memory=[g.memory_mib for g, _ in gpu_rows],
        gpu_loc=gpu_loc,
        nics=table.nics,
        n_slots=n_slots,
        slot_of={d: s for s, d in enumerate(slot_id)},
        slot_id=slot_id,
        unit_level=units.level,
        unit_mask=unit_mask,
        unit_parent=units.parent,
        level_units=units.level_units,
        gpu_all=(1 << n_gpus) - 1,
        pf_all=table.pf_all,
        vf_all=table.vf_all,
        vf_parent=table.vf_parent,
        pf_vfs=table.pf_vfs,
        partitions=partitions,
        maximal_parts=maximal_parts,
        paths=_paths(topo),
        aligned=sum(
            min((m & ((1 << n_gpus) - 1)).bit_count(), (m & table.pf_all).bit_count())
            for u, m in enumerate(unit_mask)
            if units.level[u] == 0
        ),
    )


def device_at(topo: NodeTopology, path: tuple[int, int, int, int, int, int], *, nic: bool) -> Gpu | Nic:
    """The GPU or NIC (the PF, for a VF path) at ``path`` in a topology of the path's shape."""
    si, ni, ri, wi, di, _vi = path
    root = topo.sockets[si].numa_nodes[ni].roots[ri]
    holder: PcieRoot | PcieSwitch = root if wi < 0 else root.switches[wi]
    return holder.nics[di] if nic else holder.gpus[di]


def bits(mask: int) -> list[int]:
    """Slot numbers set in ``mask``, lowest first."""
    return _bits(mask)
