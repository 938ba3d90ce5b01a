"""A fake ``pynvml`` module: the NVML boundary for tests on machines without a GPU.

Built from the real module's names and return shapes (checked against the installed
``nvidia-ml-py`` by ``tests/unit/test_nvml.py::test_fake_matches_real_pynvml``): handles are
opaque objects; ``nvmlDeviceGetPciInfo_v3`` returns a struct whose ``busId`` is *bytes* with an
8-digit domain; ``nvmlDeviceGetUUID``/``nvmlDeviceGetName`` return ``str`` (pynvml decodes
them); ``nvmlEventSetWait_v2`` returns a struct with ``device``, ``eventType``, ``eventData``
and raises ``NVMLError_Timeout`` when nothing happened; errors are ``NVMLError`` subclasses
carrying ``value`` (the NVML return code).

MIG: ``nvmlDeviceGetMigMode`` returns ``[current, pending]`` (``NVML_DEVICE_MIG_ENABLE`` = 1)
or raises ``NVMLError_NotSupported`` on a GPU without MIG; ``nvmlDeviceGetMaxMigDeviceCount``
is the number of MIG device slots, and ``nvmlDeviceGetMigDeviceHandleByIndex`` raises
``NVMLError_NotFound`` for a slot with no instance (as the driver does). A MIG device handle
answers ``nvmlDeviceGetUUID`` (``MIG-...``), ``nvmlDeviceGetName`` (``"<GPU name> MIG
1g.10gb"``), ``nvmlDeviceGetMemoryInfo`` and ``nvmlDeviceGetGpuInstanceId`` /
``nvmlDeviceGetComputeInstanceId``.
"""

from __future__ import annotations

import ctypes
import queue
import types
import uuid
from dataclasses import dataclass, field
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_FEATURE_ENABLED = 1
NVML_FEATURE_DISABLED = 0
NVML_NVLINK_MAX_LINKS = 36
nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypePState = 0x4
nvmlEventTypeXidCriticalError = 0x8
NVML_GPU_FABRIC_UUID_LEN = 16
NVML_GPU_FABRIC_STATE_NOT_SUPPORTED = 0
NVML_GPU_FABRIC_STATE_NOT_STARTED = 1
NVML_GPU_FABRIC_STATE_IN_PROGRESS = 2
NVML_GPU_FABRIC_STATE_COMPLETED = 3
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1


