"""The best-fit index of shared GPUs: one-GPU share requests decided without a signature.

Why. A share request's in-node result and node order depend on its size (memory, compute), so
through the share index (:mod:`.plugins.shares`, :mod:`.shares`) every distinct size is a signature
of its own, and every signature replays every change of the share index since its last
decision: the work grew with (distinct sizes x changes), and a rarely used size met a backlog
of hundreds of groups (``docs/benchmarks.md``, "Shares"). The most common share request asks
one GPU and no NIC, and for it the order is simple enough to index directly, by size:

* every placement of a one-GPU, no-NIC share has the same alignment (no pair, no NVLink
  set), so only packing orders them;
* ``binpack``: a GPU that already has shares and that the share fits on is taken before any
  fresh GPU is opened (the opened-GPU term of the cross-node key, ahead of everything else
  but alignment; :func:`.search.fresh_cost` and :func:`.search.capacity_cost` are 0 for it,
  as it takes no free device); among those, the *best fit* over the whole cluster: the least
  memory left after placing, then the least compute left, then the most shares;
* ``spread``: a fresh GPU first; only when none fits anywhere, the *worst fit* shared GPU (the
  most memory left, then compute, then the fewest shares).

So the stacking choice is a query over the shared GPUs by what they have left, and the choice
of a fresh GPU is a whole-GPU decision (a fresh GPU has all its memory and compute, so the
share's size matters only as a minimum GPU memory): :meth:`.plugins.shares.Shares.place` asks
this index, then, if it has nothing, the whole-GPU index with a request whose device class
also asks that minimum memory (``Shares.open_spec``), normalised to the smallest GPU memory of
the fleet that is at least the share's, so that every share size the fleet's GPUs all hold
is one signature there. Neither keeps state per size.

The index. Per device class (built on the first such request of the class, O(nodes) once,
then kept up to date on every move of a node in the share index): every shared GPU of the
class that can take another share (a shared GPU that is out of service or also held whole
has no share bits, see :mod:`.shares`), filed under its *point* ``(memory left MiB, compute
left %, -shares)``; the points are kept sorted. A query for memory ``m``, compute ``c`` and a
class limit of ``k`` shares bisects to the first point with at least ``m`` left and walks up
to the first one with at least ``c`` compute left and fewer than ``k`` shares: that point is
the best fit (points sort by what is left, and what is left after placing is that minus a
constant). Its GPUs are kept sorted by the rest of the node order (one-sided waste, then the
node policy's order, then node name and slot), so its first GPU is the answer.
The walk skips points with too little compute or too many shares; their number is bounded by
the distinct points (a few hundred at 10,000 nodes), not by the GPUs.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import Any

from schemas.config import DeviceClass

from .model import Shape
from .request import Spec
from .search import Choice, Refusal, cross_key
from .shares import gpu_use

__all__ = ["FitIndex", "Point", "StackIndex"]

Point = tuple[int, int, int]  # (memory left MiB, compute left percent, -shares)


class FitIndex:
    """Shared GPUs of one device class by what they have left (see the module docstring)."""

    __slots__ = ("_by_node", "_members", "_sorted", "dc", "name", "node_policy")

    def __init__(self, name: str, dc: DeviceClass, *, node_policy: str) -> None:
        self.name = name
        self.dc = dc
        self.node_policy = node_policy
        # point -> its GPUs' node-order tails (see _tail), sorted: the first is the best
        self._members: dict[Point, list[tuple[Any, ...]]] = {}
        self._sorted: list[Point] = []
        # node -> its filed GPUs as (point, tail)
        self._by_node: dict[str, tuple[tuple[Point, tuple[Any, ...]], ...]] = {}

    def node_count(self) -> int:
        """Nodes with a GPU filed here (a shared GPU of the class that can take a share)."""
        return len(self._by_node)

    def update(self, name: str, shape: Shape | None, mask: int) -> None:
        """Node ``name`` now has group mask ``mask`` (``shape`` None: the node is gone)."""
        if shape is None or mask >> shape.n_slots == 0:
            now: tuple[tuple[Point, tuple[Any, ...]], ...] = ()
        else:
            memory = shape.gpu_memory
            gpu_ok = shape.view(self.name, self.dc).gpu_ok
            low = mask & ((1 << shape.n_slots) - 1)
            free_g = (low & shape.gpu_all).bit_count()
            free_n = (low & shape.pf_all).bit_count()
            # The rest of the node order once the fit terms tie (scores.NodeOrder.order, for a
            # placement with no pair and no fragmentation): the one-sided waste (free NICs),
            # then binpack: the less capable server and the fullest node; spread: the
            # emptiest node. Then the node name and the slot, so that the answer is unique.
            if self.node_policy == "binpack":
                head: tuple[Any, ...] = (free_n, shape.aligned, shape.n_gpus, free_g, free_n, shape.id, name)
            else:
                head = (free_n, -free_g, -free_n, name)
            now = tuple(
                ((memory[s] - mem, 100 - cores, -count), (*head, s))
                # Only GPUs whose shares have this class's mode (one mode per GPU: .shares).
                for s, (mem, cores, count) in gpu_use(shape, mask, sharing=self.dc.sharing).items()
                if gpu_ok >> s & 1
            )
        old = self._by_node.get(name, ())
        if old == now:
            return
        members = self._members
        for point, tail in old:
            at = members[point]
            del at[bisect.bisect_left(at, tail)]
            if not at:
                del members[point]
                del self._sorted[bisect.bisect_left(self._sorted, point)]
        for point, tail in now:
            into = members.get(point)
            if into is None:
                into = members[point] = []
                bisect.insort(self._sorted, point)
            bisect.insort(into, tail)
        if now:
            self._by_node[name] = now
        else:
            self._by_node.pop(name, None)

    def best_fit(self, memory: int, cores: int, limit: int) -> tuple[str, int] | None:
        """The GPU with the least memory, then compute, left (then the most shares) that takes
        a share of ``memory`` MiB and ``cores`` percent (fewer than ``limit`` shares on it),
        best in the node order among equals; None if none does."""
        order = self._sorted
        for i in range(bisect.bisect_left(order, (memory, -1, -(1 << 30))), len(order)):
            point = order[i]
            if point[1] >= cores and -point[2] < limit:
                tail = self._members[point][0]
                return tail[-2], tail[-1]
        return None

    def worst_fit(self, memory: int, cores: int, limit: int) -> tuple[str, int] | None:
        """The GPU with the most memory, then compute, left (then the fewest shares) that
        takes the share, best in the node order among equals; None if none does."""
        order = self._sorted
        for i in range(len(order) - 1, -1, -1):
            point = order[i]
            if point[0] < memory:
                return None
            # Descending: the first point that fits has the most room, then the fewest shares.
            if point[1] >= cores and -point[2] < limit:
                tail = self._members[point][0]
                return tail[-2], tail[-1]
        return None

    def gpus(self) -> Iterator[tuple[str, int, Point]]:
        """Every filed GPU as (node, slot, point) (tests and reports)."""
        for point, tails in self._members.items():
            for tail in tails:
                yield tail[-2], tail[-1], point


# (memory left, compute left, -shares, server capability, GPUs, *fragmentation, free GPUs,
# free NICs, shape id, *in-node quality key, node name, GPU slot): the binpack node order of
# a stacked one-GPU share after its alignment prefix (see StackIndex).
StackEntry = tuple[Any, ...]


class StackIndex:
    """Shared GPUs by the best placement of a one-GPU share *with NICs* on each, for one
    request shape (everything but the share's size) and ``binpack``.

    A one-GPU share stacked on shared GPU ``s`` takes ``s`` and the NICs the exact in-node
    search picks for it alone (the search on the node's free NICs and ``s``): that choice does
    not depend on the share's size, only whether ``s`` fits does. So each shared GPU of the
    class is filed once per change of its node, under the alignment part of its node order
    (:meth:`.scores.NodeOrder.order`: fresh-node cost, which is 0 for a node with a shared GPU, and
    the cross-node alignment), as an entry that sorts like the rest of that order with the fit
    terms of :func:`.shares.fit_terms` first (memory left, compute left, -shares: best fit),
    then server capability, fragmentation, fullness, shape, in-node quality, and the node name
    and slot (so the answer is unique). A query walks the alignment buckets from the best and,
    in each, the entries from the first with enough memory left to the first that fits (the
    compute and share count checked on the way): the first bucket with one has the answer.
    """

    __slots__ = ("_buckets", "_by_node", "_order", "evaluate", "spec")

    def __init__(self, spec: Spec, evaluate: Callable[[Shape, int], Choice | Refusal]) -> None:
        self.spec = spec
        self.evaluate = evaluate  # the cached in-node search of spec's shape on a free mask
        self._buckets: dict[tuple[int, ...], list[StackEntry]] = {}
        self._order: list[tuple[int, ...]] = []  # bucket keys, sorted
        self._by_node: dict[str, tuple[tuple[tuple[int, ...], StackEntry], ...]] = {}

    def node_count(self) -> int:
        return len(self._by_node)

    def update(self, name: str, shape: Shape | None, mask: int) -> None:
        """Node ``name`` now has group mask ``mask`` (``shape`` None: the node is gone)."""
        now: tuple[tuple[tuple[int, ...], StackEntry], ...] = ()
        if shape is not None and mask >> shape.n_slots:
            spec = self.spec
            gpu_ok = shape.view(spec.device_class, spec.dc).gpu_ok
            low = mask & ((1 << shape.n_slots) - 1)
            nics = low & ~shape.gpu_all
            free_g = (low & shape.gpu_all).bit_count()
            free_n = (low & shape.pf_all).bit_count()
            memory = shape.gpu_memory
            scope = int(spec.scope)
            rows = []
            for s, (mem, cores, count) in gpu_use(shape, mask, sharing=spec.dc.sharing).items():
                if not gpu_ok >> s & 1:
                    continue
                got = self.evaluate(shape, nics | 1 << s)
                if not isinstance(got, Choice):
                    continue
                bucket = (0, *cross_key(got.key, scope))
                entry = (
                    memory[s] - mem,
                    100 - cores,
                    -count,
                    shape.aligned,
                    shape.n_gpus,
                    *got.frag,
                    free_g,
                    free_n,
                    shape.id,
                    *got.key,
                    name,
                    s,
                )
                rows.append((bucket, entry))
            now = tuple(rows)
        old = self._by_node.get(name, ())
        if old == now:
            return
        buckets = self._buckets
        for bucket, entry in old:
            lst = buckets[bucket]
            del lst[bisect.bisect_left(lst, entry)]
            if not lst:
                del buckets[bucket]
                del self._order[bisect.bisect_left(self._order, bucket)]
        for bucket, entry in now:
            lst2 = buckets.get(bucket)
            if lst2 is None:
                lst2 = buckets[bucket] = []
                bisect.insort(self._order, bucket)
            bisect.insort(lst2, entry)
        if now:
            self._by_node[name] = now
        else:
            self._by_node.pop(name, None)

    def best(self, memory: int, cores: int, limit: int) -> tuple[str, int] | None:
        """The node and GPU slot of the best stacked placement of a share of ``memory`` MiB
        and ``cores`` percent (fewer than ``limit`` shares on the GPU); None if none fits."""
        for bucket in self._order:
            lst = self._buckets[bucket]
            for i in range(bisect.bisect_left(lst, (memory,)), len(lst)):
                e = lst[i]
                if e[1] >= cores and -e[2] < limit:
                    return e[-2], e[-1]
        return None
