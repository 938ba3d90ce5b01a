"""Priority preemption: which allocations to evict so that a request can be placed.

When a request of priority ``P`` that may preempt (:func:`may_preempt`: its own
``preemption`` field, else its device class's; ``"lower-priority"``) cannot be placed,
:func:`plan` looks for a node on which evicting some allocations would make room. Only
*eligible* holds are ever victims: held ``preemptible`` (``Cluster.hold``; a decision in
flight, a claim or another preemptor's reservation is not), of priority strictly below ``P``.

The plan is the exact minimum, over every node matching the request's selector and every set
``V`` of eligible holds on that node after whose release the in-node search places the request
(a ``required`` scope met, as always), of:

1. ``len(V)`` — the fewest allocations evicted;
2. the victims' priorities sorted from highest to lowest, compared element by element — the
   highest priority evicted as low as possible, then the next, ...;
3. the placement's in-node quality on the freed node (:class:`.search.Choice` ``key``:
   required scope met, pairs at each scope finer first, NVLink fit) — the best alignment the
   request can get with that eviction;
4. fragmentation (``Choice.frag``);
5. the node name, then the victims' request ids (only to make the answer unique).

Victims on other nodes never help a placement on one node, so sets spanning several nodes
need not be considered; a minimal set never holds a victim whose devices the placement does not
need (without it a smaller set would do, which 1. ranks first).

Cost: only nodes with eligible holds are looked at; on each, one search with every eligible
hold released rules the node out cheaply, then sets are tried by increasing size, never larger
than the best size found so far on any node, and within a size in order of 2. (a set whose
priorities rank behind the best found is not searched). The in-node searches are the cluster's
cached ones, so identical nodes with identical holds cost one search each. A node with ``h``
eligible holds costs at most ``2^h`` searches; nodes hold a few allocations each, and
preemption runs only for requests nothing else can place.

Pure: reads the :class:`~services.allocator.core.cluster.Cluster`, changes no hold. The
caller (the allocator service, ``tandem plan``) evicts the victims and places the request
once their devices are free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import combinations

from schemas.config import DeviceClass
from schemas.messages import AllocationRequest

from .cluster import Cluster, Placement
from .errors import InvalidRequest
from .request import Spec
from .search import Choice

__all__ = ["Preemption", "Victim", "may_preempt", "plan"]


@dataclass(frozen=True, slots=True)
class Victim:
    """One allocation to evict: its request id, its priority and the devices it frees."""

    request_id: str
    priority: int
    devices: tuple[str, ...]


@dataclass(slots=True)
class Preemption:
    """A plan: evict ``victims`` (all on ``placement.node``), then place the request there.

    ``order`` is the plan's rank in the module docstring's order (smaller is better)."""

    placement: Placement
    victims: list[Victim]
    order: tuple[object, ...]

    @property
    def node(self) -> str:
        return self.placement.node


def may_preempt(request: AllocationRequest, classes: Mapping[str, DeviceClass]) -> bool:
    """Whether ``request`` may evict allocations of lower priority (its own ``preemption``,
    else its device class's). Raises InvalidRequest for an unknown class."""
    if request.preemption is not None:
        return request.preemption == "lower-priority"
    dc = classes.get(request.device_class)
    if dc is None:
        raise InvalidRequest(f"request {request.request_id}: unknown device class {request.device_class!r}")
    return dc.preemption == "lower-priority"


def plan(cluster: Cluster, request: AllocationRequest) -> Preemption | None:
    """The best preemption for ``request`` (module docstring), or None when evicting eligible
    allocations cannot make room anywhere. Does not check :func:`may_preempt` (the caller
    does) nor whether the request fits without evicting (call it after ``decide`` failed)."""
    spec = cluster.normalise(request)
    prio = request.priority
    # (len, priorities desc, quality, frag, node, ids) of the best so far, with its parts.
    best: tuple[tuple[object, ...], str, Choice, list[Victim]] | None = None
    best_size = None
    for name, holds in sorted(cluster.preemptible().items()):
        eligible = sorted(
            (Victim(rid, p, devs) for rid, (devs, p) in holds.items() if p < prio and devs),
            key=lambda v: (-v.priority, v.request_id),
        )
        if not eligible or not cluster.matches(name, spec):
            continue
        if not isinstance(cluster.evaluate_without(name, spec, [v.request_id for v in eligible]), Choice):
            continue  # even evicting every eligible allocation does not make room here
        top = len(eligible) if best_size is None else min(best_size, len(eligible))
        for size in range(1, top + 1):
            found = _best_of_size(cluster, name, spec, eligible, size, best)
            if found is not None:
                best = found
                best_size = size
                break
    if best is None:
        return None
    order, name, choice, victims = best
    placement = cluster.placement_on(name, choice)
    return Preemption(placement=placement, victims=victims, order=order)


def _best_of_size(
    cluster: Cluster,
    name: str,
    spec: Spec,
    eligible: list[Victim],
    size: int,
    best: tuple[tuple[object, ...], str, Choice, list[Victim]] | None,
) -> tuple[tuple[object, ...], str, Choice, list[Victim]] | None:
    """The best set of ``size`` victims on ``name`` if it ranks before ``best``, else None."""
    sets = sorted(
        combinations(eligible, size),
        key=lambda vs: (tuple(v.priority for v in vs), tuple(v.request_id for v in vs)),
    )
    found = None
    current = best
    for victims in sets:
        prios = tuple(v.priority for v in victims)  # highest first: ``eligible`` is in that order
        if current is not None:
            head = current[0]
            # Sets come in order of (size, priorities): once this one ranks behind the best
            # on those alone, so do all the rest.
            if (size, prios) > (head[0], head[1]):
                break
        res = cluster.evaluate_without(name, spec, [v.request_id for v in victims])
        if not isinstance(res, Choice):
            continue
        order: tuple[object, ...] = (
            size,
            prios,
            res.key,
            res.frag,
            name,
            tuple(sorted(v.request_id for v in victims)),
        )
        if current is None or order < current[0]:
            current = found = (order, name, res, list(victims))
    return found
