"""Read the text of ``nvidia-smi topo -m`` into a :class:`TopoMatrix` (step 1 of the import).

Pure: text in, matrix out; :mod:`services.topology.nvsmi` infers the tree from it (step 2).

:func:`parse_matrix` accepts what real captures look like: cells separated by tabs or runs of
spaces, terminal colour codes left in the header, ``#`` comment lines before the matrix,
``NIC#`` columns named by a trailing "NIC Legend" or older ``mlx5_#`` columns named directly,
optional ``CPU Affinity`` / ``NUMA Affinity`` / ``GPU NUMA ID`` columns (absent, ``N/A``, or
empty in NIC rows), the old ``SOC`` spelling of ``SYS``, and ``NV#`` cells. Grace-era output
too: ``NUMA Affinity`` as an id list (``0,3-9,11-17``, read by :func:`parse_id_list`; the
lowest id is the row's NUMA node), a numeric ``GPU NUMA ID`` (kept in ``gpu_numa_id``), and
tab-separated rows with empty cells (a GPU outside a container's cpuset has no CPU Affinity).
Anything else that is not a square, symmetric relation matrix raises :class:`NvsmiFormatError`
naming the file and line.

The reading is one pass over the lines (:class:`_Reader`): comments and the header, the NIC
Legend, then the rows in order, each row's relation cells before its trailing values; the
whole matrix is checked (every row present, symmetric, distinct device names) once read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from schemas.topology import Scope
from services.topology.errors import NvsmiFormatError

__all__ = [
    "MAX_NUMA_ID",
    "MatrixDevice",
    "TopoMatrix",
    "cell_scope",
    "nvlink_cell",
    "parse_id_list",
    "parse_matrix",
]

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


def cell_scope(cell: str) -> Scope | None:
    """Scope for a relation token: PIX/PXB → pcie-switch, PHB → pcie-root, NODE → numa,
    SYS → node. ``NV#`` hides the PCIe relation (None); ``X`` is self (None)."""
    return _CELL_SCOPE.get(cell)


def _valid_cell(cell: str) -> bool:
    return cell == "X" or cell in _CELL_SCOPE or _NV.match(cell) is not None


def nvlink_cell(cell: str) -> bool:
    """Whether a relation token is ``NV#`` (an NVLink connection that hides the PCIe relation)."""
    return _NV.match(cell) is not None


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
    return _Reader(text, source=None if source is None else str(source)).read()


