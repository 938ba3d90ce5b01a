"""Draw a topology tree as indented text (``tandem topology show``). Pure: tree in, text out."""

from __future__ import annotations

from schemas.topology import Gpu, Nic, NodeTopology, PcieRoot, PcieSwitch

__all__ = ["render_tree", "summary"]


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


def _devices(holder: PcieRoot | PcieSwitch) -> list[str]:
    return [f"GPU {_gpu_line(g)}" for g in holder.gpus] + [f"NIC {_nic_line(n)}" for n in holder.nics]


def render_tree(topo: NodeTopology) -> str:
    """The tree with box-drawing branches, one node or device per line."""
    lines = [f"{topo.name}: {summary(topo)}"]
    if topo.description:
        lines.append(f"  {topo.description}")
    if topo.nvlink_partitions:
        parts = " ".join("[" + ",".join(str(i) for i in part) + "]" for part in topo.nvlink_partitions)
        lines.append(f"  NVLink partitions (GPU indices): {parts}")

    def emit(prefix: str, items: list[tuple[str, object]]) -> None:
        for k, (text, child) in enumerate(items):
            last = k == len(items) - 1
            lines.append(f"{prefix}{'└─ ' if last else '├─ '}{text}")
            if isinstance(child, list) and child:
                emit(prefix + ("   " if last else "│  "), child)

    def root_items(root: PcieRoot) -> list[tuple[str, object]]:
        items: list[tuple[str, object]] = [(d, None) for d in _devices(root)]
        items += [(f"PCIe switch {sw.id}", [(d, None) for d in _devices(sw)]) for sw in root.switches]
        return items

    tree: list[tuple[str, object]] = [
        (
            f"socket {sock.id}",
            [
                (f"NUMA {numa.id}", [(f"PCIe root {root.id}", root_items(root)) for root in numa.roots])
                for numa in sock.numa_nodes
            ],
        )
        for sock in topo.sockets
    ]
    emit("", tree)
    return "\n".join(lines) + "\n"
