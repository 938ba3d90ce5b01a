"""Crash recovery decisions, pure: state file, real namespaces and allocator records → actions.

After a restart the agent knows three things: its state file (what it had started or finished
applying), which pod network namespaces still exist, and — from the allocator's node record in
KV ``tandem-allocs`` — which requests are still allocated here (``None`` when that could not be
read). :func:`reconcile` decides, per record:

=================  ======================  =============  ====================================
phase in file      still allocated?        pod netns       action
=================  ======================  =============  ====================================
cleaning           any                     any             ``cleanup`` (a release was taken)
applying/applied   no                      any             ``cleanup`` (released while down)
applying           yes / unknown           exists          ``apply`` (finish; steps idempotent)
applying           yes / unknown           gone            ``cleanup`` (pod died mid-apply;
                                                           bring the VF home, report it)
applied            yes / unknown           exists          ``keep``
applied            yes / unknown           gone            ``keep`` (the release will come and
                                                           clean up; the kernel returned the VF)
=================  ======================  =============  ====================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from services.nodeagent.state import AgentState

__all__ = ["Action", "reconcile"]


@dataclass(frozen=True, slots=True)
class Action:
    request_id: str
    action: Literal["apply", "cleanup", "keep"]
    reason: str


def reconcile(
    state: AgentState, *, allocated: set[str] | None, netns_exists: Callable[[str], bool]
) -> list[Action]:
    out: list[Action] = []
    for rid, rec in sorted(state.records.items()):
        alive = bool(rec.netns) and netns_exists(rec.netns)
        if rec.phase == "cleaning":
            out.append(Action(rid, "cleanup", "cleanup was in progress"))
        elif allocated is not None and rid not in allocated:
            out.append(Action(rid, "cleanup", "no longer allocated to this node"))
        elif rec.phase == "applying":
            if alive:
                out.append(Action(rid, "apply", "apply was in progress; pod namespace exists"))
            else:
                out.append(Action(rid, "cleanup", "apply was in progress; pod namespace is gone"))
        else:
            out.append(
                Action(rid, "keep", "applied" + ("" if alive else "; pod namespace gone, awaiting release"))
            )
    return out
