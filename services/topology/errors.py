"""Errors of the topology package (the tree is drawn in ``services.topology``'s docstring)."""

from __future__ import annotations

from pathlib import Path


class TopologyFileError(ValueError):
    """A topology file (or built-in name) that cannot be read, decoded or validated.

    The message names the file and, where one is known, the field path in msgspec's notation
    (``$.sockets[0].numa_nodes[1].roots[0].gpus[2].index``).
    """

    def __init__(self, message: str, *, path: str | Path | None = None, field: str | None = None) -> None:
        self.path = None if path is None else str(path)
        self.field = field
        where = self.path or "<topology>"
        at = f" at `{field}`" if field and f"`{field}`" not in message else ""
        super().__init__(f"{where}: {message}{at}")


class NvsmiFormatError(TopologyFileError):
    """``nvidia-smi topo -m`` text that is not a usable matrix; names the file and line."""

    def __init__(self, message: str, *, path: str | Path | None = None, line: int | None = None) -> None:
        self.line = line
        where = str(path) if path is not None else "<nvidia-smi output>"
        if line is not None:
            where = f"{where}:{line}"
        super().__init__(message, path=where)
        self.path = None if path is None else str(path)
