"""Netlink link events for a NIC's netdev (a real veth standing in for a RoCE port)."""

from __future__ import annotations

import asyncio

import pytest

from services.nodeagent.backends.base import HealthChange
from services.nodeagent.backends.sysfs import SysfsBackend, link_change
from tests.netns.conftest import Lab, sh
from tests.sysfs_tree import SysfsTree

pytestmark = pytest.mark.netns


def test_link_change_pure() -> None:
    assert link_change("mlx5_0", "eth9", "UP", last=None) is None  # the first sighting of a healthy link
    assert link_change("mlx5_0", "eth9", "DOWN", last="UP") == HealthChange(
        "mlx5_0", False, "link down (eth9 operstate DOWN)"
    )
    assert link_change("mlx5_0", "eth9", "UP", last="DOWN") == HealthChange("mlx5_0", True, "link up (eth9)")
    assert link_change("mlx5_0", "eth9", "DOWN", last="DOWN") is None
    assert link_change("mlx5_0", "eth9", "UNKNOWN", last="UP") is None


async def test_peer_down_and_up_reach_the_nic_health(lab: Lab) -> None:
    vf = lab.vf()
    sh(f"ip link set {vf.peer} up")
    tree = SysfsTree(lab.tmp / "sys")
    tree.numa_node(0, cpus=range(0, 2), socket=0)
    tree.nic(
        "pci0000:3a",
        ["0000:3a:00.0", "0000:3b:00.0"],
        "mlx5_0",
        numa=0,
        uverbs=0,
        netdev=vf.name,
        link_layer="Ethernet",
    )
    backend = SysfsBackend(tree.root, node_name="n", poll_interval=30.0, netlink=True)
    seen: list[HealthChange] = []

    async def watch() -> None:
        async for change in backend.health_changes():
            seen.append(change)
            if len(seen) == 1:
                sh(f"ip link set {vf.peer} up")
            if len(seen) == 2:
                return

    task = asyncio.ensure_future(watch())
    await asyncio.sleep(0.5)  # the RTNL socket is bound
    sh(f"ip link set {vf.peer} down")
    await asyncio.wait_for(task, 10)
    await backend.close()
    assert seen == [
        HealthChange("mlx5_0", False, f"link down ({vf.name} operstate LOWERLAYERDOWN)"),
        HealthChange("mlx5_0", True, f"link up ({vf.name})"),
    ]
