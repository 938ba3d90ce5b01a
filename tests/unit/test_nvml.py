"""NVML backend against a fake ``pynvml`` built from the real API (tests/fake_pynvml.py)."""

from __future__ import annotations

import asyncio
import types

import pynvml
import pytest

from schemas.messages import DeviceHealth
from services.nodeagent.backends.base import BackendError, BackendUnavailable, HealthChange
from services.nodeagent.backends.nvml import (
    DEFAULT_IGNORED_XIDS,
    GPU_LOST,
    NvmlBackend,
    classify_event,
    gpu_index,
    mig_profile_of,
    nvlink_peers,
)
from services.nodeagent.health import HealthTracker, recover_due
from tests import fake_pynvml
from tests.fake_pynvml import FakeGpu, FakeMig, hgx_gpus

TEST_HELPERS = {"fire", "fail_wait", "calls", "state", "gpus"}


def test_fake_matches_real_pynvml() -> None:
    """Every name the fake offers exists in the installed nvidia-ml-py with the same value."""
    fake = fake_pynvml.build([])
    for name in dir(fake):
        if name.startswith("_") or name in TEST_HELPERS:
            continue
        assert hasattr(pynvml, name), f"fake pynvml offers {name}, the real module has no such name"
        value = getattr(fake, name)
        if isinstance(value, int):
            assert getattr(pynvml, name) == value, name
        if isinstance(value, type) and issubclass(value, Exception) and name != "NVMLError":
            assert issubclass(getattr(pynvml, name), pynvml.NVMLError), name
            assert getattr(pynvml, name)(value.value).value == value.value


def test_default_ignore_list() -> None:
    assert frozenset({13, 31, 43, 45, 68, 109}) == DEFAULT_IGNORED_XIDS


def test_classify_event_pure() -> None:
    kw = {"xid_type": 0x8, "dbe_type": 0x2, "ignored_xids": DEFAULT_IGNORED_XIDS}
    assert classify_event(event_type=0x8, data=13, **kw) is None  # type: ignore[arg-type]
    assert classify_event(event_type=0x8, data=79, **kw) == "XID 79 (GPU has fallen off the bus)"  # type: ignore[arg-type]
    assert classify_event(event_type=0x8, data=150, **kw) == "XID 150"  # type: ignore[arg-type]
    assert classify_event(event_type=0x2, data=0, **kw) == "double-bit ECC error"  # type: ignore[arg-type]
    assert classify_event(event_type=0x1, data=0, **kw) is None  # type: ignore[arg-type]


def test_nvlink_peers_pure() -> None:
    direct = {"a": [("b", 0)], "b": [("a", 0)], "c": [("d", 0)], "d": [("c", 0)]}
    assert nvlink_peers(direct) == {"a": ["b"], "b": ["a"], "c": ["d"], "d": ["c"]}
    fabric = {"a": [("sw", 2)], "b": [("sw2", 2)], "c": []}
    assert nvlink_peers(fabric) == {"a": ["b"], "b": ["a"], "c": []}


async def open_backend(gpus: list[FakeGpu], **kw: object) -> tuple[NvmlBackend, types.ModuleType]:
    mod = fake_pynvml.build(gpus)
    backend = await NvmlBackend.open(node_name="gpu-node-1", nvml=mod, event_timeout_ms=20, **kw)  # type: ignore[arg-type]
    return backend, mod


async def test_discovery_of_hgx_board() -> None:
    backend, mod = await open_backend(hgx_gpus())
    facts = await backend.gpus()
    assert [f.gpu.index for f in facts] == list(range(8))
    g2 = facts[2].gpu
    assert g2.uuid == "GPU-00000002-1111-2222-3333-444455556666"
    assert (g2.model, g2.memory_mib, g2.minor, g2.pci_bus_id) == (
        "NVIDIA H100 80GB HBM3",
        81559,
        2,
        "0000:3c:00.0",
    )
    assert g2.nvlink_peers == [0, 1, 3, 4, 5, 6, 7]  # NVSwitch fabric: everyone
    assert [f.numa for f in facts] == [0, 0, 0, 0, 1, 1, 1, 1]
    topo = await backend.discover()
    assert [r.id for s in topo.sockets for n in s.numa_nodes for r in n.roots] == ["numa0", "numa1"]
    assert len(topo.gpus()) == 8
    assert "nvmlDeviceGetPciInfo_v3" in mod.calls and "nvmlDeviceGetNvLinkRemotePciInfo" in mod.calls  # type: ignore[attr-defined]
    await backend.close()
    assert mod.state["init"] == 0  # type: ignore[attr-defined]


