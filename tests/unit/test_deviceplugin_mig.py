"""MIG instances through the device plugin, with this test acting as kubelet over real gRPC.

The node is the HGX fixture of test_deviceplugin (fake NVML GPUs placed by a sysfs tree) with
GPUs 0 and 1 in MIG mode. The allocator core decides a MIG request on the discovered
topology (so the assignment is the one the service would publish, built by
``build_assignment``); the MIG resource lists the instances by ``MIG-`` UUID and never the
MIG-mode GPUs as whole GPUs, the preferred allocation is the assigned instances, and Allocate
answers ``NVIDIA_VISIBLE_DEVICES=MIG-<uuid>,...`` (the NIC comes from the RDMA resource).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from schemas.messages import AllocationRequest, PodRef
from schemas.topology import NodeTopology
from services.allocator.core import Cluster, Placement
from services.allocator.placer import build_assignment
from services.nodeagent.backends.host import HostBackend
from services.nodeagent.backends.nvml import NvmlBackend
from services.nodeagent.backends.simulated import SimulatedApplier
from services.nodeagent.backends.sysfs import SysfsBackend
from services.nodeagent.deviceplugin.server import DevicePlugins, PluginApplier
from services.nodeagent.deviceplugin.v1beta1 import api_pb2 as pb
from services.nodeagent.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from tests import fake_pynvml
from tests.fake_kubelet import FakeKubelet
from tests.fake_pynvml import FakeMig
from tests.sysfs_tree import hgx_8gpu
from tests.waiting import wait_until


@pytest.fixture
async def mig_node(tmp_path: Path) -> AsyncIterator[tuple[NodeTopology, SysfsBackend]]:
    tree = hgx_8gpu(tmp_path / "sys")
    gpus = fake_pynvml.hgx_gpus()
    gpus[0].mig_mode = (1, 1)
    gpus[0].mig_devices = [
        FakeMig(uuid=f"MIG-0000000{k}-aaaa-bbbb-cccc-000000000000", profile="1g.10gb", gpu_instance_id=7 + k)
        for k in range(3)
    ]
    gpus[1].mig_mode = (1, 1)
    gpus[1].mig_devices = [
        FakeMig(uuid="MIG-11111111-aaaa-bbbb-cccc-000000000000", profile="3g.40gb", gpu_instance_id=1),
        FakeMig(uuid="MIG-11111112-aaaa-bbbb-cccc-000000000000", profile="1g.10gb", gpu_instance_id=9),
    ]
    nvml = await NvmlBackend.open(node_name="hgx-1", nvml=fake_pynvml.build(gpus))
    sysfs = SysfsBackend(tree.root, node_name="hgx-1")
    host = HostBackend(gpus=nvml, nics=sysfs, node_name="hgx-1")
    yield await host.discover(), sysfs
    await host.close()


def decide(
    topo: NodeTopology, rid: str, *, gpus: int, rdma: int, profile: str, cluster: Cluster
) -> Placement:
    req = AllocationRequest(
        request_id=rid, pod=PodRef("ml", rid, rid), gpus=gpus, rdma=rdma, mig_profile=profile
    )
    got = cluster.decide(req)
    assert isinstance(got, Placement), got
    cluster.hold(got.node, rid, got.devices())
    return got


async def test_allocate_hands_mig_instances_to_the_container(
    tmp_path: Path, mig_node: tuple[NodeTopology, SysfsBackend]
) -> None:
    topo, sysfs = mig_node
    cluster = Cluster()
    cluster.set_node("hgx-1", topo)
    # Two 1g.10gb instances with a NIC each (binpack: both on GPU 0, the GPU that has them),
    # then a 3g.40gb one alone.
    p1 = decide(topo, "pod-a", gpus=2, rdma=2, profile="1g.10gb", cluster=cluster)
    p2 = decide(topo, "pod-b", gpus=1, rdma=0, profile="3g.40gb", cluster=cluster)
    assert [g.index for g in p1.gpus] == [0, 0] and [g.index for g in p2.gpus] == [1]
    a1 = build_assignment(
        AllocationRequest(request_id="pod-a", pod=PodRef("ml", "pod-a", "pod-a"), gpus=2), p1, instance="t"
    )
    a2 = build_assignment(
        AllocationRequest(request_id="pod-b", pod=PodRef("ml", "pod-b", "pod-b"), gpus=1), p2, instance="t"
    )
    assert a1.gpus[0].mig is not None and a1.gpus[0].mig.profile == "1g.10gb"
    mig_a = [g.mig.uuid for g in a1.gpus if g.mig is not None]
    mig_b = [g.mig.uuid for g in a2.gpus if g.mig is not None]
    assert mig_b == ["MIG-11111111-aaaa-bbbb-cccc-000000000000"]
    # Each instance's NIC is on its GPU's PCIe switch (GPU 0's switch carries its NICs).
    assert {p.scope for p in a1.pairs} == {"pcie-switch"}

    dp = tmp_path / "dp"
    dp.mkdir()
    kubelet = FakeKubelet(dp / "kubelet.sock")
    await kubelet.start()
    plugins = DevicePlugins(plugin_dir=dp, uverbs=sysfs.reader.uverbs_of, poll_interval=0.05, mig=True)
    await plugins.update(topology=topo, health={})
    stop = asyncio.Event()
    plugins.start(stop)
    try:
        await wait_until(lambda: len(kubelet.requests) == 3, what="three resources to register")
        regs = {r.resource_name: r for r in kubelet.requests}
        assert set(regs) == {"tandem.io/gpu", "tandem.io/rdma", "tandem.io/mig"}
        assert regs["tandem.io/mig"].endpoint == "tandem-mig.sock"
        async with (
            grpc.aio.insecure_channel(f"unix://{dp / regs['tandem.io/mig'].endpoint}") as ch,
            grpc.aio.insecure_channel(f"unix://{dp / regs['tandem.io/gpu'].endpoint}") as gch,
        ):
            dev = pb_grpc.DevicePluginStub(ch)
            listed = await dev.ListAndWatch(pb.Empty()).read()
            ids = [d.ID for d in listed.devices]
            assert sorted(ids) == sorted(m.uuid for g in topo.gpus() for m in g.mig_instances)
            assert len(ids) == 5
            # The MIG-mode GPUs are not whole GPUs for kubelet.
            whole = await pb_grpc.DevicePluginStub(gch).ListAndWatch(pb.Empty()).read()
            whole_ids = {d.ID for d in whole.devices}
            assert len(whole_ids) == 6 and not whole_ids & {g.uuid for g in topo.gpus() if g.mig_mode}

            applier = PluginApplier(plugins, SimulatedApplier())
            await applier.apply(a2)
            await applier.apply(a1)
            pref = await dev.GetPreferredAllocation(
                pb.PreferredAllocationRequest(
                    container_requests=[
                        pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=2)
                    ]
                )
            )
            assert sorted(pref.container_responses[0].deviceIDs) == sorted(mig_a)

            resp = await dev.Allocate(
                pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=mig_a)])
            )
            c = resp.container_responses[0]
            assert dict(c.envs) == {"NVIDIA_VISIBLE_DEVICES": ",".join(mig_a)}
            assert [d.name for d in c.cdi_devices] == [f"nvidia.com/gpu={u}" for u in mig_a]
            # An id that is no MIG instance of this node is refused.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await dev.Allocate(
                    pb.AllocateRequest(
                        container_requests=[pb.ContainerAllocateRequest(devices_ids=["MIG-nope"])]
                    )
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # A cordoned GPU makes its instances Unhealthy for kubelet.
            await plugins.update(health={"gpu1": _cordoned()})
            async for upd in dev.ListAndWatch(pb.Empty()):
                states = {d.ID: d.health for d in upd.devices}
                break
            assert states["MIG-11111111-aaaa-bbbb-cccc-000000000000"] == "Unhealthy"
            assert states[mig_a[0]] == "Healthy"
    finally:
        stop.set()
        await plugins.aclose()
        await kubelet.stop()


def _cordoned():  # type: ignore[no-untyped-def]
    from schemas.messages import DeviceHealth

    return DeviceHealth(cordoned=True)


async def test_metrics_count_a_mig_gpu_allocated_while_an_instance_is_held(
    mig_node: tuple[NodeTopology, SysfsBackend],
) -> None:
    from schemas.messages import AllocRecord, NodeAllocations, NodeRecord
    from services.allocator.metrics import node_device_states

    topo, _ = mig_node
    cluster = Cluster()
    cluster.set_node("hgx-1", topo)
    p = decide(topo, "pod-a", gpus=1, rdma=0, profile="3g.40gb", cluster=cluster)
    a = build_assignment(
        AllocationRequest(request_id="pod-a", pod=PodRef("ml", "pod-a", "pod-a"), gpus=1), p, instance="t"
    )
    record = NodeRecord(node="hgx-1", topology=topo)
    allocs = NodeAllocations(node="hgx-1", allocations={"pod-a": AllocRecord(assignment=a)})
    counts = node_device_states(record, allocs)
    assert (counts["gpu", "allocated"], counts["gpu", "free"]) == (1, 7)
    assert node_device_states(record, None)["gpu", "free"] == 8
