"""Cleanup verification for GPUs: "no compute process left", checked, never assumed.

The node agent reports ``Cleaned(ok=True)`` only when the applier found every VF back home and
restored *and* no compute process remains on any of the assignment's GPUs. A GPU whose
processes cannot be listed (NVML says the GPU is lost, the driver is wedged) is not clean
either: the failure becomes a problem for that GPU, so the device is marked unhealthy and stays
held (and the cleanup is tried again with back-off), never freed unverified. Each GPU
is asked on its own, so one lost GPU does not hide the verdict on the others.

A *shared* GPU (docs/sharing.md) whose other shares are still in use on the node runs their
processes, which NVML cannot tell from the leaving share's: for it the check is that the GPU
answers, not that it is empty (``busy``). The last share to leave a GPU is checked like a
whole GPU.

A *MIG instance* (docs/sharing.md, "MIG") is checked the same way on its parent GPU: while
other instances of the GPU are in use on the node, their processes are theirs, so the GPU must
only answer; the last instance to leave is checked like a whole GPU. Its problems are named
by the instance's device id (:func:`mig_problems`), not the GPU's, so only that instance is
marked unhealthy.

Every problem names its device first (``"gpu1: ..."``, ``"mlx5_3: ..."``);
:func:`problems_by_device` turns a cleanup's problems into one reason per device, so each
device is marked unhealthy with its own problem. An unverified cleanup is tried again (the node
agent does it) after :func:`retry_delay`: 1 s, doubling, at most 5 minutes apart, until it is
verified or the allocation leaves the node's record.
"""

from __future__ import annotations

from services.nodeagent.backends.base import BackendError, DiscoveryBackend

__all__ = ["gpu_problems", "mig_problems", "problems_by_device", "process_problems", "retry_delay"]

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 300.0


def process_problems(procs: dict[int, list[int]]) -> list[str]:
    """One problem per GPU that still runs compute processes (``"gpu<i>: ..."``)."""
    return [f"gpu{i}: compute processes {pids} still running" for i, pids in sorted(procs.items()) if pids]


async def gpu_problems(
    backend: DiscoveryBackend, indices: list[int], *, busy: frozenset[int] = frozenset()
) -> list[str]:
    """Problems of the GPUs ``indices``; those in ``busy`` (shared GPUs with other shares in
    use) must only answer, their processes are the other shares'."""
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
        if index not in busy:
            problems += process_problems(procs)
    return problems


def mig_problems(problems: list[str], instances: dict[int, list[str]]) -> list[str]:
    """Problems of parent GPUs (``"gpu<i>: ..."``) named by the MIG instances of the
    assignment on them instead (``instances``: GPU index -> instance device ids), one per
    instance; other problems unchanged."""
    out: list[str] = []
    for problem in problems:
        head, sep, rest = problem.partition(": ")
        index = head.removeprefix("gpu")
        devs = instances.get(int(index)) if sep and index.isdigit() and index != head else None
        if devs:
            out.extend(f"{dev}: {rest}" for dev in devs)
        else:
            out.append(problem)
    return out


def problems_by_device(problems: list[str], devices: list[str]) -> dict[str, str]:
    """One reason per device of the assignment (``devices``): its own problems, joined by
    ``"; "``. A problem that names none of them (``"<device>: ..."``) concerns them all."""
    own: dict[str, list[str]] = {}
    shared: list[str] = []
    for problem in problems:
        head, sep, rest = problem.partition(":")
        if sep and head in devices:
            own.setdefault(head, []).append(rest.strip())
        else:
            shared.append(problem)
    reasons = {d: "; ".join(ps) for d, ps in own.items()}
    if shared:
        for d in devices:
            reasons[d] = "; ".join([*own.get(d, []), *shared])
    return reasons


def retry_delay(attempt: int, *, first: float = RETRY_FIRST_S, cap: float = RETRY_MAX_S) -> float:
    """Seconds before cleanup attempt ``attempt + 1`` after ``attempt`` failed ones (≥ 1)."""
    return float(min(cap, first * 2 ** min(max(attempt - 1, 0), 62)))
