"""sysfs backend against fixture trees shaped like real servers (tests/sysfs_tree.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from schemas.topology import Scope, locate, scope_between
from services.nodeagent.backends.base import BackendUnavailable, HealthChange
from services.nodeagent.backends.pcie import (
    Placement,
    normalize_bus_id,
    parse_device_path,
)
from services.nodeagent.backends.sysfs import (
    SysfsBackend,
    SysfsReader,
    parse_cpulist,
    parse_port_state,
    parse_rate_gbps,
    port_changes,
)
from tests.sysfs_tree import hgx_8gpu, nic_with_vfs, pcie_4gpu


def test_bus_id_normalisation() -> None:
    assert normalize_bus_id("00000000:17:00.0") == "0000:17:00.0"
    assert normalize_bus_id("0000:AB:1F.7") == "0000:ab:1f.7"
    with pytest.raises(ValueError, match="not a PCI bus id"):
        normalize_bus_id("17:00.0")


def test_device_path_parsing() -> None:
    p = parse_device_path(
        "/sys/devices/pci0000:16/0000:16:01.0/0000:17:00.0/0000:18:04.0/0000:1a:00.0/net/ib0"
    )
    assert p.host_bridge == "pci0000:16"
    assert p.chain == ("0000:16:01.0", "0000:17:00.0", "0000:18:04.0", "0000:1a:00.0")
    assert p.switch == "0000:17:00.0"
    assert parse_device_path("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0").switch is None
    assert parse_device_path("/sys/devices/pci0000:00/0000:00:02.0").switch is None
    with pytest.raises(ValueError, match="not a PCI device path"):
        parse_device_path("/sys/devices/platform/serial8250")


def test_small_parsers() -> None:
    assert parse_port_state("4: ACTIVE") == "active"
    assert parse_port_state("1: DOWN\n") == "down"
    assert parse_port_state("3: ARMED") == "init"
    assert parse_port_state("garbage") == "unknown"
    assert parse_rate_gbps("400 Gb/sec (4X NDR)") == 400
    assert parse_rate_gbps("2.5 Gb/sec (1X SDR)") == 2
    assert parse_rate_gbps("") == 0
    assert parse_cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]


def test_port_changes_diff() -> None:
    old = {"mlx5_0": "active", "mlx5_1": "active", "mlx5_2": "down"}
    new = {"mlx5_0": "down", "mlx5_2": "active"}
    assert port_changes(old, new) == [
        HealthChange("mlx5_0", False, "port down"),
        HealthChange("mlx5_2", True, "port active"),
        HealthChange("mlx5_1", False, "RDMA device disappeared from sysfs"),
    ]
    assert port_changes(new, new) == []


def test_hgx_groups_gpus_and_nics_by_switch(tmp_path: Path) -> None:
    tree = hgx_8gpu(tmp_path)
    reader = SysfsReader(tree.root)
    gpus = sorted(reader.nvidia_gpus())
    assert len(gpus) == 8
    placements = {g: reader.placement(g) for g in gpus}
    # the nested-switch GPU and the direct one share the top switch of their host bridge
    assert placements["0000:1a:00.0"] == Placement(socket=0, numa=0, root="pci0000:15", switch="0000:16:00.0")
    assert placements["0000:1b:00.0"] == Placement(socket=0, numa=0, root="pci0000:15", switch="0000:16:00.0")
    assert placements["0000:bc:00.0"] == Placement(socket=1, numa=1, root="pci0000:b7", switch="0000:b8:00.0")
    switches = {p.switch for p in placements.values()}
    assert len(switches) == 4

    nics = dict((n.name, (n, p)) for n, p in reader.nics())
    assert sorted(nics) == [f"mlx5_{i}" for i in range(9)]
    n0, p0 = nics["mlx5_0"]
    assert (n0.pci_bus_id, n0.netdev, n0.link_type, n0.speed_gbps, n0.port_state) == (
        "0000:1c:00.0",
        "ibp28s0",
        "infiniband",
        400,
        "active",
    )
    assert p0 == placements["0000:1a:00.0"]  # same switch as GPUs 0/1
    mgmt, pm = nics["mlx5_8"]
    assert (mgmt.link_type, mgmt.speed_gbps) == ("ethernet", 100)
    assert pm == Placement(socket=0, numa=0, root="pci0000:00", switch=None)
    assert reader.uverbs_of("mlx5_3") == ["/dev/infiniband/uverbs3"]


async def test_hgx_discover_tree(tmp_path: Path) -> None:
    tree = hgx_8gpu(tmp_path)
    backend = SysfsBackend(tree.root, node_name="hgx-1")
    topo = await backend.discover()
    assert [s.id for s in topo.sockets] == [0, 1]
    roots = [r for s in topo.sockets for n in s.numa_nodes for r in n.roots]
    assert [r.id for r in roots] == ["pci0000:00", "pci0000:15", "pci0000:37", "pci0000:97", "pci0000:b7"]
    assert [len(sw.nics) for r in roots for sw in r.switches] == [2, 2, 2, 2]
    assert [n.name for n in roots[0].nics] == ["mlx5_8"]
    locs = {loc.device.id: loc for loc in locate(topo)}
    assert scope_between(locs["mlx5_0"], locs["mlx5_1"]) is Scope.PCIE_SWITCH
    assert scope_between(locs["mlx5_0"], locs["mlx5_2"]) is Scope.NUMA
    assert scope_between(locs["mlx5_0"], locs["mlx5_8"]) is Scope.NUMA
    assert scope_between(locs["mlx5_0"], locs["mlx5_4"]) is Scope.NODE
    await backend.close()


def test_pcie_4gpu_server_has_no_switches(tmp_path: Path) -> None:
    tree = pcie_4gpu(tmp_path)
    reader = SysfsReader(tree.root)
    placements = [reader.placement(g) for g in reader.nvidia_gpus()]
    assert [p.switch for p in placements] == [None, None, None, None]
    assert [(p.socket, p.numa, p.root) for p in placements] == [
        (0, 0, "pci0000:00"),
        (0, 0, "pci0000:00"),
        (1, 1, "pci0000:80"),
        (1, 1, "pci0000:c0"),
    ]
    nics = {n.name: (n, p) for n, p in reader.nics()}
    assert nics["mlx5_0"][1] == Placement(socket=0, numa=0, root="pci0000:00", switch=None)
    assert nics["mlx5_1"][0].port_state == "down"
    assert nics["mlx5_1"][1].root == "pci0000:c0"


def test_nic_with_vfs(tmp_path: Path) -> None:
    tree = nic_with_vfs(tmp_path)
    reader = SysfsReader(tree.root)
    nics = reader.nics()
    assert len(nics) == 1, "VFs are listed under their PF, not as NICs"
    pf, place = nics[0]
    assert pf.name == "mlx5_0" and pf.netdev == "ens1f0np0"
    assert place == Placement(socket=0, numa=0, root="pci0000:3a", switch=None)  # numa_node -1 → 0
    assert [(v.index, v.name, v.pci_bus_id, v.netdev) for v in pf.vfs] == [
        (i, f"mlx5_{i + 1}", f"0000:3b:00.{i + 2}", f"ens1f0v{i}") for i in range(4)
    ]
    assert reader.uverbs_of("mlx5_2") == ["/dev/infiniband/uverbs2"]


async def test_port_poll_reports_down_and_back(tmp_path: Path) -> None:
    tree = hgx_8gpu(tmp_path)
    backend = SysfsBackend(tree.root, node_name="hgx-1", poll_interval=0.02)
    state = tree.root / "class/infiniband/mlx5_3/ports/1/state"
    seen: list[HealthChange] = []

    def set_state(text: str) -> None:
        # The kernel's sysfs file changes at once; write_text truncates first, and a poll
        # that lands between truncate and write (seen on a loaded machine) would read "".
        tmp = state.with_name("state.tmp")
        tmp.write_text(text)
        tmp.replace(state)

    async def collect() -> None:
        async for change in backend.health_changes():
            seen.append(change)
            if len(seen) == 1:
                set_state("4: ACTIVE\n")
            if len(seen) == 2:
                await backend.close()

    task = asyncio.create_task(collect())
    await asyncio.sleep(0.05)
    set_state("1: DOWN\n")
    await asyncio.wait_for(task, 5)
    assert seen == [HealthChange("mlx5_3", False, "port down"), HealthChange("mlx5_3", True, "port active")]


def test_missing_sysfs_root_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailable, match="bus/pci/devices does not exist"):
        SysfsBackend(tmp_path / "nope", node_name="n")


async def test_probe_keeps_a_port_that_is_still_down_out_of_service(tmp_path: Path) -> None:
    """The poll reports a port going down once; after the clean period the probe is what says
    it is still down (issue 9 finding 7, for NICs)."""
    tree = hgx_8gpu(tmp_path)
    backend = SysfsBackend(tree.root, node_name="hgx-1")
    state = tree.root / "class/infiniband/mlx5_3/ports/1/state"
    assert await backend.probe("mlx5_3") is None
    state.write_text("1: DOWN\n")
    assert await backend.probe("mlx5_3") == "port down"
    assert await backend.probe("mlx5_0") is None
    assert await backend.probe("gpu0") is None  # not a NIC: not sysfs's to judge
    state.write_text("4: ACTIVE\n")
    assert await backend.probe("mlx5_3") is None
