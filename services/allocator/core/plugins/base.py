"""The interface between the framework (:class:`~..cluster.Cluster`) and a device kind.

A decision runs one fixed pipeline (:meth:`Cluster.decide`):

1. *PreFilter*: the first kind whose :meth:`DeviceKind.applies` takes the request (in the
   order MIG, stacking view, shares, whole GPUs) decides it — one dispatch per decision;
2. a kind that keeps an index of its own (MIG) decides alone (:meth:`DeviceKind.place`);
3. *Filter + Score*: otherwise a node selector narrows the nodes (a few matching nodes are
   decided directly), a kind may decide by an index of its own (:meth:`DeviceKind.place`:
   shares without a selector), and else the framework reads the top of the signature heap
   over the kind's :class:`~..index.GroupIndex`: :meth:`IndexedKind.first_status` is the
   cheap filter of a group (no search), :meth:`IndexedKind.evaluate` the exact in-node search
   (filter and in-node score, cached), :mod:`..scores` the node order; with a preferred
   shard, the steps run on the shard's nodes first and on all nodes only when none can;
4. *PostFilter*: no node — the caller may ask :mod:`..preempt` for victims;
5. *Reserve*: a hold moves the node between groups; every kind with an index follows the move
   (:meth:`IndexedKind.follow`).

The methods called per group or per change (``first_status``, ``evaluate``, ``follow``) are
bound once per signature state or per cluster, never looked up per node.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from services.allocator.core.index import GroupIndex, GroupKey
from services.allocator.core.model import Shape
from services.allocator.core.nodes import Node
from services.allocator.core.placement import Placement, Unschedulable
from services.allocator.core.request import Spec
from services.allocator.core.search import Choice, Refusal

__all__ = ["NOT_SKIPPED", "Best", "DeviceKind", "IndexedKind", "Status"]

Status = Choice | Refusal | None  # None: passed the cheap check, not searched yet
# The ``skip`` of a kind that keeps every group it is shown (no cheap check returns it).
NOT_SKIPPED = Refusal("", "")


class Best(NamedTuple):
    """The best node of an index for a request: the node (first or last of its group), the
    in-node choice, and the candidates (nodes able to take it, or not searched yet)."""

    node: Node
    choice: Choice
    candidates: int


class DeviceKind(Protocol):
    """One kind of device a request may ask (whole GPUs, shares, MIG instances, ...)."""

    name: str

    def applies(self, spec: Spec) -> bool:
        """Whether this kind decides ``spec`` (the framework asks the kinds in order)."""
        ...

    def place(self, spec: Spec, *, shard: str | None) -> Placement | Unschedulable | None:
        """The kind's own decision, when it has one (None: decide through ``index``)."""
        ...

    def fit_count(self, spec: Spec) -> int | None:
        """How many nodes could take ``spec`` now, when the kind counts them itself."""
        ...


class IndexedKind(DeviceKind, Protocol):
    """A kind decided through a group index (nodes grouped by hardware and group mask)."""

    index: GroupIndex  # the groups the framework's heaps read
    # A refusal of the cheap check whose groups a signature does not keep (the next change
    # looks again): the stacking view's, which the share index reports instead.
    skip: Refusal

    def first_status(self, spec: Spec, gkey: GroupKey) -> Status:
        """A group's status without searching: a cheap refusal, a cached result, or None."""
        ...

    def evaluate(self, spec: Spec, shape: Shape, mask: int) -> Choice | Refusal:
        """The cached exact in-node search on a group mask."""
        ...

    def follow(
        self, name: str, old: GroupKey | None, new: GroupKey | None, *, was_impaired: bool, now_impaired: bool
    ) -> None:
        """Node ``name`` moved from group ``old`` to ``new`` (full group keys)."""
        ...