async def test_direct_nvlink_pairs_and_unsupported_numa() -> None:
    gpus = [
        FakeGpu(
            uuid="GPU-a", bus_id="00000000:01:00.0", minor=0, numa=None, nvlinks={0: ("00000000:02:00.0", 0)}
        ),
        FakeGpu(
            uuid="GPU-b", bus_id="00000000:02:00.0", minor=1, numa=None, nvlinks={0: ("00000000:01:00.0", 0)}
        ),
        FakeGpu(uuid="GPU-c", bus_id="00000000:81:00.0", minor=2, numa=None),
    ]
    backend, _ = await open_backend(gpus)
    facts = await backend.gpus()
    assert [f.gpu.nvlink_peers for f in facts] == [[1], [0], []]
    assert [f.numa for f in facts] == [None, None, None]
    await backend.close()


async def test_one_lost_gpu_does_not_hide_the_others() -> None:
    gpus = hgx_gpus()
    gpus[3].lost = True
    backend, _ = await open_backend(gpus)
    facts = await backend.gpus()
    assert [f.gpu.index for f in facts] == [0, 1, 2, 4, 5, 6, 7]
    await backend.close()


async def collect(backend: NvmlBackend, n: int, *, timeout: float = 5.0) -> list[HealthChange]:
    out: list[HealthChange] = []

    async def run() -> None:
        async for change in backend.health_changes():
            out.append(change)
            if len(out) == n:
                return

    await asyncio.wait_for(run(), timeout)
    return out


async def until_registered(mod: types.ModuleType, count: int) -> None:
    for _ in range(200):
        if len(mod.state["registered"]) == count:  # type: ignore[attr-defined]
            return
        await asyncio.sleep(0.01)
    raise AssertionError("events never registered")


async def test_xid_events_with_ignore_list() -> None:
    backend, mod = await open_backend(hgx_gpus())
    task = asyncio.ensure_future(collect(backend, 2))
    await until_registered(mod, 8)
    assert set(mod.state["registered"].values()) == {0x8 | 0x2}  # type: ignore[attr-defined]
    mod.fire(1, pynvml.nvmlEventTypeXidCriticalError, 13)  # type: ignore[attr-defined]  # app fault: ignored
    mod.fire(1, pynvml.nvmlEventTypeSingleBitEccError)  # type: ignore[attr-defined]  # not registered
    mod.fire(2, pynvml.nvmlEventTypeXidCriticalError, 79)  # type: ignore[attr-defined]
    mod.fire(5, pynvml.nvmlEventTypeDoubleBitEccError)  # type: ignore[attr-defined]
    changes = await task
    assert changes == [
        HealthChange("gpu2", False, "XID 79 (GPU has fallen off the bus)"),
        HealthChange("gpu5", False, "double-bit ECC error"),
    ]
    await backend.close()


async def test_configurable_ignore_list() -> None:
    backend, mod = await open_backend(hgx_gpus(), ignored_xids={94})
    task = asyncio.ensure_future(collect(backend, 1))
    await until_registered(mod, 8)
    mod.fire(0, pynvml.nvmlEventTypeXidCriticalError, 94)  # type: ignore[attr-defined]  # ignored now
    mod.fire(0, pynvml.nvmlEventTypeXidCriticalError, 13)  # type: ignore[attr-defined]  # not ignored now
    assert await task == [HealthChange("gpu0", False, "XID 13")]
    await backend.close()


async def test_gpu_lost_during_event_wait() -> None:
    gpus = hgx_gpus()
    backend, mod = await open_backend(gpus)
    task = asyncio.ensure_future(collect(backend, 1))
    await until_registered(mod, 8)
    gpus[6].lost = True
    mod.fail_wait(fake_pynvml.NVMLError_GpuIsLost())  # type: ignore[attr-defined]
    assert await task == [HealthChange("gpu6", False, "GPU is lost (fallen off the bus)")]
    await backend.close()


