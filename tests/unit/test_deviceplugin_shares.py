"""Shared GPUs through the device plugin, with this test acting as kubelet over real gRPC.

The node is the HGX fixture of test_deviceplugin (fake NVML GPUs placed by a sysfs tree).
Two pods hold shares of one GPU and a third a share of another GPU with MPS limits: the share
resource lists each GPU ``replicas`` times, the preferred allocation picks a free replica of
the assigned GPU, and Allocate answers with the HAMi-core (or MPS) limit environment.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from schemas.messages import AssignedGpu, Assignment, PodRef
from schemas.topology import NodeTopology
from services.nodeagent.backends.simulated import SimulatedApplier
from services.nodeagent.backends.sysfs import SysfsBackend
from services.nodeagent.deviceplugin.logic import share_envs
from services.nodeagent.deviceplugin.server import DevicePlugins, PluginApplier
from services.nodeagent.deviceplugin.v1beta1 import api_pb2 as pb
from services.nodeagent.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from tests.fake_kubelet import FakeKubelet
from tests.unit.test_deviceplugin import node  # noqa: F401  (the HGX node fixture)
from tests.waiting import wait_until

REPLICAS = 4


def share(
    rid: str,
    topo: NodeTopology,
    gpus: list[int],
    *,
    mem: int | None,
    cores: int | None,
    decided_at: float,
    sharing: str = "hami",
) -> Assignment:
    by_index = {g.index: g for g in topo.gpus()}
    return Assignment(
        request_id=rid,
        pod=PodRef(namespace="ml", name=rid, uid=rid),
        node="hgx-1",
        gpus=[AssignedGpu(index=i, uuid=by_index[i].uuid, memory_mib=mem, cores_percent=cores) for i in gpus],
        decided_at=decided_at,
        sharing=sharing,  # type: ignore[arg-type]
    )


async def test_allocate_hands_share_limits_to_the_container(
    tmp_path: Path,
    node: tuple[NodeTopology, SysfsBackend],  # noqa: F811
) -> None:
    topo, sysfs = node
    uuids = [g.uuid for g in topo.gpus()]
    dp = tmp_path / "dp"
    dp.mkdir()
    kubelet = FakeKubelet(dp / "kubelet.sock")
    await kubelet.start()
    plugins = DevicePlugins(
        plugin_dir=dp, uverbs=sysfs.reader.uverbs_of, poll_interval=0.05, share_replicas=REPLICAS
    )
    await plugins.update(topology=topo, health={})
    stop = asyncio.Event()
    plugins.start(stop)
    try:
        await wait_until(lambda: len(kubelet.requests) == 3, what="three resources to register")
        regs = {r.resource_name: r for r in kubelet.requests}
        assert set(regs) == {"tandem.io/gpu", "tandem.io/rdma", "tandem.io/gpu-share"}
        reg = regs["tandem.io/gpu-share"]
        assert reg.endpoint == "tandem-gpu-share.sock"
        async with grpc.aio.insecure_channel(f"unix://{dp / reg.endpoint}") as ch:
            dev = pb_grpc.DevicePluginStub(ch)
            listed = await dev.ListAndWatch(pb.Empty()).read()
            ids = [d.ID for d in listed.devices]
            assert len(ids) == 8 * REPLICAS
            assert ids[:REPLICAS] == [f"{uuids[0]}::{k}" for k in range(REPLICAS)]

            applier = PluginApplier(plugins, SimulatedApplier())
            a = share("pod-a", topo, [2], mem=4096, cores=30, decided_at=100.0)
            b = share("pod-b", topo, [2], mem=8192, cores=50, decided_at=200.0)
            m = share("pod-m", topo, [5], mem=10240, cores=25, decided_at=300.0, sharing="mps")
            for x in (m, b, a):
                await applier.apply(x)

            # Preferred: a free replica of the GPU of the oldest pending share assignment.
            pref = await dev.GetPreferredAllocation(
                pb.PreferredAllocationRequest(
                    container_requests=[
                        pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=1)
                    ]
                )
            )
            first = list(pref.container_responses[0].deviceIDs)
            assert first == [f"{uuids[2]}::0"]

            async def allocate(dev_ids: list[str]) -> dict[str, str]:
                resp = await dev.Allocate(
                    pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=dev_ids)])
                )
                c = resp.container_responses[0]
                assert [d.name for d in c.cdi_devices] == [
                    f"nvidia.com/gpu={share_id.split('::')[0]}" for share_id in dev_ids
                ]
                return dict(c.envs)

            # Two pods on one GPU, admitted in decision order, each with its own limits.
            assert await allocate(first) == {
                "NVIDIA_VISIBLE_DEVICES": uuids[2],
                "CUDA_DEVICE_MEMORY_LIMIT_0": "4096m",
                "CUDA_DEVICE_SM_LIMIT": "30",
            }
            assert await allocate([f"{uuids[2]}::1"]) == {
                "NVIDIA_VISIBLE_DEVICES": uuids[2],
                "CUDA_DEVICE_MEMORY_LIMIT_0": "8192m",
                "CUDA_DEVICE_SM_LIMIT": "50",
            }
            # A class with sharing: mps gets CUDA MPS client limits instead.
            assert await allocate([f"{uuids[5]}::3"]) == {
                "NVIDIA_VISIBLE_DEVICES": uuids[5],
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
            }
            # A third share Allocate on GPU 2 matches no pending assignment: refused, never
            # run without limits; so is a replica id of an unknown GPU.
            for bad, why in (([f"{uuids[2]}::2"], "no pending Tandem share"), (["GPU-x::0"], "unknown")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await allocate(bad)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert why in (err.value.details() or "")

            # Cleanup forgets the assignment, and with it the record that it was allocated.
            assert await applier.cleanup(a) == []
            assert "pod-a" not in plugins.state.pending and "pod-a" not in plugins.state.share_taken
    finally:
        stop.set()
        await plugins.aclose()
        await kubelet.stop()


def test_share_envs_cover_several_gpus_and_soft_memory() -> None:
    gpus = [AssignedGpu(index=i, uuid=f"GPU-{i}", memory_mib=2048, cores_percent=20) for i in (3, 1)]
    two = Assignment(request_id="r", pod=PodRef("ns", "p"), node="n", gpus=gpus, sharing="hami")
    # Indices follow NVIDIA_VISIBLE_DEVICES' order, which is the order passed in.
    assert share_envs(two, ["GPU-1", "GPU-3"]) == {
        "CUDA_DEVICE_MEMORY_LIMIT_0": "2048m",
        "CUDA_DEVICE_MEMORY_LIMIT_1": "2048m",
        "CUDA_DEVICE_SM_LIMIT": "20",
    }
    soft = Assignment(request_id="r", pod=PodRef("ns", "p"), node="n", gpus=gpus, memory_limit="soft")
    assert share_envs(soft, ["GPU-1", "GPU-3"]) == {"CUDA_DEVICE_SM_LIMIT": "20"}
    mps = Assignment(request_id="r", pod=PodRef("ns", "p"), node="n", gpus=gpus, sharing="mps")
    assert share_envs(mps, ["GPU-3", "GPU-1"]) == {
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M,1=2048M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "20",
    }
