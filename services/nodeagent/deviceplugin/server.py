"""The kubelet device plugin over gRPC: one server per resource on the kubelet's plugin dir.

Protocol (kubelet device plugin API v1beta1): the plugin serves ``DevicePlugin`` on
``<plugin dir>/<endpoint>`` and then calls ``Registration.Register`` on
``<plugin dir>/kubelet.sock``; kubelet connects back, opens ``ListAndWatch`` (a stream of full
device lists, one per change), asks ``GetPreferredAllocation`` at pod admission and
``Allocate`` before the container starts. A restarting kubelet wipes the plugin directory and
creates a new ``kubelet.sock``, so :meth:`ResourcePlugin.run` watches both: when the kubelet
socket's inode changes or the plugin's own socket disappears, it serves again and re-registers.

The decisions live in :mod:`services.nodeagent.deviceplugin.logic`; this module is the gRPC
I/O and the shared :class:`PluginState` the node agent feeds (inventory, health, pending
assignments).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from schemas.messages import Assignment, DeviceHealth
from schemas.topology import NodeTopology
from services.nodeagent.atomicfile import write_atomic
from services.nodeagent.backends.base import Applier
from services.nodeagent.deviceplugin.logic import (
    GPU_RESOURCE,
    GPU_SHARE_RESOURCE,
    MIG_RESOURCE,
    RDMA_RESOURCE,
    AllocateError,
    allocate,
    check_assigned,
    match_share,
    plugin_devices,
    preferred,
    preferred_shares,
    rdma_cdi_spec,
)
from services.nodeagent.deviceplugin.v1beta1 import api_pb2 as pb
from services.nodeagent.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from services.runtime.observe.logging import get_logger
from services.runtime.process.tasks import Supervisor

__all__ = ["API_VERSION", "DevicePlugins", "PluginApplier", "PluginState", "ResourcePlugin"]

log = get_logger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"


class PluginState:
    """What the plugins serve: the node's devices, their health, and pending assignments."""

    def __init__(self) -> None:
        self.topology: NodeTopology | None = None
        self.health: dict[str, DeviceHealth] = {}
        self.pending: dict[str, Assignment] = {}
        # Share assignments an Allocate has answered for (see logic.match_share).
        self.share_taken: set[str] = set()
        self.version = 0
        self.changed = asyncio.Condition()

    async def update(
        self, *, topology: NodeTopology | None = None, health: dict[str, DeviceHealth] | None = None
    ) -> None:
        async with self.changed:
            if topology is not None:
                self.topology = topology
            if health is not None:
                self.health = dict(health)
            self.version += 1
            self.changed.notify_all()

    def assign(self, assignment: Assignment) -> None:
        self.pending[assignment.request_id] = assignment

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.share_taken.discard(request_id)