async def test_a_gpu_lost_a_second_time_is_reported_again() -> None:
    """Issue 9 finding 7: the "lost" suppression lasts one episode. A probe that finds the GPU
    readable again ends it, so the next loss is reported; while it is still lost the probe
    says so and the repeated NVML errors stay quiet."""
    gpus = hgx_gpus()
    backend, mod = await open_backend(gpus)
    changes = backend.health_changes()
    first = asyncio.ensure_future(asyncio.wait_for(anext(changes), 5))
    await until_registered(mod, 8)
    gpus[6].lost = True
    mod.fail_wait(fake_pynvml.NVMLError_GpuIsLost())  # type: ignore[attr-defined]
    assert await first == HealthChange("gpu6", False, GPU_LOST)

    mod.fail_wait(fake_pynvml.NVMLError_GpuIsLost())  # type: ignore[attr-defined]  # NVML repeats it
    mod.fire(1, pynvml.nvmlEventTypeXidCriticalError, 79)  # type: ignore[attr-defined]
    # The repeat was swallowed: the next change is the XID queued after it.
    assert await asyncio.wait_for(anext(changes), 5) == HealthChange(
        "gpu1", False, "XID 79 (GPU has fallen off the bus)"
    )
    assert await backend.probe("gpu6") == GPU_LOST  # still lost: stays unhealthy

    gpus[6].lost = False  # reset and back
    assert await backend.probe("gpu6") is None
    gpus[6].lost = True  # ... and lost again
    mod.fail_wait(fake_pynvml.NVMLError_GpuIsLost())  # type: ignore[attr-defined]
    assert await asyncio.wait_for(anext(changes), 5) == HealthChange("gpu6", False, GPU_LOST)
    await backend.close()
    await changes.aclose()


async def test_every_lost_gpu_is_reported_not_only_the_first() -> None:
    gpus = hgx_gpus()
    backend, mod = await open_backend(gpus)
    task = asyncio.ensure_future(collect(backend, 2))
    await until_registered(mod, 8)
    gpus[2].lost = gpus[5].lost = True
    mod.fail_wait(fake_pynvml.NVMLError_GpuIsLost())  # type: ignore[attr-defined]
    mod.fail_wait(fake_pynvml.NVMLError_GpuIsLost())  # type: ignore[attr-defined]
    assert await task == [HealthChange("gpu2", False, GPU_LOST), HealthChange("gpu5", False, GPU_LOST)]
    await backend.close()


async def test_probe_answers_for_gpus_only() -> None:
    gpus = hgx_gpus()
    backend, _ = await open_backend(gpus)
    assert [gpu_index(d) for d in ("gpu0", "gpu12", "mlx5_0", "gpu", "gpux1")] == [0, 12, None, None, None]
    assert await backend.probe("mlx5_0") is None
    assert await backend.probe("gpu3") is None
    assert await backend.probe("gpu9") == "NVML cannot read the GPU: Invalid Argument"  # no such index
    await backend.close()


async def test_lost_gpu_stays_unhealthy_past_its_clean_period() -> None:
    """Issue 9 finding 7: a lost GPU became "healthy" after the clean period while still lost.
    Recovery probes first: still lost → failed again, clean period restarted; readable → back."""
    gpus = hgx_gpus()
    backend, _ = await open_backend(gpus)
    tracker = HealthTracker([f"gpu{i}" for i in range(8)], clean_period=60)
    gpus[6].lost = True
    tracker.fail("gpu6", GPU_LOST, now=1000.0)

    assert await recover_due(tracker, probe=backend.probe, now=1060.0) == {}  # same reason: no event
    assert tracker.state["gpu6"] == DeviceHealth(healthy=False, reason=GPU_LOST, since=1060.0)
    gpus[6].lost = False
    assert await recover_due(tracker, probe=backend.probe, now=1100.0) == {}  # clean period restarted
    changed = await recover_due(tracker, probe=backend.probe, now=1120.0)
    assert changed == {"gpu6": DeviceHealth(healthy=True, reason="clean for 60s", since=1120.0)}
    await backend.close()


