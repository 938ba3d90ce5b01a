"""The host node agent over real NATS: NVML (fake module) + sysfs (fixture tree) discovery,
health from an XID reaching both the inventory stream and kubelet's device list, and the
device plugins registered with a (fake) kubelet over real gRPC."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
import pynvml
import pytest

from schemas import codec, subjects
from schemas.messages import HealthEvent, NodeInventory
from services.nodeagent.deviceplugin.v1beta1 import api_pb2 as pb
from services.nodeagent.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from services.nodeagent.host_agent import HostAgentConfig, build_host_agent
from tests import fake_pynvml
from tests.conftest import BusFactory, make_settings
from tests.fake_kubelet import FakeKubelet
from tests.sysfs_tree import hgx_8gpu

pytestmark = pytest.mark.integration


async def test_host_agent_inventory_health_and_kubelet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nats_url: str, bus_factory: BusFactory
) -> None:
    nvml = fake_pynvml.build(fake_pynvml.hgx_gpus())
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    tree = hgx_8gpu(tmp_path / "sys")
    dp = tmp_path / "dp"
    dp.mkdir()
    kubelet = FakeKubelet(dp / "kubelet.sock")
    await kubelet.start()
    observer = await bus_factory("observer")
    inventory = await observer.nc.subscribe(subjects.node_inventory("hgx-1"))
    health = await observer.nc.subscribe(subjects.node_health("hgx-1"))

    settings = make_settings(
        nats_url, "nodeagent", node_name="hgx-1", state_dir=str(tmp_path / "state"), heartbeat_interval=0.2
    )
    bus = await bus_factory("nodeagent", node_name="hgx-1", state_dir=str(tmp_path / "state"))
    cfg = HostAgentConfig(
        sysfs_root=str(tree.root),
        plugin_dir=str(dp),
        cdi_dir=str(tmp_path / "cdi"),
        netns_resolver="named",
        netns_wait=0.0,
        sync_interval=0.05,
    )
    host = await build_host_agent(bus, settings, config=cfg)
    stop = asyncio.Event()
    task = asyncio.ensure_future(host.run(stop))
    try:
        inv = codec.NODE_EVENT.decode((await inventory.next_msg(timeout=10)).data)
        assert isinstance(inv, NodeInventory) and inv.agent == "host"
        switches = [
            sw for s in inv.topology.sockets for n in s.numa_nodes for r in n.roots for sw in r.switches
        ]
        assert [([g.index for g in sw.gpus], [n.name for n in sw.nics]) for sw in switches] == [
            ([0, 1], ["mlx5_0", "mlx5_1"]),
            ([2, 3], ["mlx5_2", "mlx5_3"]),
            ([4, 5], ["mlx5_4", "mlx5_5"]),
            ([6, 7], ["mlx5_6", "mlx5_7"]),
        ]
        for _ in range(250):
            if len(kubelet.requests) == 2:
                break
            await asyncio.sleep(0.02)
        assert sorted(r.resource_name for r in kubelet.requests) == ["tandem.io/gpu", "tandem.io/rdma"]

        uuids = [g.uuid for g in inv.topology.gpus()]
        async with grpc.aio.insecure_channel(f"unix://{dp / 'tandem-gpu.sock'}") as ch:
            stream = pb_grpc.DevicePluginStub(ch).ListAndWatch(pb.Empty())
            first = await stream.read()
            assert [d.ID for d in first.devices] == uuids and {d.health for d in first.devices} == {"Healthy"}

            for _ in range(250):
                if len(nvml.state["registered"]) == 8:  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.02)
            nvml.fire(2, pynvml.nvmlEventTypeXidCriticalError, 79)  # type: ignore[attr-defined]
            ev = codec.NODE_EVENT.decode((await health.next_msg(timeout=10)).data)
            assert isinstance(ev, HealthEvent)
            assert (ev.device, ev.healthy, ev.reason) == (
                "gpu2",
                False,
                "XID 79 (GPU has fallen off the bus)",
            )
            update = await asyncio.wait_for(stream.read(), 5)
            assert [d.ID for d in update.devices if d.health == "Unhealthy"] == [uuids[2]]
            stream.cancel()
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await kubelet.stop()
        await inventory.unsubscribe()
        await health.unsubscribe()
