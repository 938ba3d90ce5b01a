"""GPUs from NVML (``nvidia-ml-py``, module ``pynvml``): discovery, health events, processes.

Discovery reads, per GPU index: UUID, model, minor number, total memory, PCI bus id, NUMA node
and NVLink peers (a link to another GPU names that GPU; a link to an NVSwitch puts the GPU in
the switch fabric, where every fabric GPU is a peer of every other), and the GPU's multi-node
NVLink fabric (``nvmlDeviceGetGpuFabricInfoV``: cluster UUID and clique id once the fabric
manager has registered the GPU, state ``COMPLETED``): when every GPU of the node reports the
same one, it is the node's ``nvlink_domain`` (:func:`node_domain`; a GB200 NVL72 rack is one).
MIG: a GPU whose *current* MIG mode is enabled (``nvmlDeviceGetMigMode``; NOT_SUPPORTED means
no MIG; any other error reading the mode reports the GPU in MIG mode without instances, so that
it is not handed out whole) is reported with ``mig_mode`` and its existing MIG devices
(``nvmlDeviceGetMaxMigDeviceCount`` slots, ``nvmlDeviceGetMigDeviceHandleByIndex``; an empty
slot is NOT_FOUND): per instance its ``MIG-`` UUID, memory, GPU and compute instance ids and
its profile, parsed from the MIG handle's name (``"NVIDIA H100 80GB HBM3 MIG 1g.10gb"``). An
instance that cannot be read is left out with an error log naming the GPU and the slot; its GPU
stays in MIG mode, so it is still never handed out whole (:func:`mig_profile_of`).
Health comes from one NVML event set: XID critical errors (application XIDs — 13, 31, 43, 45,
68, 109 by default — are ignored: they are the job's fault, not the GPU's), double-bit ECC
errors, and a GPU that NVML reports lost (``NVML_ERROR_GPU_IS_LOST``, XID 79 "fallen off the
bus"). Only failures are reported; a device returns to service through
:class:`~services.nodeagent.health.HealthTracker` after its clean period or an operator's
uncordon — never by restarting the agent. Compute processes per GPU back the "cleanup
verified, not assumed" rule.

NVML is a blocking C library: every call runs in a worker thread (``asyncio.to_thread``), one
call at a time under a lock (NVML is thread-safe, but the event wait holds a thread for up to
``event_timeout_ms`` and must not starve discovery). The decisions — which event is a
failure and with which reason, who is an NVLink peer of whom — are pure functions below.

The module is injectable (``nvml=``): tests pass a fake built from the real API's names and
return shapes; production imports ``pynvml``. Without the NVIDIA driver ``nvmlInit`` raises
``NVMLError_LibraryNotFound``; :meth:`NvmlBackend.open` turns that into one
:class:`BackendUnavailable` naming ``libnvidia-ml.so.1`` and the other backends.
"""

from __future__ import annotations

import asyncio
import ctypes
import re
import threading
import uuid as uuidlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import msgspec

from schemas.topology import MIG_PROFILE_PATTERN, Gpu, MigInstance, NodeTopology, NvlinkDomain
from services.nodeagent.backends.base import BackendError, BackendUnavailable, HealthChange
from services.nodeagent.backends.pcie import Placement, build_topology, normalize_bus_id
from services.runtime.observe.logging import get_logger

__all__ = [
    "DEFAULT_IGNORED_XIDS",
    "GPU_LOST",
    "NVML_MISSING_HELP",
    "GpuFacts",
    "NvmlBackend",
    "classify_event",
    "fabric_domain",
    "mig_profile_of",
    "node_domain",
    "nvlink_peers",
]

log = get_logger(__name__)

DEFAULT_IGNORED_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
GPU_LOST = "GPU is lost (fallen off the bus)"

# Well-known XIDs, so a health reason says what happened (NVIDIA's XID catalogue).
XID_NAMES: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping event",
    64: "ECC page retirement or row remapper failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

NVML_MISSING_HELP = (
    "NVML backend unavailable: {error}. The NVIDIA driver's libnvidia-ml.so.1 could not be used on "
    "this machine (no NVIDIA driver, or the library is not mounted into the agent). Discovery backends: "
    "'host' (NVML GPUs + sysfs NICs; needs the NVIDIA driver), 'sysfs' (RDMA NICs only, no GPUs), "
    "'simulated' (a topology file: TANDEM_BACKEND=simulated TANDEM_TOPOLOGY_FILE=<file or built-in>)."
)

# NVML's NVLink remote device types (nvmlIntNvLinkDeviceType_t).
_NVLINK_GPU = 0
_NVLINK_SWITCH = 2


