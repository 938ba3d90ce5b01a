"""Reading and writing topology files, and the built-in topologies shipped as package data.

A topology file is a :class:`schemas.topology.NodeTopology` written as YAML or JSON (the
format is described in ``docs/topology.md``). Decoding is msgspec's, so a wrong type or a
missing field is reported with its path (``$.sockets[0].numa_nodes[0].id``). After decoding,
:func:`check_tree` checks what a type cannot: ids that must be unique (devices, VFs, root
complexes, NUMA nodes, sockets, switches within a root) and NVLink cross-references, again
naming the field path; finally ``NodeTopology.validate()`` runs, so a file accepted here is
accepted everywhere the model is used.

Everything here is pure apart from reading the one file named.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import msgspec
import msgspec.json
import msgspec.yaml
import yaml

from schemas.topology import Gpu, Nic, NodeTopology, TopologyError
from services.topology.errors import TopologyFileError

__all__ = [
    "BUILTIN_DIR",
    "TopologyFormat",
    "builtin_names",
    "builtin_path",
    "check_tree",
    "decode_topology",
    "dump_topology",
    "load_topology",
]

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
TopologyFormat = Literal["yaml", "json"]
_AT = re.compile(r"at `(\$[^`]*)`")
_SUFFIXES: dict[str, TopologyFormat] = {".yaml": "yaml", ".yml": "yaml", ".json": "json"}


def builtin_names() -> list[str]:
    """Names of the built-in topologies, sorted (``dgx-h100``, ``gpu-only-8``, ...)."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml"))


def builtin_path(name: str) -> Path:
    """The YAML file of built-in topology ``name``; :class:`TopologyFileError` if unknown."""
    path = BUILTIN_DIR / f"{name}.yaml"
    if "/" in name or not path.is_file():
        raise TopologyFileError(
            f"no built-in topology {name!r}; built-ins are: {', '.join(builtin_names())}", path=name
        )
    return path


def _resolve(source: str | Path) -> Path:
    """A path as given, or a built-in's file. A string without a file suffix that is not an
    existing file is taken as a built-in name (so ``dgx-h100`` works from any directory)."""
    if isinstance(source, Path):
        return source
    path = Path(source)
    if path.suffix.lower() in _SUFFIXES or path.exists():
        return path
    return builtin_path(source)


def load_topology(source: str | Path) -> NodeTopology:
    """Load, decode and validate a topology file or a built-in topology by name.

    Raises :class:`TopologyFileError` naming the file and the offending field path.
    """
    path = _resolve(source)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TopologyFileError(f"cannot read topology file: {exc.strerror or exc}", path=path) from exc
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        # A file named without a known suffix: JSON is a subset of YAML, so YAML reads both.
        fmt = "yaml"
    return decode_topology(data, fmt=fmt, path=path)


def decode_topology(
    data: bytes | str, *, fmt: TopologyFormat, path: str | Path | None = None
) -> NodeTopology:
    """Decode topology text (no file I/O); ``path`` is only used in error messages."""
    try:
        if fmt == "json":
            topo = msgspec.json.decode(data, type=NodeTopology)
        else:
            topo = msgspec.yaml.decode(data, type=NodeTopology)
    except msgspec.ValidationError as exc:
        # msgspec's text already ends with "- at `$.field.path`".
        at = _AT.search(str(exc))
        raise TopologyFileError(
            f"invalid topology: {exc}", path=path, field=at.group(1) if at else None
        ) from exc
    except msgspec.DecodeError as exc:
        raise TopologyFileError(f"not valid {fmt.upper()}: {exc}", path=path) from exc
    check_tree(topo, path=path)
    try:
        return topo.validate()
    except TopologyError as exc:  # pragma: no cover - check_tree catches these first, with paths
        raise TopologyFileError(str(exc), path=path) from exc


def dump_topology(topo: NodeTopology, *, fmt: TopologyFormat = "yaml") -> str:
    """Encode a topology as YAML or (indented) JSON text; defaults are omitted."""
    if fmt == "json":
        return msgspec.json.format(msgspec.json.encode(topo), indent=2).decode() + "\n"
    if fmt == "yaml":
        data = msgspec.to_builtins(topo)
        # The tree last, so a reader sees name, description and partitions before the detail.
        data["sockets"] = data.pop("sockets")
        return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)
    raise ValueError(f"unknown topology format {fmt!r}; expected 'yaml' or 'json'")


class _Dumper(yaml.SafeDumper):
    """Block style for the tree, flow style (``[1, 2, 3]``) for short lists of numbers, so
    NVLink peers and partitions stay one line each."""


