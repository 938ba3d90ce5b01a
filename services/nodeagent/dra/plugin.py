"""The node agent as Kubernetes' DRA kubelet plugin for driver ``tandem.io`` (docs/dra.md,
"The kubelet side").

Protocol (kubelet 1.36): the plugin serves ``pluginregistration.Registration`` on a socket in
kubelet's plugin registry (``/var/lib/kubelet/plugins_registry/tandem.io-reg.sock``); kubelet's
plugin watcher finds the socket, calls ``GetInfo`` (type ``DRAPlugin``, name ``tandem.io``,
the DRA socket as endpoint, service ``v1.DRAPlugin``) and reports the outcome with
``NotifyRegistrationStatus``. It then calls the DRA socket
(``/var/lib/kubelet/plugins/tandem.io/dra.sock``): ``NodePrepareResources`` before a pod's
containers start, ``NodeUnprepareResources`` after they stopped, and ``NodeWatchResources``
(``DRAResourceHealth``, beta and on in 1.36) for device health. A restarted kubelet walks the
registry again and calls ``GetInfo`` on the same socket; the plugin keeps nothing per kubelet,
so that is all re-registration needs. Should a socket file disappear (an operator wiped the
directory), the plugin serves it again within ``poll_interval``.

**Prepare** reads the claim from the API server (the agent pod's service account may get
ResourceClaims), checks its ``tandem.io`` results against Tandem's record of this node
(:mod:`.prepare`: a claim whose devices Tandem did not assign to its pod is refused), writes
the claim's CDI spec (:mod:`.cdi`) and answers the CDI ids of every device. Preparing is
idempotent: it is recomputed from the claim each time and the spec file replaced atomically,
so a kubelet that asks again (after its restart) gets the same answer. A failure is answered
in the claim's ``error``, never as an RPC error, so the other claims of the call still count.

**VFs** are not moved here: kubelet prepares a pod's claims *before* it creates the pod's
sandbox, so there is no network namespace to move them into yet. The agent moves them as it
does for the device-plugin path — when the allocation arrives in its record, waiting for the
sandbox (``VfApplier``, ``NetnsNotReady``) — and brings them back in the release's verified
cleanup, which holds the devices until it is verified. **Unprepare** removes the claim's CDI
spec and verifies it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import aiohttp
import grpc
import msgspec

from schemas.messages import DeviceHealth, NodeAllocations
from schemas.topology import NodeTopology
from services.kube.errors import KubeError, NotFound
from services.nodeagent.atomicfile import write_atomic
from services.nodeagent.dra.cdi import claim_spec, spec_file_name
from services.nodeagent.dra.kubeletapi import dra_pb2 as dra
from services.nodeagent.dra.kubeletapi import dra_pb2_grpc as dra_grpc
from services.nodeagent.dra.kubeletapi import health_pb2 as health
from services.nodeagent.dra.kubeletapi import health_pb2_grpc as health_grpc
from services.nodeagent.dra.kubeletapi import pluginregistration_pb2 as reg
from services.nodeagent.dra.kubeletapi import pluginregistration_pb2_grpc as reg_grpc
from services.nodeagent.dra.prepare import DRIVER, PrepareError, check, claim_results, reserved_pods, where
from services.nodeagent.dra.slices import device_names, tandem_ids
from services.runtime.errors import SettingsError
from services.runtime.observe.logging import get_logger
from services.runtime.settings import Settings

__all__ = [
    "DRA_SERVICE",
    "AgentView",
    "ClaimReader",
    "KubeletPlugin",
    "PluginPaths",
    "device_health",
    "plugin_from_settings",
]

log = get_logger(__name__)

PLUGIN_TYPE = "DRAPlugin"
DRA_SERVICE = "v1.DRAPlugin"  # k8s.io/kubelet/pkg/apis/dra/v1.DRAPluginService
HEALTH_TIMEOUT_S = 30  # kubelet's default; the stream repeats the full list well within it
HEALTH_REFRESH_S = 10.0


class ClaimReader(Protocol):
    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...


class AgentView(NamedTuple):
    """What the node agent knows now: its devices, their health, its allocation record."""

    topology: NodeTopology | None
    health: Mapping[str, DeviceHealth]
    record: NodeAllocations | None


class PluginPaths(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where the plugin's sockets and the CDI specs live (the DaemonSet's hostPath mounts)."""

    registry_dir: str = "/var/lib/kubelet/plugins_registry"
    plugin_dir: str = f"/var/lib/kubelet/plugins/{DRIVER}"
    cdi_dir: str = "/var/run/cdi"

    @property
    def registration_socket(self) -> Path:
        return Path(self.registry_dir) / f"{DRIVER}-reg.sock"

    @property
    def dra_socket(self) -> Path:
        return Path(self.plugin_dir) / "dra.sock"


