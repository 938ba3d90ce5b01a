"""Build sysfs trees shaped like real servers in a temp directory (the sysfs test boundary).

The layout is the kernel's: devices live under ``devices/pci<dom>:<bus>/<root port>/...``
with one directory per PCI function nested under its parent bridge; ``bus/pci/devices/<bdf>``
and ``class/infiniband/<dev>`` / ``class/net/<if>`` are relative symlinks into that tree,
``<rdma>/device`` points back at the PCI function, VFs are linked by ``virtfn<i>`` /
``physfn``. The three servers below follow published layouts: an 8-GPU HGX board where each
PCIe switch carries two GPUs and two ConnectX NICs (one GPU pair behind a second-level
switch, as on HGX H100), a 4-GPU PCIe server with every device on its own root port, and a
ConnectX PF with four SR-IOV VFs.
"""

from __future__ import annotations

import os
from pathlib import Path


class SysfsTree:
    def __init__(self, root: Path) -> None:
        self.root = root
        for d in ("bus/pci/devices", "class/infiniband", "class/net", "devices/system/node"):
            (root / d).mkdir(parents=True, exist_ok=True)

    def _write(self, path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    def _link(self, link: Path, target: Path) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(target, link.parent))

    def numa_node(self, node: int, *, cpus: range, socket: int) -> None:
        self._write(self.root / f"devices/system/node/node{node}/cpulist", f"{cpus.start}-{cpus.stop - 1}")
        for cpu in cpus:
            self._write(self.root / f"devices/system/cpu/cpu{cpu}/topology/physical_package_id", str(socket))

    def pci(self, host_bridge: str, chain: list[str], *, vendor: str, cls: str, numa: int) -> Path:
        """Create every function along ``chain`` (root port ... device) under ``host_bridge``;
        bridges get class 0x060400. Returns the device's directory."""
        d = self.root / "devices" / host_bridge
        for i, bdf in enumerate(chain):
            d = d / bdf
            last = i == len(chain) - 1
            if not (d / "class").exists() or last:
                self._write(d / "vendor", vendor if last else "0x8086" if i == 0 else "0x1000")
                self._write(d / "class", cls if last else "0x060400")
                self._write(d / "numa_node", str(numa))
            bus_link = self.root / "bus/pci/devices" / bdf
            if not bus_link.is_symlink():
                self._link(bus_link, d)
        return d

    def gpu(self, host_bridge: str, chain: list[str], *, numa: int) -> Path:
        return self.pci(host_bridge, chain, vendor="0x10de", cls="0x030200", numa=numa)

    def rdma(
        self,
        pci_dir: Path,
        name: str,
        *,
        netdev: str | None,
        uverbs: int,
        link_layer: str = "InfiniBand",
        state: str = "4: ACTIVE",
        rate: str = "400 Gb/sec (4X NDR)",
    ) -> None:
        ib = pci_dir / "infiniband" / name
        self._write(ib / "ports/1/state", state)
        self._write(ib / "ports/1/phys_state", "5: LinkUp" if "ACTIVE" in state else "3: Disabled")
        self._write(ib / "ports/1/link_layer", link_layer)
        self._write(ib / "ports/1/rate", rate)
        self._link(ib / "device", pci_dir)
        self._link(self.root / "class/infiniband" / name, ib)
        self._write(pci_dir / f"infiniband_verbs/uverbs{uverbs}/ibdev", name)
        if netdev:
            self._write(pci_dir / "net" / netdev / "operstate", "up")
            self._link(self.root / "class/net" / netdev, pci_dir / "net" / netdev)

    def nic(
        self, host_bridge: str, chain: list[str], name: str, *, numa: int, uverbs: int, **kw: str
    ) -> Path:
        d = self.pci(host_bridge, chain, vendor="0x15b3", cls="0x020700", numa=numa)
        self.rdma(d, name, uverbs=uverbs, **kw)  # type: ignore[arg-type]
        return d

    def vfs(self, pf_dir: Path, vfs: list[tuple[str, str, str]], *, numa: int, first_uverbs: int) -> None:
        """SR-IOV VFs of a PF: (bdf, rdma name, netdev) each, as siblings of the PF."""
        self._write(pf_dir / "sriov_totalvfs", "16")
        self._write(pf_dir / "sriov_numvfs", str(len(vfs)))
        for i, (bdf, name, netdev) in enumerate(vfs):
            vf_dir = pf_dir.parent / bdf
            self._write(vf_dir / "vendor", "0x15b3")
            self._write(vf_dir / "class", "0x020700")
            self._write(vf_dir / "numa_node", str(numa))
            self._link(self.root / "bus/pci/devices" / bdf, vf_dir)
            self._link(pf_dir / f"virtfn{i}", vf_dir)
            self._link(vf_dir / "physfn", pf_dir)
            self.rdma(vf_dir, name, netdev=netdev, uverbs=first_uverbs + i)