async def test_xid_failure_then_recovery_through_health_tracker() -> None:
    """The event path into the shared HealthTracker: fail, stay out for the clean period,
    come back by itself; a cordon holds until uncordon; other GPUs are never touched."""
    backend, mod = await open_backend(hgx_gpus())
    tracker = HealthTracker([f"gpu{i}" for i in range(8)], clean_period=60)
    task = asyncio.ensure_future(collect(backend, 1))
    await until_registered(mod, 8)
    mod.fire(4, pynvml.nvmlEventTypeXidCriticalError, 48)  # type: ignore[attr-defined]
    (change,) = await task
    assert tracker.fail(change.device, change.reason, now=1000.0) == DeviceHealth(
        healthy=False, reason="XID 48 (double-bit ECC error)", since=1000.0
    )
    assert [d for d, h in tracker.state.items() if not h.healthy] == ["gpu4"]
    assert tracker.tick(now=1059.0) == {}
    recovered = tracker.tick(now=1060.0)
    assert list(recovered) == ["gpu4"] and recovered["gpu4"].healthy
    tracker.cordon("gpu1", "operator: bad fan", now=1100.0)
    assert tracker.tick(now=5000.0) == {}
    assert tracker.state["gpu1"].cordoned
    assert tracker.uncordon("gpu1", now=5001.0) == DeviceHealth(
        healthy=True, reason="uncordoned", since=5001.0
    )
    await backend.close()


async def test_compute_processes_for_cleanup() -> None:
    gpus = hgx_gpus()
    gpus[1].processes = [4242, 17]
    backend, _ = await open_backend(gpus)
    assert await backend.gpu_processes([0, 1]) == {0: [], 1: [17, 4242]}
    gpus[0].lost = True
    with pytest.raises(BackendError, match="gpu0: cannot list compute processes: GPU is lost"):
        await backend.gpu_processes([0])
    await backend.close()


async def test_missing_library_fake() -> None:
    mod = fake_pynvml.build(None, library_present=False)
    with pytest.raises(BackendUnavailable) as err:
        await NvmlBackend.open(node_name="n", nvml=mod)
    msg = str(err.value)
    assert "libnvidia-ml.so.1" in msg and "'simulated'" in msg and "'sysfs'" in msg


