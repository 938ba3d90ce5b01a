"""Stacking: a share placed on GPUs that already have shares (the stacking view of a share
request, ``Spec.stack``), the second tier of a share decision (:mod:`.shares`).

A share request's signature includes its size, and every signature replays every change of
its index, so through the share index alone share requests cost O(distinct sizes x
changes) and a rarely used size meets a long backlog. So the placements that stack on a
shared GPU come from indexes that see only the nodes with shares:

* a share on several GPUs (or with ``spread``, or under reserve pressure): the *stacking
  index*, a third :class:`..index.GroupIndex` holding only the share index's groups that have
  share bits; its signatures' cheap check refuses every node without a shared GPU the share
  fits on (:data:`..shares.NO_STACK`, not kept: the next change looks again), so their heaps
  hold only those nodes;
* a one-GPU share with NICs under ``binpack``: a per-GPU :class:`..sharefit.StackIndex` of the
  request's shape (the shared GPUs by what they have left, best fit first), built on first use.

The search is the share kind's (:func:`..shares.evaluate_shared` on the stacking view), with
its cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from services.allocator.core.index import GroupIndex, GroupKey
from services.allocator.core.model import Shape
from services.allocator.core.nodes import Hardware, Node
from services.allocator.core.placement import Placement, Unschedulable
from services.allocator.core.request import Spec
from services.allocator.core.search import Choice, Refusal, evaluate
from services.allocator.core.sharefit import StackIndex
from services.allocator.core.shares import NO_STACK, stacked_with_nics

from .base import Best, Hooks, Status
from .whole import EVAL_MAX

__all__ = ["Stacking"]

_STACKS_MAX = 16  # per-GPU stacking indexes (one per one-GPU share request shape with NICs)
_SPECS_MAX = 512  # stacking views of share requests kept (cleared when full)


class Stacking(Hooks):
    """The stacking view of share requests (see the module docstring). ``first_status`` and
    ``evaluate`` are the share kind's; ``sevals`` its search cache. Built and made live with
    the share index (:meth:`.shares.Shares.turn_on`)."""

    __slots__ = (
        "_compact",
        "_log_max",
        "_nodes",
        "_specs",
        "_stacks",
        "evaluate",
        "first_status",
        "hw",
        "index",
        "live",
        "sevals",
    )

    name = "stack"
    skip = NO_STACK

    def __init__(
        self,
        hw: list[Hardware],
        nodes: dict[str, Node],
        *,
        first_status: Callable[[Spec, GroupKey], Status],
        evaluate: Callable[[Spec, Shape, int], Choice | Refusal],
        sevals: dict[tuple[object, ...], Choice | Refusal],
        log_max: int,
        compact: Callable[[GroupIndex], None],
    ) -> None:
        self.hw = hw
        self._nodes = nodes
        self.index = GroupIndex()  # the share index's groups that have share bits
        self.first_status = first_status
        self.evaluate = evaluate
        self.sevals = sevals
        self._stacks: dict[tuple[object, ...], StackIndex] = {}  # one-GPU shares with NICs
        self._specs: dict[tuple[object, ...], Spec] = {}  # share spec key -> its stacking view
        self._log_max = log_max
        self._compact = compact
        self.live = False

    def applies(self, spec: Spec) -> bool:
        return spec.stack

    def ready(self) -> None:
        pass  # built by the share kind, which decides before its view is read

    def place(self, spec: Spec, *, shard: str | None) -> Placement | Unschedulable | None:
        return None

    def fit_count(self, spec: Spec) -> int | None:
        return None

    def indexes(self) -> int:
        return len(self._stacks)

    def view(self, spec: Spec) -> Spec:
        """The stacking view of share request ``spec`` (cached by its key)."""
        stack = self._specs.get(spec.key)
        if stack is None:
            if len(self._specs) >= _SPECS_MAX:
                self._specs.clear()
            stack = self._specs[spec.key] = replace(spec, stack=True)
        return stack

    def rebuild(self, share_groups: dict[GroupKey, dict[str, None]]) -> None:
        """Take the groups with share bits from a freshly built share index."""
        self.index.reset()
        hw = self.hw
        for gkey, members in share_groups.items():
            if gkey[1] >> hw[gkey[0]].shape.n_slots:
                self.index.groups[gkey] = dict(members)

    def stacked_one(self, spec: Spec) -> Best | None:
        """The best placement of a one-GPU share with NICs on a shared GPU (binpack), from the
        :class:`..sharefit.StackIndex` of the request's shape (built on first use, O(nodes))."""
        shape_key = spec.key[:6]
        index = self._stacks.get(shape_key)
        if index is None:
            cache = self.sevals
            base = spec

            def search(shape: Shape, free: int) -> Choice | Refusal:
                # The same cache and key as evaluate_shared's exact searches.
                key = (shape_key, shape.id, free)
                got = cache.get(key)
                if got is None:
                    if len(cache) >= EVAL_MAX:
                        cache.clear()
                    got = cache[key] = evaluate(shape, free, base)
                return got

            if len(self._stacks) >= _STACKS_MAX:
                # Each index follows every move of a node with shares: keep a few request shapes.
                del self._stacks[next(iter(self._stacks))]
            index = self._stacks[shape_key] = StackIndex(spec, search)
            for node in self._nodes.values():
                index.update(node.name, node.shape, node.mask)
        hit = index.best(spec.memory_mib, spec.cores_percent, spec.dc.max_shares_per_gpu)
        if hit is None:
            return None
        name, slot = hit
        node = self._nodes[name]
        got = stacked_with_nics(node.shape, node.mask, slot, spec, search=index.evaluate)
        return Best(node, got, index.node_count())

    def follow(
        self, name: str, old: GroupKey | None, new: GroupKey | None, *, was_impaired: bool, now_impaired: bool
    ) -> None:
        """A node moved: only groups with share bits are in the index; the per-GPU indexes
        follow every move."""
        if self._stacks and old != new:
            shape = self.hw[new[0]].shape if new is not None else None
            mask = new[1] if new is not None else 0
            for stack in self._stacks.values():
                stack.update(name, shape, mask)
        hw = self.hw
        if old is not None and not old[1] >> hw[old[0]].shape.n_slots:
            old = None
        if new is not None and not new[1] >> hw[new[0]].shape.n_slots:
            new = None
        if old == new:
            return
        index = self.index
        index.move(name, old, new)
        if len(index.log) > self._log_max:
            self._compact(index)
