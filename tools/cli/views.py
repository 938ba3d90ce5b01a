"""How the NATS commands show records: JSON or YAML documents, ages, device lists in short,
a GPU share's size, what a request asks, and the assignment tables.

Pure functions of records and numbers (and :func:`emit`, which prints a document), shared
by :mod:`.request_rows`, :mod:`.submit`, :mod:`.explain`, :mod:`.devices`, :mod:`.status` and
the demo, so a share or a MIG instance reads the same in every table.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from schemas.messages import AssignedGpu, Assignment
from tools.cli.workloads import plural


def emit(data: Any, fmt: str) -> None:
    """``data`` (builtins) as JSON or YAML on stdout."""
    if fmt == "json":
        print(json.dumps(data, indent=2, sort_keys=False))
    else:
        import yaml

        sys.stdout.write(yaml.safe_dump(data, sort_keys=False, default_flow_style=False))


def age(seconds: float) -> str:
    """kubectl's way: 42s, 7m, 3h, 5d."""
    s = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size * (2 if unit != "m" else 1):
            return f"{s // size}{unit}"
    return f"{s}s"


def short(text: str, width: int = 70) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def compact(devices: list[str]) -> str:
    """Device ids in short: ``gpu0-3,6 mlx5_0,1`` for gpu0..gpu3, gpu6, mlx5_0, mlx5_1."""
    groups: dict[str, list[int]] = {}
    other: list[str] = []
    for dev in devices:
        m = re.fullmatch(r"(.*?)(\d+)", dev)
        if m is None:
            other.append(dev)
        else:
            groups.setdefault(m.group(1), []).append(int(m.group(2)))
    parts = []
    for prefix, numbers in groups.items():
        numbers = sorted(set(numbers))
        runs: list[str] = []
        start = prev = numbers[0]
        for n in [*numbers[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            runs.append(f"{start}-{prev}" if prev > start + 1 else ",".join(map(str, range(start, prev + 1))))
            if n is not None:
                start = prev = n
        parts.append(prefix + ",".join(runs))
    return " ".join(parts + other)


def without_id(reason: str, rid: str) -> str:
    """A reason without the ``request <id>: `` the allocator puts in front of some."""
    return reason.removeprefix(f"request {rid}: ")


def trace_id(traceparent: str) -> str:
    parts = traceparent.split("-")
    return parts[1] if len(parts) >= 4 else ""


ASSIGNMENT_HEADERS = ["pod", "node", "gpu", "nic", "alignment"]


def gpu_label(gpu: AssignedGpu) -> str:
    """A GPU as the assignment tables show it: ``4``, a share ``4 (20480 MiB, 25 %)``, a MIG
    instance ``1 (MIG 1g.10gb gpu1-mig9-0)``."""
    if gpu.mig is not None:
        return f"{gpu.index} (MIG {gpu.mig.profile} {gpu.mig.device})"
    if gpu.shared:
        return f"{gpu.index} ({share_size(gpu.memory_mib, gpu.cores_percent)})"
    return str(gpu.index)


def assignment_rows(assignments: list[Assignment]) -> list[list[str]]:
    """One row per GPU/NIC pair (pod and node on the first row of each pod); GPUs without a
    NIC of their own (GPU-only pods) are listed together on one row. A shared GPU shows the
    share's size, a MIG instance its profile and id."""
    rows: list[list[str]] = []
    for a in assignments:
        first = [f"{a.pod.namespace}/{a.pod.name}", a.node]
        by_index = {g.index: gpu_label(g) for g in a.gpus}
        paired = {p.gpu for p in a.pairs}
        lines = [[by_index.get(p.gpu, str(p.gpu)), p.nic, p.scope] for p in a.pairs]
        lonely = [gpu_label(g) for g in a.gpus if g.index not in paired]
        if lonely:
            lines.append([", ".join(lonely) if any(" " in x for x in lonely) else ",".join(lonely), "-", "-"])
        for i, line in enumerate(lines or [["-", "-", "-"]]):
            rows.append((first if i == 0 else ["", ""]) + line)
    return rows


def share_size(memory_mib: int | None, cores_percent: int | None) -> str:
    """``20480 MiB, 25 %`` (what a share asked; 0 or None: not limited)."""
    parts = [f"{memory_mib} MiB" if memory_mib else "", f"{cores_percent} %" if cores_percent else ""]
    return ", ".join(p for p in parts if p) or "no limit"


def asks_text(
    gpus: int,
    rdma: int,
    *,
    memory_mib: int | None = None,
    cores_percent: int | None = None,
    mig_profile: str | None = None,
) -> str:
    """``2 GPUs + 2 NICs``, ``1 GPU share (20480 MiB, 25 % of each GPU) + 0 NICs``,
    ``2 MIG instances 1g.10gb + 1 NIC``."""
    if mig_profile is not None:
        what = f"{plural(gpus, 'MIG instance')} {mig_profile}"
    elif memory_mib is not None or cores_percent is not None:
        what = f"{plural(gpus, 'GPU share')} ({share_size(memory_mib, cores_percent)} of each GPU)"
    else:
        what = plural(gpus, "GPU")
    return f"{what} + {plural(rdma, 'NIC')}"
