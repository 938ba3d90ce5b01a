"""Draw a topology tree as indented text (``tandem topology show``), optionally with each
device's live state. Pure: tree in, text out. :mod:`.picture` draws the same tree as DOT/SVG."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from schemas.topology import Gpu, Nic, NodeTopology, PcieRoot, PcieSwitch

__all__ = ["TreeNode", "render_tree", "summary", "tree_of"]


def summary(topo: NodeTopology) -> str:
    """One line: GPU, NIC and VF counts, and the NVLink layout."""
    gpus, nics = topo.gpus(), topo.nics()
    vfs = sum(len(n.vfs) for n in nics)
    nvlinked = sum(1 for g in gpus if g.nvlink_peers)
    n_parts = len(topo.nvlink_partitions)
    parts = f", {n_parts} NVLink partition{'s' if n_parts != 1 else ''}" if n_parts else ""
    return f"{len(gpus)} GPUs ({nvlinked} with NVLink{parts}), {len(nics)} NICs, {vfs} VFs"


def _gpu_line(g: Gpu) -> str:
    bits = [f"{g.id}", g.model]
    if g.memory_mib:
        bits.append(f"{g.memory_mib} MiB")
    if g.pci_bus_id:
        bits.append(g.pci_bus_id)
    bits.append(g.uuid)
    if g.nvlink_peers:
        bits.append(f"NVLink peers {len(g.nvlink_peers)}")
    return "  ".join(bits)


def _nic_line(n: Nic) -> str:
    bits = [n.name]
    if n.netdev:
        bits.append(n.netdev)
    speed = f" {n.speed_gbps}G" if n.speed_gbps else ""
    bits.append(f"{n.link_type}{speed}")
    if n.pci_bus_id:
        bits.append(n.pci_bus_id)
    bits.append(n.port_state)
    if n.vfs:
        bits.append(f"{len(n.vfs)} VFs ({', '.join(vf.name for vf in n.vfs)})")
    return "  ".join(bits)


@dataclass
class TreeNode:
    """One box of the drawn tree: a socket, NUMA node, PCIe root or switch, or a device
    (``device`` = its id, whose live ``state`` a picture may show)."""

    label: str
    children: list[TreeNode] = field(default_factory=list)
    device: str = ""


def tree_of(topo: NodeTopology) -> list[TreeNode]:
    """The topology as the tree every picture draws (sockets at the top, devices as leaves)."""

    def devices(holder: PcieRoot | PcieSwitch) -> list[TreeNode]:
        return [TreeNode(f"GPU {_gpu_line(g)}", device=g.id) for g in holder.gpus] + [
            TreeNode(f"NIC {_nic_line(n)}", device=n.id) for n in holder.nics
        ]

    def root_node(root: PcieRoot) -> TreeNode:
        switches = [TreeNode(f"PCIe switch {sw.id}", devices(sw)) for sw in root.switches]
        return TreeNode(f"PCIe root {root.id}", devices(root) + switches)

    return [
        TreeNode(
            f"socket {sock.id}",
            [TreeNode(f"NUMA {numa.id}", [root_node(r) for r in numa.roots]) for numa in sock.numa_nodes],
        )
        for sock in topo.sockets
    ]


def render_tree(topo: NodeTopology, *, states: Mapping[str, str] | None = None) -> str:
    """The tree with box-drawing branches, one node or device per line; with ``states``
    (device id → what it is doing now), each device line ends with its state."""
    lines = [f"{topo.name}: {summary(topo)}"]
    if topo.description:
        lines.append(f"  {topo.description}")
    if topo.nvlink_partitions:
        parts = " ".join("[" + ",".join(str(i) for i in part) + "]" for part in topo.nvlink_partitions)
        lines.append(f"  NVLink partitions (GPU indices): {parts}")

    def emit(prefix: str, items: list[TreeNode]) -> None:
        for k, item in enumerate(items):
            last = k == len(items) - 1
            state = f"  [{states.get(item.device, 'free')}]" if states is not None and item.device else ""
            lines.append(f"{prefix}{'└─ ' if last else '├─ '}{item.label}{state}")
            if item.children:
                emit(prefix + ("   " if last else "│  "), item.children)

    emit("", tree_of(topo))
    return "\n".join(lines) + "\n"
