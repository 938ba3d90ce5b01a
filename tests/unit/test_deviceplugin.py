"""The device plugin, with this test acting as kubelet over real gRPC on unix sockets.

A fake kubelet ``Registration`` server runs on ``<tmp>/dp/kubelet.sock``; the plugin
registers with it; the test then dials the plugin's own socket as kubelet does and calls
ListAndWatch, GetPreferredAllocation and Allocate. The node is the HGX fixture (fake NVML GPUs
placed by a sysfs tree), uverbs devices come from that sysfs tree.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from schemas.messages import AssignedGpu, AssignedNic, Assignment, DeviceHealth, PodRef
from schemas.topology import NodeTopology
from services.nodeagent.backends.host import HostBackend
from services.nodeagent.backends.nvml import NvmlBackend
from services.nodeagent.backends.simulated import SimulatedApplier
from services.nodeagent.backends.sysfs import SysfsBackend
from services.nodeagent.deviceplugin.logic import preferred
from services.nodeagent.deviceplugin.server import DevicePlugins, PluginApplier
from services.nodeagent.deviceplugin.v1beta1 import api_pb2 as pb
from services.nodeagent.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from tests import fake_pynvml
from tests.fake_kubelet import FakeKubelet
from tests.sysfs_tree import hgx_8gpu


async def eventually(check: Any, what: str, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[tuple[NodeTopology, SysfsBackend]]:
    tree = hgx_8gpu(tmp_path / "sys")
    nvml = await NvmlBackend.open(node_name="hgx-1", nvml=fake_pynvml.build(fake_pynvml.hgx_gpus()))
    sysfs = SysfsBackend(tree.root, node_name="hgx-1")
    host = HostBackend(gpus=nvml, nics=sysfs, node_name="hgx-1")
    yield await host.discover(), sysfs
    await host.close()


def assignment(
    rid: str, gpus: list[int], nics: list[str], topo: NodeTopology, decided_at: float
) -> Assignment:
    by_index = {g.index: g for g in topo.gpus()}
    return Assignment(
        request_id=rid,
        pod=PodRef(namespace="ml", name=rid, uid=rid),
        node="hgx-1",
        gpus=[AssignedGpu(index=i, uuid=by_index[i].uuid) for i in gpus],
        nics=[AssignedNic(name=n, pf=n) for n in nics],
        decided_at=decided_at,
    )


async def test_kubelet_conversation(tmp_path: Path, node: tuple[NodeTopology, SysfsBackend]) -> None:
    topo, sysfs = node
    uuids = [g.uuid for g in topo.gpus()]
    dp = tmp_path / "dp"
    dp.mkdir()
    kubelet = FakeKubelet(dp / "kubelet.sock")
    await kubelet.start()
    plugins = DevicePlugins(
        plugin_dir=dp, uverbs=sysfs.reader.uverbs_of, cdi_dir=tmp_path / "cdi", poll_interval=0.05
    )
    await plugins.update(topology=topo, health={})
    stop = asyncio.Event()
    plugins.start(stop)
    try:
        await eventually(lambda: len(kubelet.requests) == 2, "both resources to register")
        regs = {r.resource_name: r for r in kubelet.requests}
        assert set(regs) == {"tandem.io/gpu", "tandem.io/rdma"}
        gpu_reg = regs["tandem.io/gpu"]
        assert (gpu_reg.version, gpu_reg.endpoint) == ("v1beta1", "tandem-gpu.sock")
        assert gpu_reg.options.get_preferred_allocation_available is True

        async with (
            grpc.aio.insecure_channel(f"unix://{dp / gpu_reg.endpoint}") as gch,
            grpc.aio.insecure_channel(f"unix://{dp / regs['tandem.io/rdma'].endpoint}") as rch,
        ):
            gpu, rdma = pb_grpc.DevicePluginStub(gch), pb_grpc.DevicePluginStub(rch)
            opts = await gpu.GetDevicePluginOptions(pb.Empty())
            assert opts.get_preferred_allocation_available and not opts.pre_start_required

            # ListAndWatch: the full list at once, then a new list on every health change
            stream = gpu.ListAndWatch(pb.Empty())
            first = await stream.read()
            assert [d.ID for d in first.devices] == uuids
            assert {d.health for d in first.devices} == {"Healthy"}
            assert [d.topology.nodes[0].ID for d in first.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
            await plugins.update(
                health={
                    "gpu3": DeviceHealth(healthy=False, reason="XID 79"),
                    "gpu6": DeviceHealth(cordoned=True),
                }
            )
            second = await stream.read()
            assert [d.ID for d in second.devices if d.health == "Unhealthy"] == [uuids[3], uuids[6]]
            stream.cancel()
            rlist = await rdma.ListAndWatch(pb.Empty()).read()
            assert sorted(d.ID for d in rlist.devices) == [f"mlx5_{i}" for i in range(9)]

            # Two pods assigned by the allocator; kubelet admits them one at a time
            applier = PluginApplier(plugins, SimulatedApplier())
            a = assignment("pod-a", [4, 5], ["mlx5_4", "mlx5_5"], topo, decided_at=100.0)
            b = assignment("pod-b", [0, 1], ["mlx5_0", "mlx5_1"], topo, decided_at=200.0)
            await applier.apply(b)
            await applier.apply(a)
            req = pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(available_deviceIDs=uuids, allocation_size=2)
                ]
            )
            pref = await gpu.GetPreferredAllocation(req)
            assert list(pref.container_responses[0].deviceIDs) == [uuids[4], uuids[5]]  # pod-a: decided first
            req.container_requests[0].must_include_deviceIDs.append(uuids[0])
            pref = await gpu.GetPreferredAllocation(req)
            assert list(pref.container_responses[0].deviceIDs) == [uuids[0], uuids[1]]  # only pod-b fits
            rpref = await rdma.GetPreferredAllocation(
                pb.PreferredAllocationRequest(
                    container_requests=[
                        pb.ContainerPreferredAllocationRequest(
                            available_deviceIDs=[f"mlx5_{i}" for i in range(9)], allocation_size=2
                        )
                    ]
                )
            )
            assert list(rpref.container_responses[0].deviceIDs) == ["mlx5_4", "mlx5_5"]

            # Allocate: env with exactly these UUIDs, device specs, CDI names
            resp = await gpu.Allocate(
                pb.AllocateRequest(
                    container_requests=[pb.ContainerAllocateRequest(devices_ids=[uuids[4], uuids[5]])]
                )
            )
            c = resp.container_responses[0]
            assert dict(c.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{uuids[4]},{uuids[5]}"}
            assert [d.name for d in c.cdi_devices] == [
                f"nvidia.com/gpu={uuids[4]}",
                f"nvidia.com/gpu={uuids[5]}",
            ]
            resp = await rdma.Allocate(
                pb.AllocateRequest(
                    container_requests=[pb.ContainerAllocateRequest(devices_ids=["mlx5_4", "mlx5_5"])]
                )
            )
            c = resp.container_responses[0]
            assert [(d.container_path, d.host_path, d.permissions) for d in c.devices] == [
                ("/dev/infiniband/uverbs4", "/dev/infiniband/uverbs4", "rw"),
                ("/dev/infiniband/uverbs5", "/dev/infiniband/uverbs5", "rw"),
                ("/dev/infiniband/rdma_cm", "/dev/infiniband/rdma_cm", "rw"),
            ]
            assert [d.name for d in c.cdi_devices] == ["tandem.io/rdma=mlx5_4", "tandem.io/rdma=mlx5_5"]
            # Only what the allocator assigned: a free GPU no assignment names, or GPUs of two
            # different assignments, are refused (a pod that bypassed the scheduling gate).
            for bad, why in (
                ([], "no device ids"),
                (["GPU-nope"], "unknown device ids"),
                ([uuids[6]], "no Tandem assignment on this node names"),
                ([uuids[4], uuids[0]], "no Tandem assignment on this node names"),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await gpu.Allocate(
                        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=bad)])
                    )
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in (
                    err.value.details() or ""
                )

            assert await applier.cleanup(a) == []
            assert "pod-a" not in plugins.state.pending
            with pytest.raises(grpc.aio.AioRpcError) as err:  # cleaned up: not handed out again
                await gpu.Allocate(
                    pb.AllocateRequest(
                        container_requests=[pb.ContainerAllocateRequest(devices_ids=[uuids[4], uuids[5]])]
                    )
                )
            assert "no Tandem assignment" in (err.value.details() or "")

        spec = json.loads((tmp_path / "cdi" / "tandem-rdma.json").read_text())
        assert spec["kind"] == "tandem.io/rdma"
        mlx4 = next(d for d in spec["devices"] if d["name"] == "mlx5_4")
        assert mlx4["containerEdits"]["deviceNodes"] == [
            {"path": "/dev/infiniband/uverbs4"},
            {"path": "/dev/infiniband/rdma_cm"},
        ]

        # kubelet restarts: it wipes the plugin dir and serves a new kubelet.sock
        await kubelet.stop()
        for sock in dp.iterdir():
            sock.unlink()
        kubelet2 = FakeKubelet(dp / "kubelet.sock")
        await kubelet2.start()
        await eventually(lambda: len(kubelet2.requests) == 2, "re-registration with the new kubelet")
        assert (dp / "tandem-gpu.sock").exists() and (dp / "tandem-rdma.sock").exists()
        async with grpc.aio.insecure_channel(f"unix://{dp / 'tandem-gpu.sock'}") as ch:
            again = await pb_grpc.DevicePluginStub(ch).ListAndWatch(pb.Empty()).read()
            assert len(again.devices) == 8
        await kubelet2.stop()
    finally:
        stop.set()
        await plugins.aclose()


def test_preferred_falls_back_to_kubelet_order_without_a_fitting_assignment() -> None:
    assert preferred([], "tandem.io/gpu", available=["a", "b", "c"], must_include=["c"], size=2) == ["c", "a"]