class _Servicer(pb_grpc.DevicePluginServicer):
    def __init__(self, plugin: ResourcePlugin) -> None:
        self.plugin = plugin

    async def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        return self.plugin.options()

    async def ListAndWatch(self, request: pb.Empty, context: Any) -> AsyncIterator[pb.ListAndWatchResponse]:
        state = self.plugin.state
        seen = -1
        while True:
            async with state.changed:
                while state.version == seen:
                    await state.changed.wait()
                seen = state.version
            yield self.plugin.device_list()

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        out = pb.PreferredAllocationResponse()
        for creq in request.container_requests:
            if self.plugin.resource == GPU_SHARE_RESOURCE:
                ids = preferred_shares(
                    self.plugin.state.pending.values(),
                    available=list(creq.available_deviceIDs),
                    must_include=list(creq.must_include_deviceIDs),
                    size=creq.allocation_size,
                )
            else:
                ids = preferred(
                    self.plugin.state.pending.values(),
                    self.plugin.resource,
                    available=list(creq.available_deviceIDs),
                    must_include=list(creq.must_include_deviceIDs),
                    size=creq.allocation_size,
                )
            out.container_responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return out

    async def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        out = pb.AllocateResponse()
        known = {d.id for d in self.plugin.devices()}
        state = self.plugin.state
        for creq in request.container_requests:
            share = None
            ids = list(creq.devices_ids)
            try:
                if self.plugin.resource == GPU_SHARE_RESOURCE:
                    share = match_share(state.pending.values(), ids, taken=state.share_taken)
                ans = await asyncio.to_thread(
                    allocate,
                    self.plugin.resource,
                    ids,
                    known=known,
                    uverbs=self.plugin.uverbs,
                    cdi=self.plugin.cdi,
                    share=share,
                )
                if share is None:  # a share was matched to its assignment above
                    check_assigned(state.pending.values(), self.plugin.resource, ids)
            except AllocateError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                raise  # abort raises; this line only satisfies the type checker
            if share is not None:
                state.share_taken.add(share.request_id)
            out.container_responses.append(
                pb.ContainerAllocateResponse(
                    envs=ans.envs,
                    devices=[
                        pb.DeviceSpec(container_path=c, host_path=h, permissions=p) for c, h, p in ans.devices
                    ],
                    cdi_devices=[pb.CDIDevice(name=n) for n in ans.cdi],
                    annotations=ans.annotations,
                )
            )
        return out

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Any
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


