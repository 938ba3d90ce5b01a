"""RDMA NICs and PCIe placement from sysfs, rooted at a configurable path (``/sys`` on a node).

What is read, and where (all standard Linux sysfs; the tests build the same trees in a temp
directory, see ``tests/sysfs_tree.py``):

* ``class/infiniband/<dev>/device`` → the NIC's PCI function; ``ports/<n>/state``
  (``4: ACTIVE``), ``ports/<n>/link_layer`` (``InfiniBand`` / ``Ethernet``), ``ports/<n>/rate``
  (``400 Gb/sec (4X NDR)``);
* ``bus/pci/devices/<bdf>`` → a symlink into ``devices/pci<dom>:<bus>/...``, whose path is the
  PCIe ancestry (:mod:`services.nodeagent.backends.pcie` turns it into root + switch);
  ``numa_node``; ``net/<ifname>`` (the netdev); ``sriov_numvfs`` and ``virtfn<i>`` links (VFs);
  ``physfn`` (present on a VF, so VFs are not reported as NICs of their own);
  ``infiniband_verbs/uverbs<N>`` (the ``/dev/infiniband/uverbsN`` a container needs);
* ``devices/system/node/node<N>/cpulist`` and ``devices/system/cpu/cpu<k>/topology/
  physical_package_id`` → which socket a NUMA node belongs to.

Port state changes are found by polling the ``state`` files: this works for InfiniBand ports,
which have no netdev carrier for netlink to report, as well as for RoCE ports. With
``netlink=True`` the backend also listens to RTNL link events (pyroute2, ``RTMGRP_LINK``) for
the NICs' netdevs and reports an operstate change at once instead of at the next poll.
File reads run in a thread; the parsing and diffing are pure functions.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from schemas.topology import LinkType, Nic, NodeTopology, VirtualFunction
from services.nodeagent.backends.base import BackendError, BackendUnavailable, HealthChange
from services.nodeagent.backends.pcie import Placement, build_topology, normalize_bus_id, parse_device_path
from services.runtime.process.tasks import Supervisor

__all__ = [
    "SysfsBackend",
    "SysfsReader",
    "link_change",
    "parse_cpulist",
    "parse_port_state",
    "parse_rate_gbps",
    "port_changes",
]

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec")
NVIDIA_VENDOR = "0x10de"


# ---------------------------------------------------------------------------------------------
# pure parsing


PortState = Literal["active", "down", "init", "unknown"]


def parse_port_state(text: str) -> PortState:
    """``4: ACTIVE`` → ``active``; ``1: DOWN`` → ``down``; ``2: INIT``/``3: ARMED`` → ``init``."""
    word = text.strip().split(":", 1)[-1].strip().upper()
    states: dict[str, PortState] = {"ACTIVE": "active", "DOWN": "down", "INIT": "init", "ARMED": "init"}
    return states.get(word, "unknown")


def parse_rate_gbps(text: str) -> int:
    """``400 Gb/sec (4X NDR)`` → 400; ``2.5 Gb/sec (1X SDR)`` → 2; unreadable → 0."""
    m = _RATE.match(text)
    return int(float(m.group(1))) if m else 0


def parse_link_layer(text: str) -> LinkType:
    return "ethernet" if text.strip().lower() == "ethernet" else "infiniband"


def parse_cpulist(text: str) -> list[int]:
    """``0-3,8,10-11`` → [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def link_change(device: str, netdev: str, operstate: str | None, *, last: str | None) -> HealthChange | None:
    """Health change for one RTNL link message (operstate ``UP``/``DOWN``/``LOWERLAYERDOWN``...);
    None when the state did not change or says nothing (``UNKNOWN``, e.g. no carrier support)."""
    if operstate is None or operstate == last or operstate == "UNKNOWN":
        return None
    if operstate == "UP":
        return None if last is None else HealthChange(device, True, f"link up ({netdev})")
    return HealthChange(device, False, f"link down ({netdev} operstate {operstate})")


def port_changes(old: dict[str, str], new: dict[str, str]) -> list[HealthChange]:
    """Health changes between two port-state snapshots (device → state)."""
    out: list[HealthChange] = []
    for dev, state in sorted(new.items()):
        before = old.get(dev)
        if before == state:
            continue
        if state == "active":
            if before is not None:
                out.append(HealthChange(dev, True, "port active"))
        else:
            out.append(HealthChange(dev, False, f"port {state}"))
    for dev in sorted(set(old) - set(new)):
        out.append(HealthChange(dev, False, "RDMA device disappeared from sysfs"))
    return out


# ---------------------------------------------------------------------------------------------
# reading a sysfs tree


@dataclass(frozen=True, slots=True)
class PciFacts:
    bus_id: str
    vendor: str
    cls: str
    numa: int
    path: str


class SysfsReader:
    """Blocking reads of one sysfs tree (``root`` = ``/sys`` or a fixture directory)."""

    def __init__(self, root: str | Path = "/sys", *, port: int = 1) -> None:
        self.root = Path(root)
        self.port = port

    # -- small helpers ----------------------------------------------------------------------

    def _read(self, path: Path, default: str = "") -> str:
        try:
            return path.read_text().strip()
        except OSError:
            return default

    def pci_dir(self, bus_id: str) -> Path:
        return self.root / "bus" / "pci" / "devices" / normalize_bus_id(bus_id)

    def pci_facts(self, bus_id: str) -> PciFacts:
        link = self.pci_dir(bus_id)
        if not link.exists():
            raise BackendError(f"sysfs: no PCI device {bus_id} under {link.parent}")
        real = os.path.realpath(link)
        numa = self._read(link / "numa_node", "-1")
        return PciFacts(
            bus_id=normalize_bus_id(bus_id),
            vendor=self._read(link / "vendor"),
            cls=self._read(link / "class"),
            numa=int(numa) if numa.lstrip("-").isdigit() else -1,
            path=real,
        )

    def socket_of_numa(self, numa: int) -> int:
        """The physical package of the NUMA node's first CPU (0 when unknown)."""
        cpus = parse_cpulist(self._read(self.root / "devices/system/node" / f"node{numa}" / "cpulist"))
        if not cpus:
            return 0
        pkg = self._read(self.root / "devices/system/cpu" / f"cpu{cpus[0]}" / "topology/physical_package_id")
        return int(pkg) if pkg.isdigit() else 0

    def placement(self, bus_id: str) -> Placement:
        """Socket, NUMA node, host bridge and switch of one PCI function."""
        facts = self.pci_facts(bus_id)
        path = parse_device_path(facts.path)
        # numa_node is -1 on single-node machines and some firmware; those have one node, 0.
        numa = max(facts.numa, 0)
        return Placement(
            socket=self.socket_of_numa(numa), numa=numa, root=path.host_bridge, switch=path.switch
        )

    # -- RDMA devices -----------------------------------------------------------------------

    def rdma_names(self) -> list[str]:
        base = self.root / "class" / "infiniband"
        try:
            return sorted(p.name for p in base.iterdir())
        except OSError:
            return []

    def rdma_bus_id(self, name: str) -> str:
        dev = self.root / "class" / "infiniband" / name / "device"
        return normalize_bus_id(os.path.basename(os.path.realpath(dev)))

    def port_state(self, name: str) -> str:
        ports = self.root / "class" / "infiniband" / name / "ports" / str(self.port)
        return parse_port_state(self._read(ports / "state", "unknown"))

    def port_states(self) -> dict[str, str]:
        return {n: self.port_state(n) for n in self.rdma_names() if not self._is_vf(self.rdma_bus_id(n))}

    def _is_vf(self, bus_id: str) -> bool:
        return (self.pci_dir(bus_id) / "physfn").exists()

    def netdev_of(self, bus_id: str) -> str | None:
        try:
            names = sorted(p.name for p in (self.pci_dir(bus_id) / "net").iterdir())
        except OSError:
            return None
        return names[0] if names else None

    def rdma_of_pci(self, bus_id: str) -> str | None:
        try:
            names = sorted(p.name for p in (self.pci_dir(bus_id) / "infiniband").iterdir())
        except OSError:
            return None
        return names[0] if names else None

    def uverbs_of(self, name: str) -> list[str]:
        """``/dev/infiniband/uverbsN`` for an RDMA device (its verbs char device)."""
        verbs = self.root / "class" / "infiniband" / name / "device" / "infiniband_verbs"
        try:
            entries = sorted(p.name for p in verbs.iterdir() if p.name.startswith("uverbs"))
        except OSError:
            return []
        return [f"/dev/infiniband/{e}" for e in entries]

    def vfs_of(self, bus_id: str) -> list[VirtualFunction]:
        pf = self.pci_dir(bus_id)
        numvfs = self._read(pf / "sriov_numvfs", "0")
        out: list[VirtualFunction] = []
        for i in range(int(numvfs) if numvfs.isdigit() else 0):
            link = pf / f"virtfn{i}"
            if not link.exists():
                continue
            vf_bus = normalize_bus_id(os.path.basename(os.path.realpath(link)))
            name = self.rdma_of_pci(vf_bus)
            if name is None:
                continue  # a VF without an RDMA device (driver not bound) cannot be handed out
            out.append(VirtualFunction(index=i, name=name, pci_bus_id=vf_bus, netdev=self.netdev_of(vf_bus)))
        return out

    def nic(self, name: str) -> Nic:
        bus_id = self.rdma_bus_id(name)
        port = self.root / "class" / "infiniband" / name / "ports" / str(self.port)
        state = parse_port_state(self._read(port / "state", "unknown"))
        return Nic(
            name=name,
            pci_bus_id=bus_id,
            netdev=self.netdev_of(bus_id),
            link_type="ethernet"
            if parse_link_layer(self._read(port / "link_layer")) == "ethernet"
            else "infiniband",
            speed_gbps=parse_rate_gbps(self._read(port / "rate")),
            port_state="active"
            if state == "active"
            else "down"
            if state == "down"
            else "init"
            if state == "init"
            else "unknown",
            vfs=self.vfs_of(bus_id),
        )

    def nics(self) -> list[tuple[Nic, Placement]]:
        """Every RDMA physical function with its placement (VFs hang under their PF)."""
        out: list[tuple[Nic, Placement]] = []
        for name in self.rdma_names():
            bus_id = self.rdma_bus_id(name)
            if self._is_vf(bus_id):
                continue
            out.append((self.nic(name), self.placement(bus_id)))
        return out

    def nvidia_gpus(self) -> list[str]:
        """Bus ids of NVIDIA display/3D controllers (class 0x03xxxx) — a cross-check for NVML."""
        base = self.root / "bus" / "pci" / "devices"
        try:
            entries = sorted(p.name for p in base.iterdir())
        except OSError:
            return []
        return [
            e
            for e in entries
            if self._read(base / e / "vendor") == NVIDIA_VENDOR
            and self._read(base / e / "class").startswith("0x03")
        ]


class SysfsBackend:
    """NIC-only discovery backend (GPUs come from NVML; :class:`HostBackend` joins them)."""

    name = "sysfs"

    def __init__(
        self,
        root: str | Path = "/sys",
        *,
        node_name: str,
        poll_interval: float = 2.0,
        port: int = 1,
        netlink: bool = False,
    ) -> None:
        self.reader = SysfsReader(root, port=port)
        self.node_name = node_name
        self.poll_interval = poll_interval
        self.netlink = netlink
        self._closed = asyncio.Event()
        if not (self.reader.root / "bus" / "pci" / "devices").is_dir():
            raise BackendUnavailable(
                f"sysfs backend: {self.reader.root}/bus/pci/devices does not exist; "
                "set the sysfs root to the host's /sys (mounted into the agent) or use the simulated backend"
            )

    async def discover(self) -> NodeTopology:
        nics = await asyncio.to_thread(self.reader.nics)
        return build_topology(self.node_name, gpus=[], nics=nics, description="sysfs")

    async def health_changes(self) -> AsyncIterator[HealthChange]:
        """Port state changes (polled) and, with ``netlink``, link events; until :meth:`close`."""
        if not self.netlink:
            async for change in self._polled():
                yield change
            return
        queue: asyncio.Queue[HealthChange] = asyncio.Queue()
        tasks = Supervisor(f"sysfs-health:{self.node_name}")

        async def pump(source: AsyncIterator[HealthChange]) -> None:
            async for change in source:
                await queue.put(change)

        tasks.spawn("poll", lambda: pump(self._polled()))
        tasks.spawn("netlink", lambda: pump(self.link_events()))
        try:
            while not self._closed.is_set():
                getter = asyncio.ensure_future(queue.get())
                closed = asyncio.ensure_future(self._closed.wait())
                done, _ = await asyncio.wait({getter, closed}, return_when=asyncio.FIRST_COMPLETED)
                for f in (getter, closed):
                    if f not in done:
                        f.cancel()
                if getter in done:
                    yield getter.result()
        finally:
            await tasks.aclose()

    async def link_events(self) -> AsyncIterator[HealthChange]:
        """RTNL link events for the NICs' netdevs (in the agent's network namespace)."""
        from pyroute2 import AsyncIPRoute
        from pyroute2.netlink.rtnl import RTMGRP_LINK

        nics = await asyncio.to_thread(self.reader.nics)
        by_netdev = {n.netdev: n.name for n, _ in nics if n.netdev}
        last: dict[str, str | None] = {}
        async with AsyncIPRoute() as ipr:
            await ipr.bind(groups=RTMGRP_LINK)
            while not self._closed.is_set():
                # get() yields one receive's worth of messages; call it again for the next.
                async for msg in ipr.get():
                    netdev = msg.get("IFLA_IFNAME")
                    device = by_netdev.get(netdev)
                    if device is None:
                        continue
                    state = msg.get("IFLA_OPERSTATE")
                    change = link_change(device, netdev, state, last=last.get(device))
                    last[device] = state
                    if change is not None:
                        yield change

    async def _polled(self) -> AsyncIterator[HealthChange]:
        states = await asyncio.to_thread(self.reader.port_states)
        for dev, state in sorted(states.items()):
            if state != "active":
                yield HealthChange(dev, False, f"port {state}")
        while not self._closed.is_set():
            try:
                await asyncio.wait_for(self._closed.wait(), timeout=self.poll_interval)
                return
            except TimeoutError:
                pass
            new = await asyncio.to_thread(self.reader.port_states)
            for change in port_changes(states, new):
                yield change
            states = new

    async def probe(self, device: str) -> str | None:
        """A NIC whose port is not active (or whose RDMA device is gone) is still unusable:
        the port-state poll reports only changes, so a port still down after the clean period
        would otherwise be "recovered" with nothing to fail it again. VFs and devices this
        backend does not know: None."""

        def look() -> str | None:
            states = self.reader.port_states()
            if device in states:
                state = states[device]
                return None if state == "active" else f"port {state}"
            return None

        return await asyncio.to_thread(look)

    async def gpu_processes(self, indices: list[int]) -> dict[int, list[int]]:
        if indices:
            raise BackendError("sysfs backend sees no GPU processes; pair it with the NVML backend (host)")
        return {}

    async def close(self) -> None:
        self._closed.set()
