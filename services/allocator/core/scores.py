"""The node order: which of the nodes that can take a request gets it, as named score terms.

A decision ranks nodes by one key, smaller first (:meth:`NodeOrder.order`; the index's heaps
are ordered by it, :mod:`.cluster`). Its terms, most significant first:

1. **shard preference** — with several allocator replicas, a replica ranks the nodes of its
   own shard before every other node (``Cluster.decide(..., prefer_shard=)``). It is a tier,
   not a field of the key below: a field would put every other shard's groups into the heap
   and search them, while the other shards' holds are applied to a replica's core only when
   something looks at them (services/allocator/readmodel.py, ``catch_up``). So the own shard
   is decided first (the nodes of other shards refused by one memoized check per hardware
   id, as a node selector is), and only when it has no room are the others brought up to date
   and decided, taking the *last* of equally good nodes: their owner takes the first, and both
   taking the same one made every such decision a compare-and-set conflict
   (services/allocator/replicas.py);
2. **reserve pressure** (``binpack`` only) — see :class:`NodeOrder` and :meth:`pressure`;
3. the *cross-node* part of the placement quality (:func:`.search.cross_key`): requested
   scope met, pairs within the requested scope and each coarser one, NVLink fit; then, for a
   GPU-only (NIC-only) request, fewer free NICs (GPUs) on the node
   (:func:`.search.one_sided_waste`). Alignment finer than requested only orders placements
   within a node, so a ``numa`` request does not take a fresh node for a free switch pair;
4. **binpack / spread** — ``binpack``: among equally aligned nodes a ``preferred`` request
   does not open a completely free server while a used one can take it
   (:func:`.search.fresh_cost`; the default ``node_order: alignment-first``); a class with
   ``node_order: used-first`` puts this ahead of 3. instead (a used node whatever its scope,
   among free servers the smallest: fewer refusals near full, weaker pairs; docs/benchmarks.md,
   "Node order", measures both); then the less capable server
   (``Shape.aligned``: GPUs that can pair with a NIC on their own PCIe switch; then GPU
   count), so that small jobs use the aligned slots of weaker servers and the servers that
   can host large aligned jobs stay whole; then fragmentation (the whole switches / NUMA
   nodes / NVLink partitions the placement breaks) and the fullest node (fewest free GPUs,
   then NICs), then the hardware (shape) registered first — not the labels, so that grouping
   by a label never reorders nodes; ``spread``: the emptiest node, then fragmentation;
5. the full in-node quality (finer pairs win ties), then first registered.

Quality comes before node policy: a half-empty node with switch-aligned pairs beats a nearly
full node that could only align at NUMA level, and on an empty mixed cluster a 2+2 request
takes a DGX, both pairs on their switches, not a PCIe box across its root complex (issue 26,
item 8) — except under reserve pressure, and except for a class with ``node_order:
used-first``, for which ``binpack`` does not open a completely free node for a ``preferred``
request while a used one can take it. Opening well-aligned servers for small jobs breaks big
servers that large aligned jobs need: measured as more refusals near full
(docs/benchmarks.md, "Node order"); reserve pressure is what bounds that.

Where to add a rule: a new term here, in :meth:`NodeOrder.order`, measured with
``bench.run`` ``--quality`` (docs/benchmarks.md).
"""

from __future__ import annotations

import math

from .index import GroupKey
from .nodes import Hardware
from .request import Spec
from .search import Choice, Refusal, capacity_cost, cross_bound, fresh_cost
from .shares import share_bound, slot_bits

__all__ = ["DEFAULT_RESERVE", "NodeOrder", "OrderKey"]

# Share of the nodes that can host the largest aligned job which binpack tries to keep able to
# host it (see NodeOrder.pressure); measured in docs/benchmarks.md.
DEFAULT_RESERVE = 0.02

OrderKey = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]

_NO_FRAG = (0, 0, 0, 0, 0)  # the least fragmentation: a lower bound of Choice.frag


