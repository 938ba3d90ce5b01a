"""The host backend: fake NVML GPUs placed by a fixture sysfs tree, NICs from sysfs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pynvml
import pytest

from schemas.topology import Scope, locate, scope_between
from services.nodeagent.backends.base import BackendError, HealthChange
from services.nodeagent.backends.host import HostBackend
from services.nodeagent.backends.nvml import NvmlBackend
from services.nodeagent.backends.sysfs import SysfsBackend
from tests import fake_pynvml
from tests.sysfs_tree import hgx_8gpu


async def make(tmp_path: Path, gpus: list[fake_pynvml.FakeGpu]) -> tuple[HostBackend, object, Path]:
    tree = hgx_8gpu(tmp_path)
    mod = fake_pynvml.build(gpus)
    nvml = await NvmlBackend.open(node_name="hgx-1", nvml=mod, event_timeout_ms=20)
    sysfs = SysfsBackend(tree.root, node_name="hgx-1", poll_interval=0.02)
    return HostBackend(gpus=nvml, nics=sysfs, node_name="hgx-1"), mod, tree.root


async def test_host_tree_pairs_gpus_and_nics_on_switches(tmp_path: Path) -> None:
    backend, _, _ = await make(tmp_path, fake_pynvml.hgx_gpus())
    topo = await backend.discover()
    switches = [sw for s in topo.sockets for n in s.numa_nodes for r in n.roots for sw in r.switches]
    assert [([g.index for g in sw.gpus], [n.name for n in sw.nics]) for sw in switches] == [
        ([0, 1], ["mlx5_0", "mlx5_1"]),
        ([2, 3], ["mlx5_2", "mlx5_3"]),
        ([4, 5], ["mlx5_4", "mlx5_5"]),
        ([6, 7], ["mlx5_6", "mlx5_7"]),
    ]
    locs = {loc.device.id: loc for loc in locate(topo)}
    assert scope_between(locs["gpu0"], locs["mlx5_1"]) is Scope.PCIE_SWITCH
    assert scope_between(locs["gpu0"], locs["mlx5_2"]) is Scope.NUMA
    assert scope_between(locs["gpu0"], locs["gpu7"]) is Scope.NODE
    assert topo.gpus()[0].nvlink_peers == [1, 2, 3, 4, 5, 6, 7]
    await backend.close()


async def test_gpu_missing_from_sysfs_is_a_config_error(tmp_path: Path) -> None:
    gpus = fake_pynvml.hgx_gpus()
    gpus[0].bus_id = "00000000:E1:00.0"
    backend, _, _ = await make(tmp_path, gpus)
    with pytest.raises(BackendError, match=r"gpu0 \(0000:e1:00.0\) is not in .*mount the host's /sys"):
        await backend.discover()
    await backend.close()


async def test_merged_health_stream(tmp_path: Path) -> None:
    backend, mod, root = await make(tmp_path, fake_pynvml.hgx_gpus())
    seen: list[HealthChange] = []

    async def run() -> None:
        async for change in backend.health_changes():
            seen.append(change)
            if len(seen) == 2:
                return

    task = asyncio.ensure_future(run())
    for _ in range(200):
        if len(mod.state["registered"]) == 8:  # type: ignore[attr-defined]
            break
        await asyncio.sleep(0.01)
    mod.fire(3, pynvml.nvmlEventTypeXidCriticalError, 74)  # type: ignore[attr-defined]
    (root / "class/infiniband/mlx5_6/ports/1/state").write_text("1: DOWN\n")
    await asyncio.wait_for(task, 5)
    assert sorted(seen, key=lambda c: c.device) == [
        HealthChange("gpu3", False, "XID 74 (NVLink error)"),
        HealthChange("mlx5_6", False, "port down"),
    ]
    await backend.close()


async def test_rescan_sees_hot_unplugged_nic(tmp_path: Path) -> None:
    """The agent's periodic rescan calls discover(); a NIC gone from sysfs is gone from the tree."""
    backend, _, root = await make(tmp_path, fake_pynvml.hgx_gpus())
    before = await backend.discover()
    (root / "class/infiniband/mlx5_7").unlink()
    after = await backend.discover()
    assert before != after
    assert sorted(n.name for n in before.nics()) == [f"mlx5_{i}" for i in range(9)]
    assert sorted(n.name for n in after.nics()) == [f"mlx5_{i}" for i in range(9) if i != 7]
    assert [g.index for g in after.gpus()] == list(range(8))
    await backend.close()
