"""``python -m services.nodeagent``: run the node agent of this node.

``backend: host`` (the chart's default) is a real GPU node: NVML GPUs, sysfs RDMA NICs and
PCIe placement, the kubelet device plugins and VF hand-off (``host_agent`` options).
``backend: simulated`` reads ``topology_file`` (a path or a built-in topology name) and
applies nothing real; it is what ``tandem up`` and the demo run.
"""

from __future__ import annotations

import sys

import msgspec

from services.nodeagent.backends.base import BackendUnavailable
from services.nodeagent.backends.simulated import SimulatedApplier, SimulatedBackend
from services.nodeagent.dra.plugin import plugin_from_settings
from services.nodeagent.dra.sync import slice_api
from services.nodeagent.host_agent import HostAgent, HostAgentConfig, build_host_agent
from services.nodeagent.service import NodeAgent
from services.runtime.errors import SettingsError
from services.runtime.nats.bus import Bus
from services.runtime.process.lifecycle import service_main
from services.runtime.settings import Settings
from services.topology import load_topology


async def build(bus: Bus, settings: Settings) -> NodeAgent | HostAgent:
    if settings.backend == "host":
        try:
            config = msgspec.convert(settings.host_agent, HostAgentConfig)
        except msgspec.ValidationError as exc:
            raise SettingsError(f"host_agent: {exc}") from exc
        return await build_host_agent(bus, settings, config=config)
    if settings.backend != "simulated":
        raise BackendUnavailable(f"unknown node agent backend {settings.backend!r}; known: host, simulated")
    if not settings.topology_file:
        raise BackendUnavailable("backend 'simulated' needs topology_file (a path or built-in name)")
    backend = SimulatedBackend(load_topology(settings.topology_file), node=settings.node_name)
    kube = await slice_api(enabled=settings.dra_slices)
    agent = NodeAgent(
        bus,
        node=settings.node_name,
        backend=backend,
        applier=SimulatedApplier(),
        heartbeat_interval=settings.heartbeat_interval,
        clean_period=settings.health_clean_period,
        slice_api=kube,
    )
    agent.kubelet_plugin = plugin_from_settings(settings, kube, view=agent.dra_view, uverbs=backend.uverbs_of)
    return agent


if __name__ == "__main__":
    # The agent never provisions: its NATS user may not create streams (schemas.permissions).
    # The control-plane services do; an agent started before any of them fails its first
    # publish and is restarted (DaemonSet), as it would be without NATS.
    sys.exit(service_main("nodeagent", build, provision_streams=False))
