"""Why a placement pairs at a coarser scope than its request asked: the texts of
``Cluster.scope_reason`` (``Assignment.scope_note``, printed by ``tandem submit`` / ``explain``).

The cluster finds the facts — the placement missed its preferred scope; whether reserve
pressure ordered it; where the best achievable scope is now (deciding once more with the
alignment-first order, for a class that chose ``used-first``); else the refusals of the same
request with its scope *required* — and this module words them. Pure: no cluster state.
"""

from __future__ import annotations

from dataclasses import replace

import msgspec

from .placement import SCOPE, Placement, Unschedulable
from .request import Spec

__all__ = ["aligned_order", "better_elsewhere", "limited", "no_node", "reserve", "with_scope_required"]

# At most this many refusal reasons in a note (most common first): a note is one line.
_MOST_REASONS = 3


def aligned_order(spec: Spec) -> Spec:
    """``spec`` with the alignment-first node order. Its own class name, so that it gets a
    signature state of its own (built on first use) and never shares the class's."""
    return replace(
        spec,
        device_class=f"{spec.device_class}\x00alignment-first",
        dc=msgspec.structs.replace(spec.dc, node_order="alignment-first"),
    )


def with_scope_required(spec: Spec) -> Spec:
    """``spec`` with its scope required: its refusals say why no node met the scope."""
    return replace(spec, required=True)


def limited(spec: Spec) -> str:
    """Shares, MIG instances, node selectors: the nodes it may use are a part of the fleet."""
    return f"no node it may use could pair at {spec.scope.wire} now"


def reserve(spec: Spec) -> str:
    return (
        "few servers can still host a large aligned job, so placements that keep them whole "
        f"came first; none of those pairs at {spec.scope.wire}"
    )


def better_elsewhere(spec: Spec, *, node: str, scope: int, used_first: bool) -> str:
    """A better scope was possible on ``node``: because the class chose ``used-first``, or
    (alignment-first) because this allocator replica took a node of its own shard first."""
    if used_first:
        return (
            f"{SCOPE[scope]} pairs were possible on {node}, a server not in use: the class "
            f"{spec.device_class!r} places on servers in use, else on the smallest free one "
            "(node_order: used-first), keeping big servers whole for large aligned jobs; "
            "node_order: alignment-first puts alignment first, as classes do by default"
        )
    return (
        f"{SCOPE[scope]} pairs were possible on {node}, a node another allocator replica "
        "places on first: each replica takes its own nodes while one of them can take a request"
    )


def no_node(spec: Spec, required: Placement | Unschedulable) -> str:
    """No node could pair at the asked scope: the refusals of the request with that scope
    required (``required``), most common first."""
    head = f"no node could pair at {spec.scope.wire} now"
    if not isinstance(required, Unschedulable) or not required.reasons:
        return head
    shown = required.reasons[:_MOST_REASONS]
    text = "; ".join(f"{r.nodes} node{'' if r.nodes == 1 else 's'}: {r.text}" for r in shown)
    more = len(required.reasons) - len(shown)
    return f"{head} ({text}{f'; {more} more reasons' if more > 0 else ''})"