def classify_event(
    *, event_type: int, data: int, xid_type: int, dbe_type: int, ignored_xids: Iterable[int]
) -> str | None:
    """The failure reason for one NVML event, or None when it does not make the GPU unhealthy."""
    if event_type & xid_type:
        if data in set(ignored_xids):
            return None
        name = XID_NAMES.get(data)
        return f"XID {data}" + (f" ({name})" if name else "")
    if event_type & dbe_type:
        return "double-bit ECC error"
    return None


def nvlink_peers(links: dict[str, list[tuple[str, int]]]) -> dict[str, list[str]]:
    """GPU bus id → peer GPU bus ids, from each GPU's active links (remote bus id, remote type).

    A direct link to another GPU makes the two peers; GPUs with links into NVSwitches form one
    fabric in which all are peers (an HGX board: every GPU reaches every other at full speed)."""
    gpus = set(links)
    peers: dict[str, set[str]] = {g: set() for g in gpus}
    fabric = {g for g, ls in links.items() if any(t == _NVLINK_SWITCH for _, t in ls)}
    for g, ls in links.items():
        for remote, kind in ls:
            if kind == _NVLINK_GPU and remote in gpus and remote != g:
                peers[g].add(remote)
                peers[remote].add(g)
        if g in fabric:
            peers[g] |= fabric - {g}
    return {g: sorted(p) for g, p in peers.items()}


@dataclass(frozen=True, slots=True)
class GpuFacts:
    gpu: Gpu
    numa: int | None
    fabric: NvlinkDomain | None = None


# NVML's nvmlGpuFabricState_t value once the fabric manager has registered the GPU.
_FABRIC_COMPLETED = 3


def fabric_domain(cluster_uuid: bytes, clique_id: int, *, state: int, status: int) -> NvlinkDomain | None:
    """A GPU's NVLink domain from its fabric info; None unless registration completed with
    success and the cluster UUID is set (a GPU outside any multi-node fabric reports zeros)."""
    if state != _FABRIC_COMPLETED or status != 0 or len(cluster_uuid) != 16 or not any(cluster_uuid):
        return None
    return NvlinkDomain(cluster_uuid=str(uuidlib.UUID(bytes=bytes(cluster_uuid))), clique_id=int(clique_id))


def node_domain(facts: Iterable[GpuFacts]) -> NvlinkDomain | None:
    """The node's NVLink domain: the one every GPU reports; None when any GPU reports none or
    they disagree (a node is placed in one domain or in none, never half of each)."""
    domains = {f.fabric for f in facts}
    if len(domains) == 1:
        return next(iter(domains))
    if len(domains) > 1 and None not in domains:
        log.warning("nvml_fabric_domains_differ", domains=sorted(d.key for d in domains if d))
    return None


_MIG_NAME = re.compile(r"\bMIG\s+(\S+)\s*$")
_PROFILE = re.compile(MIG_PROFILE_PATTERN)


def mig_profile_of(name: str) -> str | None:
    """The profile in a MIG device's NVML name (``"NVIDIA A100-SXM4-40GB MIG 1g.5gb"`` →
    ``1g.5gb``); None when the name carries no valid profile."""
    m = _MIG_NAME.search(name)
    if m is None or _PROFILE.match(m.group(1)) is None:
        return None
    return m.group(1)


