"""The placement framework: the node registry and one fixed decision pipeline.

:class:`Cluster` keeps every node's hardware, labels, health and holds (the registry) and
decides placements without walking every node. What is particular to a device kind — whole
GPUs, shares, stacking, MIG — is a plugin (:mod:`.plugins`, the interface and the pipeline in
:mod:`.plugins.base`); the node order is :mod:`.scores`; preemption, the step after a decision
that found no node, is :mod:`.preempt` (its view of the holds: :mod:`.victims`).

The index. State is kept per node as ``(hardware id, group mask)``: the hardware id names the
compiled :class:`~.model.Shape` plus the node's *grouping* labels and shard (see "Labels and
node selectors" below), the group mask the free slots (and a kind's state above them: share
usage). Nodes with the same pair form a *group* (:class:`~.index.GroupIndex`, one per indexed
kind); the in-node search runs once per (request key, shape, mask) and is cached, so a fleet of
identical servers costs one search per distinct free state.

Every change of a node's group is appended to its index's change log; per request
*signature* (request key, node selector, shard, reserve pressure) :mod:`.signatures` keeps a
heap of the groups that may take it, replayed from the log, so a decision costs O(changes
since the signature's last decision), not O(nodes), and a refusal's aggregated reason comes
from counters without a scan.

Labels and node selectors. A node's labels are indexed by ``(key, value)``; a group is keyed
only by the labels a selector has needed to *tell groups apart*. A selector that few nodes
match (at most ``pinned_max``, as a ``kubernetes.io/hostname`` selector matches one) is
decided on those nodes directly: their in-node results come from the same cache and they are
ordered by the same key as the heap, so such requests cost O(matching nodes) and create no
signature state. Only a selector that matches many nodes (``pool: a``) is decided through the
heap, and its label keys then become grouping keys: every node is re-keyed once (O(nodes), once
per new key). Labels that are unique per node, like the hostname the allocator service puts on
every node, therefore never split the fleet into one group per node. A node's *shard* (the
allocator replica that looks at it first, :mod:`.scores`) is always part of its hardware id and
is decided like a selector that needs no regrouping. Memory does not grow with the stream of
selectors: signature states are bounded in number and in total size (:mod:`.signatures`,
``_SIG_RECORDS``, least recently used dropped), cached in-node results and memoized selector
matches per hardware id in number (``EVAL_MAX``, ``_SELECTOR_MATCH_MAX``), grouping keys can
only be label keys that many nodes carry, and nothing else is kept per selector
(:meth:`Cluster.cache_stats` reports the sizes).

Holds are kept per node name and survive ``set_node`` / ``remove_node`` (a removed or
unknown node keeps its holds until they are released, so a node that comes back never has its
in-use devices handed out twice). Not thread-safe: one owner calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Literal

from schemas.config import DeviceClass, default_device_classes
from schemas.messages import AllocationRequest
from schemas.topology import NodeTopology, Scope

from . import scopenote
from .errors import InvalidRequest
from .index import GroupIndex, GroupKey
from .labels import Labels
from .model import Shape, bits, compile_shape, shape_signature
from .nodes import Hardware, Node, port_down
from .placement import (
    SELECTOR_REFUSAL,
    NodeReason,
    Placement,
    Unschedulable,
    unschedulable,
    wire_placement,
)
from .plugins import Best, DeviceKind, IndexedKind, MigInstances, Shares, Stacking, WholeGpus
from .plugins.base import overriding
from .preempt import Preemption, plan
from .request import Spec, normalise
from .scores import DEFAULT_RESERVE, NodeOrder, OrderKey
from .search import Choice, Refusal
from .shares import GpuUse, slot_bits
from .signatures import Signatures
from .victims import PreemptionView, Victims

__all__ = ["DEFAULT_RESERVE", "Cluster", "NodeReason", "Placement", "Unschedulable"]

NodePolicy = Literal["binpack", "spread"]

# The bounds below are read when a Cluster is made (tests lower them to reach the limits).
_LOG_MAX = 200_000  # change-log entries kept before lagging signatures are rebuilt
# Group records (groups seen + heap entries) over all signature states: what bounds their
# memory when groups are many (a fleet split by labels) or selectors keep changing.
_SIG_RECORDS = 300_000
_SELECTOR_MATCH_MAX = 50_000  # memoized selector matches before they are cleared (.signatures)
# Selectors matching at most this many nodes are decided on those nodes directly.
DEFAULT_PINNED_MAX = 32
_NO_HOLDS: dict[str, tuple[str, ...]] = {}  # a node without holds (never written)


class Cluster:
    """All nodes' hardware, health and holds; decides placements (see the module docstring).

    ``reserve``: the share of the servers able to host the largest aligned job that binpack
    tries to keep able to host it (0 turns reserve pressure off, :mod:`.scores`).
    ``pinned_max``: a node selector that at most this many nodes match is decided on those
    nodes directly (0: every selector goes through the groups; for tests of that path)."""

    def __init__(
        self,
        node_policy: NodePolicy | str = "binpack",
        device_classes: Mapping[str, DeviceClass] | None = None,
        *,
        reserve: float = DEFAULT_RESERVE,
        pinned_max: int = DEFAULT_PINNED_MAX,
    ) -> None:
        if node_policy not in ("binpack", "spread"):
            raise InvalidRequest(f"unknown node policy {node_policy!r}; expected binpack or spread")
        if not 0.0 <= reserve <= 1.0:
            raise InvalidRequest(f"reserve must be a fraction between 0 and 1, got {reserve!r}")
        if pinned_max < 0:
            raise InvalidRequest(f"pinned_max must not be negative, got {pinned_max!r}")
        self.reserve = reserve
        self.pinned_max = pinned_max
        self.node_policy: NodePolicy = "binpack" if node_policy == "binpack" else "spread"
        self.device_classes: dict[str, DeviceClass] = dict(
            device_classes if device_classes is not None else default_device_classes()
        )
        self._nodes: dict[str, Node] = {}
        self._holds: dict[str, dict[str, tuple[str, ...]]] = {}
        self._victims = Victims(self._nodes, self._holds)
        self._shapes: dict[tuple[object, ...], Shape] = {}
        # Labels, shards, grouping keys and the hardware ids they make (see the docstring).
        self._labels = Labels()
        self._hw: list[Hardware] = self._labels.hw  # hardware id -> shape, grouping labels, shard
        self._scores = NodeOrder(self._hw, node_policy=self.node_policy, reserve=reserve)
        # The node order, as the property tests call it.
        self._order = self._scores.order
        # The device kinds, in the order they are asked (see .plugins.base).
        self._whole_kind = WholeGpus(self._hw, self._scores, log_max=_LOG_MAX, compact=self._compact)
        self._shares = Shares(
            self._hw,
            self._nodes,
            whole=self._whole_kind,
            order=self._scores,
            best=self._best,
            log_max=_LOG_MAX,
            compact=self._compact,
            went_live=self._went_live,
        )
        self._stacking: Stacking = self._shares.stack
        self._mig = MigInstances(self._nodes, node_policy=self.node_policy)
        self._alone: tuple[DeviceKind, ...] = (self._mig,)  # kinds with an index of their own
        self._indexed: tuple[IndexedKind, ...] = (self._stacking, self._shares, self._whole_kind)
        self._whole = self._whole_kind.index  # the main index (tests read its log)
        # What the registry tells the kinds (.plugins.base.Hooks): every kind at a node's
        # registration; per hold, refresh and move only the live kinds that override the hook
        # (bound in _went_live), and a hold with shares every kind that keeps holds.
        self._kinds: tuple[DeviceKind, ...] = (*self._alone, *self._indexed)
        self._hold_set_any = overriding(self._kinds, "hold_set")
        self._protects = overriding(self._kinds, "protects")
        self._went_live()
        self._signatures = Signatures(
            self._hw,
            self._nodes,
            order=self._order,
            pressure=self._scores.pressure,
            log_max=_LOG_MAX,
            records_max=_SIG_RECORDS,
            match_max=_SELECTOR_MATCH_MAX,
        )
        # Bumped whenever a node's hardware or labels change or it goes: readers that index
        # nodes by their labels (core.gang's fabric index) know when to rebuild.
        self.nodes_version = 0

    # ------------------------------------------------------------------------------------
    # the registry: state changes

    def set_node(
        self,
        name: str,
        topology: NodeTopology,
        *,
        labels: Mapping[str, str] | None = None,
        unavailable: Iterable[str] = (),
        shard: str | None = None,
    ) -> None:
        """Add or replace a node's hardware, labels, unavailable devices and shard (the
        allocator replica that decides on it first, see ``decide``); holds are kept."""
        sig = shape_signature(topology)
        shape = self._shapes.get(sig)
        if shape is None:
            shape = self._shapes[sig] = compile_shape(topology, shape_id=len(self._shapes), signature=sig)
            for kind in self._kinds:
                kind.new_shape(shape)
        merged = {**topology.labels, **(labels or {})}
        hw = self._labels.hw_id(shape, merged, shard)
        node = Node(name, topology, shape, hw, merged, tuple(unavailable), port_down(topology), shard=shard)
        refreshing = []
        for kind in self._kinds:
            taken = kind.node_set(name, topology, shape, merged, shard=shard)
            if taken:
                node.kind_block |= taken
                refreshing.append(kind.refreshed)
        node.refreshing = tuple(refreshing)
        self._victims.forget(name)
        old = self._nodes.get(name)
        self.nodes_version += 1
        self._nodes[name] = node
        if old is not None:
            self._labels.file(old, -1)
        self._labels.file(node, 1)
        if old is None or old.shape is not shape:
            if old is not None:
                self._scores.count_capable(old.shape.aligned, -1)
            self._scores.count_capable(shape.aligned, 1)
        if old is None:
            self._refresh(node, old_key=None, was_impaired=False)
        else:
            self._refresh(node, old_key=(old.hw, old.mask), was_impaired=old.impaired)

    def set_unavailable(self, name: str, devices: Iterable[str]) -> None:
        """Replace the set of unhealthy or cordoned device ids of ``name``."""
        node = self._need(name)
        was = node.impaired
        node.unavailable = tuple(devices)
        self._victims.forget(name)
        self._refresh(node, old_key=(node.hw, node.mask), was_impaired=was)

    def remove_node(self, name: str) -> None:
        """Forget the node's hardware (its holds stay until released)."""
        node = self._nodes.pop(name, None)
        self._victims.forget(name)
        if node is not None:
            for kind in self._kinds:
                kind.node_removed(name)
            self.nodes_version += 1
            self._labels.file(node, -1)
            self._scores.count_capable(node.shape.aligned, -1)
            self._move(name, (node.hw, node.mask), None, was_impaired=node.impaired, now_impaired=False)

    def hold(
        self,
        name: str,
        request_id: str,
        devices: Iterable[str],
        *,
        priority: int = 0,
        preemptible: bool = False,
        shares: Mapping[str, tuple[int, int]] | None = None,
        sharing: str = "",
    ) -> None:
        """Mark ``devices`` used by ``request_id`` on ``name`` (replaces that request's hold).

        ``devices`` may name MIG instances (``gpu0-mig1-0``, see :mod:`.mig`); a hold with one
        is never a victim either.

        ``preemptible``: a request of higher ``priority`` that may preempt may have this hold
        evicted (:mod:`.preempt`, :mod:`.victims`); the default is protected (a decision in
        flight, a claim). ``shares``: the GPUs of ``devices`` held as shares, device id ->
        (memory MiB, compute percent), as :meth:`Placement.shares` gives them; the other
        devices are held whole. A preemptible hold with shares may be a victim like any other:
        its GPUs count as held, so only evicting every share of a GPU frees it
        (:mod:`.preempt`). ``sharing``: how the shares are limited (the assignment's
        ``sharing``: ``mps``, else HAMi-core); a GPU takes further shares of its shares' mode
        only (:mod:`.shares`). The kinds keep what is theirs of a hold (.plugins.base.Hooks)."""
        devs = tuple(sorted(set(devices)))
        evictable = preemptible
        if evictable:
            for protects in self._protects:  # a kind whose holds are never victims (MIG)
                if protects(devs):
                    evictable = False
                    break
        if evictable:
            self._victims.add(name, request_id, priority)
        else:
            self._victims.drop(name, request_id)
        holds = self._holds.setdefault(name, {})
        changed = holds.get(request_id) != devs
        for hold_set in self._hold_set_any if shares else self._hold_set:
            if hold_set(name, request_id, shares=shares, sharing=sharing):
                changed = True
        if not changed:
            return
        holds[request_id] = devs
        node = self._nodes.get(name)
        if node is not None:
            self._refresh(node, old_key=(node.hw, node.mask), was_impaired=node.impaired)

    def release(self, name: str, request_id: str) -> None:
        """Free ``request_id``'s hold on ``name``; releasing an unknown hold does nothing."""
        self._victims.drop(name, request_id)
        holds = self._holds.get(name)
        if not holds or request_id not in holds:
            return
        del holds[request_id]
        if not holds:
            del self._holds[name]
        for hold_removed in self._hold_removed:
            hold_removed(name, request_id)
        node = self._nodes.get(name)
        if node is not None:
            self._refresh(node, old_key=(node.hw, node.mask), was_impaired=node.impaired)

    def _refresh(self, node: Node, *, old_key: GroupKey | None, was_impaired: bool) -> None:
        """Recompute a node's group mask from its holds and health, and move it (Reserve)."""
        shape = node.shape
        blocked = 0
        slot_of = shape.slot_of
        for dev in (*node.unavailable, *node.port_down):
            s = slot_of.get(dev)
            if s is not None:
                blocked |= 1 << s
        blocked |= node.kind_block
        holds = self._holds.get(node.name, _NO_HOLDS)
        mask = None
        for group_mask in self._group_mask:  # a kind that keeps state in the mask (shares)
            mask = group_mask(node, blocked, holds)
            if mask is not None:
                break
        if mask is None:
            for devs in holds.values():
                for dev in devs:
                    s = slot_of.get(dev)
                    if s is not None:
                        blocked |= 1 << s
            mask = shape.effective_free(blocked)
        node.mask = mask
        for refreshed in node.refreshing:
            refreshed(node, holds)
        self._move(
            node.name, old_key, (node.hw, node.mask), was_impaired=was_impaired, now_impaired=node.impaired
        )

    def _move(
        self,
        name: str,
        old: GroupKey | None,
        new: GroupKey | None,
        *,
        was_impaired: bool,
        now_impaired: bool,
    ) -> None:
        """A node moves from group ``old`` to ``new`` (full keys: slot and share bits): every
        indexed kind whose index is live follows (one built on first use from then on)."""
        for follow in self._follow:
            follow(name, old, new, was_impaired=was_impaired, now_impaired=now_impaired)

    def _went_live(self) -> None:
        """A kind went live (its index built on first use, or rebuilt): from now on the holds,
        refreshes and moves reach it. A kind keeps no state of holds before it is live, so
        until then only a hold with shares (what makes the share kind live) is shown to it."""
        live = [kind for kind in self._kinds if kind.live]
        self._hold_set = overriding(live, "hold_set")
        self._hold_removed = overriding(live, "hold_removed")
        self._group_mask = overriding(live, "group_mask")
        self._follow: tuple[Callable[..., None], ...] = tuple(
            kind.follow for kind in self._indexed if kind.live
        )

    # ------------------------------------------------------------------------------------
    # the registry: queries

    def nodes(self) -> list[str]:
        return list(self._nodes)

    def topology(self, name: str) -> NodeTopology:
        return self._need(name).topology

    def labels(self, name: str) -> dict[str, str]:
        return dict(self._need(name).labels)

    def shard(self, name: str) -> str | None:
        """The shard ``name`` was registered with (None: none)."""
        return self._need(name).shard

    def held(self, name: str) -> list[str]:
        """The requests (and reservation keys) holding devices on ``name``."""
        holds = self._holds.get(name)
        return list(holds) if holds else []

    def holds(self, name: str) -> dict[str, frozenset[str]]:
        return {rid: frozenset(devs) for rid, devs in self._holds.get(name, {}).items()}

    def shares(self, name: str) -> dict[str, dict[str, tuple[int, int]]]:
        """The share holds of ``name``: request -> GPU device id -> (memory MiB, compute %)."""
        return self._shares.shares_of(name)

    def gpu_shares(self, name: str) -> dict[str, GpuUse]:
        """Shared GPUs of ``name`` that can take more shares, by device id: (used memory MiB,
        used compute percent, shares); a shared GPU that is out of service is left out."""
        return self._shares.gpu_shares(self._need(name))

    def used_devices(self, name: str) -> set[str]:
        return {d for devs in self._holds.get(name, {}).values() for d in devs}

    def unavailable_devices(self, name: str) -> set[str]:
        node = self._need(name)
        return {*node.unavailable, *node.port_down}

    def free_devices(self, name: str) -> list[str]:
        """Device ids (``gpu<N>``, NIC and VF RDMA names) that a request could get now."""
        node = self._need(name)
        return [node.shape.slot_id[s] for s in bits(slot_bits(node.shape, node.mask))]

    def free_counts(self, name: str) -> tuple[int, int]:
        """(free GPUs, free NIC physical functions) of ``name``."""
        node = self._need(name)
        return ((node.mask & node.shape.gpu_all).bit_count(), (node.mask & node.shape.pf_all).bit_count())

    def mig_instances(self, name: str) -> dict[str, list[str]]:
        """Free MIG instances of ``name`` by profile (device ids); empty without MIG GPUs."""
        return self._mig.free_instances(name)

    def totals(self) -> dict[str, int]:
        """Cluster-wide counts: gpus, free_gpus, nics, free_nics (physical functions)."""
        t = {"gpus": 0, "free_gpus": 0, "nics": 0, "free_nics": 0}
        for (hw, mask), members in self._whole.groups.items():
            shape = self._hw[hw].shape
            n = len(members)
            t["gpus"] += shape.n_gpus * n
            t["free_gpus"] += (mask & shape.gpu_all).bit_count() * n
            t["nics"] += shape.pf_all.bit_count() * n
            t["free_nics"] += (mask & shape.pf_all).bit_count() * n
        return t

    def fit_count(self, request: AllocationRequest) -> int:
        """How many nodes could take ``request`` now (a required scope met); walks every group.

        For reports and benchmarks (for example "nodes that can still take an 8-GPU + 8-NIC
        switch-aligned job"), not for the decision path."""
        spec = normalise(request, self.device_classes)
        alone = self._alone_kind(spec)
        if alone is not None:
            return alone.fit_count(spec) or 0
        kind = self._kind(spec)
        evaluate = kind.evaluate
        if spec.selector:
            matching = self._labels.matching(self._nodes, spec.selector)
            return sum(isinstance(evaluate(spec, node.shape, node.mask), Choice) for node in matching)
        kind.ready()
        n = 0
        for (hw, mask), members in kind.index.groups.items():
            if isinstance(evaluate(spec, self._hw[hw].shape, mask), Choice):
                n += len(members)
        return n

    def group_count(self) -> int:
        """Distinct (hardware, free-mask) groups: what a decision's work scales with."""
        return len(self._whole.groups)

    def grouping_labels(self) -> frozenset[str]:
        """The label keys nodes are grouped by: those of selectors that matched many nodes."""
        return self._labels.keyed

    def cache_stats(self) -> dict[str, int]:
        """Sizes of the index and caches, for metrics and benchmarks: every one is bounded
        (see the module docstring), whatever the stream of requests and selectors."""
        stats = {
            "nodes": len(self._nodes),
            "groups": len(self._whole.groups),
            "hardware_ids": len(self._hw),
            "selector_matches": len(self._signatures.selector_match),
            "grouping_labels": len(self._labels.keyed),
            "signatures": len(self._signatures.sigs),
            "signature_records": self._signatures.records,
        }
        for kind in reversed(self._kinds):  # whole GPUs first
            stats.update(kind.stats())
        return stats

    # ------------------------------------------------------------------------------------
    # preemption support (the search itself is in .preempt, the views in .victims)

    def preemptible(self) -> dict[str, dict[str, tuple[tuple[str, ...], int]]]:
        """Per known node that has any: its preemptible holds, as request id -> (devices,
        priority)."""
        return self._victims.preemptible()

    def matches(self, name: str, spec: Spec) -> bool:
        """Whether node ``name`` matches the request's node selector."""
        labels = self._need(name).labels
        return all(labels.get(k) == v for k, v in spec.selector)

    def preemption_groups(self) -> dict[PreemptionView, dict[str, None]]:
        """Nodes with preemptible holds, grouped by their preemption view (see
        :meth:`.victims.Victims.groups`). Maintained lazily: only the nodes whose holds or
        hardware changed since the last call are looked at again."""
        return self._victims.groups()

    def preemptible_holds(self, name: str) -> dict[str, tuple[int, int]]:
        """The preemptible holds of ``name``: request id -> (priority, slot mask)."""
        return self._victims.holds_of(self._need(name))

    def shape_of(self, name: str) -> Shape:
        return self._need(name).shape

    # ------------------------------------------------------------------------------------
    # whole jobs: what core.gang reads (the same cached in-node search as decide)

    def job_nodes(self) -> Iterator[tuple[str, Mapping[str, str], NodeTopology, Shape, int]]:
        """``(name, labels, topology, shape, free mask)`` of every node, in registration
        order. The labels are the node's own mapping: read it, never change it."""
        for node in self._nodes.values():
            yield node.name, node.labels, node.topology, node.shape, node.mask

    def job_groups(self) -> Iterator[tuple[Shape, int, Collection[str]]]:
        """``(shape, free mask, node names)`` per group of nodes with the same hardware and
        free slots: a whole job's per-node search runs once per group, not per node."""
        for (hw, mask), members in self._whole.groups.items():
            yield self._hw[hw].shape, mask, members.keys()

    def evaluate_free(self, spec: Spec, shape: Shape, mask: int) -> Choice | Refusal:
        """The cached in-node search of ``spec`` on ``shape`` with free slots ``mask`` (which
        need not be a node's current mask: a job asks what is left after its earlier pods)."""
        return self._kind(spec).evaluate(spec, shape, mask)

    def placement_of(self, name: str, choice: Choice, spec: Spec, *, candidates: int = 1) -> Placement:
        """``choice`` (slot-level, on ``name``'s shape, found for ``spec``) as a
        :class:`Placement` (the wire-level one a decision returns)."""
        return wire_placement(self._need(name), choice, spec=spec, candidates=candidates)

    # ------------------------------------------------------------------------------------
    # decisions: the pipeline (see .plugins.base)

    def normalise(self, request: AllocationRequest) -> Spec:
        """The request with class defaults applied; raises InvalidRequest."""
        return normalise(request, self.device_classes)

    def decide(
        self,
        request: AllocationRequest,
        *,
        last_of_equals: bool = False,
        prefer_shard: str | None = None,
        before_fallback: Callable[[], None] | None = None,
        fallback: bool = True,
    ) -> Placement | Unschedulable:
        """The best node and devices for ``request`` now; changes no hold.

        ``last_of_equals``: among equally good nodes (the members of one group) take the last
        instead of the first. ``prefer_shard``: the nodes registered with that shard come
        first (:mod:`.scores`, "shard preference"); when none of them can take the request,
        ``before_fallback`` is called (the caller brings the other nodes up to date) and every
        node is considered, taking the last of equally good nodes (services/allocator/replicas.py)
        — unless ``fallback`` is false: then the shard's refusal is the answer."""
        spec = normalise(request, self.device_classes)
        if prefer_shard is not None:
            mine = self._decide(spec, shard=prefer_shard)
            if isinstance(mine, Placement) or not fallback:
                return mine
            if before_fallback is not None:
                before_fallback()
            last_of_equals = True
        return self._decide(spec, last_of_equals=last_of_equals)

    def preempt(self, spec: Spec) -> Preemption | None:
        """The pipeline's step after a failed decision (the PostFilter): which lower-priority
        allocations to evict so that ``spec`` (the failed decision's ``Unschedulable.spec``)
        fits, or None when it may not preempt or nothing helps (:mod:`.preempt`). Changes no
        hold: the caller evicts and decides again once the victims are freed."""
        return plan(self, spec)

    def _decide(
        self, spec: Spec, *, shard: str | None = None, last_of_equals: bool = False
    ) -> Placement | Unschedulable:
        # PreFilter: the kind that decides the request (loops inlined: once per decision).
        for alone in self._alone:
            if alone.applies(spec):
                got = alone.place(spec, shard=shard)
                assert got is not None, "a kind that decides alone always answers"
                return got
        for kind in self._indexed:
            if kind.applies(spec):
                break
        if spec.selector or shard is not None:
            few = self._labels.few_matching(self._nodes, spec.selector, shard, most=self.pinned_max)
            if few is not None:
                return self._decide_among(spec, kind, few)
            keys = frozenset(k for k, _ in spec.selector)
            if not keys <= self._labels.keyed:
                self._regroup(self._labels.keyed | keys)
        # A kind's own decision, without the heaps (shares without a selector); a kind whose
        # index is built on first use builds it here, before the heaps below read it.
        got = kind.place(spec, shard=shard)
        if got is not None:
            return got
        top = self._signatures.top(spec, kind, shard=shard, last_of_equals=last_of_equals)
        if isinstance(top, Best):
            return wire_placement(top.node, top.choice, spec=spec, candidates=top.candidates)
        st = top
        impaired: dict[str, int] = {}
        for gkey, n in kind.index.impaired.items():
            rec = st.groups.get(gkey)
            if rec is not None and isinstance(rec.status, Refusal):
                text = rec.status.text
                impaired[text] = impaired.get(text, 0) + n
        return unschedulable(
            spec, refused=st.refused, codes=st.codes, impaired=impaired, any_nodes=bool(self._nodes)
        )

    def _alone_kind(self, spec: Spec) -> DeviceKind | None:
        for kind in self._alone:
            if kind.applies(spec):
                return kind
        return None

    def _kind(self, spec: Spec) -> IndexedKind:
        for kind in self._indexed:
            if kind.applies(spec):
                return kind
        raise AssertionError("the whole-GPU kind takes every request")

    def scope_reason(self, placement: Placement) -> str:
        """Why ``placement``, just decided, pairs at a coarser scope than its request asked (""
        when it met it), for the person reading ``tandem explain``; worded
        by :mod:`.scopenote`. Asked only for a placement that missed a preferred scope, so it
        may decide once more: with the alignment-first order where the class chose
        ``used-first`` (is a better scope free elsewhere?), or with the scope required (why
        does no node meet it?)."""
        if placement.met:
            return ""
        spec = placement.spec  # as the decision resolved it: no default derived again
        if spec.shared or spec.mig_profile or spec.selector:
            return scopenote.limited(spec)
        if self._scores.pressure():
            return scopenote.reserve(spec)
        used_first = self.node_policy == "binpack" and spec.dc.node_order == "used-first"
        top = self._best(scopenote.aligned_order(spec) if used_first else spec)
        if top and top.node.name != placement.node and top.choice.scope < Scope.parse(placement.scope):
            return scopenote.better_elsewhere(
                spec, node=top.node.name, scope=top.choice.scope, used_first=used_first
            )
        return scopenote.no_node(spec, self._decide(scopenote.with_scope_required(spec)))

    def _best(self, spec: Spec) -> Best | None:
        """The best node of the index of ``spec``'s kind, or None (what plugins ask)."""
        top = self._signatures.top(spec, self._kind(spec))
        return top if isinstance(top, Best) else None

    # ------------------------------------------------------------------------------------
    # the registry: hardware ids, labels, selectors

    def _need(self, name: str) -> Node:
        node = self._nodes.get(name)
        if node is None:
            raise KeyError(f"unknown node {name!r}")
        return node

    def _decide_among(self, spec: Spec, kind: IndexedKind, nodes: list[Node]) -> Placement | Unschedulable:
        """Decide on a few nodes (a pinned request): the same cached in-node results and the
        same node order as the heap, without a signature state; O(len(nodes))."""
        pressure = self._scores.pressure()
        evaluate, order = kind.evaluate, self._order
        refused: dict[str, int] = {}
        codes: dict[str, str] = {}
        impaired: dict[str, int] = {}
        best: tuple[OrderKey, Node, Choice] | None = None
        feasible = 0
        for node in nodes:
            res = evaluate(spec, node.shape, node.mask)
            if isinstance(res, Refusal):
                refused[res.text] = refused.get(res.text, 0) + 1
                codes[res.text] = res.code
                if node.impaired:
                    impaired[res.text] = impaired.get(res.text, 0) + 1
                continue
            feasible += 1
            key = order(spec, (node.hw, node.mask), res, pressure=pressure)
            if best is None or key < best[0]:
                best = (key, node, res)
        if best is not None:
            _key, node, choice = best
            return wire_placement(node, choice, spec=spec, candidates=feasible)
        others = len(self._nodes) - len(nodes)
        if others:
            text = SELECTOR_REFUSAL.text
            refused[text] = refused.get(text, 0) + others
            codes[text] = SELECTOR_REFUSAL.code
        return unschedulable(
            spec, refused=refused, codes=codes, impaired=impaired, any_nodes=bool(self._nodes)
        )

    def _regroup(self, keyed: frozenset[str]) -> None:
        """Group nodes by ``keyed`` label keys from now on: every node gets a new hardware id,
        so the groups, the change log and every signature state start over (O(nodes), once
        per new grouping key)."""
        self._labels.regroup(keyed)
        self._signatures.clear()
        hw_id = self._labels.hw_id
        nodes = self._nodes.values()
        for node in nodes:
            node.hw = hw_id(node.shape, node.labels, node.shard)
        for kind in reversed(self._kinds):  # the main index first
            kind.regrouped(nodes)

    def _compact(self, index: GroupIndex) -> None:
        """A kind's index log grew past its bound (see :meth:`.signatures.Signatures.compact`)."""
        self._signatures.compact(index)