def _represent_list(dumper: yaml.SafeDumper, value: list[object]) -> yaml.Node:
    flow = all(isinstance(v, int | float | str) for v in value) and len(value) <= 32
    return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def _walk(topo: NodeTopology) -> Iterator[tuple[str, Gpu | Nic]]:
    """Every GPU and NIC with its field path, in tree order."""
    for si, sock in enumerate(topo.sockets):
        for ni, numa in enumerate(sock.numa_nodes):
            for ri, root in enumerate(numa.roots):
                base = f"$.sockets[{si}].numa_nodes[{ni}].roots[{ri}]"
                for gi, gpu in enumerate(root.gpus):
                    yield f"{base}.gpus[{gi}]", gpu
                for ci, nic in enumerate(root.nics):
                    yield f"{base}.nics[{ci}]", nic
                for wi, sw in enumerate(root.switches):
                    for gi, gpu in enumerate(sw.gpus):
                        yield f"{base}.switches[{wi}].gpus[{gi}]", gpu
                    for ci, nic in enumerate(sw.nics):
                        yield f"{base}.switches[{wi}].nics[{ci}]", nic


def _fail(topo: NodeTopology, message: str, *, path: str | Path | None, field: str) -> TopologyFileError:
    return TopologyFileError(f"{topo.name}: {message} - at `{field}`", path=path, field=field)


def check_tree(topo: NodeTopology, *, path: str | Path | None = None) -> None:
    """Cross-reference checks with field paths; raises :class:`TopologyFileError`.

    Root-complex and NUMA ids must be unique in the node because alignment scopes compare
    them across the whole tree (``DeviceLocation.key``); switch ids only within their root.
    """
    seen_socket: dict[int, str] = {}
    seen_numa: dict[int, str] = {}
    seen_root: dict[str, str] = {}
    for si, sock in enumerate(topo.sockets):
        here = f"$.sockets[{si}].id"
        if sock.id in seen_socket:
            raise _fail(topo, f"socket id {sock.id} also at `{seen_socket[sock.id]}`", path=path, field=here)
        seen_socket[sock.id] = here
        for ni, numa in enumerate(sock.numa_nodes):
            here = f"$.sockets[{si}].numa_nodes[{ni}].id"
            if numa.id in seen_numa:
                raise _fail(
                    topo, f"NUMA node id {numa.id} also at `{seen_numa[numa.id]}`", path=path, field=here
                )
            seen_numa[numa.id] = here
            for ri, root in enumerate(numa.roots):
                here = f"$.sockets[{si}].numa_nodes[{ni}].roots[{ri}].id"
                if root.id in seen_root:
                    raise _fail(
                        topo,
                        f"PCIe root id {root.id!r} also at `{seen_root[root.id]}`",
                        path=path,
                        field=here,
                    )
                seen_root[root.id] = here
                seen_switch: set[str] = set()
                for wi, sw in enumerate(root.switches):
                    if sw.id in seen_switch:
                        raise _fail(
                            topo,
                            f"PCIe switch id {sw.id!r} appears twice under root {root.id!r}",
                            path=path,
                            field=f"$.sockets[{si}].numa_nodes[{ni}].roots[{ri}].switches[{wi}].id",
                        )
                    seen_switch.add(sw.id)

    seen_dev: dict[str, str] = {}
    gpu_indices: set[int] = set()
    gpus: list[tuple[str, Gpu]] = []
    for where, dev in _walk(topo):
        names = [(dev.id, f"{where}.index" if isinstance(dev, Gpu) else f"{where}.name")]
        if isinstance(dev, Nic):
            names += [(vf.name, f"{where}.vfs[{vi}].name") for vi, vf in enumerate(dev.vfs)]
        else:
            gpu_indices.add(dev.index)
            gpus.append((where, dev))
        for name, field in names:
            if name in seen_dev:
                raise _fail(topo, f"device id {name!r} also at `{seen_dev[name]}`", path=path, field=field)
            seen_dev[name] = field
    for where, gpu in gpus:
        bad = [p for p in gpu.nvlink_peers if p not in gpu_indices or p == gpu.index]
        if bad:
            raise _fail(
                topo,
                f"gpu{gpu.index} names unknown NVLink peers {bad}",
                path=path,
                field=f"{where}.nvlink_peers",
            )
    for i, part in enumerate(topo.nvlink_partitions):
        bad = [g for g in part if g not in gpu_indices]
        if bad:
            raise _fail(
                topo,
                f"NVLink partition names unknown GPUs {bad}",
                path=path,
                field=f"$.nvlink_partitions[{i}]",
            )
