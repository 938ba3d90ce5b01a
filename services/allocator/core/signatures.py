"""Filter + Score over a group index: one *signature state* per distinct request signature.

A signature is a request key, its node selector and preferred shard, and whether reserve
pressure holds (:mod:`.scores`): everything the set of nodes able to take the request and
their order depend on. Its :class:`_SigState` keeps a heap of the groups of the kind's
:class:`~.index.GroupIndex` that may take the request, the number of nodes in each, and
per-reason counts of the nodes that cannot. A decision first replays the log entries the
signature has not seen (net changes only when there are many; a signature unused for long is
rebuilt from the groups instead), then reads the top of the heap (:meth:`Signatures.top`).
Groups enter the heap after the kind's cheap check with an optimistic key (a lower bound of
the node order) and are searched only when they reach the top, so most groups of a large
fleet are never searched for most requests. A decision costs O(changes since the signature's
last decision), not O(nodes); a refusal's aggregated reason comes from the counters without a
scan.

Memory is bounded whatever the stream of requests and selectors: at most ``_SIG_MAX`` states
and ``records_max`` group records over all of them (least recently used dropped), and the
memoized selector matches per hardware id (``match_max``, cleared when full). A kind's index
log is trimmed to what the states still need (:meth:`Signatures.compact`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .index import GroupIndex, GroupKey
from .nodes import Hardware, Node
from .placement import SELECTOR_REFUSAL
from .plugins import Best, IndexedKind
from .plugins.base import Status
from .request import Spec
from .scores import OrderKey
from .search import Choice, Refusal

__all__ = ["HeapEntry", "Signatures"]

_SIG_MAX = 512  # signature states kept (least recently used dropped)
_SHARD_REFUSAL = Refusal("selector", "not a node of the preferred shard")
_new_best = tuple.__new__

# A heap entry: the node order (the four parts of scores.OrderKey), then ``seq`` (unique: first
# pushed first, so comparisons never reach the group), the group, and whether the key is exact
# (the group was searched) or a bound. A plain tuple read by unpacking, not a NamedTuple:
# entries are made on every push, and a NamedTuple's constructor costs several times a tuple's.
HeapEntry = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], int, GroupKey, bool]


class _Group:
    """A signature's record of one group: its nodes as replayed, and its status (a Choice, a
    Refusal, or None: passed the cheap check, not searched yet). Made by ``_new_group`` and two
    stores, not by an ``__init__``: the replay makes one for most changes under churn, and a
    Python ``__init__`` call costs about as much again."""

    __slots__ = ("n", "status")

    n: int
    status: Status


_new_group = object.__new__


@dataclass(slots=True)
class _SigState:
    """One request signature's view of its kind's groups (see the module docstring)."""

    spec: Spec
    kind: IndexedKind
    cursor: int
    # The cheap check of a new group: the kind's own, or with the selector / shard in front.
    first: Callable[[Spec, GroupKey], Status]
    heap: list[HeapEntry] = field(default_factory=list)
    in_heap: set[GroupKey] = field(default_factory=set)
    groups: dict[GroupKey, _Group] = field(default_factory=dict)
    # Refusal text -> nodes, and its code. Keyed by the text: a str caches its hash, and this
    # dict is updated on every replayed change of a refused group.
    refused: dict[str, int] = field(default_factory=dict)
    codes: dict[str, str] = field(default_factory=dict)
    feasible: int = 0  # nodes searched and able to take the request
    pending: int = 0  # nodes that passed the cheap check and are not searched yet
    pressure: bool = False  # ordered by the reserve-pressure order (see .scores)


class Signatures:
    """The signature states of one cluster. ``hw`` and ``nodes`` are the registry's own
    (read only); ``order`` and ``pressure`` the node order's (:mod:`.scores`)."""

    __slots__ = (
        "_hw",
        "_log_max",
        "_match_max",
        "_nodes",
        "_order",
        "_pressure",
        "_records_max",
        "_seq",
        "records",
        "selector_match",
        "sigs",
    )

    def __init__(
        self,
        hw: list[Hardware],
        nodes: dict[str, Node],
        *,
        order: Callable[..., OrderKey],
        pressure: Callable[[], bool],
        log_max: int,
        records_max: int,
        match_max: int,
    ) -> None:
        self._hw = hw
        self._nodes = nodes
        self._order = order
        self._pressure = pressure
        self._log_max = log_max
        self._records_max = records_max
        self._match_max = match_max
        self.sigs: dict[tuple[object, ...], _SigState] = {}
        self.records = 0  # groups + heap entries over all signature states
        # (selector, hardware id) -> whether its grouping labels match (see _selected)
        self.selector_match: dict[tuple[tuple[tuple[str, str], ...], int], bool] = {}
        self._seq = 0

    def clear(self) -> None:
        """Forget every state (the hardware ids were renumbered)."""
        self.sigs.clear()
        self.records = 0
        self.selector_match.clear()

    def compact(self, index: GroupIndex) -> None:
        """Drop the log prefix no signature state of ``index`` still needs; states that lag
        by more than half the log are dropped (rebuilt from the groups when next used)."""
        end = index.end
        keep_from = end - self._log_max // 2
        mine = {k: st for k, st in self.sigs.items() if st.kind.index is index}
        for k in [k for k, st in mine.items() if st.cursor < keep_from]:
            self._drop_sig(k)
            del mine[k]
        index.trim(min((st.cursor for st in mine.values()), default=end))

    def _state(self, spec: Spec, kind: IndexedKind, shard: str | None) -> _SigState:
        pressure = self._pressure()
        sk = (spec.key, spec.selector, pressure, shard)
        st = self.sigs.get(sk)
        index = kind.index
        all_groups, log, base = index.groups, index.log, index.base
        end = index.end
        if st is not None:
            # Most recently used last, so the LRU drop below takes the stalest.
            self.sigs[sk] = self.sigs.pop(sk)
            backlog = end - st.cursor
            if backlog == 0:
                return st
            if backlog <= 2 * len(all_groups) + 256:
                before = len(st.groups) + len(st.heap)
                changes = log[st.cursor - base :]
                if backlog > 32:
                    # Under churn most groups come and go; replay only the net change.
                    net: dict[GroupKey, int] = {}
                    for gkey, delta in changes:
                        net[gkey] = net.get(gkey, 0) + delta
                    self._replay(st, [(k, d) for k, d in net.items() if d])
                else:
                    self._replay(st, changes)
                st.cursor = end
                if len(st.heap) > 4 * len(st.groups) + 64:
                    # Entries of groups that are gone pile up under churn: drop them.
                    groups = st.groups
                    st.heap = [e for e in st.heap if _gkey_of(e) in groups]
                    heapq.heapify(st.heap)
                    st.in_heap = {_gkey_of(e) for e in st.heap}
                self.records += len(st.groups) + len(st.heap) - before
                self._trim_sigs(keep=sk)
                return st
            # A long-unused signature: rebuilding from the groups is cheaper than replaying.
            self._drop_sig(sk)
        first = self._selected(kind, spec.selector, shard) if spec.selector or shard is not None else None
        st = _SigState(spec=spec, kind=kind, cursor=end, first=first or kind.first_status, pressure=pressure)
        self._replay(st, [(gkey, len(members)) for gkey, members in all_groups.items()])
        if len(self.sigs) >= _SIG_MAX:
            self._drop_sig(next(iter(self.sigs)))
        self.sigs[sk] = st
        self.records += len(st.groups) + len(st.heap)
        self._trim_sigs(keep=sk)
        return st

    def _drop_sig(self, sk: tuple[object, ...]) -> None:
        st = self.sigs.pop(sk)
        self.records -= len(st.groups) + len(st.heap)

    def _trim_sigs(self, *, keep: tuple[object, ...]) -> None:
        """Drop the least recently used signature states while their records exceed the budget."""
        while self.records > self._records_max and len(self.sigs) > 1:
            oldest = next(iter(self.sigs))
            if oldest == keep:
                break
            self._drop_sig(oldest)

    def _replay(self, st: _SigState, changes: Iterable[tuple[GroupKey, int]]) -> None:
        """Replay group membership changes into a signature's state (hot path; kept flat)."""
        groups = st.groups
        refused = st.refused
        spec = st.spec
        first = st.first
        skip = st.kind.skip
        new_group = _new_group
        for gkey, delta in changes:
            rec = groups.get(gkey)
            if rec is None:
                status = first(spec, gkey)
                if status is skip:
                    # A refusal the kind does not report (the stacking view's: the share index
                    # says why), so its group is not kept: the next change looks again.
                    continue
                rec = groups[gkey] = new_group(_Group)
                rec.n = delta
                rec.status = status
                if status.__class__ is not Refusal and gkey not in st.in_heap:
                    self._push(st, gkey, status)
            else:
                status = rec.status
                n = rec.n + delta
                if n:
                    rec.n = n
                else:
                    del groups[gkey]
            if status is None:
                st.pending += delta
            elif status.__class__ is Refusal:
                text = status.text
                left = refused.get(text, 0) + delta
                if left:
                    if text not in refused:
                        st.codes[text] = status.code
                    refused[text] = left
                else:
                    del refused[text]
            else:
                st.feasible += delta

    def _push(self, st: _SigState, gkey: GroupKey, status: Status) -> None:
        self._seq += 1
        heapq.heappush(st.heap, self._entry(st, gkey, status, self._seq))
        st.in_heap.add(gkey)

    def _entry(self, st: _SigState, gkey: GroupKey, status: Status, seq: int) -> HeapEntry:
        """A heap entry: the node order (.scores), then ``seq`` (first pushed first).

        A bound entry (group not searched yet) must sort no later than the group's exact entry:
        its key is a prefix of, or smaller than, the exact one."""
        a, b, c, d = self._order(st.spec, gkey, status, pressure=st.pressure)
        return (a, b, c, d, seq, gkey, isinstance(status, Choice))

    def top(
        self, spec: Spec, kind: IndexedKind, *, shard: str | None = None, last_of_equals: bool = False
    ) -> Best | _SigState:
        """The best node of ``kind``'s index for ``spec``, or the signature state when no node
        can take it (its counters say why). The node is the first member of the best group
        (the last with ``last_of_equals``). Hot path."""
        st = self._state(spec, kind, shard)
        heap = st.heap
        groups = st.groups
        while heap:
            _a, _b, _c, _d, seq, gkey, exact = heap[0]
            rec = groups.get(gkey)
            if rec is None or rec.status.__class__ is Refusal:
                heapq.heappop(heap)
                st.in_heap.discard(gkey)
                continue
            status = rec.status
            if status is None:
                n = rec.n
                status = rec.status = kind.evaluate(spec, self._hw[gkey[0]].shape, gkey[1])
                st.pending -= n
                if isinstance(status, Refusal):
                    st.refused[status.text] = st.refused.get(status.text, 0) + n
                    st.codes[status.text] = status.code
                    heapq.heappop(heap)
                    st.in_heap.discard(gkey)
                    continue
                st.feasible += n
            assert isinstance(status, Choice)
            if not exact:
                # A bound entry: put the exact key in and look at the top again.
                heapq.heapreplace(heap, self._entry(st, gkey, status, seq))
                continue
            members = kind.index.groups[gkey]
            name = next(reversed(members)) if last_of_equals else next(iter(members))
            # tuple.__new__: a NamedTuple's own constructor is a Python call (hot path).
            return _new_best(Best, (self._nodes[name], status, st.feasible + st.pending))
        return st

    def _selected(
        self, kind: IndexedKind, selector: tuple[tuple[str, str], ...], shard: str | None
    ) -> Callable[[Spec, GroupKey], Status]:
        """The cheap check of a signature with a selector or shard: the group's hardware id
        says (a selector here has only grouping keys, see ``Cluster._decide``), then the kind's."""
        first = kind.first_status
        hw = self._hw
        memo = self.selector_match

        def check(spec: Spec, gkey: GroupKey) -> Status:
            h = gkey[0]
            if shard is not None and hw[h].shard != shard:
                return _SHARD_REFUSAL
            if selector:
                # Memoized per hardware id: a selector meets every change of the groups it
                # does not match here.
                match = memo.get((selector, h))
                if match is None:
                    if len(memo) >= self._match_max:
                        memo.clear()
                    labels = hw[h].labels
                    match = memo[(selector, h)] = all(labels.get(k) == v for k, v in selector)
                if not match:
                    return SELECTOR_REFUSAL
            return first(spec, gkey)

        return check


def _gkey_of(entry: HeapEntry) -> GroupKey:
    _a, _b, _c, _d, _seq, gkey, _exact = entry
    return gkey