class _Reader:
    """One pass over the text: what each step reads is kept here for the next and the checks."""

    def __init__(self, text: str, *, source: str | None) -> None:
        self.src = source
        self.lines = [_ANSI.sub("", raw).replace("\r", "") for raw in text.split("\n")]
        self.comments: list[str] = []
        self.columns: list[str] = []
        self.extras: list[str] = []
        self.cells: dict[tuple[str, str], str] = {}
        self.cpu: dict[str, str] = {}
        self.numa: dict[str, int] = {}
        self.numa_ids: dict[str, tuple[int, ...]] = {}
        self.gpu_numa: dict[str, int] = {}
        self.row_line: dict[str, int] = {}

    def fail(self, message: str, line: int | None) -> NvsmiFormatError:
        return NvsmiFormatError(message, path=self.src, line=line)

    def read(self) -> TopoMatrix:
        header_at = self._header()
        legend = self._legend(start=header_at + 1)
        self._rows(start=header_at + 1)
        missing = [c for c in self.columns if c not in self.row_line]
        if missing:
            after = max(self.row_line.values(), default=header_at + 1) + 1
            raise self.fail(f"matrix has no row for {', '.join(missing)}", after)
        self._check_symmetric()
        return TopoMatrix(
            devices=tuple(self._devices(legend)),
            cells=self.cells,
            cpu_affinity=self.cpu,
            numa_affinity=self.numa,
            comments=tuple(self.comments),
            source=self.src,
            extra_columns=tuple(self.extras),
            numa_affinity_ids=self.numa_ids,
            gpu_numa_id=self.gpu_numa,
        )

    def _header(self) -> int:
        """Keep the comment lines before the header; read its columns; return its index."""
        header_at: int | None = None
        for i, line in enumerate(self.lines):
            stripped = line.strip()
            if stripped.startswith("#"):
                self.comments.append(stripped.lstrip("#").strip())
                continue
            if _is_header(stripped.split()):
                header_at = i
                break
        if header_at is None:
            raise self.fail("not an `nvidia-smi topo -m` matrix: no header line with a GPU0 column", None)
        self.columns, self.extras = _split_header(self.lines[header_at].split())
        hline = header_at + 1
        if len(set(self.columns)) != len(self.columns):
            raise self.fail("header names a device column twice", hline)
        for label in self.columns:
            if not _DEVICE_LABEL.match(label):
                raise self.fail(f"header column {label!r} is not a device label", hline)
        return header_at

    def _legend(self, *, start: int) -> dict[str, str]:
        """Names for ``NIC#`` columns, from a legend anywhere after the header."""
        legend: dict[str, str] = {}
        for line in self.lines[start:]:
            m = _NIC_LEGEND.match(line)
            if m:
                legend[m.group(1)] = m.group(2)
        return legend

    def _rows(self, *, start: int) -> None:
        for i in range(start, len(self.lines)):
            tokens = self.lines[i].split()
            if not tokens or tokens[0] not in self.columns:
                # A blank line or "Legend:" ends the matrix; a stray row label is an error only
                # while rows are still missing (reported by read() with the first missing label).
                break
            label, lineno = tokens[0], i + 1
            if label in self.row_line:
                raise self.fail(f"second row for {label} (first on line {self.row_line[label]})", lineno)
            self.row_line[label] = lineno
            self._cells(label, tokens, lineno=lineno)
            self._values(label, _row_values(self.lines[i], tokens, len(self.columns)), lineno=lineno)

    def _cells(self, label: str, tokens: list[str], *, lineno: int) -> None:
        """A row's relation cells: one valid token per device column, ``X`` on the diagonal."""
        n = len(self.columns)
        row = tokens[1 : 1 + n]
        for k, (col, cell) in enumerate(zip(self.columns, row, strict=False)):
            if not _valid_cell(cell):
                if _RELATION_WORD.match(cell):
                    raise self.fail(f"row {label}, column {col}: unknown relation {cell!r}", lineno)
                # An affinity value where a relation belongs: the row is short of cells.
                row = row[:k]
                break
            self.cells[(label, col)] = cell
        if len(row) < n:
            raise self.fail(
                f"row {label} has {len(row)} relation cells; the header has {n} device columns", lineno
            )
        if self.cells[(label, label)] != "X":
            raise self.fail(
                f"row {label}: expected X on the diagonal, got {self.cells[(label, label)]!r}", lineno
            )

    def _values(self, label: str, values: list[str], *, lineno: int) -> None:
        """A row's values after its cells, one per extra column (affinities, GPU NUMA ID)."""
        extras = self.extras
        # Drop padding: empty fields past the first, while there are more values than columns.
        while len(values) > len(extras) and "" in values[1:]:
            del values[values.index("", 1)]
        if len(values) > len(extras):
            raise self.fail(
                f"row {label} has {len(values)} values after the matrix; the header names "
                f"{len(extras)} ({', '.join(extras) or 'none'})",
                lineno,
            )
        for name, value in zip(extras, values, strict=False):
            if not value or value.upper() == "N/A":
                continue
            if name == "CPU Affinity":
                self.cpu[label] = value
            elif name == "NUMA Affinity":
                ids = parse_id_list(value, column=name, row=label, source=self.src, line=lineno)
                self.numa_ids[label] = ids
                self.numa[label] = ids[0]
            elif name == "GPU NUMA ID":
                if not value.isdigit() or int(value) > MAX_NUMA_ID:
                    raise self.fail(
                        f"row {label}, column {name}: {value!r} is not a NUMA id (a number up to "
                        f"{MAX_NUMA_ID}, or N/A)",
                        lineno,
                    )
                self.gpu_numa[label] = int(value)

    def _check_symmetric(self) -> None:
        # nvidia-smi prints a symmetric matrix; a one-sided relation means the text was damaged
        # (hand-aligned, columns shifted), and guessing which side is right is unsafe.
        cells = self.cells
        for a in self.columns:
            for b in self.columns:
                ab, ba = cells[(a, b)], cells[(b, a)]
                if a < b and (cell_scope(ab) != cell_scope(ba) or nvlink_cell(ab) != nvlink_cell(ba)):
                    raise self.fail(
                        f"matrix is not symmetric: {a}→{b} is {ab} but {b}→{a} is {ba}", self.row_line[b]
                    )

    def _devices(self, legend: dict[str, str]) -> list[MatrixDevice]:
        devices: list[MatrixDevice] = []
        for label in self.columns:
            line = self.row_line[label]
            gm = _GPU_LABEL.match(label)
            if gm:
                index = int(gm.group(1))
                devices.append(MatrixDevice(label, "gpu", f"gpu{index}", line, gpu_index=index))
            else:
                devices.append(MatrixDevice(label, "nic", legend.get(label, label), line))
        names = [d.name for d in devices]
        for d in devices:
            if names.count(d.name) > 1:
                raise self.fail(f"device name {d.name!r} is used by two columns", d.line)
        return devices
