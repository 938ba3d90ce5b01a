"""Import ``nvidia-smi topo -m`` output into a :class:`~schemas.topology.NodeTopology`.

Pure: text in, tree out; no hardware, no file I/O (the CLI reads the file). Two steps:

1. :func:`parse_matrix` reads the text into a :class:`TopoMatrix`. It accepts what real
   captures look like: cells separated by tabs or runs of spaces, terminal colour codes left in
   the header, ``#`` comment lines before the matrix, ``NIC#`` columns named by a trailing
   "NIC Legend" or older ``mlx5_#`` columns named directly, optional ``CPU Affinity`` /
   ``NUMA Affinity`` / ``GPU NUMA ID`` columns (absent, ``N/A``, or empty in NIC rows), the
   old ``SOC`` spelling of ``SYS``, and ``NV#`` cells. Grace-era output too: ``NUMA Affinity``
   as an id list (``0,3-9,11-17``, read by :func:`parse_id_list`; the lowest id is the row's
   NUMA node), a numeric ``GPU NUMA ID`` (kept in ``gpu_numa_id``), and tab-separated rows
   with empty cells (a GPU outside a container's cpuset has no CPU Affinity). Anything else
   that is not a square, symmetric relation matrix raises :class:`NvsmiFormatError` naming
   the file and line.

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

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_GPU_LABEL = re.compile(r"^GPU(\d+)$")
_NIC_LEGEND = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
_DEVICE_LABEL = re.compile(r"^[A-Za-z][A-Za-z0-9_.:-]*$")
_NV = re.compile(r"^NV(\d+)$")
_ID_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")
# Linux caps NUMA node ids far below this (MAX_NUMNODES is 1024 on arm64 and x86); a larger
# id is damaged text, and refusing it keeps a range like 0-99999999 from expanding.
MAX_NUMA_ID = 4095
_RELATION_WORD = re.compile(r"^[A-Za-z]+\d*$")  # what a relation cell looks like, valid or not
# Trailing non-device columns, longest first ("GPU NUMA ID" before anything starting "GPU").
_EXTRA_COLUMNS: tuple[tuple[str, ...], ...] = (
    ("GPU", "NUMA", "ID"),
    ("CPU", "Affinity"),
    ("NUMA", "Affinity"),
)
_CELL_SCOPE: dict[str, Scope] = {
    "PIX": Scope.PCIE_SWITCH,
    "PXB": Scope.PCIE_SWITCH,
    "PHB": Scope.PCIE_ROOT,
    "NODE": Scope.NUMA,
    "SYS": Scope.NODE,
    "SOC": Scope.NODE,  # the pre-2017 spelling of SYS
}


@dataclass(frozen=True)
class MatrixDevice:
    """One row/column of the matrix. ``name`` is the device id it becomes in the tree."""

    label: str  # as printed: GPU3, NIC0, mlx5_0
    kind: Literal["gpu", "nic"]
    name: str  # gpu3, or the RDMA device name from the NIC Legend (mlx5_0)
    line: int  # 1-based line of its row
    gpu_index: int | None = None


@dataclass(frozen=True)
class TopoMatrix:
    """The parsed matrix. ``cells[(a, b)]`` is the relation token from row a to column b
    (labels as printed); affinity maps hold only rows that had a usable value.

    ``numa_affinity`` is the row's NUMA node: the lowest id of its ``NUMA Affinity`` list
    (``0`` of ``0,3-9,11-17`` on Grace systems, where the rest are GPU-memory NUMA nodes);
    ``numa_affinity_ids`` keeps the whole list. ``gpu_numa_id`` is the ``GPU NUMA ID``
    column: the NUMA node of the GPU's own memory on coherent (C2C-attached) systems."""

    devices: tuple[MatrixDevice, ...]
    cells: dict[tuple[str, str], str]
    cpu_affinity: dict[str, str]
    numa_affinity: dict[str, int]
    comments: tuple[str, ...] = ()
    source: str | None = None
    extra_columns: tuple[str, ...] = ()
    numa_affinity_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    gpu_numa_id: dict[str, int] = field(default_factory=dict)

    def mentioned_numa_ids(self) -> set[int]:
        """Every NUMA id the text names (affinity lists and GPU NUMA IDs)."""
        ids = {n for ids in self.numa_affinity_ids.values() for n in ids}
        return ids | set(self.numa_affinity.values()) | set(self.gpu_numa_id.values())

    @property
    def gpus(self) -> list[MatrixDevice]:
        return [d for d in self.devices if d.kind == "gpu"]

    @property
    def nics(self) -> list[MatrixDevice]:
        return [d for d in self.devices if d.kind == "nic"]

    def scope(self, a: MatrixDevice, b: MatrixDevice) -> Scope | None:
        """The scope the matrix states between two devices; None for NVLink (PCIe hidden)."""
        return cell_scope(self.cells[(a.label, b.label)])


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


