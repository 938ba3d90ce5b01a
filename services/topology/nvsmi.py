"""Import ``nvidia-smi topo -m`` output into a :class:`~schemas.topology.NodeTopology`.

Pure: text in, tree out; no hardware, no file I/O (the CLI reads the file). Two steps:

1. :func:`parse_matrix` (module :mod:`services.topology.nvsmi_matrix`) reads the text into a
   :class:`TopoMatrix`: every form real captures take, and a :class:`NvsmiFormatError` naming
   the file and line for anything that is not a square, symmetric relation matrix.

2. :func:`build_topology` infers the tree. Each relation is evidence about shared ancestors:
   ``PIX``/``PXB`` → same PCIe switch, ``PHB`` → same root complex, ``NODE`` → same NUMA node,
   ``SYS`` → different NUMA nodes. Switches, roots and NUMA nodes are the connected components
   (union-find) of the "same switch", "same root or finer" and "same NUMA or finer" relations;
   GPUs are also joined by equal NUMA affinity (or, lacking that column, equal CPU affinity),
   which is how GPU pairs whose PCIe relation is hidden behind ``NV#`` get their NUMA node.
   A NIC takes the NUMA node of whatever it is PCIe-related to; a group with no non-``SYS``
   relation to any GPU (e.g. a NIC pair alone on a NUMA node without GPUs, or every NIC of a
   Grace system, whose GPUs attach by C2C) gets the smallest NUMA id no other group uses and
   the text never names; ids past every real one share one extra socket, so such NICs sit at
   node scope from every GPU, with no invented PCIe or NUMA locality. Sockets: one per NUMA
   node, or ``sockets=N`` spreads NUMA ids evenly over N sockets (Linux numbers NUMA nodes
   socket by socket).

   A device that shares no switch with anything hangs directly under its root complex; a GPU
   whose only PCIe evidence is hidden behind NVLink cells gets a root complex of its own
   (the matrix cannot tell whether two such GPUs share one).

The tree then answers every pair's relation again (:func:`tree_relation`); pairs where it
differs from the matrix are returned as :class:`Mismatch` rows. That only happens when the
matrix contradicts itself in a way no tree can hold (A PIX B, B PIX C, but A SYS C): the
importer trusts the positive "shares an ancestor" evidence, so such devices come out closer
than one cell says. :func:`relations` and :func:`matrix_relations` give the GPU x NIC scope
maps for the round-trip check.

Synthetic values (documented in ``docs/topology.md``): GPU UUIDs are
``GPU-<uuid5(namespace, "<node name>/gpu<index>")>`` (deterministic, distinct per node name);
``minor`` is the GPU index; root complexes are ``root0..`` and switches ``sw0..`` in order of
their first device; NICs are assumed ``active``; a NIC whose name contains ``eth`` or ``roce``
is Ethernet, otherwise InfiniBand; speeds, memory and bus ids are unknown (left unset).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec
import msgspec.json

from schemas.topology import (
    Gpu,
    Nic,
    NodeTopology,
    NumaNode,
    PcieRoot,
    PcieSwitch,
    Scope,
    Socket,
    locate,
    scope_between,
)
from services.topology.errors import NvsmiFormatError
from services.topology.files import decode_topology
from services.topology.nvsmi_matrix import (
    MAX_NUMA_ID,
    MatrixDevice,
    TopoMatrix,
    cell_scope,
    nvlink_cell,
    parse_id_list,
    parse_matrix,
)

__all__ = [
    "MAX_NUMA_ID",
    "UUID_NAMESPACE",
    "ImportResult",
    "MatrixDevice",
    "Mismatch",
    "NvsmiFormatError",
    "TopoMatrix",
    "build_topology",
    "cell_scope",
    "import_nvidia_smi",
    "matrix_relations",
    "parse_id_list",
    "parse_matrix",
    "relations",
    "tree_relation",
]

# Fixed namespace for the synthetic GPU UUIDs: the same node name and index always give the
# same UUID, and two nodes imported from one capture under different names never collide.
UUID_NAMESPACE = uuid.UUID("0b5e7d0e-3c1a-5d2e-9f47-7a6e1c2d4b88")


@dataclass(frozen=True)
class Mismatch:
    """A pair whose relation in the inferred tree differs from the matrix cell."""

    a: str
    b: str
    cell: str
    tree: Scope

    def __str__(self) -> str:
        return f"{self.a}-{self.b}: matrix says {self.cell}, tree gives {self.tree.wire}"


@dataclass
class ImportResult:
    topology: NodeTopology
    matrix: TopoMatrix
    mismatches: list[Mismatch] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Inference


class _UnionFind:
    def __init__(self, items: Iterable[str]) -> None:
        self.parent = {x: x for x in items}

    def find(self, x: str) -> str:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra

    def groups(self, order: list[str]) -> list[list[str]]:
        """Components, each in ``order``, ordered by their first member."""
        out: dict[str, list[str]] = {}
        for x in order:
            out.setdefault(self.find(x), []).append(x)
        return list(out.values())


def _first_cpu(cpus: str) -> int:
    m = re.match(r"\d+", cpus)
    return int(m.group(0)) if m else 0


def _gpu_numa_hints(matrix: TopoMatrix, notes: list[str]) -> dict[str, int]:
    """NUMA id per GPU label from the NUMA Affinity column, else from distinct CPU affinity
    sets numbered by their lowest CPU (Linux numbers NUMA nodes in CPU order)."""
    gpus = [d.label for d in matrix.gpus]
    explicit = {g: matrix.numa_affinity[g] for g in gpus if g in matrix.numa_affinity}
    if explicit:
        return explicit
    cpu_sets = sorted({matrix.cpu_affinity[g] for g in gpus if g in matrix.cpu_affinity}, key=_first_cpu)
    if cpu_sets:
        notes.append(
            "no NUMA Affinity column: NUMA ids numbered from the distinct CPU Affinity sets "
            f"({', '.join(f'{i}={s}' for i, s in enumerate(cpu_sets))})"
        )
    ids = {s: i for i, s in enumerate(cpu_sets)}
    return {g: ids[matrix.cpu_affinity[g]] for g in gpus if g in matrix.cpu_affinity}


def _link_type(nic_name: str) -> Literal["infiniband", "ethernet"]:
    lowered = nic_name.lower()
    return "ethernet" if "eth" in lowered or "roce" in lowered else "infiniband"


def _nic(d: MatrixDevice) -> Nic:
    return Nic(name=d.name, link_type=_link_type(d.name))


def build_topology(
    matrix: TopoMatrix,
    *,
    name: str,
    gpu_model: str = "unknown",
    sockets: int | None = None,
) -> ImportResult:
    """Infer the node tree from a parsed matrix (see the module docstring for the rules)."""
    if sockets is not None and sockets < 1:
        raise ValueError("sockets must be at least 1")
    return _Builder(matrix, name=name, gpu_model=gpu_model).build(sockets=sockets)


class _Builder:
    """One inference: the relations' components, the NUMA ids given to them, and the notes
    for the user, in the order the steps of :meth:`build` find them."""

    def __init__(self, matrix: TopoMatrix, *, name: str, gpu_model: str) -> None:
        self.matrix = matrix
        self.name = name
        self.gpu_model = gpu_model
        self.notes: list[str] = []
        self.labels = [d.label for d in matrix.devices]
        self.by_label = {d.label: d for d in matrix.devices}
        self.same_switch = _UnionFind(self.labels)
        self.same_root = _UnionFind(self.labels)
        self.same_numa = _UnionFind(self.labels)
        self.numa_of_group: dict[str, int] = {}  # same_numa component → NUMA id
        self.beyond: set[int] = set()  # synthetic ids past every real one: their own socket
        self.nv_pairs = {
            (a.label, b.label)
            for a in matrix.gpus
            for b in matrix.gpus
            if nvlink_cell(matrix.cells[(a.label, b.label)])
        }

    def numa_id(self, label: str) -> int:
        return self.numa_of_group[self.same_numa.find(label)]

    def build(self, *, sockets: int | None) -> ImportResult:
        self._join_related()
        hints = _gpu_numa_hints(self.matrix, self.notes)
        self._join_by_hint(hints)
        self._number_numa(hints)
        self._c2c_note()
        tree = self._assemble(self._sockets(sockets))
        self._nic_notes()
        topo = self._topology(tree)
        return ImportResult(
            topology=topo, matrix=self.matrix, mismatches=_mismatches(self.matrix, topo), notes=self.notes
        )

    def _join_related(self) -> None:
        """Union the devices each cell says share a switch, a root complex or a NUMA node."""
        for i, a in enumerate(self.labels):
            for b in self.labels[i + 1 :]:
                scope = cell_scope(self.matrix.cells[(a, b)])
                if scope is None:
                    continue
                if scope <= Scope.PCIE_SWITCH:
                    self.same_switch.union(a, b)
                if scope <= Scope.PCIE_ROOT:
                    self.same_root.union(a, b)
                if scope <= Scope.NUMA:
                    self.same_numa.union(a, b)

    def _join_by_hint(self, hints: dict[str, int]) -> None:
        # GPUs with equal NUMA hints share a NUMA node even when NV# cells hide their PCIe relation.
        by_hint: dict[int, str] = {}
        for gpu_label, hinted in hints.items():
            if hinted in by_hint:
                self.same_numa.union(by_hint[hinted], gpu_label)
            else:
                by_hint[hinted] = gpu_label

    def _number_numa(self, hints: dict[str, int]) -> None:
        """A NUMA id per NUMA component: from its GPUs' hints; otherwise the smallest unused id."""
        unassigned: list[list[str]] = []
        for group in self.same_numa.groups(self.labels):
            ids = sorted({hints[m] for m in group if m in hints})
            if not ids:
                unassigned.append(group)
                continue
            if len(ids) > 1:
                self.notes.append(
                    f"{', '.join(group)} are PCIe-related (NODE or closer) but report NUMA nodes {ids}; "
                    f"placed on NUMA {ids[0]}"
                )
            self.numa_of_group[self.same_numa.find(group[0])] = ids[0]
        self._number_unhinted(unassigned, hinted=bool(hints))
        if not hints and len(unassigned) > 1:
            self.notes.append("no affinity columns: NUMA nodes numbered in order of their first device")

    def _number_unhinted(self, unassigned: list[list[str]], *, hinted: bool) -> None:
        # Ids for groups without NUMA information: the smallest ids no group uses and the text
        # never names (on Grace systems the NUMA Affinity lists and GPU NUMA IDs name the GPU
        # memory nodes 2-33, which must not be handed to a NIC).
        used = set(self.numa_of_group.values()) | self.matrix.mentioned_numa_ids()
        real_top = max(used, default=-1)
        for group in unassigned:
            fresh = next(k for k in range(len(self.labels) + len(used) + 1) if k not in used)
            used.add(fresh)
            self.numa_of_group[self.same_numa.find(group[0])] = fresh
            if hinted:
                if fresh > real_top:
                    self.beyond.add(fresh)
                self.notes.append(self._unhinted_note(group, fresh=fresh, own_socket=fresh > real_top))

    def _unhinted_note(self, group: list[str], *, fresh: int, own_socket: bool) -> str:
        matrix, by_label = self.matrix, self.by_label
        names = ", ".join(by_label[m].name for m in group)
        gpu_free = all(matrix.scope(by_label[m], g) is Scope.NODE for m in group for g in matrix.gpus)
        if gpu_free and matrix.gpus:
            return (
                f"{names}: no NUMA information: SYS to every GPU, no PCIe locality to any "
                f"(as on Grace systems, whose GPUs attach to the CPU by C2C); placed at node "
                f"scope on NUMA {fresh}, an id the matrix does not name"
                + (", in a socket of its own" if own_socket else "")
            )
        return (
            f"{names}: no NUMA information (only SYS to devices with a known NUMA node); assumed NUMA {fresh}"
        )

    def _c2c_note(self) -> None:
        c2c = {g: n for g, n in self.matrix.gpu_numa_id.items()}
        if c2c:
            self.notes.append(
                "GPU NUMA ID column: "
                + ", ".join(f"{self.by_label[g].name} memory is NUMA node {n}" for g, n in c2c.items())
                + " (coherent, C2C-attached GPUs); the tree places each GPU on its NUMA Affinity "
                "node, the CPU it is attached to"
            )

    def _sockets(self, sockets: int | None) -> dict[int, int]:
        """Socket per NUMA id: one each, or ``sockets`` spread evenly; synthetic ids share one more."""
        numa_ids = sorted(set(self.numa_of_group.values()))
        core = [n for n in numa_ids if n not in self.beyond]
        if sockets is None:
            socket_of = {n: k for k, n in enumerate(core)}
        else:
            span = max(core) + 1
            socket_of = {n: n * sockets // span for n in core}
        extra_socket = max(socket_of.values(), default=-1) + 1
        socket_of.update({n: extra_socket for n in self.beyond})
        return socket_of

    def _pcie_names(
        self, socket_of: dict[int, int]
    ) -> tuple[list[list[str]], dict[str, str], dict[str, str]]:
        """Root groups in tree order, and the names of roots and switches by component."""
        labels = self.labels
        # Roots in tree order (socket, NUMA node, then first device in matrix order); they and
        # the switches are numbered in that order, so root0 is the first root of socket 0.
        root_groups = sorted(
            self.same_root.groups(labels),
            key=lambda g: (socket_of[self.numa_id(g[0])], self.numa_id(g[0]), labels.index(g[0])),
        )
        root_name = {self.same_root.find(g[0]): f"root{k}" for k, g in enumerate(root_groups)}
        switch_name: dict[str, str] = {}
        for group in root_groups:
            for sw_group in self.same_switch.groups(group):
                if len(sw_group) > 1:
                    switch_name[self.same_switch.find(sw_group[0])] = f"sw{len(switch_name)}"
        return root_groups, root_name, switch_name

    def _assemble(self, socket_of: dict[int, int]) -> dict[int, dict[int, dict[str, PcieRoot]]]:
        """socket → NUMA → root → (switch) → device, all in matrix order."""
        root_groups, root_name, switch_name = self._pcie_names(socket_of)
        tree: dict[int, dict[int, dict[str, PcieRoot]]] = {}
        for group in root_groups:
            rid = root_name[self.same_root.find(group[0])]
            nid = self.numa_id(group[0])
            root = PcieRoot(id=rid)
            switches: dict[str, PcieSwitch] = {}
            for label in group:
                d = self.by_label[label]
                dev: Gpu | Nic = self._gpu(d) if d.kind == "gpu" else _nic(d)
                sw_key = self.same_switch.find(label)
                holder: PcieRoot | PcieSwitch = root
                if sw_key in switch_name:
                    holder = switches.setdefault(sw_key, PcieSwitch(id=switch_name[sw_key]))
                if isinstance(dev, Gpu):
                    holder.gpus.append(dev)
                else:
                    holder.nics.append(dev)
            root.switches = list(switches.values())
            tree.setdefault(socket_of[nid], {}).setdefault(nid, {})[rid] = root
        return tree

    def _gpu(self, d: MatrixDevice) -> Gpu:
        assert d.gpu_index is not None
        peers = sorted(
            i for (a, b) in self.nv_pairs if a == d.label and (i := self.by_label[b].gpu_index) is not None
        )
        gid = uuid.uuid5(UUID_NAMESPACE, f"{self.name}/gpu{d.gpu_index}")
        return Gpu(
            index=d.gpu_index, uuid=f"GPU-{gid}", model=self.gpu_model, minor=d.gpu_index, nvlink_peers=peers
        )

    def _nic_notes(self) -> None:
        matrix = self.matrix
        if not any(d.kind == "nic" for d in matrix.devices):
            self.notes.append("GPU-only matrix: no NICs")
        unnamed = [d.label for d in matrix.nics if d.label.startswith("NIC") and d.name == d.label]
        if unnamed:
            self.notes.append(
                f"no NIC Legend entry for {', '.join(unnamed)}: the column label is used as the name"
            )

    def _topology(self, tree: dict[int, dict[int, dict[str, PcieRoot]]]) -> NodeTopology:
        matrix = self.matrix
        gpu_indices = [d.gpu_index for d in matrix.gpus if d.gpu_index is not None]
        partitions: list[list[int]] = []
        if len(gpu_indices) > 1 and len(self.nv_pairs) == len(gpu_indices) * (len(gpu_indices) - 1):
            # Every GPU pair is NVLink-connected (NVSwitch, or a 2-GPU bridge): one domain.
            partitions = [sorted(gpu_indices)]
        desc = "imported from `nvidia-smi topo -m`"
        if matrix.source:
            desc += f" ({Path(matrix.source).name})"
        if matrix.comments:
            desc += "; " + "; ".join(c for c in matrix.comments if c)
        tree_topo = NodeTopology(
            name=self.name,
            description=desc,
            labels={"tandem.io/source": "nvidia-smi-topo"},
            nvlink_partitions=partitions,
            sockets=[
                Socket(
                    id=sid,
                    numa_nodes=[
                        NumaNode(id=nid, roots=list(roots.values())) for nid, roots in sorted(numas.items())
                    ],
                )
                for sid, numas in sorted(tree.items())
            ],
        )
        # Constructing Structs does not apply field constraints (patterns, lengths); a decode of
        # the encoded tree does, so a bad --name or NIC name fails here, not when the file is read.
        return decode_topology(msgspec.json.encode(tree_topo), fmt="json", path=matrix.source)


def import_nvidia_smi(
    text: str,
    *,
    name: str,
    gpu_model: str = "unknown",
    sockets: int | None = None,
    source: str | Path | None = None,
) -> ImportResult:
    """Parse and convert in one step (what ``tandem topology import --nvidia-smi`` runs)."""
    return build_topology(parse_matrix(text, source=source), name=name, gpu_model=gpu_model, sockets=sockets)


# --------------------------------------------------------------------------------------------
# Relations back out of a tree


def tree_relation(topo: NodeTopology) -> dict[tuple[str, str], Scope]:
    """The scope between every ordered pair of devices (GPUs and NIC PFs) by device id, as
    ``nvidia-smi`` would print it: devices on different NUMA nodes are ``node`` (SYS) whether
    or not they share a socket, because the matrix does not tell sockets apart."""
    locs = locate(topo)
    out: dict[tuple[str, str], Scope] = {}
    for a in locs:
        for b in locs:
            if a is b:
                continue
            scope = scope_between(a, b)
            out[(a.device.id, b.device.id)] = Scope.NODE if scope is Scope.SOCKET else scope
    return out


def relations(topo: NodeTopology) -> dict[tuple[str, str], Scope]:
    """GPU x NIC relation classes recomputed from a tree: ``(gpu id, nic id) → scope``."""
    every = tree_relation(topo)
    return {(g.id, n.id): every[(g.id, n.id)] for g in topo.gpus() for n in topo.nics()}


def matrix_relations(matrix: TopoMatrix) -> dict[tuple[str, str], Scope]:
    """GPU x NIC relation classes as the matrix states them: ``(gpu id, nic id) → scope``."""
    out: dict[tuple[str, str], Scope] = {}
    for g in matrix.gpus:
        for n in matrix.nics:
            scope = matrix.scope(g, n)
            if scope is None:  # pragma: no cover - parse_matrix admits only X on the diagonal
                raise ValueError(
                    f"{g.label}-{n.label} has no PCIe relation ({matrix.cells[(g.label, n.label)]})"
                )
            out[(g.name, n.name)] = scope
    return out


def _mismatches(matrix: TopoMatrix, topo: NodeTopology) -> list[Mismatch]:
    """Every unordered pair with a PCIe relation in the matrix that the tree answers otherwise."""
    got = tree_relation(topo)
    out: list[Mismatch] = []
    devices = list(matrix.devices)
    for i, a in enumerate(devices):
        for b in devices[i + 1 :]:
            want = matrix.scope(a, b)
            if want is None:
                continue
            tree = got[(a.name, b.name)]
            if tree != want:
                out.append(Mismatch(a.label, b.label, matrix.cells[(a.label, b.label)], tree))
    return out
