"""``tandem gpu-check``: run the NVML backend here and print inventory + health as JSON.

Meant for a machine with an NVIDIA GPU (``make gpu-check``): it opens NVML, discovers the GPUs
(placed in the PCIe tree by sysfs when ``--sysfs-root`` exists, with the RDMA NICs), lists
compute processes per GPU, watches health events for ``--watch`` seconds, and prints one JSON
document. Without NVML it prints one line naming ``libnvidia-ml.so.1`` and the backend options
and exits non-zero — no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

from tools.cli.errors import CliError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "gpu-check", help="run the NVML backend on this machine; print inventory + health JSON"
    )
    p.add_argument("--sysfs-root", default="/sys", help="sysfs to place GPUs and find NICs (default /sys)")
    p.add_argument(
        "--watch",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="seconds to collect health events (default 2)",
    )
    p.add_argument(
        "--ignore-xids",
        default=None,
        metavar="XID,...",
        help="comma-separated application XIDs that do not fail a GPU (default: the NVML backend's list)",
    )
    p.add_argument("--node", default=None, help="node name (default: NODE_NAME or the host name)")
    p.set_defaults(func=_gpu_check)


async def _check(args: argparse.Namespace) -> dict[str, Any]:
    import asyncio

    # Imported here: `tandem --help` must not load the node side (tools/cli/main.py).
    from services.nodeagent.backends.base import BackendError, BackendUnavailable, HealthChange
    from services.nodeagent.backends.host import HostBackend
    from services.nodeagent.backends.nvml import DEFAULT_IGNORED_XIDS, NvmlBackend
    from services.nodeagent.backends.sysfs import SysfsBackend
    from services.nodeagent.health import HealthTracker
    from services.runtime.settings import load_settings

    node = args.node or load_settings("nodeagent").node_name
    if args.ignore_xids is None:
        args.ignore_xids = ",".join(str(x) for x in sorted(DEFAULT_IGNORED_XIDS))
    try:
        ignored = {int(x) for x in args.ignore_xids.split(",") if x.strip()}
    except ValueError as exc:
        raise CliError(f"--ignore-xids: expected comma-separated integers, got {args.ignore_xids!r}") from exc
    try:
        nvml = await NvmlBackend.open(node_name=node, ignored_xids=ignored)
    except BackendUnavailable as exc:
        raise CliError(str(exc)) from exc
    backend: NvmlBackend | HostBackend = nvml
    placement = "nvml only (no sysfs)"
    if await asyncio.to_thread(Path(args.sysfs_root, "bus/pci/devices").is_dir):
        backend = HostBackend(gpus=nvml, nics=SysfsBackend(args.sysfs_root, node_name=node), node_name=node)
        placement = f"sysfs at {args.sysfs_root}"
    try:
        topology = await backend.discover()
        devices = [g.id for g in topology.gpus()] + [n.id for n in topology.nics()]
        tracker = HealthTracker(devices)
        events: list[HealthChange] = []

        async def watch() -> None:
            async for change in backend.health_changes():
                events.append(change)
                if change.device in tracker.state and not change.healthy:
                    tracker.fail(change.device, change.reason, now=time.time())

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(watch(), timeout=args.watch)
        processes = await backend.gpu_processes([g.index for g in topology.gpus()])
    except BackendError as exc:
        raise CliError(str(exc)) from exc
    finally:
        await backend.close()
    return {
        "node": node,
        "backend": backend.name,
        "placement": placement,
        "topology": topology,
        "health": tracker.state,
        "events": events,
        "processes": {f"gpu{i}": pids for i, pids in processes.items()},
    }


def _gpu_check(args: argparse.Namespace) -> int:
    import asyncio

    import msgspec

    report = asyncio.run(_check(args))
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(report).decode(), indent=2) + "\n")
    return 0
