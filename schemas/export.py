"""JSON Schema export of every message and record (``tandem schema export DIR``)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from schemas import messages, topology

EXPORTED: tuple[type[msgspec.Struct], ...] = (
    messages.NodeInventory,
    messages.HealthEvent,
    messages.Heartbeat,
    messages.AllocatorHeartbeat,
    messages.DeviceCommand,
    messages.AllocationRequest,
    messages.JobRequest,
    messages.Assignment,
    messages.AllocationFailed,
    messages.Applied,
    messages.Release,
    messages.Cleaned,
    messages.Freed,
    messages.DeadLetter,
    messages.InventoryQuery,
    messages.InventoryReply,
    messages.NodeRecord,
    messages.NodeAllocations,
    messages.RequestRecord,
    messages.ClaimRecord,
    topology.NodeTopology,
)


def export(directory: Path) -> list[Path]:
    """Write ``<Name>.schema.json`` for each exported type; return the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for cls in EXPORTED:
        path = directory / f"{cls.__name__}.schema.json"
        path.write_text(json.dumps(msgspec.json.schema(cls), indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written
