"""The real node: NVML's GPUs placed by sysfs, plus sysfs's RDMA NICs, as one tree.

NVML knows the GPUs (UUID, memory, NVLink, XIDs) but not the PCIe tree; sysfs knows the tree
and the NICs but not what a GPU is. :class:`HostBackend` asks NVML for GPU facts, asks sysfs
where each GPU's bus id sits (host bridge, top switch, NUMA node, socket), reads the NICs from
sysfs, and builds one :class:`~schemas.topology.NodeTopology` with
:func:`~services.nodeagent.backends.pcie.build_topology`. A GPU NVML reports but sysfs does not
show (an agent without the host's ``/sys`` mounted) is a configuration error, reported as such
rather than guessed. Health merges both streams: XID/ECC/lost from NVML, port state from sysfs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

from schemas.topology import Gpu, NodeTopology
from services.nodeagent.backends.base import BackendError, HealthChange
from services.nodeagent.backends.nvml import NvmlBackend, node_domain
from services.nodeagent.backends.pcie import Placement, build_topology
from services.nodeagent.backends.sysfs import SysfsBackend
from services.runtime.process.tasks import Supervisor


class HostBackend:
    name = "host"

    def __init__(self, *, gpus: NvmlBackend, nics: SysfsBackend, node_name: str) -> None:
        self.gpu_backend = gpus
        self.nic_backend = nics
        self.node_name = node_name

    async def discover(self) -> NodeTopology:
        facts = await self.gpu_backend.gpus()
        reader = self.nic_backend.reader

        def place() -> list[tuple[Gpu, Placement]]:
            out: list[tuple[Gpu, Placement]] = []
            for f in facts:
                if f.gpu.pci_bus_id is None:
                    raise BackendError(f"gpu{f.gpu.index}: NVML gave no PCI bus id; cannot place it")
                try:
                    out.append((f.gpu, reader.placement(f.gpu.pci_bus_id)))
                except BackendError as exc:
                    raise BackendError(
                        f"gpu{f.gpu.index} ({f.gpu.pci_bus_id}) is not in {reader.root}: {exc}; "
                        "mount the host's /sys into the agent"
                    ) from exc
            return out

        placed = await asyncio.to_thread(place)
        nics = await asyncio.to_thread(reader.nics)
        topo = build_topology(self.node_name, gpus=placed, nics=nics, description="nvml+sysfs")
        return msgspec.structs.replace(topo, nvlink_domain=node_domain(facts))

    async def health_changes(self) -> AsyncIterator[HealthChange]:
        queue: asyncio.Queue[HealthChange] = asyncio.Queue()
        tasks = Supervisor(f"host-health:{self.node_name}")

        async def pump(source: AsyncIterator[HealthChange]) -> None:
            async for change in source:
                await queue.put(change)

        tasks.spawn("nvml", lambda: pump(self.gpu_backend.health_changes()))
        tasks.spawn("sysfs", lambda: pump(self.nic_backend.health_changes()))
        try:
            while True:
                yield await queue.get()
        finally:
            await tasks.aclose()

    async def probe(self, device: str) -> str | None:
        """GPUs are NVML's to judge, NICs sysfs's (each answers None for the other's)."""
        return await self.gpu_backend.probe(device) or await self.nic_backend.probe(device)

    async def gpu_processes(self, indices: list[int]) -> dict[int, list[int]]:
        return await self.gpu_backend.gpu_processes(indices)

    async def close(self) -> None:
        await self.gpu_backend.close()
        await self.nic_backend.close()
