"""Node topology files: load, validate and write them; built-in topologies.

The tree model and file format is :class:`schemas.topology.NodeTopology` (see
``docs/topology.md``). This package is the one place that turns files into trees:

- :func:`load_topology` reads a ``.yaml``/``.yml``/``.json`` file, or a built-in by name
  (:func:`builtin_names`, :func:`builtin_path`), decodes it with msgspec and validates it.
- :func:`dump_topology` writes a tree back as YAML or JSON.
- :func:`import_nvidia_smi` (module :mod:`services.topology.nvsmi`, which reads the text with
  :mod:`services.topology.nvsmi_matrix`) infers a tree from the text of ``nvidia-smi topo -m``;
  :func:`relations` recomputes the GPU x NIC relation classes from any tree,
  :func:`matrix_relations` reads them off a parsed matrix.
- :func:`render_tree` draws a tree as indented text.

Errors::

    ValueError
    └── TopologyFileError      a file/name that cannot be read, decoded or validated;
        │                      the message names the file and the field path (``$.sockets[0]...``)
        └── NvsmiFormatError   ``nvidia-smi topo -m`` text that is not a usable matrix;
                               the message names the file and line

Everything is pure apart from reading the file named; no NATS, no hardware.
"""

from __future__ import annotations

from services.topology.errors import NvsmiFormatError, TopologyFileError
from services.topology.files import (
    builtin_names,
    builtin_path,
    check_tree,
    decode_topology,
    dump_topology,
    load_topology,
)
from services.topology.nvsmi import (
    ImportResult,
    Mismatch,
    TopoMatrix,
    build_topology,
    import_nvidia_smi,
    matrix_relations,
    parse_matrix,
    relations,
    tree_relation,
)
from services.topology.render import render_tree, summary

__all__ = [
    "ImportResult",
    "Mismatch",
    "NvsmiFormatError",
    "TopoMatrix",
    "TopologyFileError",
    "build_topology",
    "builtin_names",
    "builtin_path",
    "check_tree",
    "decode_topology",
    "dump_topology",
    "import_nvidia_smi",
    "load_topology",
    "matrix_relations",
    "parse_matrix",
    "relations",
    "render_tree",
    "summary",
    "tree_relation",
]