class c_nvmlGpuFabricInfoV_t(ctypes.Structure):
    """pynvml's versioned fabric info struct (v2), filled through ``ctypes.byref``."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_uint8 * NVML_GPU_FABRIC_UUID_LEN),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint8),
        ("healthMask", ctypes.c_uint32),
    ]


class NVMLError(Exception):
    value = 999

    def __str__(self) -> str:
        return self.__class__.__doc__ or "Unknown Error"


class NVMLError_InvalidArgument(NVMLError):
    """Invalid Argument"""

    value = NVML_ERROR_INVALID_ARGUMENT


class NVMLError_NotSupported(NVMLError):
    """Not Supported"""

    value = NVML_ERROR_NOT_SUPPORTED


class NVMLError_NotFound(NVMLError):
    """Not Found"""

    value = NVML_ERROR_NOT_FOUND


class NVMLError_Timeout(NVMLError):
    """Timeout"""

    value = NVML_ERROR_TIMEOUT


class NVMLError_LibraryNotFound(NVMLError):
    """NVML Shared Library Not Found"""

    value = NVML_ERROR_LIBRARY_NOT_FOUND


class NVMLError_FunctionNotFound(NVMLError):
    """Function Not Found"""

    value = NVML_ERROR_FUNCTION_NOT_FOUND


class NVMLError_GpuIsLost(NVMLError):
    """GPU is lost"""

    value = NVML_ERROR_GPU_IS_LOST


@dataclass
class FakeMig:
    """One MIG device of a FakeGpu. ``broken``: every query on its handle fails (a driver
    error on one instance)."""

    uuid: str
    profile: str = "1g.10gb"
    gpu_instance_id: int = 0
    compute_instance_id: int = 0
    memory_total: int = 9856 * 1024 * 1024
    broken: bool = False


@dataclass
class FakeGpu:
    uuid: str
    bus_id: str  # NVML form, 8-digit domain: "00000000:18:00.0"
    name: str = "NVIDIA H100 80GB HBM3"
    minor: int = 0
    memory_total: int = 81559 * 1024 * 1024
    numa: int | None = 0
    # link index -> (remote bus id, remote type 0=GPU 2=switch); missing = inactive
    nvlinks: dict[int, tuple[str, int]] = field(default_factory=dict)
    processes: list[int] = field(default_factory=list)
    lost: bool = False
    events_supported: int = nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError | 0x1
    # Multi-node NVLink fabric: (cluster UUID, clique id, state, status); None = not supported.
    fabric: tuple[str, int, int, int] | None = None
    # MIG: (current, pending) mode, None = the GPU does not support MIG; the device slots
    # (None = empty slot), at most ``mig_slots`` of them.
    mig_mode: tuple[int, int] | None = None
    mig_devices: list[FakeMig | None] = field(default_factory=list)
    mig_slots: int = 7


@dataclass
class _Handle:
    gpu: FakeGpu
    mig: FakeMig | None = None


class _Struct(types.SimpleNamespace):
    pass


def build(gpus: list[FakeGpu] | None, *, library_present: bool = True) -> types.ModuleType:
    """A module object with pynvml's API over ``gpus`` (``None`` / no library: init fails).

    ``module.fire(index, event_type, data)`` queues an event for ``nvmlEventSetWait_v2``.
    ``module.calls`` records every API call name (to check what the backend used)."""
    mod = types.ModuleType("pynvml")
    state: dict[str, Any] = {"init": 0, "registered": {}}
    events: queue.Queue[Any] = queue.Queue()
    calls: list[str] = []
    gpus = list(gpus or [])

    for name, value in list(globals().items()):
        if name.startswith(("NVML_", "nvmlEventType", "NVMLError")):
            setattr(mod, name, value)

    def api(fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            calls.append(fn.__name__)
            if fn.__name__ not in {"nvmlInit", "nvmlShutdown"} and state["init"] <= 0:
                raise NVMLError("Uninitialized")
            return fn(*args)

        wrapper.__name__ = fn.__name__
        setattr(mod, fn.__name__, wrapper)
        return wrapper

    def handle_ok(h: _Handle) -> FakeGpu:
        if h.gpu.lost:
            raise NVMLError_GpuIsLost()
        if h.mig is not None and h.mig.broken:
            raise NVMLError("Unknown Error")
        return h.gpu

    @api
    def nvmlInit() -> None:
        if not library_present:
            raise NVMLError_LibraryNotFound()
        state["init"] += 1

    @api
    def nvmlShutdown() -> None:
        state["init"] -= 1

    @api
    def nvmlDeviceGetCount() -> int:
        return len(gpus)

    @api
    def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
        if not 0 <= index < len(gpus):
            raise NVMLError_InvalidArgument()
        return _Handle(gpus[index])

    @api
    def nvmlDeviceGetUUID(h: _Handle) -> str:
        g = handle_ok(h)
        return h.mig.uuid if h.mig is not None else g.uuid

    @api
    def nvmlDeviceGetName(h: _Handle) -> str:
        g = handle_ok(h)
        return f"{g.name} MIG {h.mig.profile}" if h.mig is not None else g.name

    @api
    def nvmlDeviceGetMinorNumber(h: _Handle) -> int:
        return handle_ok(h).minor

    @api
    def nvmlDeviceGetMemoryInfo(h: _Handle) -> _Struct:
        g = handle_ok(h)
        total = h.mig.memory_total if h.mig is not None else g.memory_total
        return _Struct(total=total, free=total, used=0)

    @api
    def nvmlDeviceGetMigMode(h: _Handle) -> list[int]:
        g = handle_ok(h)
        if g.mig_mode is None or h.mig is not None:
            raise NVMLError_NotSupported()
        return list(g.mig_mode)

    @api
    def nvmlDeviceGetMaxMigDeviceCount(h: _Handle) -> int:
        g = handle_ok(h)
        if g.mig_mode is None:
            raise NVMLError_NotSupported()
        return g.mig_slots

    @api
    def nvmlDeviceGetMigDeviceHandleByIndex(h: _Handle, index: int) -> _Handle:
        g = handle_ok(h)
        if g.mig_mode is None:
            raise NVMLError_NotSupported()
        if not 0 <= index < g.mig_slots:
            raise NVMLError_InvalidArgument()
        mig = g.mig_devices[index] if index < len(g.mig_devices) else None
        if mig is None:
            raise NVMLError_NotFound()
        return _Handle(g, mig)

    @api
    def nvmlDeviceGetGpuInstanceId(h: _Handle) -> int:
        handle_ok(h)
        if h.mig is None:
            raise NVMLError_InvalidArgument()
        return h.mig.gpu_instance_id

    @api
    def nvmlDeviceGetComputeInstanceId(h: _Handle) -> int:
        handle_ok(h)
        if h.mig is None:
            raise NVMLError_InvalidArgument()
        return h.mig.compute_instance_id

    def pci(bus_id: str) -> _Struct:
        dom, bus, devfn = bus_id.split(":")
        return _Struct(
            busIdLegacy=bus_id[-12:].encode(),
            domain=int(dom, 16),
            bus=int(bus, 16),
            device=int(devfn.split(".")[0], 16),
            pciDeviceId=0x233010DE,
            pciSubSystemId=0x16C110DE,
            busId=bus_id.encode(),
        )

    @api
    def nvmlDeviceGetPciInfo_v3(h: _Handle) -> _Struct:
        return pci(handle_ok(h).bus_id)

    mod.c_nvmlGpuFabricInfoV_t = c_nvmlGpuFabricInfoV_t  # type: ignore[attr-defined]

    @api
    def nvmlDeviceGetGpuFabricInfoV(h: _Handle, ref: Any) -> int:
        g = handle_ok(h)
        if g.fabric is None:
            raise NVMLError_NotSupported()
        info = ref._obj  # what ctypes.byref points at, as the C function would write it
        cluster, clique, fstate, status = g.fabric
        info.clusterUuid[:] = list(uuid.UUID(cluster).bytes)
        info.cliqueId, info.state, info.status = clique, fstate, status
        return NVML_SUCCESS

    @api
    def nvmlDeviceGetNumaNodeId(h: _Handle) -> int:
        g = handle_ok(h)
        if g.numa is None:
            raise NVMLError_NotSupported()
        return g.numa

    @api
    def nvmlDeviceGetNvLinkState(h: _Handle, link: int) -> int:
        g = handle_ok(h)
        if link >= NVML_NVLINK_MAX_LINKS:
            raise NVMLError_InvalidArgument()
        if not g.nvlinks:
            raise NVMLError_NotSupported()
        return NVML_FEATURE_ENABLED if link in g.nvlinks else NVML_FEATURE_DISABLED

    @api
    def nvmlDeviceGetNvLinkRemotePciInfo(h: _Handle, link: int) -> _Struct:
        g = handle_ok(h)
        if link not in g.nvlinks:
            raise NVMLError_InvalidArgument()
        return pci(g.nvlinks[link][0])

    @api
    def nvmlDeviceGetNvLinkRemoteDeviceType(h: _Handle, link: int) -> int:
        g = handle_ok(h)
        if link not in g.nvlinks:
            raise NVMLError_InvalidArgument()
        return g.nvlinks[link][1]

    @api
    def nvmlDeviceGetComputeRunningProcesses(h: _Handle) -> list[_Struct]:
        g = handle_ok(h)
        return [
            _Struct(pid=p, usedGpuMemory=1 << 30, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
            for p in g.processes
        ]

    @api
    def nvmlEventSetCreate() -> _Struct:
        return _Struct(id=id(events))

    @api
    def nvmlDeviceGetSupportedEventTypes(h: _Handle) -> int:
        return handle_ok(h).events_supported

    @api
    def nvmlDeviceRegisterEvents(h: _Handle, event_types: int, event_set: Any) -> None:
        state["registered"][handle_ok(h).uuid] = event_types

    @api
    def nvmlEventSetWait_v2(event_set: Any, timeout_ms: int) -> _Struct:
        try:
            item = events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError_Timeout() from None
        if isinstance(item, Exception):
            raise item
        return item

    @api
    def nvmlEventSetFree(event_set: Any) -> None:
        return None

    def fire(index: int, event_type: int, data: int = 0) -> None:
        g = gpus[index]
        registered = state["registered"].get(g.uuid, 0)
        if registered & event_type:  # NVML delivers only registered event types
            events.put(
                _Struct(
                    device=_Handle(g),
                    eventType=event_type,
                    eventData=data,
                    gpuInstanceId=0xFFFFFFFF,
                    computeInstanceId=0xFFFFFFFF,
                )
            )

    def fail_wait(exc: Exception) -> None:
        events.put(exc)

    mod.fire = fire  # type: ignore[attr-defined]
    mod.fail_wait = fail_wait  # type: ignore[attr-defined]
    mod.calls = calls  # type: ignore[attr-defined]
    mod.state = state  # type: ignore[attr-defined]
    mod.gpus = gpus  # type: ignore[attr-defined]
    return mod


def hgx_gpus() -> list[FakeGpu]:
    """Eight H100 SXM GPUs on the bus ids of tests/sysfs_tree.hgx_8gpu, all in one NVSwitch
    fabric (each GPU has links to four NVSwitches, as on HGX H100)."""
    buses = []
    for base in (0x16, 0x38, 0x98, 0xB8):
        buses += [f"00000000:{base + 4:02X}:00.0", f"00000000:{base + 5:02X}:00.0"]
    out = []
    for i, bus in enumerate(buses):
        switch_links = {link: (f"00000000:{0x05 + link % 4:02X}:00.0", 2) for link in range(18)}
        out.append(
            FakeGpu(
                uuid=f"GPU-{i:08x}-1111-2222-3333-444455556666",
                bus_id=bus,
                minor=i,
                numa=0 if i < 4 else 1,
                nvlinks=switch_links,
            )
        )
    return out