def cell_scope(cell: str) -> Scope | None:
    """Scope for a relation token: PIX/PXB → pcie-switch, PHB → pcie-root, NODE → numa,
    SYS → node. ``NV#`` hides the PCIe relation (None); ``X`` is self (None)."""
    return _CELL_SCOPE.get(cell)


def _valid_cell(cell: str) -> bool:
    return cell == "X" or cell in _CELL_SCOPE or _NV.match(cell) is not None


def parse_id_list(
    value: str,
    *,
    column: str,
    row: str,
    source: str | Path | None = None,
    line: int | None = None,
) -> tuple[int, ...]:
    """Parse a Linux id list such as ``0``, ``0,3-9,11-17`` (the ``NUMA Affinity`` format of
    Grace systems) into sorted, distinct ids. Raises :class:`NvsmiFormatError` naming the row,
    the column and, where known, the file and line."""

    def bad(why: str) -> NvsmiFormatError:
        return NvsmiFormatError(
            f"row {row}, column {column}: {value!r} is not a list of ids like 0,3-9,11-17 ({why})",
            path=source,
            line=line,
        )

    ids: set[int] = set()
    for item in value.split(","):
        m = _ID_ITEM.match(item)
        if m is None:
            raise bad(f"item {item!r} is neither a number nor a range a-b" if item else "empty item")
        lo = int(m.group(1))
        hi = lo if m.group(2) is None else int(m.group(2))
        if hi < lo:
            raise bad(f"range {item} runs backwards")
        if hi > MAX_NUMA_ID:
            raise bad(f"id {hi} is above {MAX_NUMA_ID}")
        ids.update(range(lo, hi + 1))
    return tuple(sorted(ids))


def _row_values(raw: str, tokens: list[str], n: int) -> list[str]:
    """The values after a row's ``n`` relation cells.

    Tab-separated output (what ``nvidia-smi`` writes) keeps empty cells: a GPU whose CPU
    affinity is hidden (a container's cpuset) prints ``\t\t1\t\tN/A``, which whitespace
    splitting would shift left. ``nvidia-smi`` also pads ``NUMA Affinity`` with a second tab,
    so one empty field between values is padding, not a value. Space-aligned text (a
    terminal copy) cannot show an empty cell and is split on whitespace."""
    fields = raw.split("\t")
    if len(fields) > n + 1 and [f.strip() for f in fields[: n + 1]] == tokens[: n + 1]:
        values = [f.strip() for f in fields[n + 1 :]]
        while values and not values[-1]:
            values.pop()
        return values
    return tokens[1 + n :]


# --------------------------------------------------------------------------------------------
# Parsing


def _split_header(tokens: list[str]) -> tuple[list[str], list[str]]:
    """Device column labels and the trailing extra column names of a header line."""
    columns: list[str] = []
    extras: list[str] = []
    i = 0
    while i < len(tokens):
        for words in _EXTRA_COLUMNS:
            if tuple(tokens[i : i + len(words)]) == words:
                extras.append(" ".join(words))
                i += len(words)
                break
        else:
            if extras:
                # An unknown trailing column: keep it by name so values stay aligned.
                extras.append(tokens[i])
            else:
                columns.append(tokens[i])
            i += 1
    return columns, extras


def _is_header(tokens: list[str]) -> bool:
    # The header names GPU0 and is not GPU0's own row (whose next cell is "X").
    if "GPU0" not in tokens:
        return False
    at = tokens.index("GPU0")
    return at + 1 >= len(tokens) or tokens[at + 1] != "X"


