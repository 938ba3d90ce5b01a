"""Whole GPUs and exclusive NICs: the kind every request without shares or MIG is.

Its index is the framework's main one: nodes grouped by ``(hardware id, free slot bits)``. A
change of share usage alone is not a change for it (keys are cut to their slot bits once the
share index exists, :mod:`.shares`), so whole-GPU decisions cost the same whether or not the
fleet shares GPUs. The in-node search is :func:`..search.evaluate` (exact; property tests
compare it with the exhaustive search), cached by (request key, shape, free slots), so a fleet
of identical servers costs one search per distinct free state; the cheap filter is
:func:`..search.precheck` (popcounts). Following a move it also keeps the reserve count of
:class:`..scores.NodeOrder` (the aligned capacity of every node), which only whole GPUs change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from services.allocator.core.index import GroupIndex, GroupKey
from services.allocator.core.model import Shape
from services.allocator.core.nodes import Hardware, Node
from services.allocator.core.placement import Placement, Unschedulable
from services.allocator.core.request import Spec
from services.allocator.core.scores import NodeOrder
from services.allocator.core.search import Choice, Refusal, evaluate, precheck
from services.allocator.core.shares import slot_bits

from .base import NOT_SKIPPED, Hooks, Status

__all__ = ["EVAL_MAX", "WholeGpus"]

EVAL_MAX = 50_000  # cached in-node results before the cache is cleared (~1 KB each at most)


class WholeGpus(Hooks):
    """The whole-GPU kind (see the module docstring)."""

    __slots__ = ("_compact", "_log_max", "_order", "evals", "hw", "index", "split")

    name = "whole"
    skip = NOT_SKIPPED
    live = True  # follows every move from the first node on

    def __init__(
        self, hw: list[Hardware], order: NodeOrder, *, log_max: int, compact: Callable[[GroupIndex], None]
    ) -> None:
        self.hw = hw
        self.index = GroupIndex()  # keyed by (hardware id, slot bits)
        self.evals: dict[tuple[object, ...], Choice | Refusal] = {}
        self.split = False  # group keys carry share bits (the share index is on): cut them
        self._order = order
        self._log_max = log_max
        self._compact = compact

    def applies(self, spec: Spec) -> bool:
        return True  # the last kind asked: whatever no other kind takes

    def place(self, spec: Spec, *, shard: str | None) -> Placement | Unschedulable | None:
        return None  # always through the index

    def fit_count(self, spec: Spec) -> int | None:
        return None

    def ready(self) -> None:
        pass

    def regrouped(self, nodes: Iterable[Node]) -> None:
        """Every node has a new hardware id: the groups and the change log start over."""
        index = self.index
        index.reset()
        for node in nodes:
            index.put(node.name, (node.hw, slot_bits(node.shape, node.mask)), impaired=node.impaired)

    def stats(self) -> dict[str, int]:
        return {"evaluations": len(self.evals), "change_log": len(self.index.log)}

    def first_status(self, spec: Spec, gkey: GroupKey) -> Status:
        shape = self.hw[gkey[0]].shape
        mask = slot_bits(shape, gkey[1])
        cached = self.evals.get((spec.key, shape.id, mask))
        if cached is not None:
            return cached
        return precheck(shape, mask, spec)

    def evaluate(self, spec: Spec, shape: Shape, mask: int) -> Choice | Refusal:
        """The cached search; it depends on the slot bits only."""
        free = slot_bits(shape, mask)
        key = (spec.key, shape.id, free)
        res = self.evals.get(key)
        if res is None:
            if len(self.evals) >= EVAL_MAX:
                self.evals.clear()
            res = self.evals[key] = evaluate(shape, free, spec)
        return res

    def follow(
        self, name: str, old: GroupKey | None, new: GroupKey | None, *, was_impaired: bool, now_impaired: bool
    ) -> None:
        """A node moved (hot path: every hold and release)."""
        if self.split:
            hw = self.hw
            if old is not None:
                old = (old[0], slot_bits(hw[old[0]].shape, old[1]))
            if new is not None:
                new = (new[0], slot_bits(hw[new[0]].shape, new[1]))
        index = self.index
        if old == new:
            if old is not None and was_impaired != now_impaired:
                index.count_impaired(old, 1 if now_impaired else -1)
            return
        if index.move(name, old, new) and old is not None:
            self._order.count_capacity(old, -1)
            if was_impaired:
                index.count_impaired(old, -1)
        if new is not None:
            self._order.count_capacity(new, 1)
            if now_impaired:
                index.count_impaired(new, 1)
        if len(index.log) > self._log_max:
            self._compact(index)
