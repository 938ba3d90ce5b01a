"""Node labels, shards and the hardware ids they make.

A node's labels are indexed by ``(key, value)`` and its shard by name, so that a node selector
(or a shard preference) that few nodes match is answered from the index, in O(matching
nodes). A *hardware id* names a compiled shape plus the node's *grouping* labels (the label
keys some selector has needed to tell groups apart, :attr:`Labels.keyed`) and its shard:
nodes with the same hardware id and group mask are one group of the indexes (:mod:`.cluster`).
Only grouping keys count, so labels unique per node (the hostname) never split the fleet into
one group per node; a new grouping key renumbers every hardware id (:meth:`Labels.regroup`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from .model import Shape
from .nodes import Hardware, Node

__all__ = ["Labels"]

_K = TypeVar("_K")
Selector = tuple[tuple[str, str], ...]


class Labels:
    """The label and shard index of the registry's nodes, and the hardware ids."""

    __slots__ = ("_by_pair", "_by_shard", "_hw_ids", "_keyed_order", "hw", "keyed")

    def __init__(self) -> None:
        self.hw: list[Hardware] = []  # hardware id -> shape, grouping labels, shard
        self._hw_ids: dict[tuple[int, Selector, str | None], int] = {}
        self._by_pair: dict[tuple[str, str], dict[str, None]] = {}
        self._by_shard: dict[str, dict[str, None]] = {}
        self.keyed: frozenset[str] = frozenset()  # the label keys groups are split by
        self._keyed_order: tuple[str, ...] = ()  # the same, sorted

    def hw_id(self, shape: Shape, labels: Mapping[str, str], shard: str | None) -> int:
        """The hardware id of a shape with these labels and shard: only grouping keys count."""
        grouping = tuple((k, labels[k]) for k in self._keyed_order if k in labels)
        hw_key = (shape.id, grouping, shard)
        hw = self._hw_ids.get(hw_key)
        if hw is None:
            hw = self._hw_ids[hw_key] = len(self.hw)
            self.hw.append(Hardware(shape, dict(grouping), shard))
        return hw

    def regroup(self, keyed: frozenset[str]) -> None:
        """Group by ``keyed`` from now on: every hardware id is forgotten (the caller gives
        every node a new one)."""
        self.keyed = keyed
        self._keyed_order = tuple(sorted(keyed))
        self._hw_ids.clear()
        self.hw.clear()

    def file(self, node: Node, delta: int) -> None:
        """Add (``delta`` > 0) or remove a node's labels and shard."""
        _file(self._by_pair, node.labels.items(), name=node.name, delta=delta)
        if node.shard is not None:
            _file(self._by_shard, (node.shard,), name=node.name, delta=delta)

    def few_matching(
        self, nodes: Mapping[str, Node], selector: Selector, shard: str | None, *, most: int
    ) -> list[Node] | None:
        """The nodes matching ``selector`` (and of ``shard``) when its rarest label (or the
        shard) has at most ``most`` nodes; None when it has more (decide through the groups)."""
        smallest: dict[str, None] | None = None
        for pair in selector:
            names = self._by_pair.get(pair)
            if not names:
                return []
            if smallest is None or len(names) < len(smallest):
                smallest = names
        if shard is not None:
            names = self._by_shard.get(shard)
            if not names:
                return []
            if smallest is None or len(names) < len(smallest):
                smallest = names
        assert smallest is not None
        if len(smallest) > most:
            return None
        return [
            node
            for node in (nodes[name] for name in smallest)
            if all(node.labels.get(k) == v for k, v in selector) and (shard is None or node.shard == shard)
        ]

    def matching(self, nodes: Mapping[str, Node], selector: Selector) -> list[Node]:
        """Every node matching the selector (reports only)."""
        few = self.few_matching(nodes, selector, None, most=len(nodes))
        return few if few is not None else []


def _file(index: dict[_K, dict[str, None]], keys: Iterable[_K], *, name: str, delta: int) -> None:
    """Add (``delta`` > 0) or remove node ``name`` under each of ``keys`` of ``index``."""
    for key in keys:
        names = index.get(key)
        if delta > 0:
            if names is None:
                names = index[key] = {}
            names[name] = None
        elif names is not None:
            names.pop(name, None)
            if not names:
                del index[key]