def gpu_index(device: str) -> int | None:
    """The index of a GPU device id (``gpu3`` → 3); None for any other device."""
    digits = device.removeprefix("gpu")
    if digits == device or not digits.isdigit():
        return None
    return int(digits)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlBackend:
    """GPU discovery and health from NVML. Create with :meth:`open` (it initialises NVML)."""

    name = "nvml"

    def __init__(
        self,
        nvml: ModuleType,
        *,
        node_name: str,
        ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS,
        event_timeout_ms: int = 1000,
    ) -> None:
        self.nvml = nvml
        self.node_name = node_name
        self.ignored_xids = frozenset(ignored_xids)
        self.event_timeout_ms = event_timeout_ms
        self._lock = threading.Lock()
        self._wait_lock = threading.Lock()  # held during an event wait; close() frees the set after it
        self._closed = threading.Event()
        self._event_set: Any = None
        # GPUs reported lost in this episode (touched on the event loop only; see probe()).
        self._lost: set[str] = set()

    @classmethod
    async def open(
        cls,
        *,
        node_name: str,
        nvml: ModuleType | None = None,
        ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS,
        event_timeout_ms: int = 1000,
    ) -> NvmlBackend:
        if nvml is None:
            import pynvml

            nvml = pynvml
        try:
            await asyncio.to_thread(nvml.nvmlInit)
        except nvml.NVMLError as exc:
            raise BackendUnavailable(NVML_MISSING_HELP.format(error=exc)) from exc
        return cls(nvml, node_name=node_name, ignored_xids=ignored_xids, event_timeout_ms=event_timeout_ms)

    # -- blocking parts (run in a thread) ---------------------------------------------------

    def _call(self, fn: str, *args: Any) -> Any:
        with self._lock:
            return getattr(self.nvml, fn)(*args)

    def _optional(self, fn: str, *args: Any) -> Any:
        """A call some GPUs/drivers do not support: None instead of NOT_SUPPORTED & co."""
        n = self.nvml
        try:
            return self._call(fn, *args)
        except (n.NVMLError_NotSupported, n.NVMLError_FunctionNotFound, n.NVMLError_InvalidArgument):
            return None

    def read_gpus(self) -> list[GpuFacts]:
        n = self.nvml
        try:
            count = self._call("nvmlDeviceGetCount")
        except n.NVMLError as exc:
            raise BackendError(f"NVML: cannot count GPUs: {exc}") from exc
        rows: list[tuple[int, str, str, int | None, int, str, int | None]] = []
        links: dict[str, list[tuple[str, int]]] = {}
        fabric: dict[int, NvlinkDomain | None] = {}
        mig: dict[int, tuple[bool, list[MigInstance]]] = {}
        for index in range(count):
            try:
                h = self._call("nvmlDeviceGetHandleByIndex", index)
                uuid = _text(self._call("nvmlDeviceGetUUID", h))
                model = _text(self._call("nvmlDeviceGetName", h))
                minor = self._optional("nvmlDeviceGetMinorNumber", h)
                memory = self._call("nvmlDeviceGetMemoryInfo", h).total // (1024 * 1024)
                bus = normalize_bus_id(_text(self._call("nvmlDeviceGetPciInfo_v3", h).busId))
            except n.NVMLError as exc:
                # One GPU off the bus must not hide the node's other GPUs: skip it, say why.
                log.error("nvml_gpu_unreadable", index=index, error=str(exc))
                continue
            numa = self._optional("nvmlDeviceGetNumaNodeId", h)
            rows.append((index, uuid, model, minor, memory, bus, numa))
            links[bus] = self._links(h)
            fabric[index] = self._fabric(h)
            mig[index] = self._mig(h, index)
        peers = nvlink_peers(links)
        index_of = {bus: index for index, _, _, _, _, bus, _ in rows}
        return [
            GpuFacts(
                Gpu(
                    index=index,
                    uuid=uuid,
                    model=model,
                    memory_mib=memory,
                    minor=minor,
                    pci_bus_id=bus,
                    nvlink_peers=sorted(index_of[p] for p in peers.get(bus, []) if p in index_of),
                    mig_mode=mig[index][0],
                    mig_instances=mig[index][1],
                ),
                numa if isinstance(numa, int) and numa >= 0 else None,
                fabric.get(index),
            )
            for index, uuid, model, minor, memory, bus, numa in rows
        ]

    def _mig(self, handle: Any, index: int) -> tuple[bool, list[MigInstance]]:
        """(MIG mode on, its instances) of one GPU; (False, []) on GPUs without MIG."""
        n = self.nvml
        try:
            mode = self._optional("nvmlDeviceGetMigMode", handle)
        except n.NVMLError as exc:
            # A GPU whose mode cannot be read may be in MIG mode, and a pod given it whole would
            # fail: report it in MIG mode without instances (never handed out) and say why.
            log.error("nvml_mig_mode_unreadable", index=index, error=str(exc))
            return True, []
        if mode is None:
            return False, []
        current, pending = int(mode[0]), int(mode[1])
        enabled = int(getattr(n, "NVML_DEVICE_MIG_ENABLE", 1))
        if current != pending:
            log.warning("nvml_mig_mode_pending", index=index, current=current, pending=pending)
        if current != enabled:
            return False, []
        try:
            slots = int(self._call("nvmlDeviceGetMaxMigDeviceCount", handle))
        except n.NVMLError as exc:
            log.error("nvml_mig_unreadable", index=index, error=str(exc))
            return True, []
        out: list[MigInstance] = []
        seen: set[tuple[int, int]] = set()
        for slot in range(slots):
            try:
                mh = self._call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            except n.NVMLError_NotFound:
                continue  # an empty slot: fewer instances than the GPU could hold
            except n.NVMLError as exc:
                log.error("nvml_mig_instance_unreadable", index=index, slot=slot, error=str(exc))
                continue
            try:
                uuid = _text(self._call("nvmlDeviceGetUUID", mh))
                name = _text(self._call("nvmlDeviceGetName", mh))
                memory = self._call("nvmlDeviceGetMemoryInfo", mh).total // (1024 * 1024)
                gi = int(self._call("nvmlDeviceGetGpuInstanceId", mh))
                ci = int(self._call("nvmlDeviceGetComputeInstanceId", mh))
            except n.NVMLError as exc:
                # One bad instance must not hide the others (nor make the GPU whole): skip it.
                log.error("nvml_mig_instance_unreadable", index=index, slot=slot, error=str(exc))
                continue
            profile = mig_profile_of(name)
            if profile is None or not uuid.startswith("MIG-") or (gi, ci) in seen:
                log.error(
                    "nvml_mig_instance_unusable",
                    index=index,
                    slot=slot,
                    name=name,
                    uuid=uuid,
                    why="no MIG profile in its name" if profile is None else "bad or repeated id",
                )
                continue
            seen.add((gi, ci))
            try:
                out.append(
                    msgspec.convert(
                        {
                            "profile": profile,
                            "uuid": uuid,
                            "gpu_instance_id": gi,
                            "compute_instance_id": ci,
                            "memory_mib": memory,
                        },
                        MigInstance,
                    )
                )
            except msgspec.ValidationError as exc:
                log.error("nvml_mig_instance_unusable", index=index, slot=slot, why=str(exc))
        return True, out

    def _fabric(self, handle: Any) -> NvlinkDomain | None:
        """The GPU's multi-node NVLink fabric info (the versioned call, else the older one);
        None on GPUs, drivers and bindings without it."""
        n = self.nvml
        for fn, struct in (
            ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfoV_t"),
            ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t"),
        ):
            if not hasattr(n, fn) or not hasattr(n, struct):
                continue
            info = getattr(n, struct)()
            try:
                if self._optional(fn, handle, ctypes.byref(info)) is None:
                    continue
            except n.NVMLError as exc:
                log.warning("nvml_fabric_unreadable", error=str(exc))
                return None
            return fabric_domain(bytes(info.clusterUuid), info.cliqueId, state=info.state, status=info.status)
        return None

    def _links(self, handle: Any) -> list[tuple[str, int]]:
        n = self.nvml
        out: list[tuple[str, int]] = []
        for link in range(int(getattr(n, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if self._call("nvmlDeviceGetNvLinkState", handle, link) != n.NVML_FEATURE_ENABLED:
                    continue
                remote = normalize_bus_id(
                    _text(self._call("nvmlDeviceGetNvLinkRemotePciInfo", handle, link).busId)
                )
            except n.NVMLError:
                continue  # link index past this GPU's links, or NVLink unsupported
            kind = self._optional("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
            out.append((remote, _NVLINK_GPU if kind is None else int(kind)))
        return out

    def processes(self, indices: list[int]) -> dict[int, list[int]]:
        n = self.nvml
        out: dict[int, list[int]] = {}
        for index in indices:
            try:
                h = self._call("nvmlDeviceGetHandleByIndex", index)
                procs = self._call("nvmlDeviceGetComputeRunningProcesses", h)
            except n.NVMLError as exc:
                raise BackendError(f"gpu{index}: cannot list compute processes: {exc}") from exc
            out[index] = sorted(int(p.pid) for p in procs)
        return out

    def _register_events(self) -> dict[str, int]:
        """Create the event set; register every GPU for XID + DBE events. Returns uuid → index."""
        n = self.nvml
        wanted = n.nvmlEventTypeXidCriticalError | n.nvmlEventTypeDoubleBitEccError
        self._event_set = self._call("nvmlEventSetCreate")
        by_uuid: dict[str, int] = {}
        for index in range(self._call("nvmlDeviceGetCount")):
            try:
                h = self._call("nvmlDeviceGetHandleByIndex", index)
                by_uuid[_text(self._call("nvmlDeviceGetUUID", h))] = index
                supported = self._optional("nvmlDeviceGetSupportedEventTypes", h)
                mask = wanted if supported is None else wanted & int(supported)
                if mask:
                    self._call("nvmlDeviceRegisterEvents", h, mask, self._event_set)
            except n.NVMLError as exc:
                log.warning("nvml_events_unavailable", index=index, error=str(exc))
        return by_uuid

    def _wait_event(self, by_uuid: dict[str, int]) -> list[HealthChange]:
        """Wait up to ``event_timeout_ms`` for one event (no lock: the wait is the long call)."""
        n = self.nvml
        try:
            with self._wait_lock:
                if self._closed.is_set():
                    return []
                data = n.nvmlEventSetWait_v2(self._event_set, self.event_timeout_ms)
        except n.NVMLError_Timeout:
            return []
        except n.NVMLError_GpuIsLost:
            return self._find_lost(by_uuid)
        reason = classify_event(
            event_type=int(data.eventType),
            data=int(data.eventData),
            xid_type=n.nvmlEventTypeXidCriticalError,
            dbe_type=n.nvmlEventTypeDoubleBitEccError,
            ignored_xids=self.ignored_xids,
        )
        if reason is None:
            return []
        try:
            uuid = _text(self._call("nvmlDeviceGetUUID", data.device))
        except n.NVMLError_GpuIsLost:
            return self._find_lost(by_uuid)
        index = by_uuid.get(uuid)
        if index is None:
            log.warning("nvml_event_for_unknown_gpu", uuid=uuid, reason=reason)
            return []
        return [HealthChange(f"gpu{index}", False, reason)]

    def _find_lost(self, by_uuid: dict[str, int]) -> list[HealthChange]:
        """NVML said 'GPU is lost' without saying which: probe each GPU, report every lost one
        (not only the first: a GPU lost earlier must not hide the next one)."""
        return [
            HealthChange(f"gpu{index}", False, GPU_LOST)
            for index in sorted(by_uuid.values())
            if self._probe_index(index) == GPU_LOST
        ]

    def _probe_index(self, index: int) -> str | None:
        """Why the GPU at ``index`` is unusable now (lost, unreadable), or None."""
        n = self.nvml
        try:
            h = self._call("nvmlDeviceGetHandleByIndex", index)
            self._call("nvmlDeviceGetUUID", h)
        except n.NVMLError_GpuIsLost:
            return GPU_LOST
        except n.NVMLError as exc:
            return f"NVML cannot read the GPU: {exc}"
        return None

    # -- DiscoveryBackend ---------------------------------------------------------------------

    async def gpus(self) -> list[GpuFacts]:
        return await asyncio.to_thread(self.read_gpus)

    async def discover(self) -> NodeTopology:
        """GPUs alone (the host backend adds sysfs placement): without sysfs the PCIe tree is
        unknown, so each NUMA node gets one pseudo root ``numa<N>`` and no switches."""
        facts = await self.gpus()
        placed = [
            (f.gpu, Placement(socket=0, numa=f.numa or 0, root=f"numa{f.numa or 0}", switch=None))
            for f in facts
        ]
        topo = build_topology(self.node_name, gpus=placed, nics=[], description="nvml")
        return msgspec.structs.replace(topo, nvlink_domain=node_domain(facts))

    async def health_changes(self) -> AsyncIterator[HealthChange]:
        by_uuid = await asyncio.to_thread(self._register_events)
        while not self._closed.is_set():
            changes = await asyncio.to_thread(self._wait_event, by_uuid)
            fresh: list[HealthChange] = []
            for change in changes:
                # "GPU lost" repeats on every wait once a GPU is gone; report it once per
                # episode (probe() ends the episode when the GPU is readable again).
                if change.reason == GPU_LOST:
                    if change.device in self._lost:
                        continue
                    self._lost.add(change.device)
                fresh.append(change)
            if changes and not fresh:
                await asyncio.sleep(self.event_timeout_ms / 1000)  # do not spin on a lost GPU
            for change in fresh:
                yield change

    async def probe(self, device: str) -> str | None:
        """Look at a GPU again before it returns to service: the reason it is still unusable
        (lost, unreadable), or None. A readable GPU's loss episode ends here, so its next loss
        is reported again. Devices that are not GPUs are not NVML's: None."""
        index = gpu_index(device)
        if index is None:
            return None
        reason = await asyncio.to_thread(self._probe_index, index)
        if reason is None:
            self._lost.discard(device)
        return reason

    async def gpu_processes(self, indices: list[int]) -> dict[int, list[int]]:
        return await asyncio.to_thread(self.processes, indices)

    async def close(self) -> None:
        self._closed.set()
        n = self.nvml

        def shutdown() -> None:
            try:
                with self._wait_lock:  # never free the event set under a running wait
                    if self._event_set is not None:
                        self._call("nvmlEventSetFree", self._event_set)
                        self._event_set = None
                self._call("nvmlShutdown")
            except n.NVMLError as exc:
                log.warning("nvml_shutdown_failed", error=str(exc))

        await asyncio.to_thread(shutdown)
