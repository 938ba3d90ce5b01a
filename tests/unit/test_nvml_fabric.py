"""The NVML backend's multi-node NVLink domain (GPU fabric info), through the fake pynvml."""

from __future__ import annotations

import dataclasses

import pynvml

from services.nodeagent.backends.nvml import NvmlBackend, fabric_domain
from tests import fake_pynvml
from tests.fake_pynvml import FakeGpu, hgx_gpus

DOMAIN = "7d2f1c4e-0b5a-4e8e-9a51-3c6f0d2b8a10"
COMPLETED = fake_pynvml.NVML_GPU_FABRIC_STATE_COMPLETED


def with_fabric(gpus: list[FakeGpu], fabric: tuple[str, int, int, int] | None) -> list[FakeGpu]:
    return [dataclasses.replace(g, fabric=fabric) for g in gpus]


async def discover(gpus: list[FakeGpu]) -> object:
    mod = fake_pynvml.build(gpus)
    backend = await NvmlBackend.open(node_name="gb200-tray-3", nvml=mod, event_timeout_ms=20)
    try:
        return await backend.discover()
    finally:
        await backend.close()


def test_fake_fabric_struct_matches_the_real_one() -> None:
    assert [f[0] for f in fake_pynvml.c_nvmlGpuFabricInfoV_t._fields_] == [
        f[0] for f in pynvml.c_nvmlGpuFabricInfoV_t._fields_
    ]
    assert fake_pynvml.NVML_GPU_FABRIC_STATE_COMPLETED == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED


async def test_every_gpu_in_one_clique_gives_the_node_its_domain() -> None:
    topo = await discover(with_fabric(hgx_gpus(), (DOMAIN, 5, COMPLETED, 0)))
    dom = topo.nvlink_domain  # type: ignore[attr-defined]
    assert dom is not None and (dom.cluster_uuid, dom.clique_id, dom.key) == (DOMAIN, 5, f"{DOMAIN}/5")


async def test_no_domain_when_unsupported_unfinished_or_mixed() -> None:
    assert (await discover(hgx_gpus())).nvlink_domain is None  # type: ignore[attr-defined]
    in_progress = with_fabric(hgx_gpus(), (DOMAIN, 5, fake_pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, 0))
    assert (await discover(in_progress)).nvlink_domain is None  # type: ignore[attr-defined]
    mixed = with_fabric(hgx_gpus()[:4], (DOMAIN, 5, COMPLETED, 0)) + with_fabric(
        hgx_gpus()[4:], (DOMAIN, 6, COMPLETED, 0)
    )
    assert (await discover(mixed)).nvlink_domain is None  # type: ignore[attr-defined]


def test_fabric_domain_pure() -> None:
    raw = bytes(range(1, 17))
    assert fabric_domain(raw, 2, state=3, status=0).key == "01020304-0506-0708-090a-0b0c0d0e0f10/2"  # type: ignore[union-attr]
    assert fabric_domain(bytes(16), 2, state=3, status=0) is None  # no fabric: zeros
    assert fabric_domain(raw, 2, state=3, status=3) is None  # registration failed