def parse_matrix(text: str, *, source: str | Path | None = None) -> TopoMatrix:
    """Parse ``nvidia-smi topo -m`` text; raises :class:`NvsmiFormatError` (file + line)."""
    src = None if source is None else str(source)
    lines = [_ANSI.sub("", raw).replace("\r", "") for raw in text.split("\n")]

    def fail(message: str, line: int | None) -> NvsmiFormatError:
        return NvsmiFormatError(message, path=src, line=line)

    comments: list[str] = []
    header_at: int | None = None
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("#"):
            comments.append(stripped.lstrip("#").strip())
            continue
        if _is_header(stripped.split()):
            header_at = i
            break
    if header_at is None:
        raise fail("not an `nvidia-smi topo -m` matrix: no header line with a GPU0 column", None)

    columns, extras = _split_header(lines[header_at].split())
    hline = header_at + 1
    if len(set(columns)) != len(columns):
        raise fail("header names a device column twice", hline)
    for label in columns:
        if not _DEVICE_LABEL.match(label):
            raise fail(f"header column {label!r} is not a device label", hline)
    n = len(columns)

    # Legend (names for NIC# columns), anywhere after the matrix.
    legend: dict[str, str] = {}
    for line in lines[header_at + 1 :]:
        m = _NIC_LEGEND.match(line)
        if m:
            legend[m.group(1)] = m.group(2)

    cells: dict[tuple[str, str], str] = {}
    cpu: dict[str, str] = {}
    numa: dict[str, int] = {}
    numa_ids: dict[str, tuple[int, ...]] = {}
    gpu_numa: dict[str, int] = {}
    row_line: dict[str, int] = {}
    for i in range(header_at + 1, len(lines)):
        tokens = lines[i].split()
        if not tokens or tokens[0] not in columns:
            # A blank line or "Legend:" ends the matrix; a stray row label is an error only
            # while rows are still missing (reported below with the first missing label).
            break
        label, lineno = tokens[0], i + 1
        if label in row_line:
            raise fail(f"second row for {label} (first on line {row_line[label]})", lineno)
        row_line[label] = lineno
        row = tokens[1 : 1 + n]
        for k, (col, cell) in enumerate(zip(columns, row, strict=False)):
            if not _valid_cell(cell):
                if _RELATION_WORD.match(cell):
                    raise fail(f"row {label}, column {col}: unknown relation {cell!r}", lineno)
                # An affinity value where a relation belongs: the row is short of cells.
                row = row[:k]
                break
            cells[(label, col)] = cell
        if len(row) < n:
            raise fail(
                f"row {label} has {len(row)} relation cells; the header has {n} device columns", lineno
            )
        if cells[(label, label)] != "X":
            raise fail(f"row {label}: expected X on the diagonal, got {cells[(label, label)]!r}", lineno)
        values = _row_values(lines[i], tokens, n)
        # Drop padding: empty fields past the first, while there are more values than columns.
        while len(values) > len(extras) and "" in values[1:]:
            del values[values.index("", 1)]
        if len(values) > len(extras):
            raise fail(
                f"row {label} has {len(values)} values after the matrix; the header names "
                f"{len(extras)} ({', '.join(extras) or 'none'})",
                lineno,
            )
        for name, value in zip(extras, values, strict=False):
            if not value or value.upper() == "N/A":
                continue
            if name == "CPU Affinity":
                cpu[label] = value
            elif name == "NUMA Affinity":
                ids = parse_id_list(value, column=name, row=label, source=src, line=lineno)
                numa_ids[label] = ids
                numa[label] = ids[0]
            elif name == "GPU NUMA ID":
                if not value.isdigit() or int(value) > MAX_NUMA_ID:
                    raise fail(
                        f"row {label}, column {name}: {value!r} is not a NUMA id (a number up to "
                        f"{MAX_NUMA_ID}, or N/A)",
                        lineno,
                    )
                gpu_numa[label] = int(value)
    missing = [c for c in columns if c not in row_line]
    if missing:
        after = max(row_line.values(), default=hline) + 1
        raise fail(f"matrix has no row for {', '.join(missing)}", after)

    # Symmetry: nvidia-smi prints a symmetric matrix; a one-sided relation means the text
    # was damaged (hand-aligned, columns shifted), and guessing which side is right is unsafe.
    for a in columns:
        for b in columns:
            ab, ba = cells[(a, b)], cells[(b, a)]
            if a < b and (cell_scope(ab) != cell_scope(ba) or bool(_NV.match(ab)) != bool(_NV.match(ba))):
                raise fail(f"matrix is not symmetric: {a}→{b} is {ab} but {b}→{a} is {ba}", row_line[b])

    devices: list[MatrixDevice] = []
    for label in columns:
        gm = _GPU_LABEL.match(label)
        if gm:
            index = int(gm.group(1))
            devices.append(MatrixDevice(label, "gpu", f"gpu{index}", row_line[label], gpu_index=index))
        else:
            devices.append(MatrixDevice(label, "nic", legend.get(label, label), row_line[label]))
    names = [d.name for d in devices]
    for d in devices:
        if names.count(d.name) > 1:
            raise fail(f"device name {d.name!r} is used by two columns", d.line)
    return TopoMatrix(
        devices=tuple(devices),
        cells=cells,
        cpu_affinity=cpu,
        numa_affinity=numa,
        comments=tuple(comments),
        source=src,
        extra_columns=tuple(extras),
        numa_affinity_ids=numa_ids,
        gpu_numa_id=gpu_numa,
    )


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
    notes: list[str] = []
    labels = [d.label for d in matrix.devices]
    by_label = {d.label: d for d in matrix.devices}

    same_switch = _UnionFind(labels)
    same_root = _UnionFind(labels)
    same_numa = _UnionFind(labels)
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            scope = cell_scope(matrix.cells[(a, b)])
            if scope is None:
                continue
            if scope <= Scope.PCIE_SWITCH:
                same_switch.union(a, b)
            if scope <= Scope.PCIE_ROOT:
                same_root.union(a, b)
            if scope <= Scope.NUMA:
                same_numa.union(a, b)

    hints = _gpu_numa_hints(matrix, notes)
    by_hint: dict[int, str] = {}
    for gpu_label, hinted in hints.items():
        if hinted in by_hint:
            same_numa.union(by_hint[hinted], gpu_label)
        else:
            by_hint[hinted] = gpu_label

    # A NUMA id per NUMA component: from its GPUs' hints; otherwise the smallest unused id.
    numa_of_group: dict[str, int] = {}
    unassigned: list[list[str]] = []
    for group in same_numa.groups(labels):
        ids = sorted({hints[m] for m in group if m in hints})
        if not ids:
            unassigned.append(group)
            continue
        if len(ids) > 1:
            notes.append(
                f"{', '.join(group)} are PCIe-related (NODE or closer) but report NUMA nodes {ids}; "
                f"placed on NUMA {ids[0]}"
            )
        numa_of_group[same_numa.find(group[0])] = ids[0]
    # Ids for groups without NUMA information: the smallest ids no group uses and the text
    # never names (on Grace systems the NUMA Affinity lists and GPU NUMA IDs name the GPU
    # memory nodes 2-33, which must not be handed to a NIC).
    used = set(numa_of_group.values()) | matrix.mentioned_numa_ids()
    real_top = max(used, default=-1)
    beyond: set[int] = set()  # synthetic ids past every real one: their own socket
    for group in unassigned:
        fresh = next(k for k in range(len(labels) + len(used) + 1) if k not in used)
        used.add(fresh)
        numa_of_group[same_numa.find(group[0])] = fresh
        if hints:
            names = ", ".join(by_label[m].name for m in group)
            gpu_free = all(matrix.scope(by_label[m], g) is Scope.NODE for m in group for g in matrix.gpus)
            if fresh > real_top:
                beyond.add(fresh)
            if gpu_free and matrix.gpus:
                notes.append(
                    f"{names}: no NUMA information: SYS to every GPU, no PCIe locality to any "
                    f"(as on Grace systems, whose GPUs attach to the CPU by C2C); placed at node "
                    f"scope on NUMA {fresh}, an id the matrix does not name"
                    + (", in a socket of its own" if fresh > real_top else "")
                )
            else:
                notes.append(
                    f"{names}: no NUMA information (only SYS to devices with a known NUMA "
                    f"node); assumed NUMA {fresh}"
                )
    if not hints and len(unassigned) > 1:
        notes.append("no affinity columns: NUMA nodes numbered in order of their first device")
    c2c = {g: n for g, n in matrix.gpu_numa_id.items()}
    if c2c:
        notes.append(
            "GPU NUMA ID column: "
            + ", ".join(f"{by_label[g].name} memory is NUMA node {n}" for g, n in c2c.items())
            + " (coherent, C2C-attached GPUs); the tree places each GPU on its NUMA Affinity "
            "node, the CPU it is attached to"
        )

    def numa_id(label: str) -> int:
        return numa_of_group[same_numa.find(label)]

    numa_ids = sorted(set(numa_of_group.values()))
    core = [n for n in numa_ids if n not in beyond]
    if sockets is None:
        socket_of = {n: k for k, n in enumerate(core)}
    else:
        span = max(core) + 1
        socket_of = {n: n * sockets // span for n in core}
    extra_socket = max(socket_of.values(), default=-1) + 1
    socket_of.update({n: extra_socket for n in beyond})

    # Roots in tree order (socket, NUMA node, then first device in matrix order); they and
    # the switches are numbered in that order, so root0 is the first root of socket 0.
    root_groups = sorted(
        same_root.groups(labels), key=lambda g: (socket_of[numa_id(g[0])], numa_id(g[0]), labels.index(g[0]))
    )
    root_name = {same_root.find(g[0]): f"root{k}" for k, g in enumerate(root_groups)}
    switch_name: dict[str, str] = {}
    for group in root_groups:
        for sw_group in same_switch.groups(group):
            if len(sw_group) > 1:
                switch_name[same_switch.find(sw_group[0])] = f"sw{len(switch_name)}"

    gpu_indices = [d.gpu_index for d in matrix.gpus if d.gpu_index is not None]
    nv_pairs = {
        (a.label, b.label)
        for a in matrix.gpus
        for b in matrix.gpus
        if _NV.match(matrix.cells[(a.label, b.label)])
    }

    def make_gpu(d: MatrixDevice) -> Gpu:
        assert d.gpu_index is not None
        peers = sorted(i for (a, b) in nv_pairs if a == d.label and (i := by_label[b].gpu_index) is not None)
        gid = uuid.uuid5(UUID_NAMESPACE, f"{name}/gpu{d.gpu_index}")
        return Gpu(
            index=d.gpu_index, uuid=f"GPU-{gid}", model=gpu_model, minor=d.gpu_index, nvlink_peers=peers
        )

    def make_nic(d: MatrixDevice) -> Nic:
        return Nic(name=d.name, link_type=_link_type(d.name))

    # Assemble: socket → NUMA → root → (switch) → device, all in matrix order.
    tree: dict[int, dict[int, dict[str, PcieRoot]]] = {}
    for group in root_groups:
        rid = root_name[same_root.find(group[0])]
        nid = numa_id(group[0])
        root = PcieRoot(id=rid)
        switches: dict[str, PcieSwitch] = {}
        for label in group:
            d = by_label[label]
            dev: Gpu | Nic = make_gpu(d) if d.kind == "gpu" else make_nic(d)
            sw_key = same_switch.find(label)
            holder: PcieRoot | PcieSwitch = root
            if sw_key in switch_name:
                holder = switches.setdefault(sw_key, PcieSwitch(id=switch_name[sw_key]))
            if isinstance(dev, Gpu):
                holder.gpus.append(dev)
            else:
                holder.nics.append(dev)
        root.switches = list(switches.values())
        tree.setdefault(socket_of[nid], {}).setdefault(nid, {})[rid] = root

    if not any(d.kind == "nic" for d in matrix.devices):
        notes.append("GPU-only matrix: no NICs")
    unnamed = [d.label for d in matrix.nics if d.label.startswith("NIC") and d.name == d.label]
    if unnamed:
        notes.append(f"no NIC Legend entry for {', '.join(unnamed)}: the column label is used as the name")

    partitions: list[list[int]] = []
    if len(gpu_indices) > 1 and len(nv_pairs) == len(gpu_indices) * (len(gpu_indices) - 1):
        # Every GPU pair is NVLink-connected (NVSwitch, or a 2-GPU bridge): one domain.
        partitions = [sorted(gpu_indices)]

    desc = "imported from `nvidia-smi topo -m`"
    if matrix.source:
        desc += f" ({Path(matrix.source).name})"
    if matrix.comments:
        desc += "; " + "; ".join(c for c in matrix.comments if c)
    tree_topo = NodeTopology(
        name=name,
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
    topo = decode_topology(msgspec.json.encode(tree_topo), fmt="json", path=matrix.source)
    return ImportResult(topology=topo, matrix=matrix, mismatches=_mismatches(matrix, topo), notes=notes)


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
