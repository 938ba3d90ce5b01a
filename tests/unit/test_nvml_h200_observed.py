"""The NVML backend against a fake shaped like the one real GPU it has run on.

On 2026-12-04 ``tandem gpu-check`` ran on one NVIDIA H200 passed through to a VM (driver
580.159.04, nvidia-ml-py 13.615.71; docs/nodeagent.md, "What is and is not proven here").
There NVML answered: ``nvmlDeviceGetNumaNodeId`` NOT_SUPPORTED; ``nvmlDeviceGetNvLinkState``
NOT_SUPPORTED on every link index 0..35; ``nvmlDeviceGetGpuFabricInfoV`` success with state 0
(NOT_SUPPORTED), status 0 and a zero cluster UUID; ``nvmlDeviceGetMigMode`` ``[0, 0]``;
supported event types 0xff9f (XID and double-bit ECC registered); the event wait timed out.
The fake below answers the same, and the report must be the one the real run printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import pytest

from services.nodeagent.backends.nvml import NvmlBackend
from tests import fake_pynvml
from tests.fake_pynvml import FakeGpu
from tools.cli import gpu_cmd

# What `tandem gpu-check --sysfs-root /nonexistent --watch 1` printed on the H200 (node "vm").
OBSERVED = {
    "node": "vm",
    "backend": "nvml",
    "placement": "nvml only (no sysfs)",
    "topology": {
        "name": "vm",
        "sockets": [
            {
                "id": 0,
                "numa_nodes": [
                    {
                        "id": 0,
                        "roots": [
                            {
                                "id": "numa0",
                                "gpus": [
                                    {
                                        "index": 0,
                                        "uuid": "GPU-ddce02b2-a8b6-f8b1-a7c5-5625678801f0",
                                        "model": "NVIDIA H200",
                                        "memory_mib": 143771,
                                        "minor": 0,
                                        "pci_bus_id": "0000:00:06.0",
                                    }
                                ],
                            }
                        ],
                    }
                ],
            }
        ],
        "description": "nvml",
    },
    "health": {"gpu0": {}},
    "events": [],
    "processes": {"gpu0": []},
}


def h200_passthrough(processes: list[int] | None = None) -> FakeGpu:
    return FakeGpu(
        uuid="GPU-ddce02b2-a8b6-f8b1-a7c5-5625678801f0",
        bus_id="00000000:00:06.0",
        name="NVIDIA H200",
        minor=0,
        memory_total=150754820096,
        numa=None,  # NOT_SUPPORTED
        nvlinks={},  # every link: NOT_SUPPORTED
        processes=processes or [],
        events_supported=0xFF9F,
        fabric=("00000000-0000-0000-0000-000000000000", 0, 0, 0),  # answered, state NOT_SUPPORTED
        mig_mode=(0, 0),
        mig_slots=0,
    )


def test_h200_facts_as_observed() -> None:
    nvml = fake_pynvml.build([h200_passthrough([495])])
    backend = asyncio.run(NvmlBackend.open(node_name="vm", nvml=nvml, event_timeout_ms=10))  # type: ignore[arg-type]
    [facts] = backend.read_gpus()
    assert facts.numa is None and facts.fabric is None
    assert facts.gpu.nvlink_peers == [] and facts.gpu.mig_mode is False and facts.gpu.mig_instances == []
    assert backend.processes([0]) == {0: [495]}
    assert backend._register_events() == {"GPU-ddce02b2-a8b6-f8b1-a7c5-5625678801f0": 0}
    assert backend._wait_event({}) == []  # the wait timed out
    asyncio.run(backend.close())


def test_gpu_check_report_matches_the_real_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.build([h200_passthrough()]))
    p = argparse.ArgumentParser()
    gpu_cmd.register(p.add_subparsers())
    args = p.parse_args(["gpu-check", "--sysfs-root", "/nonexistent", "--node", "vm", "--watch", "0.3"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out) == OBSERVED
