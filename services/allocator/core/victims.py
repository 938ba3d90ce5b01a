"""Which holds may be evicted, and the nodes that have them grouped for the preemption search.

A hold may be *preemptible* with a priority (``Cluster.hold(..., priority=,
preemptible=True)``): :mod:`.preempt` (the step after a decision that found no node) may then
choose it as a victim for a request of higher priority. The nodes with such holds are kept
grouped by what that search depends on, their *preemption view* ``(shape id, blocked slots,
preemptible holds' (priority, slots))`` (:meth:`Victims.groups`), rebuilt lazily for the
nodes whose holds or hardware changed. A hold of GPU shares may be a victim too (every share
of a GPU evicted frees it whole); a hold of MIG instances never is.
"""

from __future__ import annotations

from typing import NamedTuple

from .nodes import Node, slot_mask

__all__ = ["Hold", "PreemptionView", "Victims"]


class Hold(NamedTuple):
    """A preemptible hold as the preemption search sees it."""

    priority: int
    slots: int  # slot mask


class PreemptionView(NamedTuple):
    """What a preemption plan on a node depends on (nodes with equal views plan alike)."""

    shape_id: int
    blocked: int  # slots of everything but the preemptible holds
    holds: tuple[Hold, ...]  # highest priority first


class Victims:
    """The preemptible holds per node and their views. ``nodes`` and ``holds`` are the
    registry's own dicts (read, never changed here)."""

    __slots__ = ("_dirty", "_groups", "_holds", "_nodes", "_views", "by_node")

    def __init__(self, nodes: dict[str, Node], holds: dict[str, dict[str, tuple[str, ...]]]) -> None:
        self._nodes = nodes
        self._holds = holds
        self.by_node: dict[str, dict[str, int]] = {}  # node -> preemptible hold -> its priority
        self._views: dict[str, PreemptionView] = {}
        self._groups: dict[PreemptionView, dict[str, None]] = {}
        self._dirty: set[str] = set()  # nodes whose view is rebuilt when next asked

    def add(self, name: str, request_id: str, priority: int) -> None:
        self.by_node.setdefault(name, {})[request_id] = priority
        self.forget(name)

    def drop(self, name: str, request_id: str) -> None:
        self.forget(name)
        victims = self.by_node.get(name)
        if victims is not None and victims.pop(request_id, None) is not None and not victims:
            del self.by_node[name]

    def forget(self, name: str) -> None:
        """A node's holds or hardware changed: its view is rebuilt when next asked."""
        view = self._views.pop(name, None)
        if view is not None:
            members = self._groups[view]
            del members[name]
            if not members:
                del self._groups[view]
        if view is not None or name in self.by_node:
            self._dirty.add(name)

    def preemptible(self) -> dict[str, dict[str, tuple[tuple[str, ...], int]]]:
        """Per known node that has any: its preemptible holds, as request id -> (devices,
        priority)."""
        out: dict[str, dict[str, tuple[tuple[str, ...], int]]] = {}
        for name, victims in self.by_node.items():
            if name in self._nodes:
                holds = self._holds.get(name, {})
                out[name] = {rid: (holds.get(rid, ()), prio) for rid, prio in victims.items()}
        return out

    def groups(self) -> dict[PreemptionView, dict[str, None]]:
        """Nodes with preemptible holds, grouped by their preemption view ``(shape id,
        blocked, holds)``: ``blocked`` is the slot mask of everything but those holds
        (unavailable devices, protected holds), ``holds`` the preemptible holds' ``(priority,
        slot mask)`` sorted. Nodes of one group offer the same placements for the same
        evictions. A node's free mask with some holds released is ``shape.effective_free(
        blocked | the other holds' masks)``."""
        for name in self._dirty:
            victims = self.by_node.get(name)
            node = self._nodes.get(name)
            if victims is None or node is None:
                continue
            view = self._views[name] = self._view(node, victims)
            members = self._groups.get(view)
            if members is None:
                members = self._groups[view] = {}
            members[name] = None
        self._dirty.clear()
        return self._groups

    def holds_of(self, node: Node) -> dict[str, tuple[int, int]]:
        """The preemptible holds of ``node``: request id -> (priority, slot mask)."""
        victims = self.by_node.get(node.name, {})
        slot_of = node.shape.slot_of
        out = {}
        for rid, devs in self._holds.get(node.name, {}).items():
            if rid in victims:
                out[rid] = (victims[rid], slot_mask(slot_of, devs))
        return out

    def _view(self, node: Node, victims: dict[str, int]) -> PreemptionView:
        slot_of = node.shape.slot_of
        blocked = slot_mask(slot_of, (*node.unavailable, *node.port_down)) | node.kind_block
        holds: list[Hold] = []
        for rid, devs in self._holds.get(node.name, {}).items():
            prio = victims.get(rid)
            if prio is None:
                blocked |= slot_mask(slot_of, devs)
            else:
                holds.append(Hold(prio, slot_mask(slot_of, devs)))
        holds.sort(reverse=True)
        return PreemptionView(node.shape.id, blocked, tuple(holds))
