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
4. *PostFilter*: no node — the failed decision (``Unschedulable``) carries the request as it
   was resolved at the door (``spec``), and the caller may ask :mod:`..preempt` for victims
   with it;
5. *Reserve*: a hold moves the node between groups; every kind whose index is live follows
   the move (:meth:`IndexedKind.follow`).

The methods called per group or per change (``first_status``, ``evaluate``, ``follow``) are
bound once per signature state or per cluster, never looked up per node.

The registry (:class:`~..cluster.Cluster`) knows no kind: what a kind keeps of nodes and holds
beyond the devices held (share usage, MIG instances) it keeps itself, told through the
:class:`Hooks` (a kind overrides those it needs). Per node registration every kind is told;
per hold and refresh only the kinds that override that hook are asked, bound once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, Protocol

from schemas.topology import NodeTopology
from services.allocator.core.index import GroupIndex, GroupKey
from services.allocator.core.model import Shape
from services.allocator.core.nodes import Node
from services.allocator.core.placement import Placement, Unschedulable
from services.allocator.core.request import Spec
from services.allocator.core.search import Choice, Refusal

__all__ = ["NOT_SKIPPED", "Best", "DeviceKind", "Holds", "Hooks", "IndexedKind", "Status", "overriding"]

Status = Choice | Refusal | None  # None: passed the cheap check, not searched yet
# The ``skip`` of a kind that keeps every group it is shown (no cheap check returns it).
NOT_SKIPPED = Refusal("", "")


class Best(NamedTuple):
    """The best node of an index for a request: the node (first or last of its group), the
    in-node choice, and the candidates (nodes able to take it, or not searched yet)."""

    node: Node
    choice: Choice
    candidates: int


# A node's holds as the registry keeps them: request id (or reservation key) -> device ids.
Holds = Mapping[str, tuple[str, ...]]


class Hooks(Protocol):
    """What the registry tells a kind as nodes and holds change, and asks it; the defaults keep
    nothing (a plugin subclasses this to inherit them). A kind that keeps nothing per hold
    (whole GPUs: its index follows the moves) overrides none of the hold hooks, so a hold
    costs it nothing."""

    __slots__ = ()

    # Whether the registry's holds, refreshes and moves reach the kind now. A kind that builds
    # its index on first use is not live before (it keeps no state of holds then), goes live
    # when it builds it and tells the registry (as the share kind does).
    live: bool = True

    # -- per node registration -------------------------------------------------------------

    def new_shape(self, shape: Shape) -> None:
        """A hardware shape seen for the first time."""
        return None  # a default: keeps nothing

    def node_set(
        self, name: str, topology: NodeTopology, shape: Shape, labels: Mapping[str, str], *, shard: str | None
    ) -> int:
        """Node ``name`` was added or replaced; returns the slots this kind takes out of every
        other kind's free mask for good (MIG-mode GPUs). A kind that returns some is told of the
        node's every refresh (:meth:`refreshed`)."""
        return 0

    def node_removed(self, name: str) -> None:
        """Node ``name`` is gone (its holds stay with the registry until released)."""
        return None  # a default: keeps nothing

    def regrouped(self, nodes: Iterable[Node]) -> None:
        """Every node got a new hardware id (a new grouping label): rebuild what is keyed by it."""
        return None  # a default: keeps nothing

    # -- per hold and refresh: asked of the live kinds that override them --------------------

    def hold_set(
        self, name: str, request_id: str, *, shares: Mapping[str, tuple[int, int]] | None, sharing: str
    ) -> bool:
        """A hold of ``request_id`` on ``name`` was made or replaced, with its ``shares``
        (device id -> (memory MiB, compute %)); returns whether the kind's state changed. A hold
        with shares is shown to a kind that is not live yet too."""
        return False

    def hold_removed(self, name: str, request_id: str) -> None:
        """``request_id``'s hold on ``name`` is gone."""
        return None  # a default: keeps nothing

    def protects(self, devices: tuple[str, ...]) -> bool:
        """Whether a hold of ``devices`` may never be a preemption victim."""
        return False

    def group_mask(self, node: Node, blocked: int, holds: Holds) -> int | None:
        """The node's group mask when this kind keeps state in it (shares pack their usage
        above the slot bits), else None (the registry's mask: free slots only)."""
        return None

    def refreshed(self, node: Node, holds: Holds) -> None:
        """A node whose :meth:`node_set` took slots has a new group mask or new holds."""
        return None  # a default: keeps nothing

    # -- reports ------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """The sizes of the kind's indexes and caches (``Cluster.cache_stats``)."""
        return {}


def overriding(kinds: Iterable[object], hook: str) -> tuple[Callable[..., Any], ...]:
    """The bound ``hook`` of each kind that overrides :class:`Hooks`'s default, in order: what
    the registry calls per hold or refresh (the others would only cost a call)."""
    default = getattr(Hooks, hook)
    return tuple(getattr(k, hook) for k in kinds if getattr(type(k), hook, default) is not default)


class DeviceKind(Hooks, Protocol):
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

    def ready(self) -> None:
        """Build what the kind builds on first use before its index is read (fit counts; a
        decision's :meth:`place` sees to it itself)."""
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
        """Node ``name`` moved from group ``old`` to ``new`` (full group keys); called while
        the kind is :attr:`~Hooks.live`."""
        ...