async def test_missing_library_real_pynvml() -> None:
    """This machine has no NVIDIA driver: the real pynvml raises NVMLError_LibraryNotFound."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present here; the missing-library path cannot be shown")
    with pytest.raises(BackendUnavailable, match=r"NVML Shared Library Not Found.*libnvidia-ml\.so\.1"):
        await NvmlBackend.open(node_name="n")


async def test_cleanup_verification_per_gpu() -> None:
    """A lost GPU is a cleanup problem for that GPU only; the others get their own verdict."""
    from services.nodeagent.cleanup import gpu_problems

    gpus = hgx_gpus()
    gpus[1].processes = [31337]
    gpus[2].lost = True
    backend, _ = await open_backend(gpus)
    assert await gpu_problems(backend, [0, 1, 2, 3]) == [
        "gpu1: compute processes [31337] still running",
        "gpu2: cannot list compute processes: GPU is lost",
    ]
    assert await gpu_problems(backend, [0, 3]) == []
    await backend.close()


# ---------------------------------------------------------------------------------------------
# MIG discovery


def _mig(uuid: str, profile: str, gi: int, ci: int = 0, mib: int = 9856, *, broken: bool = False) -> FakeMig:
    return FakeMig(
        uuid=uuid,
        profile=profile,
        gpu_instance_id=gi,
        compute_instance_id=ci,
        memory_total=mib * 1024 * 1024,
        broken=broken,
    )


async def test_mig_discovery_mixed_profiles_mode_off_and_not_supported() -> None:
    gpus = hgx_gpus()[:4]
    # GPU 0: MIG on, mixed profiles, with empty slots between them (NOT_FOUND, skipped).
    gpus[0].mig_mode = (1, 1)
    gpus[0].mig_devices = [
        _mig("MIG-aaaa-0001", "3g.40gb", 2, 0, 40192),
        None,
        _mig("MIG-aaaa-0002", "2g.20gb", 3, 0, 19968),
        None,
        _mig("MIG-aaaa-0003", "1g.10gb", 9),
        _mig("MIG-aaaa-0004", "1g.10gb", 10),
    ]
    gpus[1].mig_mode = (0, 0)  # MIG-capable, mode off: a whole GPU
    gpus[2].mig_mode = None  # NOT_SUPPORTED: no MIG at all
    gpus[3].mig_mode = (1, 1)  # MIG on, no instance created yet: never whole, nothing to hand out
    backend, mod = await open_backend(gpus)
    facts = await backend.gpus()
    g0, g1, g2, g3 = (f.gpu for f in facts)
    assert g0.mig_mode is True
    insts = g0.mig_instances
    got = [(m.profile, m.uuid, m.gpu_instance_id, m.compute_instance_id, m.memory_mib) for m in insts]
    assert got == [
        ("3g.40gb", "MIG-aaaa-0001", 2, 0, 40192),
        ("2g.20gb", "MIG-aaaa-0002", 3, 0, 19968),
        ("1g.10gb", "MIG-aaaa-0003", 9, 0, 9856),
        ("1g.10gb", "MIG-aaaa-0004", 10, 0, 9856),
    ]
    assert [d for d, _ in g0.mig_ids()] == ["gpu0-mig2-0", "gpu0-mig3-0", "gpu0-mig9-0", "gpu0-mig10-0"]
    assert (g1.mig_mode, g1.mig_instances) == (False, [])
    assert (g2.mig_mode, g2.mig_instances) == (False, [])
    assert (g3.mig_mode, g3.mig_instances) == (True, [])
    # The parent GPU keeps its own UUID, memory and PCIe place; the topology validates.
    assert g0.uuid == "GPU-00000000-1111-2222-3333-444455556666" and g0.memory_mib == 81559
    topo = await backend.discover()
    assert topo.validate() is topo
    for fn in ("nvmlDeviceGetMigMode", "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetGpuInstanceId"):
        assert fn in mod.calls  # type: ignore[attr-defined]
    await backend.close()


async def test_mig_one_unreadable_instance_is_skipped_not_the_gpu() -> None:
    gpus = hgx_gpus()[:2]
    gpus[0].mig_mode = (1, 1)
    gpus[0].mig_devices = [
        _mig("MIG-bbbb-0001", "1g.10gb", 7),
        _mig("MIG-bbbb-0002", "1g.10gb", 8, broken=True),
        _mig("MIG-bbbb-0003", "1g.10gb", 9),
    ]
    backend, _ = await open_backend(gpus)
    facts = await backend.gpus()
    g0 = facts[0].gpu
    assert g0.mig_mode is True  # still MIG: never handed out whole
    assert [m.uuid for m in g0.mig_instances] == ["MIG-bbbb-0001", "MIG-bbbb-0003"]
    assert [f.gpu.index for f in facts] == [0, 1]
    await backend.close()


async def test_mig_pending_mode_counts_the_current_one() -> None:
    gpus = hgx_gpus()[:2]
    gpus[0].mig_mode = (0, 1)  # enabled after the next GPU reset: whole until then
    gpus[1].mig_mode = (1, 0)  # still MIG until the reset
    gpus[1].mig_devices = [_mig("MIG-cccc-0001", "7g.80gb", 0, 0, 80000)]
    backend, _ = await open_backend(gpus)
    facts = await backend.gpus()
    assert [f.gpu.mig_mode for f in facts] == [False, True]
    assert [m.profile for m in facts[1].gpu.mig_instances] == ["7g.80gb"]
    await backend.close()


def test_mig_profile_from_the_nvml_name() -> None:
    assert mig_profile_of("NVIDIA A100-SXM4-40GB MIG 1g.5gb") == "1g.5gb"
    assert mig_profile_of("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me") == "1g.10gb+me"
    assert mig_profile_of("NVIDIA H100 80GB HBM3") is None
    assert mig_profile_of("NVIDIA H100 MIG weird") is None
