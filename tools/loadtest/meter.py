"""CPU time and peak memory of every process of a run, by role, read from ``/proc``.

Roles are the children's (``allocator`` — replicas summed —, ``inventory``, ``fleet``,
``callout``, ``prometheus``), ``nats`` (every server of the run summed: one in the dev
profile, three in the production profile) and ``harness``: this process with its checker and
its ledger, whose checks are the harness's work. :func:`per_decision` turns CPU seconds into
milliseconds per decision, the figure the issue's targets are stated in.
"""

from __future__ import annotations

import time

from tools.loadtest.procs import Children, cpu_seconds, rss_mb
from tools.loadtest.report import CpuFigures, RssFigures

HARNESS_ROLES = ("checker", "ledger")


def cpu_now(children: Children, nats_pids: list[int]) -> dict[str, float | None]:
    """CPU seconds used so far by each role (see the module docstring)."""
    out: dict[str, float | None] = {"harness": time.process_time()}
    for child in children.children:
        used = cpu_seconds(child.proc.pid) if child.alive else None
        if used is not None:
            role = "harness" if child.role in HARNESS_ROLES else child.role
            out[role] = (out.get(role) or 0.0) + used
    servers = [cpu_seconds(pid) for pid in nats_pids]
    known = [s for s in servers if s is not None]
    out["nats"] = sum(known) if known else None
    return out


def since(now: dict[str, float | None], before: dict[str, float | None]) -> dict[str, float | None]:
    """CPU used between two readings (a role absent before started after it: all of its CPU)."""
    return {k: None if v is None else v - (before.get(k) or 0.0) for k, v in now.items()}


def cpu_figures(values: dict[str, float | None], *, digits: int = 2) -> CpuFigures:
    def get(key: str) -> float | None:
        v = values.get(key)
        return None if v is None else round(v, digits)

    return CpuFigures(
        allocator=get("allocator"),
        inventory=get("inventory"),
        nats=get("nats"),
        fleet=get("fleet"),
        harness=get("harness"),
        callout=get("callout"),
        prometheus=get("prometheus"),
    )


def per_decision(cpu_s: dict[str, float | None], decisions: int) -> tuple[CpuFigures, float | None]:
    """Milliseconds of CPU per decision of each role, and of every process together."""
    if decisions <= 0:
        return CpuFigures(), None
    ms = {k: None if v is None else v * 1000 / decisions for k, v in cpu_s.items()}
    total = sum(v for v in ms.values() if v is not None)
    return cpu_figures(ms, digits=3), round(total, 3)


def rss(children: Children, nats_pids: list[int]) -> RssFigures:
    """Peak resident set of each role: the largest process of the role (a replica, a server)."""
    by_role: dict[str, list[float]] = {}
    for child in children.children:
        if child.peak_rss_mb is not None:
            by_role.setdefault(child.role, []).append(child.peak_rss_mb)
    servers = [mb for mb in (rss_mb(pid) for pid in nats_pids) if mb is not None]

    def peak(role: str) -> float | None:
        return max(by_role[role]) if role in by_role else None

    return RssFigures(
        allocator=peak("allocator"),
        inventory=peak("inventory"),
        nats=max(servers) if servers else None,
        fleet=peak("fleet"),
        callout=peak("callout"),
        prometheus=peak("prometheus"),
    )