class NodeOrder:
    """The node order of one cluster, and the reserve it keeps.

    Reserve pressure (``binpack`` only). Alignment-first placement keeps small NIC jobs on
    the servers that can align them, which under heavy load are exactly the servers the large
    aligned jobs (8 GPUs + 8 NICs on PCIe switches) need: measured in ``docs/benchmarks.md``,
    that made Tandem refuse more large jobs at 90-95 % utilisation than a GPU-first allocator.
    So the order keeps a *reserve*: ``K`` is the largest aligned job (``Shape.aligned``) that
    at least ``1 / reserve`` nodes can host when free, and while fewer than ``ceil(reserve x
    those nodes)`` can host it now (``Shape.aligned_free``), every binpack decision orders
    nodes by :func:`.search.capacity_cost` first (how far the largest fully aligned job the
    node could take drops, buddy-style: using a partial unit costs 0, breaking a node's last
    4+4 or 8+8 unit costs 4 or 8), then by alignment, then fullest node, hardware registered
    first, and fragmentation. A ``preferred`` request may then get a ``pcie-root`` or
    ``numa`` pair on a used server instead of breaking an aligned unit; a ``required`` one is
    still never placed below its scope. In-node placement is the same exact optimum in both
    orders. With the default reserve (2 %) a fleet needs 50 servers of the largest aligned
    kind before any is held in reserve; smaller clusters always use the order without
    pressure (the class's ``node_order``). Each signature keeps one heap per order (the
    pressure flag is part of its key), so switching costs a replay, not a rebuild.

    ``hw``: the cluster's hardware ids (the list itself, shared: the registry appends to it).
    """

    __slots__ = ("_aligned_now", "_capable", "_reserve_level", "binpack", "hw", "node_policy", "reserve")

    def __init__(self, hw: list[Hardware], *, node_policy: str, reserve: float) -> None:
        self.hw = hw
        self.node_policy = node_policy
        self.binpack = node_policy == "binpack"
        self.reserve = reserve
        # Nodes per shape capability (Shape.aligned) and per current aligned capacity
        # (Shape.aligned_free of the free mask); the reserve level (K, reserve nodes), cached.
        self._capable: dict[int, int] = {}
        self._aligned_now: dict[int, int] = {}
        self._reserve_level: tuple[int, int] | None = None

    def order(
        self, spec: Spec, gkey: GroupKey, status: Choice | Refusal | None, *, pressure: bool
    ) -> OrderKey:
        """The key of a group (its nodes all rank the same). For binpack: alignment, then the
        less capable server, fragmentation before fullness (packing that breaks no whole
        switch / partition first); under reserve pressure capacity cost before alignment,
        then fullness. For spread: alignment, emptiness, fragmentation. ``status`` not a
        Choice: a lower bound (the group is not searched yet)."""
        hw, group_mask = gkey
        shape = self.hw[hw].shape
        mask = slot_bits(shape, group_mask)
        free_g = (mask & shape.gpu_all).bit_count()
        free_n = (mask & shape.pf_all).bit_count()
        exact = isinstance(status, Choice)
        if pressure:
            # Reserve pressure: capacity cost, then alignment, then fullness and a fixed
            # hardware order (first-fit: the same kinds of server absorb the small jobs).
            if isinstance(status, Choice):
                cost = capacity_cost(shape, mask, status)
                key = (cost, *status.cross, free_g, free_n, shape.id, *status.frag)
                return (key, (), (), status.key)
            return ((0, *cross_bound(spec)), (), (), ())
        if isinstance(status, Choice):
            key, frag, full = status.cross, status.frag, status.key
        elif spec.shared:
            # A share search is costlier than a whole-GPU one (its candidates vary with the
            # share usage): a tight bound, so that few groups are searched (see .shares).
            key, frag, full = share_bound(shape, group_mask, spec, node_policy=self.node_policy), _NO_FRAG, ()
            exact = True  # the bound's fragmentation part is a valid (zero) bound too
        else:
            key, frag, full = cross_bound(spec), (), ()
        if self.binpack:
            fresh = fresh_cost(shape, mask, spec)
            # alignment-first (default): the best scope anywhere, used nodes among equals.
            # used-first (a class's choice): a used node that can take it, whatever its scope,
            # and the smallest free server otherwise, keep the big servers whole for large
            # aligned jobs (fewer refusals near full: docs/benchmarks.md, "Node order").
            key = (fresh, *key) if spec.dc.node_order == "used-first" else (*key, fresh)
            # Among equal placements the less capable server first (fewer GPUs that can pair
            # with a NIC on their own switch, then fewer GPUs): the servers that can host the
            # big aligned jobs stay whole for them.
            size_frag = (shape.aligned, shape.n_gpus, *frag) if exact else (shape.aligned, shape.n_gpus)
            return (key, size_frag, (free_g, free_n, shape.id), full)
        return (key, (-free_g, -free_n), frag, full)

    # -- reserve pressure ------------------------------------------------------------------

    def count_capable(self, shape_aligned: int, delta: int) -> None:
        """A node whose shape can align ``shape_aligned`` pairs joins (+1) or leaves (-1) the
        fleet: the reserve level changes."""
        if shape_aligned <= 0:
            return
        left = self._capable.get(shape_aligned, 0) + delta
        if left:
            self._capable[shape_aligned] = left
        else:
            del self._capable[shape_aligned]
        self._reserve_level = None

    def count_capacity(self, gkey: GroupKey, delta: int) -> None:
        """A node enters (+1) or leaves (-1) whole-GPU group ``gkey``: count its aligned
        capacity now. Hot path (every move of a node)."""
        shape = self.hw[gkey[0]].shape
        if shape.aligned <= 0:
            return
        now = shape.aligned_free(slot_bits(shape, gkey[1]))
        left = self._aligned_now.get(now, 0) + delta
        if left:
            self._aligned_now[now] = left
        else:
            del self._aligned_now[now]

    def pressure(self) -> bool:
        """Is the reserve of nodes that can take the largest aligned job below its target?
        Always false for ``spread``.

        ``K`` is the largest aligned job size (``Shape.aligned``: GPU/NIC pairs on shared PCIe
        switches) that at least ``1 / reserve`` nodes can host when free, so that the reserve
        is at least one node: the largest job a real part of the fleet, not one odd server, is
        built for. The target is ``ceil(reserve x nodes able to host K)``; the count is the
        nodes whose free devices can host K now (``Shape.aligned_free``)."""
        if not self.binpack or self.reserve <= 0.0:
            return False
        level = self._reserve_level
        if level is None:
            level = (0, 0)
            able = 0
            for cap in sorted(self._capable, reverse=True):
                able += self._capable[cap]
                if able * self.reserve >= 1.0 - 1e-9:
                    level = (cap, math.ceil(able * self.reserve - 1e-9))
                    break
            self._reserve_level = level
        k, target = level
        if k == 0:
            return False
        have = 0
        for now, n in self._aligned_now.items():
            if now >= k:
                have += n
                if have >= target:
                    return False
        return True
