"""The simulated backend: a node whose hardware is a topology file.

Used by ``tandem up`` / ``make demo`` and the tests. Discovery returns the file's tree renamed
to the node; failures are injected with :meth:`SimulatedBackend.inject` (they flow through the
same health path as an NVML XID would); compute processes can be planted to exercise the
"cleanup verified, not assumed" path. :class:`SimulatedApplier` records what it applied and
can be told to fail cleanup for a device.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

from schemas.messages import Assignment
from schemas.topology import NodeTopology
from services.nodeagent.backends.base import ApplyError, HealthChange


class SimulatedBackend:
    name = "simulated"

    def __init__(self, topology: NodeTopology, *, node: str) -> None:
        self._topology = msgspec.structs.replace(topology, name=node).validate()
        self._changes: asyncio.Queue[HealthChange] = asyncio.Queue()
        self.processes: dict[int, list[int]] = {}
        self.broken: dict[str, str] = {}  # device → why it is unusable (what probe() answers)

    async def discover(self) -> NodeTopology:
        return self._topology

    def replace_topology(self, topology: NodeTopology) -> None:
        """Simulate hot-plug: the next ``discover`` returns this tree."""
        self._topology = msgspec.structs.replace(topology, name=self._topology.name).validate()

    def inject(self, device: str, *, healthy: bool, reason: str) -> None:
        """Report a change; a failure also stays (``broken``) until a healthy one is injected."""
        if healthy:
            self.broken.pop(device, None)
        else:
            self.broken[device] = reason
        self._changes.put_nowait(HealthChange(device=device, healthy=healthy, reason=reason))

    def uverbs_of(self, name: str) -> list[str]:
        """The verbs device node a NIC of this topology would have (``uverbs<k>``, k its place
        among the NICs and VFs): what the DRA plugin's CDI spec names for it."""
        names = [n for nic in self._topology.nics() for n in (nic.name, *(vf.name for vf in nic.vfs))]
        return [f"/dev/infiniband/uverbs{names.index(name)}"] if name in names else []

    async def probe(self, device: str) -> str | None:
        return self.broken.get(device)

    async def health_changes(self) -> AsyncIterator[HealthChange]:
        while True:
            yield await self._changes.get()

    async def gpu_processes(self, indices: list[int]) -> dict[int, list[int]]:
        return {i: list(self.processes.get(i, [])) for i in indices}

    async def close(self) -> None:
        return None


class SimulatedApplier:
    """Applies nothing real; remembers assignments so cleanup can be checked in tests."""

    def __init__(self) -> None:
        self.applied: dict[str, Assignment] = {}
        self.stuck: set[str] = set()  # device ids whose cleanup "fails"
        self.apply_fails: set[str] = set()  # request ids whose apply fails

    async def apply(self, assignment: Assignment) -> None:
        if assignment.request_id in self.apply_fails:
            raise ApplyError(f"simulated apply failure for {assignment.request_id}")
        self.applied[assignment.request_id] = assignment

    async def cleanup(self, assignment: Assignment) -> list[str]:
        problems = [f"{d}: simulated cleanup failure" for d in assignment.device_ids() if d in self.stuck]
        if not problems:
            self.applied.pop(assignment.request_id, None)
        return problems
