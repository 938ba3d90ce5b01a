"""Priority preemption: which allocations to evict so that a request can be placed.

The step after a decision that found no node (the PostFilter): when a request of priority
``P`` that may preempt (``Spec.preempt_below`` is ``P``: its own ``preemption`` field, else its
device class's, is ``"lower-priority"``) cannot be placed, :func:`plan` looks for a node on
which evicting some allocations would make room. It works on the request as the failed
decision resolved it (``Unschedulable.spec``): the request is resolved once, at the door. Only
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
5. the node name, then which of the node's holds (only to make the answer unique; holds
   alike in priority and devices are interchangeable, the smallest request id is named).

Victims on other nodes never help a placement on one node, so sets spanning several nodes
need not be considered; a minimal set never holds a victim whose devices the placement does not
need (without it a smaller set would do, which 1. ranks first).

How it stays cheap — every step keeps the minimum exact:

* **Alike nodes once.** The cluster keeps the nodes with preemptible holds grouped by their
  *view* (:meth:`Cluster.preemption_groups`: hardware, blocked devices, each preemptible
  hold's priority and devices), maintained lazily as holds change. For a request of priority
  ``P`` holds of priority >= ``P`` count as blocked; nodes whose views then agree offer the
  same sets with the same results, and the first of them by name wins every tie, so only it
  is searched.
* **Each view's best set is cached** per request shape (``spec.key``) for the cluster's
  lifetime: a view is a pure function of the hardware and the masks, so its answer never goes
  stale; a plan for a shape seen before reads the cache except for views that changed.
* **Bounds.** Views are visited in order of their lowest eligible priority: once even one
  victim of that priority ranks behind the best found, every later view does too (stop). A
  view is searched only if its bound — one victim of its lowest priority, with the alignment
  reached when *every* eligible hold is evicted (more free devices never make the in-node
  optimum worse) — does not rank behind the best; that same search rules out views where
  nothing helps.
* **Within a view**, sets are tried by increasing size, stopping at the first size that has
  one, and within a size in order of 2., stopping once the priorities rank behind the best
  set of that size. The holds of one GPU only are taken together (:func:`_units`): on a GPU
  held as shares, evicting some of its shares frees nothing, so a minimal set has all of
  them or none (a whole hold of one GPU is such a unit of one). A view with ``u`` units costs
  at most ``2^u`` in-node searches (the cluster's cached ones); nodes hold a few
  allocations each, and a GPU's many shares are one unit.

GPU shares: a preemptible hold of shares is a victim like a whole one and counts as one
allocation in 1.; its GPU counts as held, so a placement gets that GPU only with every share on
it evicted (a share the preemptor may not evict keeps the GPU). A request *for* shares or MIG
instances does not preempt (``Spec.preempt_below`` is None for it), and a hold of MIG instances is
never a victim.

Preemption runs only for requests that may preempt and that nothing else can place
(``docs/benchmarks.md``, "Preemption (core)", for its cost at 1,000 and 10,000 nodes).

Pure: reads the node registry (the :class:`~services.allocator.core.cluster.Cluster`) through
:class:`Registry`, the few questions this step asks of it, and changes no hold. The caller
(the allocator service, ``tandem plan``) evicts the victims and places the request once their
devices are free.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import combinations
from typing import Any, NamedTuple, Protocol

from .model import Shape
from .placement import Placement
from .request import Spec
from .search import Choice, Refusal
from .victims import Hold, PreemptionView

__all__ = ["Preemption", "Registry", "Victim", "plan"]


class Registry(Protocol):
    """What the preemption step reads of the node registry (``Cluster`` is one)."""

    def preemption_groups(self) -> Mapping[PreemptionView, Mapping[str, None]]: ...
    def matches(self, name: str, spec: Spec) -> bool: ...
    def shape_of(self, name: str) -> Shape: ...
    def evaluate_free(self, spec: Spec, shape: Shape, mask: int) -> Choice | Refusal: ...
    def placement_of(self, name: str, choice: Choice, spec: Spec, *, candidates: int = 1) -> Placement: ...
    def preemptible_holds(self, name: str) -> dict[str, tuple[int, int]]: ...
    def holds(self, name: str) -> dict[str, frozenset[str]]: ...


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


def plan(cluster: Registry, spec: Spec) -> Preemption | None:
    """The best preemption for the resolved request ``spec`` (module docstring; the failed
    decision's ``Unschedulable.spec``), or None when evicting eligible allocations cannot make
    room anywhere or the request may not preempt (``spec.preempt_below`` is None). Does not
    check whether the request fits without evicting (call it after ``decide`` failed)."""
    prio = spec.preempt_below
    if prio is None:
        return None
    # Pass 1: each group of nodes alike (Cluster.preemption_groups) as this request sees it —
    # holds of its priority or above are as good as protected — and, per distinct view, the
    # first node by name (which wins every tie, so the others need no search).
    first: dict[PreemptionView, str] = {}
    for (shape_id, blocked, holds), members in cluster.preemption_groups().items():
        eligible = tuple(h for h in holds if h.priority < prio and h.slots)
        if not eligible:
            continue
        for p, m in holds:
            if not (p < prio and m):
                blocked |= m
        if spec.selector:
            names = [n for n in members if cluster.matches(n, spec)]
            if not names:
                continue
            name = min(names)
        else:
            name = min(members)
        view = PreemptionView(shape_id, blocked, eligible)
        if view not in first or name < first[view]:
            first[view] = name
    # Pass 2: each distinct view's own best set (cached: views outlive plans, only the nodes
    # that changed get new ones), then the best over the views. Views are taken in order of
    # their lowest eligible priority; a view is searched only if its bound — one victim of
    # that priority, and the alignment with every eligible hold evicted (no set does better:
    # more free devices never make the best placement worse) — does not rank behind the best.
    cache = _CACHES.get(cluster)
    if cache is None:
        cache = _CACHES[cluster] = {}
    skey = spec.key
    best: _Plan | None = None
    for view, name in sorted(first.items(), key=_lowest_first):
        eligible = view.holds
        key = (skey, view)
        if key in cache:
            own = cache[key]
        else:
            lowest = (1, (eligible[-1].priority,))
            if best is not None and lowest > best.order[:2]:
                break  # every later view's lowest priority is as high or higher
            shape = cluster.shape_of(name)
            every = cluster.evaluate_free(spec, shape, shape.effective_free(view.blocked))
            if not isinstance(every, Choice):
                own = cache[key] = None
                continue
            if best is not None and (*lowest, every.key) > best.order[:3]:
                continue
            if len(cache) >= _CACHE_MAX:
                cache.clear()
            own = cache[key] = _best_in_view(cluster, spec, shape, view.blocked, eligible)
        if own is None:
            continue
        size, prios, quality, frag, chosen = own.rank
        order = (size, prios, quality, frag, name, chosen)
        if best is None or order < best.order:
            best = _Plan(order, name, own.choice, eligible, chosen)
    if best is None:
        return None
    victims = _victims(cluster, best.node, [best.eligible[i] for i in best.chosen])
    return Preemption(
        placement=cluster.placement_of(best.node, best.choice, spec), victims=victims, order=best.order
    )


def _lowest_first(item: tuple[PreemptionView, str]) -> tuple[int, str]:
    """Views in order of their lowest eligible priority, then by node."""
    view, name = item
    return (view.holds[-1].priority, name)


class _ViewBest(NamedTuple):
    """A view's best set: ``rank`` = (size, priorities, quality, fragmentation, chosen
    indexes into the view's eligible holds), smaller first; the placement it leaves room for."""

    rank: tuple[Any, ...]
    choice: Choice


class _Plan(NamedTuple):
    """The best plan so far: its rank in the module docstring's order, and what it evicts."""

    order: tuple[Any, ...]
    node: str
    choice: Choice
    eligible: tuple[Hold, ...]
    chosen: tuple[int, ...]


# Per cluster: (request key, view) -> that view's best set, or None (see plan).
_CACHES: weakref.WeakKeyDictionary[Registry, dict[tuple[object, ...], _ViewBest | None]] = (
    weakref.WeakKeyDictionary()
)
_CACHE_MAX = 50_000


def _best_in_view(
    cluster: Registry, spec: Spec, shape: Shape, blocked: int, eligible: tuple[Hold, ...]
) -> _ViewBest | None:
    """The best set of eligible holds to evict on a node with this view, or None: sets by
    increasing size, and within a size in order of priorities (highest first), stopping at
    the first size that has one and, within it, once the priorities rank behind the best."""
    if not isinstance(cluster.evaluate_free(spec, shape, shape.effective_free(blocked)), Choice):
        return None  # even evicting every eligible allocation does not make room here
    n = len(eligible)
    units = _units(eligible, blocked, shape.gpu_all)
    singles = sorted(unit[0] for unit in units if len(unit) == 1)
    plain = len(singles) == len(units)  # no GPU of several shares (the common case)
    for size in range(1, n + 1):
        # ``eligible`` is in order of priority, highest first, and each set lists its holds
        # in that order, so its priorities are sorted too.
        pool = combinations(singles, size) if plain else _sets_of_size(units, size)
        sets = sorted(pool, key=lambda ix: tuple(eligible[i].priority for i in ix))
        found: _ViewBest | None = None
        for ix in sets:
            prios = tuple(eligible[i].priority for i in ix)
            if found is not None and prios > found.rank[1]:
                break
            mask = blocked
            for i in range(n):
                if i not in ix:
                    mask |= eligible[i].slots
            res = cluster.evaluate_free(spec, shape, shape.effective_free(mask))
            if not isinstance(res, Choice):
                continue
            order = (size, prios, res.key, res.frag, ix)
            if found is None or order < found.rank:
                found = _ViewBest(order, res)
        if found is not None:
            return found
    return None  # pragma: no cover - evicting all made room above


def _units(eligible: tuple[Hold, ...], blocked: int, gpu_all: int) -> list[tuple[int, ...]]:
    """The eligible holds (indexes) in the units a minimal set takes whole: the holds whose
    slots are one GPU alone, by that GPU (on a shared GPU, some of its shares evicted free
    nothing; a GPU that ``blocked`` keeps frees nothing at all, so its holds are left out),
    and every other hold on its own."""
    by_gpu: dict[int, list[int]] = {}
    units: list[tuple[int, ...]] = []
    for i, (_, mask) in enumerate(eligible):
        if mask & (mask - 1) == 0 and mask & gpu_all:  # exactly one slot, and it is a GPU
            if not mask & blocked:
                by_gpu.setdefault(mask, []).append(i)
        else:
            units.append((i,))
    units.extend(tuple(ix) for ix in by_gpu.values())
    return units


def _sets_of_size(units: list[tuple[int, ...]], size: int) -> list[tuple[int, ...]]:
    """Every union of ``units`` with exactly ``size`` holds, as sorted hold indexes."""
    out: list[tuple[int, ...]] = []

    def extend(start: int, left: int, taken: tuple[int, ...]) -> None:
        if left == 0:
            out.append(tuple(sorted(taken)))
            return
        for u in range(start, len(units)):
            if len(units[u]) <= left:
                extend(u + 1, left - len(units[u]), taken + units[u])

    extend(0, size, ())
    return out


def _victims(cluster: Registry, name: str, chosen: list[Hold]) -> list[Victim]:
    """The holds on ``name`` behind the chosen (priority, slots) entries."""
    holds = cluster.preemptible_holds(name)
    devices = cluster.holds(name)
    out: list[Victim] = []
    taken: set[str] = set()
    for entry in chosen:
        rid = min(r for r, h in holds.items() if h == entry and r not in taken)
        taken.add(rid)
        out.append(Victim(rid, entry.priority, tuple(sorted(devices[rid]))))
    return out
