"""The two seams of the node agent: what discovers devices, and what applies them to pods.

``DiscoveryBackend`` turns the machine (or a topology file) into a
:class:`~schemas.topology.NodeTopology`, streams device health changes, looks at one device again
before it returns to service (``probe``), and reports compute processes per GPU so cleanup can be
verified. ``Applier`` hands an assignment's devices to the
pod and takes them back; ``cleanup`` returns the problems it found (empty = verified clean).
Both raise :class:`BackendError` subclasses with a message an operator can act on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import msgspec

from schemas.messages import Assignment
from schemas.topology import NodeTopology


class BackendError(Exception):
    """A discovery or apply backend failed; the message names the backend and what to do."""


class BackendUnavailable(BackendError):
    """The backend cannot run on this machine (library missing, no such sysfs path)."""


class ApplyError(BackendError):
    """Applying an assignment to the pod failed."""


class HealthChange(msgspec.Struct, frozen=True):
    """A device's health as a backend observed it (``reason`` says why it changed)."""

    device: str
    healthy: bool
    reason: str = ""


class DiscoveryBackend(Protocol):
    name: str

    async def discover(self) -> NodeTopology: ...

    def health_changes(self) -> AsyncIterator[HealthChange]: ...

    async def probe(self, device: str) -> str | None:
        """Look at a failed device again before it returns to service: the reason it is still
        unusable, or None when it looks usable (also for devices this backend does not know).
        A usable answer ends the device's failure episode: its next failure is reported anew."""
        ...

    async def gpu_processes(self, indices: list[int]) -> dict[int, list[int]]:
        """PIDs of compute processes per GPU index (empty lists when clean)."""
        ...

    async def close(self) -> None: ...


class Applier(Protocol):
    async def apply(self, assignment: Assignment) -> None: ...

    async def cleanup(self, assignment: Assignment) -> list[str]:
        """Undo ``apply``; return problems found (an empty list means verified clean)."""
        ...