def device_health(view: AgentView, *, node: str, now: float) -> list[health.DeviceHealth]:
    """Every device of the node's pool with its health for kubelet: a failed device is
    UNHEALTHY with its reason; a cordoned one stays HEALTHY (the operator keeps new pods off
    it, the pods on it are fine) and says so."""
    if view.topology is None:
        return []
    out = []
    for dev_id, name in device_names(view.topology).items():
        h = view.health.get(dev_id) or DeviceHealth()
        message = h.reason if not h.healthy else ("cordoned: " + h.reason if h.cordoned else "")
        out.append(
            health.DeviceHealth(
                device=health.DeviceIdentifier(pool_name=node, device_name=name),
                health=health.HEALTHY if h.healthy else health.UNHEALTHY,
                last_updated_time=int(now),
                health_check_timeout_seconds=HEALTH_TIMEOUT_S,
                message=message[:1024],
            )
        )
    return out


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, plugin: KubeletPlugin) -> None:
        self.plugin = plugin

    async def GetInfo(self, request: reg.InfoRequest, context: Any) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=DRIVER,
            endpoint=str(self.plugin.paths.dra_socket),
            supported_versions=[DRA_SERVICE],
        )

    async def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: Any
    ) -> reg.RegistrationStatusResponse:
        self.plugin.registrations.append((request.plugin_registered, request.error))
        if request.plugin_registered:
            log.info("dra_plugin_registered", driver=DRIVER, endpoint=str(self.plugin.paths.dra_socket))
        else:
            log.error("dra_plugin_registration_failed", driver=DRIVER, error=request.error)
        return reg.RegistrationStatusResponse()


class _Dra(dra_grpc.DRAPluginServicer):
    def __init__(self, plugin: KubeletPlugin) -> None:
        self.plugin = plugin

    async def NodePrepareResources(
        self, request: dra.NodePrepareResourcesRequest, context: Any
    ) -> dra.NodePrepareResourcesResponse:
        out = dra.NodePrepareResourcesResponse()
        for claim in request.claims:
            out.claims[claim.uid].CopyFrom(await self.plugin.prepare(claim))
        return out

    async def NodeUnprepareResources(
        self, request: dra.NodeUnprepareResourcesRequest, context: Any
    ) -> dra.NodeUnprepareResourcesResponse:
        out = dra.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            out.claims[claim.uid].CopyFrom(await self.plugin.unprepare(claim))
        return out


class _Health(health_grpc.DRAResourceHealthServicer):
    def __init__(self, plugin: KubeletPlugin) -> None:
        self.plugin = plugin

    async def NodeWatchResources(
        self, request: health.NodeWatchResourcesRequest, context: Any
    ) -> AsyncIterator[health.NodeWatchResourcesResponse]:
        plugin = self.plugin
        while True:
            seen = plugin.version
            yield health.NodeWatchResourcesResponse(
                devices=device_health(plugin.view(), node=plugin.node, now=time.time())
            )
            await plugin.wait_changed(seen, timeout=plugin.health_refresh)


