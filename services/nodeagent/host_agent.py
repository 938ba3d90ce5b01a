"""The node agent on a real GPU node: NVML + sysfs discovery, VF hand-off, device plugin.

:func:`build_host_agent` assembles what ``python -m services.nodeagent`` runs with
``backend: host``: the lead's :class:`~services.nodeagent.service.NodeAgent` over

* :class:`~services.nodeagent.backends.host.HostBackend` (NVML GPUs placed by sysfs, sysfs
  RDMA NICs; XID/ECC/lost and port-state health);
* :class:`~services.nodeagent.deviceplugin.server.PluginApplier` → the kubelet device plugins
  learn each assignment (for ``GetPreferredAllocation``) and the
  :class:`~services.nodeagent.netns.VfApplier` moves VFs into the pod namespace;
* crash recovery before the first message: the state file is reconciled against the real
  namespaces and the allocator's record of this node (KV ``tandem-allocs``).

:class:`HostAgent` runs the agent and the two device plugins and keeps the plugins' device
list in step with the agent's inventory and health (so a failed or cordoned device turns
``Unhealthy`` at kubelet too). Paths have the DaemonSet's defaults (host ``/sys``, the
kubelet plugin dir, ``/var/run/cdi``, the host ``/proc`` for finding pod namespaces).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Literal

import msgspec
from nats.js.errors import KeyNotFoundError

from schemas import codec, subjects
from schemas.messages import DeviceHealth
from services.nodeagent.backends.host import HostBackend
from services.nodeagent.backends.nvml import DEFAULT_IGNORED_XIDS, NvmlBackend
from services.nodeagent.backends.sysfs import SysfsBackend
from services.nodeagent.deviceplugin.server import DEFAULT_PLUGIN_DIR, DevicePlugins, PluginApplier
from services.nodeagent.dra.plugin import plugin_from_settings
from services.nodeagent.dra.sync import slice_api
from services.nodeagent.netns import NamedNetnsResolver, NetnsResolver, PodCgroupResolver, VfApplier
from services.nodeagent.service import NodeAgent
from services.nodeagent.state import StateFile
from services.runtime.nats.bus import Bus
from services.runtime.observe.logging import get_logger
from services.runtime.process.tasks import Service, Supervisor
from services.runtime.settings import Settings

__all__ = ["HostAgent", "HostAgentConfig", "allocated_requests", "build_host_agent"]

log = get_logger(__name__)


class HostAgentConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    sysfs_root: str = "/sys"
    plugin_dir: str = DEFAULT_PLUGIN_DIR
    cdi_dir: str | None = "/var/run/cdi"
    netns_resolver: Literal["cgroup", "named"] = "cgroup"
    proc_root: str = "/proc"
    netns_dir: str = "/var/run/netns"
    netns_template: str = "{uid}"
    netns_wait: float = 1.0  # per attempt; a missing sandbox is retried by redelivery
    ignored_xids: list[int] = msgspec.field(default_factory=lambda: sorted(DEFAULT_IGNORED_XIDS))
    sync_interval: float = 0.5
    netlink: bool = True  # RTNL link events for the NICs' netdevs (the agent runs with hostNetwork)
    # Share replicas per GPU of the tandem.io/gpu-share resource (docs/sharing.md); 0: none.
    gpu_share_replicas: int = 0
    # Serve the tandem.io/mig resource (MIG instances of GPUs in MIG mode; docs/sharing.md).
    mig_resource: bool = False


async def allocated_requests(bus: Bus, node: str) -> set[str] | None:
    """Request ids the allocator holds on ``node``; None when the record cannot be read."""
    try:
        kv = await bus.kv(subjects.KV_ALLOCS)
        entry = await kv.get(subjects.kv_key(node))
    except KeyNotFoundError:
        return set()
    except Exception as exc:  # the bus is up but KV is not (yet): recovery must not guess
        log.warning("allocations_unreadable", node=node, error=repr(exc))
        return None
    return set(codec.NODE_ALLOCS.decode(entry.value or b"").allocations)


class HostAgent(Service):
    def __init__(
        self, agent: NodeAgent, *, plugins: DevicePlugins, vfs: VfApplier, sync_interval: float
    ) -> None:
        self.agent = agent
        self.plugins = plugins
        self.vfs = vfs
        self.sync_interval = sync_interval
        self._tasks = Supervisor(f"host-agent:{agent.node}")
        self._stopping = asyncio.Event()

    async def sync_plugins(self) -> None:
        seen: tuple[int, dict[str, DeviceHealth]] | None = None
        while True:
            now = (self.agent.generation, dict(self.agent.health.state))
            if now != seen and self.agent.topology is not None:
                await self.plugins.update(topology=self.agent.topology, health=self.agent.health.state)
                seen = now
            await asyncio.sleep(self.sync_interval)

    async def start(self) -> None:
        report = await self.vfs.recover(allocated=await allocated_requests(self.agent.bus, self.agent.node))
        for action, problems in report:
            log.info("recovered", request_id=action.request_id, action=action.action, problems=problems)
        await self.agent.start()
        self.plugins.start(self._stopping)
        self._tasks.spawn("sync-plugins", self.sync_plugins)

    async def stop(self) -> None:
        self._stopping.set()
        await self._tasks.aclose()
        await self.plugins.aclose()
        await self.agent.stop()
        await self.vfs.close()


async def build_host_agent(
    bus: Bus, settings: Settings, *, config: HostAgentConfig | None = None
) -> HostAgent:
    cfg = config or HostAgentConfig()
    node = settings.node_name
    nvml = await NvmlBackend.open(node_name=node, ignored_xids=cfg.ignored_xids)
    sysfs = SysfsBackend(cfg.sysfs_root, node_name=node, netlink=cfg.netlink)
    resolver: NetnsResolver = (
        PodCgroupResolver(cfg.proc_root, wait=cfg.netns_wait)
        if cfg.netns_resolver == "cgroup"
        else NamedNetnsResolver(cfg.netns_dir, template=cfg.netns_template, wait=cfg.netns_wait)
    )
    vfs = VfApplier(
        StateFile(Path(settings.state_dir) / f"nodeagent-{node}.json"),
        resolver=resolver,
        sysfs_root=cfg.sysfs_root,
    )
    plugins = DevicePlugins(
        plugin_dir=cfg.plugin_dir,
        uverbs=sysfs.reader.uverbs_of,
        cdi_dir=cfg.cdi_dir,
        share_replicas=cfg.gpu_share_replicas,
        mig=cfg.mig_resource,
    )
    kube = await slice_api(enabled=settings.dra_slices)
    agent = NodeAgent(
        bus,
        node=node,
        backend=HostBackend(gpus=nvml, nics=sysfs, node_name=node),
        applier=PluginApplier(plugins, vfs),
        heartbeat_interval=settings.heartbeat_interval,
        clean_period=settings.health_clean_period,
        slice_api=kube,
    )
    # DRA (setting dra_plugin): kubelet's plugin API beside the device plugins; the VFs of a
    # claim move through the same VfApplier when the allocation reaches the record.
    agent.kubelet_plugin = plugin_from_settings(
        settings, kube, view=agent.dra_view, uverbs=sysfs.reader.uverbs_of
    )
    return HostAgent(agent, plugins=plugins, vfs=vfs, sync_interval=cfg.sync_interval)