def hgx_8gpu(root: Path) -> SysfsTree:
    """2 sockets, one NUMA node each; four host bridges, each with one PCIe switch carrying two
    GPUs and two 400G InfiniBand NICs. On every switch the first GPU sits behind a second-level
    switch (upstream ``..+2:00.0``), as HGX boards do; it still belongs to the top switch."""
    t = SysfsTree(root)
    t.numa_node(0, cpus=range(0, 4), socket=0)
    t.numa_node(1, cpus=range(4, 8), socket=1)
    gpu = 0
    nic = 0
    for hb, base, numa in ((0x15, 0x16, 0), (0x37, 0x38, 0), (0x97, 0x98, 1), (0xB7, 0xB8, 1)):
        hostb = f"pci0000:{hb:02x}"
        rp = f"0000:{hb:02x}:01.0"
        up = f"0000:{base:02x}:00.0"

        def dn(k: int, base: int = base) -> str:
            return f"0000:{base + 1:02x}:{k:02x}.0"

        # GPU A behind a nested switch, GPU B on the top switch directly
        t.gpu(
            hostb,
            [
                rp,
                up,
                dn(0),
                f"0000:{base + 2:02x}:00.0",
                f"0000:{base + 3:02x}:00.0",
                f"0000:{base + 4:02x}:00.0",
            ],
            numa=numa,
        )
        t.gpu(hostb, [rp, up, dn(1), f"0000:{base + 5:02x}:00.0"], numa=numa)
        gpu += 2
        for k in (2, 3):
            t.nic(
                hostb,
                [rp, up, dn(k), f"0000:{base + 4 + k:02x}:00.0"],
                f"mlx5_{nic}",
                numa=numa,
                uverbs=nic,
                netdev=f"ibp{base + 4 + k}s0",
            )
            nic += 1
    # the storage/management NIC on socket 0's own root port, no switch, RoCE
    t.nic(
        "pci0000:00",
        ["0000:00:1c.0", "0000:03:00.0"],
        "mlx5_8",
        numa=0,
        uverbs=8,
        netdev="eno1np0",
        link_layer="Ethernet",
        rate="100 Gb/sec (4X EDR)",
    )
    return t


def pcie_4gpu(root: Path) -> SysfsTree:
    """2 sockets; every GPU and NIC on its own root port (no switches); one NIC per socket, the
    second one down. Host bridges: socket 0 has pci0000:00 (GPU0, GPU1, NIC) — one host bridge
    with three root ports — socket 1 has pci0000:80 (GPU2) and pci0000:c0 (GPU3, NIC)."""
    t = SysfsTree(root)
    t.numa_node(0, cpus=range(0, 2), socket=0)
    t.numa_node(1, cpus=range(2, 4), socket=1)
    t.gpu("pci0000:00", ["0000:00:01.0", "0000:01:00.0"], numa=0)
    t.gpu("pci0000:00", ["0000:00:03.0", "0000:02:00.0"], numa=0)
    t.nic(
        "pci0000:00",
        ["0000:00:05.0", "0000:05:00.0"],
        "mlx5_0",
        numa=0,
        uverbs=0,
        netdev="ens5f0np0",
        link_layer="Ethernet",
        rate="200 Gb/sec (4X HDR)",
    )
    t.gpu("pci0000:80", ["0000:80:01.0", "0000:81:00.0"], numa=1)
    t.gpu("pci0000:c0", ["0000:c0:01.0", "0000:c1:00.0"], numa=1)
    t.nic(
        "pci0000:c0",
        ["0000:c0:03.0", "0000:c3:00.0"],
        "mlx5_1",
        numa=1,
        uverbs=1,
        netdev="ens7f0np0",
        link_layer="Ethernet",
        rate="200 Gb/sec (4X HDR)",
        state="1: DOWN",
    )
    return t


def nic_with_vfs(root: Path) -> SysfsTree:
    """One ConnectX-7 PF (single NUMA node reported as -1, as on one-socket boards) with four
    VFs at 0000:3b:00.2-.5, each with its own RDMA device and netdev."""
    t = SysfsTree(root)
    t.numa_node(0, cpus=range(0, 2), socket=0)
    pf = t.nic(
        "pci0000:3a",
        ["0000:3a:00.0", "0000:3b:00.0"],
        "mlx5_0",
        numa=-1,
        uverbs=0,
        netdev="ens1f0np0",
        link_layer="Ethernet",
        rate="400 Gb/sec (4X NDR)",
    )
    t.vfs(
        pf,
        [(f"0000:3b:00.{i + 2}", f"mlx5_{i + 1}", f"ens1f0v{i}") for i in range(4)],
        numa=-1,
        first_uverbs=1,
    )
    return t
