"""Node topology files: load, validate and write them; built-in topologies.

The tree model and file format is :class:`schemas.topology.NodeTopology` (see
``docs/topology.md``). This package is the one place that turns files into trees:

- :func:`load_topology` reads a ``.yaml``/``.yml``/``.json`` file, or a built-in by name
  (:func:`builtin_names`, :func:`builtin_path`), decodes it with msgspec and validates it.
- :func:`dump_topology` writes a tree back as YAML or JSON.

Errors::

    ValueError
    └── TopologyFileError      a file/name that cannot be read, decoded or validated;
                               the message names the file and the field path (``$.sockets[0]...``)

Everything is pure apart from reading the file named; no NATS, no hardware.
"""

from __future__ import annotations

from services.topology.errors import TopologyFileError
from services.topology.files import (
    builtin_names,
    builtin_path,
    check_tree,
    decode_topology,
    dump_topology,
    load_topology,
)

__all__ = [
    "TopologyFileError",
    "builtin_names",
    "builtin_path",
    "check_tree",
    "decode_topology",
    "dump_topology",
    "load_topology",
]
