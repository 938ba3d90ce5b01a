"""Cleanup verification for GPUs: "no compute process left", checked, never assumed.

The node agent reports ``Cleaned(ok=True)`` only when the applier found every VF back home and
restored *and* no compute process remains on any of the assignment's GPUs. A GPU whose
processes cannot be listed (NVML says the GPU is lost, the driver is wedged) is not clean
either: the failure becomes a problem for that GPU, so the device is marked unhealthy and stays
held, instead of the release being retried forever or the GPU being freed unverified. Each GPU
is asked on its own, so one lost GPU does not hide the verdict on the others.
"""

from __future__ import annotations

from services.nodeagent.backends.base import BackendError, DiscoveryBackend

__all__ = ["gpu_problems", "process_problems"]


def process_problems(procs: dict[int, list[int]]) -> list[str]:
    """One problem per GPU that still runs compute processes (``"gpu<i>: ..."``)."""
    return [f"gpu{i}: compute processes {pids} still running" for i, pids in sorted(procs.items()) if pids]


async def gpu_problems(backend: DiscoveryBackend, indices: list[int]) -> list[str]:
    problems: list[str] = []
    for index in indices:
        try:
            procs = await backend.gpu_processes([index])
        except BackendError as exc:
            text = str(exc)
            prefix = f"gpu{index}: "
            problems.append(
                text if text.startswith(prefix) else f"{prefix}cannot verify compute processes: {text}"
            )
            continue
        problems += process_problems(procs)
    return problems
