"""PCIe placement, pure: bus ids, sysfs device paths → (host bridge, switch), and the tree.

Linux names every PCI function by its bus id ``DDDD:BB:DD.F`` and lays ``/sys/devices`` out
as the PCI hierarchy itself: ``/sys/devices/pci0000:16/0000:16:01.0/0000:17:00.0/
0000:18:04.0/0000:1a:00.0`` is a device (``1a:00.0``) behind a switch downstream port
(``18:04.0``) behind the switch's upstream port (``17:00.0``) on root port ``16:01.0`` of host
bridge ``pci0000:16``. Every directory between the host bridge and the device is a bridge
(a device has children in sysfs only when it is a bridge), so the path alone gives the
placement:

* ``root``  — the host bridge (``pci0000:16``): devices under one host bridge talk without
  crossing the CPU's interconnect (``PHB`` in ``nvidia-smi topo -m``);
* ``switch`` — the first bridge *below* the root port (the top upstream port of a PCIe switch,
  ``0000:17:00.0``); every device under it reaches the others without the host bridge
  (``PIX``/``PXB``, both Tandem's ``pcie-switch`` scope). A device straight on a root port,
  or an integrated endpoint on the host bridge, has no switch.

NVML spells bus ids with an 8-digit domain (``00000000:17:00.0``), sysfs with 4; both
normalise to the sysfs form. Nothing here touches the file system: the sysfs and NVML
backends feed it facts and get placements and a :class:`~schemas.topology.NodeTopology` back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from schemas.topology import Gpu, Nic, NodeTopology, NumaNode, PcieRoot, PcieSwitch, Socket

__all__ = [
    "PciePath",
    "Placement",
    "build_topology",
    "normalize_bus_id",
    "parse_device_path",
]

_BDF = re.compile(
    r"^(?P<dom>[0-9a-fA-F]{4,8}):(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})\.(?P<fn>[0-7])$"
)
_HOST_BRIDGE = re.compile(r"^pci[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}$")


def normalize_bus_id(bus_id: str) -> str:
    """``00000000:17:00.0`` / ``0000:17:00.0`` → ``0000:17:00.0`` (lower case, 4-digit domain)."""
    text = bus_id.strip().rstrip("\x00")
    m = _BDF.match(text)
    if m is None:
        raise ValueError(f"not a PCI bus id: {bus_id!r} (expected DDDD:BB:DD.F)")
    dom = int(m["dom"], 16)
    return f"{dom:04x}:{m['bus'].lower()}:{m['dev'].lower()}.{m['fn']}"


def is_bus_id(text: str) -> bool:
    return _BDF.match(text) is not None


@dataclass(frozen=True, slots=True)
class PciePath:
    """A device's place in the PCI hierarchy: its host bridge and the functions down to it
    (``chain[0]`` is the root port or the device itself, ``chain[-1]`` the device)."""

    host_bridge: str
    chain: tuple[str, ...]

    @property
    def device(self) -> str:
        return self.chain[-1]

    @property
    def switch(self) -> str | None:
        """The top upstream switch port, or None when the device sits on the root port/bridge."""
        return self.chain[1] if len(self.chain) >= 3 else None


def parse_device_path(path: str) -> PciePath:
    """Parse a resolved sysfs device path (``.../devices/pci0000:16/0000:16:01.0/...``)."""
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        if _HOST_BRIDGE.match(part):
            # A device path may continue below the PCI function (net/eth0, infiniband/mlx5_0);
            # stop at the first component that is not a bus id so the chain ends at the device.
            tail = parts[i + 1 :]
            end = next((k for k, p in enumerate(tail) if not is_bus_id(p)), len(tail))
            chain = tuple(normalize_bus_id(p) for p in tail[:end])
            if not chain:
                break
            return PciePath(host_bridge=part.lower(), chain=chain)
    raise ValueError(f"not a PCI device path (no pciDDDD:BB host bridge followed by a bus id): {path}")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one device sits in the node tree."""

    socket: int
    numa: int
    root: str
    switch: str | None


def build_topology(
    name: str,
    *,
    gpus: list[tuple[Gpu, Placement]],
    nics: list[tuple[Nic, Placement]],
    description: str = "",
    labels: dict[str, str] | None = None,
) -> NodeTopology:
    """Assemble the tree from placed devices; order is deterministic (ids sorted) so two scans
    of unchanged hardware compare equal."""
    tree: dict[int, dict[int, dict[str, dict[str | None, tuple[list[Gpu], list[Nic]]]]]] = {}

    def slot(p: Placement) -> tuple[list[Gpu], list[Nic]]:
        roots = tree.setdefault(p.socket, {}).setdefault(p.numa, {})
        return roots.setdefault(p.root, {}).setdefault(p.switch, ([], []))

    for gpu, p in gpus:
        slot(p)[0].append(gpu)
    for nic, p in nics:
        slot(p)[1].append(nic)

    sockets: list[Socket] = []
    for sock_id in sorted(tree):
        numas: list[NumaNode] = []
        for numa_id in sorted(tree[sock_id]):
            roots: list[PcieRoot] = []
            for root_id in sorted(tree[sock_id][numa_id]):
                groups = tree[sock_id][numa_id][root_id]
                on_root = groups.get(None, ([], []))
                switches = [
                    PcieSwitch(
                        id=sw,
                        gpus=sorted(g, key=lambda x: x.index),
                        nics=sorted(n, key=lambda x: x.name),
                    )
                    for sw, (g, n) in sorted((k, v) for k, v in groups.items() if k is not None)
                ]
                roots.append(
                    PcieRoot(
                        id=root_id,
                        switches=switches,
                        gpus=sorted(on_root[0], key=lambda x: x.index),
                        nics=sorted(on_root[1], key=lambda x: x.name),
                    )
                )
            numas.append(NumaNode(id=numa_id, roots=roots))
        sockets.append(Socket(id=sock_id, numa_nodes=numas))
    return NodeTopology(
        name=name, sockets=sockets, description=description, labels=dict(labels or {})
    ).validate()