class ResourcePlugin:
    """One resource's plugin server and its registration with kubelet."""

    def __init__(
        self,
        resource: str,
        state: PluginState,
        *,
        plugin_dir: str | Path = DEFAULT_PLUGIN_DIR,
        endpoint: str | None = None,
        uverbs: Callable[[str], list[str]] = lambda name: [],
        cdi: bool = True,
        poll_interval: float = 1.0,
        replicas: int = 0,
    ) -> None:
        self.resource = resource
        self.replicas = replicas
        self.state = state
        self.plugin_dir = Path(plugin_dir)
        self.endpoint = endpoint or f"tandem-{resource.rsplit('/', 1)[-1]}.sock"
        self.uverbs = uverbs
        self.cdi = cdi
        self.poll_interval = poll_interval
        self.registrations = 0
        self._server: grpc.aio.Server | None = None

    @property
    def socket(self) -> Path:
        return self.plugin_dir / self.endpoint

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET

    def options(self) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def devices(self) -> list[Any]:
        if self.state.topology is None:
            return []
        return plugin_devices(self.state.topology, self.state.health, self.resource, replicas=self.replicas)

    def device_list(self) -> pb.ListAndWatchResponse:
        return pb.ListAndWatchResponse(
            devices=[
                pb.Device(
                    ID=d.id,
                    health="Healthy" if d.healthy else "Unhealthy",
                    topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=d.numa)]),
                )
                for d in self.devices()
            ]
        )

    async def serve(self) -> None:
        await self.stop()
        with_socket = self.socket
        await asyncio.to_thread(self.plugin_dir.mkdir, parents=True, exist_ok=True)
        if await asyncio.to_thread(with_socket.exists):
            await asyncio.to_thread(with_socket.unlink)
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(_Servicer(self), server)  # type: ignore[no-untyped-call]
        server.add_insecure_port(f"unix://{with_socket}")
        await server.start()
        self._server = server

    async def register(self) -> None:
        async with grpc.aio.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
            stub = pb_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
            await stub.Register(
                pb.RegisterRequest(
                    version=API_VERSION,
                    endpoint=self.endpoint,
                    resource_name=self.resource,
                    options=self.options(),
                ),
                timeout=5.0,
            )
        self.registrations += 1
        log.info("device_plugin_registered", resource=self.resource, endpoint=str(self.socket))

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=0.5)
            self._server = None

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve, register, and serve + register again whenever kubelet restarts."""
        stop = stop or asyncio.Event()
        registered_with: int | None = None
        try:
            while not stop.is_set():
                kubelet = await asyncio.to_thread(_inode, self.kubelet_socket)
                mine = await asyncio.to_thread(_inode, self.socket)
                if kubelet is not None and (
                    kubelet != registered_with or mine is None or self._server is None
                ):
                    try:
                        if mine is None or self._server is None:
                            await self.serve()
                        await self.register()
                        registered_with = kubelet
                    except grpc.aio.AioRpcError as exc:
                        log.warning(
                            "device_plugin_register_failed", resource=self.resource, error=exc.details()
                        )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.poll_interval)
        finally:
            await self.stop()


class DevicePlugins:
    """Both Tandem resources, sharing one :class:`PluginState`; optionally writes the CDI spec
    for the RDMA devices (``<cdi_dir>/tandem-rdma.json``) whenever the inventory changes.
    ``share_replicas`` > 0 adds the GPU share resource with that many replicas per GPU (at
    least the largest ``max_shares_per_gpu`` of the sharing device classes). ``mig`` adds the
    MIG instance resource ``tandem.io/mig`` (for nodes with GPUs in MIG mode)."""

    def __init__(
        self,
        *,
        plugin_dir: str | Path = DEFAULT_PLUGIN_DIR,
        uverbs: Callable[[str], list[str]] = lambda name: [],
        cdi_dir: str | Path | None = None,
        poll_interval: float = 1.0,
        share_replicas: int = 0,
        mig: bool = False,
    ) -> None:
        self.state = PluginState()
        self.uverbs = uverbs
        self.cdi_dir = Path(cdi_dir) if cdi_dir else None
        self.plugins = [
            ResourcePlugin(r, self.state, plugin_dir=plugin_dir, uverbs=uverbs, poll_interval=poll_interval)
            for r in (GPU_RESOURCE, RDMA_RESOURCE)
        ]
        if share_replicas > 0:
            self.plugins.append(
                ResourcePlugin(
                    GPU_SHARE_RESOURCE,
                    self.state,
                    plugin_dir=plugin_dir,
                    uverbs=uverbs,
                    poll_interval=poll_interval,
                    replicas=share_replicas,
                )
            )
        if mig:
            self.plugins.append(
                ResourcePlugin(
                    MIG_RESOURCE,
                    self.state,
                    plugin_dir=plugin_dir,
                    uverbs=uverbs,
                    poll_interval=poll_interval,
                )
            )
        self._tasks = Supervisor("deviceplugins")

    async def update(
        self, *, topology: NodeTopology | None = None, health: dict[str, DeviceHealth] | None = None
    ) -> None:
        await self.state.update(topology=topology, health=health)
        if topology is not None and self.cdi_dir is not None:
            names = [d.id for d in plugin_devices(topology, {}, RDMA_RESOURCE)]
            spec = await asyncio.to_thread(lambda: rdma_cdi_spec({n: self.uverbs(n) for n in names}))
            await asyncio.to_thread(
                write_atomic, self.cdi_dir / "tandem-rdma.json", json.dumps(spec, indent=1).encode()
            )

    def start(self, stop: asyncio.Event) -> None:
        for p in self.plugins:
            self._tasks.spawn(p.resource, lambda p=p: p.run(stop))  # type: ignore[misc]

    async def aclose(self) -> None:
        await self._tasks.aclose()
        for p in self.plugins:
            await p.stop()


class PluginApplier:
    """An :class:`Applier` that tells the device plugins about an assignment (so
    ``GetPreferredAllocation`` can answer with it) and then runs the inner applier (VFs)."""

    def __init__(self, plugins: DevicePlugins, inner: Applier) -> None:
        self.plugins = plugins
        self.inner = inner

    async def apply(self, assignment: Assignment) -> None:
        self.plugins.state.assign(assignment)
        await self.inner.apply(assignment)

    async def cleanup(self, assignment: Assignment) -> list[str]:
        problems = await self.inner.cleanup(assignment)
        if not problems:
            self.plugins.state.forget(assignment.request_id)
        return problems