class KubeletPlugin:
    """The DRA kubelet plugin of one node agent. ``view`` is the agent's current
    :class:`AgentView`; ``uverbs`` finds a NIC's verbs device nodes; the agent calls
    :meth:`changed` when its devices or their health change (the health stream's cue)."""

    def __init__(
        self,
        api: ClaimReader,
        *,
        node: str,
        view: Callable[[], AgentView],
        uverbs: Callable[[str], list[str]],
        paths: PluginPaths | None = None,
        poll_interval: float = 1.0,
        health_refresh: float = HEALTH_REFRESH_S,
    ) -> None:
        self.api = api
        self.node = node
        self.view = view
        self.uverbs = uverbs
        self.paths = paths or PluginPaths()
        self.poll_interval = poll_interval
        self.health_refresh = health_refresh
        self.registrations: list[tuple[bool, str]] = []  # what kubelet reported, in order
        self.version = 0
        self._changed = asyncio.Event()
        self._servers: dict[Path, tuple[grpc.aio.Server, int]] = {}

    # -- prepare / unprepare -------------------------------------------------------------------

    async def prepare(self, claim: dra.Claim) -> dra.NodePrepareResourceResponse:
        at = where(claim.namespace, claim.name)
        try:
            obj = await self.api.get_resource_claim(claim.namespace, claim.name)
        except NotFound:
            return self._refused(claim, f"{at}: not found in the API server")
        except (KubeError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            return self._refused(claim, f"{at}: cannot read it from the API server: {exc}")
        try:
            results = claim_results(obj, node=self.node, uid=claim.uid)
            view = self.view()
            if view.topology is None:
                raise PrepareError(f"{at}: the node agent has not discovered this node's devices yet")
            prepared = check(
                results,
                claim=at,
                pods=reserved_pods(obj),
                record=view.record,
                names=tandem_ids(view.topology),
            )
            uverbs = {
                p.device_id: await asyncio.to_thread(self.uverbs, p.device_id) for p in prepared if p.nic
            }
            spec = claim_spec(claim.uid, prepared, uverbs=uverbs)
            path = Path(self.paths.cdi_dir) / spec_file_name(claim.uid)
            if spec.spec["devices"]:
                await asyncio.to_thread(write_atomic, path, msgspec.json.encode(spec.spec))
        except PrepareError as exc:
            return self._refused(claim, str(exc))
        except OSError as exc:  # the NICs' verbs devices unreadable, or the CDI dir unwritable
            return self._refused(claim, f"{at}: cannot prepare it on this node: {exc}")
        log.info(
            "dra_claim_prepared",
            claim=f"{claim.namespace}/{claim.name}",
            uid=claim.uid,
            devices=[p.result.device for p in prepared],
        )
        return dra.NodePrepareResourceResponse(
            devices=[
                dra.Device(
                    request_names=[p.result.request],
                    pool_name=self.node,
                    device_name=p.result.device,
                    cdi_device_ids=ids,
                    share_id=p.result.share_id,
                )
                for p, ids in zip(prepared, spec.ids, strict=True)
            ]
        )

    def _refused(self, claim: dra.Claim, error: str) -> dra.NodePrepareResourceResponse:
        log.warning("dra_claim_refused", claim=f"{claim.namespace}/{claim.name}", uid=claim.uid, error=error)
        return dra.NodePrepareResourceResponse(error=error)

    async def unprepare(self, claim: dra.Claim) -> dra.NodeUnprepareResourceResponse:
        """Remove the claim's CDI spec and verify it is gone (idempotent). Its VFs go back in
        the release's verified cleanup (the module docstring says why not here)."""
        path = Path(self.paths.cdi_dir) / spec_file_name(claim.uid)
        try:
            await asyncio.to_thread(path.unlink, missing_ok=True)
        except OSError as exc:
            return dra.NodeUnprepareResourceResponse(error=f"claim {claim.uid}: cannot remove {path}: {exc}")
        if await asyncio.to_thread(path.exists):
            return dra.NodeUnprepareResourceResponse(error=f"claim {claim.uid}: {path} is still there")
        log.info("dra_claim_unprepared", claim=f"{claim.namespace}/{claim.name}", uid=claim.uid)
        return dra.NodeUnprepareResourceResponse()

    # -- health ---------------------------------------------------------------------------------

    def changed(self) -> None:
        """The agent's devices or their health changed: the health streams send again."""
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()  # the next waiters wait for the next change

    async def wait_changed(self, seen: int, *, timeout: float) -> None:
        """Return once :attr:`version` is past ``seen``, or after ``timeout`` s (a refresh)."""
        if self.version != seen:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    # -- serving --------------------------------------------------------------------------------

    async def serve(self) -> None:
        """Serve both sockets (again, where a socket file is gone or was replaced)."""
        for path, add in (
            (self.paths.dra_socket, self._add_dra),
            (self.paths.registration_socket, self._add_registration),
        ):
            running = self._servers.get(path)
            if running is not None and await asyncio.to_thread(_inode, path) == running[1]:
                continue
            if running is not None:
                await running[0].stop(grace=0.5)
            self._servers[path] = await _serve_socket(path, add)

    def _add_dra(self, server: grpc.aio.Server) -> None:
        dra_grpc.add_DRAPluginServicer_to_server(_Dra(self), server)  # type: ignore[no-untyped-call]
        health_grpc.add_DRAResourceHealthServicer_to_server(_Health(self), server)  # type: ignore[no-untyped-call]

    def _add_registration(self, server: grpc.aio.Server) -> None:
        reg_grpc.add_RegistrationServicer_to_server(_Registration(self), server)  # type: ignore[no-untyped-call]

    async def run(self) -> None:
        """Serve until cancelled, serving a socket again if its file disappears."""
        try:
            while True:
                await self.serve()
                await asyncio.sleep(self.poll_interval)
        finally:
            await self.stop()

    async def stop(self) -> None:
        servers, self._servers = list(self._servers.items()), {}
        for path, (server, inode) in servers:
            await server.stop(grace=0.5)
            if await asyncio.to_thread(_inode, path) == inode:
                await asyncio.to_thread(path.unlink, missing_ok=True)


def plugin_from_settings(
    settings: Settings,
    api: ClaimReader | None,
    *,
    view: Callable[[], AgentView],
    uverbs: Callable[[str], list[str]],
) -> KubeletPlugin | None:
    """The plugin the settings ask for (``dra_plugin``), or None. ``api``: the agent's
    Kubernetes client, which exists when ``dra_slices`` is on: a driver that prepares claims
    but publishes no slices would have no claim allocated to prepare."""
    if not settings.dra_plugin:
        return None
    if api is None:
        raise SettingsError("dra_plugin needs dra_slices (the chart sets both with dra.enabled)")
    try:
        paths = msgspec.convert(settings.dra_plugin_paths, PluginPaths)
    except msgspec.ValidationError as exc:
        raise SettingsError(f"dra_plugin_paths: {exc}") from exc
    return KubeletPlugin(api, node=settings.node_name, view=view, uverbs=uverbs, paths=paths)


async def _serve_socket(path: Path, add: Callable[[grpc.aio.Server], None]) -> tuple[grpc.aio.Server, int]:
    await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(path.unlink, missing_ok=True)
    server = grpc.aio.server()
    add(server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    inode = await asyncio.to_thread(_inode, path)
    return server, inode or 0


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None
