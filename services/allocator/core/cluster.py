"""The cluster index: which node gets a request, without walking every node.

State is kept per node as ``(hardware id, free mask)``: the hardware id names the compiled
:class:`~services.allocator.core.model.Shape` plus the node's *grouping* labels (see "Labels
and node selectors" below), the free mask the slots neither held nor unavailable. Nodes
with the same pair form a *group*; the in-node search
(:func:`~services.allocator.core.search.evaluate`) runs once per (request key, shape, mask)
and is cached, so a fleet of identical servers costs one search per distinct free state.

Every change of a node's group is appended to a change log as ``(group, -1)`` / ``(group,
+1)``. For each distinct request *signature* (request key + node selector) the index keeps a
:class:`_SigState`: a heap of the groups that may take the request, the number of nodes in
each, and per-reason counts of the nodes that cannot. A decision first replays the log
entries that signature has not seen (net changes only when there are many; a signature
unused for long is rebuilt from the groups instead), then reads the top of the heap. Groups
enter the heap after a cheap popcount check with an optimistic key and are searched only
when they reach the top, so most groups of a large fleet are never searched for most
requests. A decision costs O(changes since the signature's last decision), not O(nodes); a
refusal's aggregated reason comes from the counters without a scan (per group: its nodes, and
how many of them have devices out of service).

Node order (the heap key):

1. the *cross-node* part of the placement quality (:func:`.search.cross_key`): requested
   scope met, pairs within the requested scope and each coarser one, NVLink fit; then, for a
   GPU-only (NIC-only) request, fewer free NICs (GPUs) on the node
   (:func:`.search.one_sided_waste`). Alignment finer than requested only orders placements
   within a node, so a ``numa`` request does not take a fresh node for a free switch pair;
2. ``binpack``: a ``preferred`` request does not open a completely free server while a used
   one can take it (:func:`.search.fresh_cost`, ahead of 1.; among free servers the smallest);
   a class with ``node_order: alignment-first`` puts this after 1. instead (the best scope
   anywhere, a used node only among equals: docs/benchmarks.md, "Node order", measures what
   that costs at high fill); then the less capable server
   (``Shape.aligned``: GPUs that can pair with a NIC on their own PCIe switch; then GPU
   count), so that small jobs use the aligned slots of weaker servers and the servers that
   can host large aligned jobs stay whole; then fragmentation (the whole switches / NUMA
   nodes / NVLink partitions the placement breaks) and the fullest node (fewest free GPUs,
   then NICs), then the hardware (shape) registered first — not the labels, so that grouping
   by a label never reorders nodes;
   ``spread``: the emptiest node, then fragmentation;
3. the full in-node quality (finer pairs win ties), then first registered.

Quality comes before node policy: a half-empty node with switch-aligned pairs beats a nearly
full node that could only align at NUMA level — except that ``binpack`` does not open a
completely free node for a ``preferred`` request (unless its class says
``alignment-first``), and except under *reserve pressure*. The price: on an empty mixed
cluster a 2+2 request lands on the smallest server, a PCIe box, across its root complex, while
DGX servers with whole switches are idle; opening the best-aligned server instead breaks the
big servers that large aligned jobs need, measured as more refusals at 90-95 % fill.

Reserve pressure (``binpack`` only). Alignment-first placement keeps small NIC jobs on the
servers that can align them, which under heavy load are exactly the servers the large
aligned jobs (8 GPUs + 8 NICs on PCIe switches) need: measured in ``docs/benchmarks.md``,
that made Tandem refuse more large jobs at 90-95 % utilisation than a GPU-first allocator.
So the index keeps a *reserve*: ``K`` is the largest aligned job (``Shape.aligned``) that at
least ``1 / reserve`` nodes can host when free, and while fewer than ``ceil(reserve x those
nodes)`` can host it now (``Shape.aligned_free``), every binpack decision orders nodes by
:func:`.search.capacity_cost` first (how far the largest fully aligned job the node could
take drops, buddy-style: using a partial unit costs 0, breaking a node's last 4+4 or 8+8
unit costs 4 or 8), then by 1., then fullest node, hardware registered first, and
fragmentation. A ``preferred`` request may then get a ``pcie-root`` or ``numa`` pair on a used
server instead of breaking an aligned unit; a ``required`` one is still never placed below
its scope. In-node placement is the same exact optimum in both orders. With the default
reserve (2 %) a fleet needs 50 servers of the largest aligned kind before any is held in
reserve; smaller clusters always use the alignment-first order. Each signature keeps one
heap per order (the pressure flag is part of its key), so switching costs a replay, not a
rebuild.

Labels and node selectors. A node's labels are indexed by ``(key, value)``; a group is keyed
only by the labels a selector has needed to *tell groups apart*. A selector that few nodes
match (at most ``pinned_max``, as a ``kubernetes.io/hostname`` selector matches one) is
decided on those nodes directly: their in-node results come from the same cache and they are
ordered by the same key as the heap, so such requests cost O(matching nodes) and create no
signature state. Only a selector that matches many nodes (``pool: a``) is decided through the
heap, and its label keys then become grouping keys: every node is re-keyed once (O(nodes), once
per new key). Labels that are unique per node, like the hostname the allocator service puts on
every node, therefore never split the fleet into one group per node. Memory does not grow
with the stream of selectors: signature states are bounded in number and in total size
(``_SIG_MAX``, ``_SIG_RECORDS``, least recently used dropped), cached in-node results and
memoized selector matches per hardware id in number (``_EVAL_MAX``,
``_SELECTOR_MATCH_MAX``), grouping keys can only be label keys that many nodes carry, and
nothing else is kept per selector (:meth:`Cluster.cache_stats` reports the sizes).

Holds are kept per node name and survive ``set_node`` / ``remove_node`` (a removed or
unknown node keeps its holds until they are released, so a node that comes back never has its
in-use devices handed out twice). A hold may be *preemptible* with a priority
(``hold(..., priority=, preemptible=True)``): :mod:`.preempt` may then choose it as a victim
for a request of higher priority; the nodes with such holds are kept grouped by what that
search depends on (:meth:`Cluster.preemption_groups`), rebuilt lazily for the nodes whose
holds changed (a hold of GPU shares may be a victim too: every share of a GPU evicted frees it
whole; a hold of MIG instances never is). Not thread-safe: one owner calls it.

Shares of GPUs (fractional GPUs, :mod:`.shares`): a hold may give some of its GPUs as shares
(memory MiB, compute percent); a shared GPU leaves the free mask like a held one, and the
node's share usage is packed into its mask above the slot bits. Whole-GPU requests are indexed
exactly as before, by ``(hardware, slot bits)``: a change of share usage alone is not a change
for them, so their decisions cost what they did. Share requests go through a second, parallel
index of the same kind keyed by the full mask (its own groups and change log), with the same
signature states, heaps, lazy search and cache. The share index is built on first use (the
first share request or share hold, O(nodes) once), so a fleet that never shares pays nothing
for it, in time or memory.

A share request's signature includes its size, and every signature replays every change of
its index, so the share index alone costs O(distinct sizes x changes) and a rarely used size
meets a long backlog. So a share request without a node selector is decided by indexes that
keep nothing per size (:meth:`Cluster._decide_share_one`, :meth:`Cluster._decide_share_tiers`,
:mod:`.sharefit`): the placement on fresh GPUs only comes from the whole-GPU index (a fresh GPU
has all its memory and compute, so the size is only a minimum GPU memory, normalised to the
fleet's GPU memory sizes: one signature for all sizes); a one-GPU share stacks through a
per-GPU index of the shared GPUs by what they have left (best fit); a share on several GPUs
stacks through the share index's *stacking view* (``Spec.stack``), whose signatures see only
the nodes with shares (a third index, of those groups only). The better of the two tiers by
the node order wins. The share index itself still decides share requests with a node selector
(through the groups) and gives the reasons of a refusal.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import msgspec

from schemas.config import DeviceClass, default_device_classes
from schemas.messages import AllocationRequest, AssignedGpu, AssignedMig, AssignedNic, Pair
from schemas.topology import Gpu, Nic, NodeTopology, Scope, ScopeName

from .errors import InvalidRequest
from .index import GroupIndex, GroupKey
from .mig import MigChoice, MigIndex, is_mig_device
from .model import Shape, bits, compile_shape, device_at, shape_signature
from .request import Spec, normalise
from .search import Choice, Refusal, capacity_cost, cross_bound, evaluate, fresh_cost, precheck
from .sharefit import FitIndex, StackIndex
from .shares import (
    NO_STACK,
    GpuUse,
    evaluate_shared,
    gpu_use,
    pack,
    precheck_shared,
    share_bound,
    slot_bits,
    stacked_choice,
    stacked_with_nics,
)

__all__ = ["Cluster", "NodeReason", "Placement", "Unschedulable"]

NodePolicy = Literal["binpack", "spread"]

_LOG_MAX = 200_000  # change-log entries kept before lagging signatures are rebuilt
_SIG_MAX = 512  # signature states kept (least recently used dropped)
# Group records (groups seen + heap entries) over all signature states: what bounds their
# memory when groups are many (a fleet split by labels) or selectors keep changing.
_SIG_RECORDS = 300_000
_STACKS_MAX = 16  # per-GPU stacking indexes (one per one-GPU share request shape with NICs)
_EVAL_MAX = 50_000  # cached in-node results before the cache is cleared (~1 KB each at most)
_SELECTOR_MATCH_MAX = 50_000  # memoized selector matches before they are cleared (see _first_status)
# Selectors matching at most this many nodes are decided on those nodes directly.
DEFAULT_PINNED_MAX = 32
# Share of the nodes that can host the largest aligned job which binpack tries to keep able to
# host it (see Cluster._pressure); measured in docs/benchmarks.md.
DEFAULT_RESERVE = 0.02


@dataclass(slots=True)
class Placement:
    """A decision: the node, the exact devices, and how they pair.

    ``scope`` is the worst (coarsest) scope over ``pairs``; a placement without pairs (GPU-only
    or NIC-only) reports the finest scope that holds all its devices. ``met`` says whether the
    requested scope was met (always true for ``required``). ``candidates`` is the number of
    nodes considered: those with enough free GPUs and NICs of the class that match the
    selector, less those the search already found unable to meet a required scope.
    ``quality`` is the in-node ranking tuple (see :mod:`.search`: scope met, pair counts,
    NVLink fit, then fragmentation), smaller is better; equal tuples are equally good.
    """

    node: str
    gpus: list[AssignedGpu]
    nics: list[AssignedNic]
    pairs: list[Pair]
    scope: ScopeName
    candidates: int
    met: bool = True
    quality: tuple[int, ...] = ()

    # The device class's sharing mode and memory limit when the GPUs are shares.
    sharing: str = ""
    memory_limit: str = "hard"

    def devices(self) -> list[str]:
        return [g.device_id for g in self.gpus] + [n.name for n in self.nics]

    def shares(self) -> dict[str, tuple[int, int]]:
        """Shared GPUs by device id: (memory MiB, compute percent); empty for whole GPUs."""
        return {
            f"gpu{g.index}": (g.memory_mib or 0, g.cores_percent or 0)
            for g in self.gpus
            if g.memory_mib is not None or g.cores_percent is not None
        }


@dataclass(frozen=True, slots=True)
class NodeReason:
    code: str  # "gpus" | "nics" | "scope" | "selector"
    text: str
    nodes: int


@dataclass(slots=True)
class Unschedulable:
    """No node can take the request now. ``reason`` aggregates ``reasons`` for people."""

    reason: str
    counts: dict[str, int]
    reasons: list[NodeReason] = field(default_factory=list)
    candidates: int = 0


@dataclass(slots=True)
class _Node:
    name: str
    topology: NodeTopology
    shape: Shape
    hw: int
    labels: dict[str, str]
    # Tuples, not sets: strings-only tuples are untracked by the cycle collector, which keeps
    # full collections cheap on fleets of 10,000+ nodes.
    unavailable: tuple[str, ...]
    port_down: tuple[str, ...]
    mask: int = 0
    mig_block: int = 0  # slots of GPUs in MIG mode: never free as whole GPUs (see .mig)

    @property
    def impaired(self) -> bool:
        """Has devices out of service (unhealthy, cordoned, port down)."""
        return bool(self.unavailable or self.port_down)


_PENDING = None  # group status: passed the cheap check, not searched yet

# (cross-node quality, frag/policy in the policy's order, full in-node quality, seq, group,
# exact?); seq is unique, so comparisons never reach the group or the flag.
# A node's preemption view: (shape id, blocked slots, preemptible holds' (priority, slots)).
PreemptionView = tuple[int, int, tuple[tuple[int, int], ...]]

HeapEntry = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], int, GroupKey, bool]


@dataclass(slots=True)
class _SigState:
    """One request signature's view of the groups (see the module docstring)."""

    spec: Spec
    cursor: int
    heap: list[HeapEntry] = field(default_factory=list)
    in_heap: set[GroupKey] = field(default_factory=set)
    # group -> [nodes in it as replayed, status: Choice | Refusal | _PENDING]
    groups: dict[GroupKey, list[Any]] = field(default_factory=dict)
    # Refusal text -> nodes, and its code. Keyed by the text: a str caches its hash, and this
    # dict is updated on every replayed change of a refused group.
    refused: dict[str, int] = field(default_factory=dict)
    codes: dict[str, str] = field(default_factory=dict)
    feasible: int = 0  # nodes searched and able to take the request
    pending: int = 0  # nodes that passed the cheap check and are not searched yet
    pressure: bool = False  # ordered by the reserve-pressure order (see _entry)


class Cluster:
    """All nodes' hardware, health and holds; decides placements (see the module docstring).

    ``reserve``: the share of the servers able to host the largest aligned job that binpack
    tries to keep able to host it (0 turns reserve pressure off). ``pinned_max``: a node
    selector that at most this many nodes match is decided on those nodes directly (0: every
    selector goes through the groups; for tests of that path)."""

    def __init__(
        self,
        policy: NodePolicy | str = "binpack",
        device_classes: Mapping[str, DeviceClass] | None = None,
        *,
        reserve: float = DEFAULT_RESERVE,
        pinned_max: int = DEFAULT_PINNED_MAX,
    ) -> None:
        if policy not in ("binpack", "spread"):
            raise InvalidRequest(f"unknown node policy {policy!r}; expected binpack or spread")
        if not 0.0 <= reserve <= 1.0:
            raise InvalidRequest(f"reserve must be a fraction between 0 and 1, got {reserve!r}")
        if pinned_max < 0:
            raise InvalidRequest(f"pinned_max must not be negative, got {pinned_max!r}")
        self.reserve = reserve
        self.pinned_max = pinned_max
        self.policy: NodePolicy = "binpack" if policy == "binpack" else "spread"
        self.device_classes: dict[str, DeviceClass] = dict(
            device_classes if device_classes is not None else default_device_classes()
        )
        self._nodes: dict[str, _Node] = {}
        self._holds: dict[str, dict[str, tuple[str, ...]]] = {}
        # node -> preemptible hold -> its priority (see hold and .preempt); the nodes'
        # preemption views built from them, grouped by what a plan depends on (see
        # preemption_groups), rebuilt lazily for the nodes changed since (_pv_dirty).
        self._victims: dict[str, dict[str, int]] = {}
        self._pv: dict[str, PreemptionView] = {}
        self._pv_groups: dict[PreemptionView, dict[str, None]] = {}
        self._pv_dirty: set[str] = set()
        # node -> request -> its shared GPUs as (device id, memory MiB, compute percent)
        # node -> request -> its shares: (GPU device id, memory MiB, compute %, an MPS share)
        self._shares: dict[str, dict[str, tuple[tuple[str, int, int, bool], ...]]] = {}
        self._mig = MigIndex()  # MIG instances of nodes with GPUs in MIG mode (see .mig)
        self._shapes: dict[tuple[object, ...], Shape] = {}
        self._hw_ids: dict[tuple[int, tuple[tuple[str, str], ...]], int] = {}
        self._hw: list[tuple[Shape, dict[str, str]]] = []  # hardware id -> (shape, grouping labels)
        # (selector, hardware id) -> whether its grouping labels match (see _first_status)
        self._selector_match: dict[tuple[tuple[tuple[str, str], ...], int], bool] = {}
        self._whole = GroupIndex()  # keyed by (hardware id, slot bits)
        # The share index (see "Shares of GPUs" above): the same, keyed by the full group mask
        # (slot bits and share bits), for share requests only; whole-GPU signatures never see
        # the changes that move only share usage.
        self._share = GroupIndex()
        self._share_index = False  # built on first use (_share_index_on)
        # One-GPU, no-NIC share requests (see .sharefit): per device class, its shared GPUs by
        # what they have left; the GPU memory sizes of the fleet, sorted (for open_spec); the
        # whole-GPU specs that open a fresh GPU for a share, by (share spec key, memory floor).
        self._fits: dict[str, FitIndex] = {}
        self._gpu_memories: list[int] = []
        self._open_specs: dict[tuple[object, ...], Spec] = {}
        self._stack_specs: dict[tuple[object, ...], Spec] = {}  # share spec key -> its stack view
        self._stacks: dict[tuple[object, ...], StackIndex] = {}  # one-GPU shares with NICs
        # The stacking index: the share index's groups that have share bits (nodes with a
        # shared GPU), for the stacking view of share requests (Spec.stack): their signatures
        # replay only the changes of nodes with shares.
        self._stack = GroupIndex()
        self._sigs: dict[tuple[object, ...], _SigState] = {}
        self._sig_records = 0  # groups + heap entries over all signature states
        self._evals: dict[tuple[object, ...], Choice | Refusal] = {}
        # Share searches have their own cache (and bound): their many share usages must never
        # push the whole-GPU searches out.
        self._sevals: dict[tuple[object, ...], Choice | Refusal] = {}
        # Label index, and the label keys groups are split by (see the module docstring).
        self._labelled: dict[tuple[str, str], dict[str, None]] = {}
        self._keyed: frozenset[str] = frozenset()
        self._keyed_order: tuple[str, ...] = ()  # the same, sorted
        self._seq = 0
        # Reserve bookkeeping: nodes per shape capability (Shape.aligned) and per current
        # aligned capacity (Shape.aligned_free of the free mask); see _pressure.
        self._capable: dict[int, int] = {}
        self._aligned_now: dict[int, int] = {}
        self._reserve_level: tuple[int, int] | None = None  # (K, reserve nodes), cached
        # Bumped whenever a node's hardware or labels change or it goes: readers that index
        # nodes by their labels (core.gang's fabric index) know when to rebuild.
        self.nodes_version = 0

    # ------------------------------------------------------------------------------------
    # state changes

    def set_node(
        self,
        name: str,
        topology: NodeTopology,
        *,
        labels: Mapping[str, str] | None = None,
        unavailable: Iterable[str] = (),
    ) -> None:
        """Add or replace a node's hardware, labels and unavailable devices; holds are kept."""
        sig = shape_signature(topology)
        shape = self._shapes.get(sig)
        if shape is None:
            shape = self._shapes[sig] = compile_shape(topology, shape_id=len(self._shapes), signature=sig)
            self._gpu_memories = sorted({*self._gpu_memories, *shape.gpu_memory})
        merged = {**topology.labels, **(labels or {})}
        hw = self._hw_id(shape, merged)
        node = _Node(name, topology, shape, hw, merged, tuple(unavailable), _port_down(topology))
        node.mig_block = self._mig.set_node(name, topology, shape, merged)
        self._pv_forget(name)
        old = self._nodes.get(name)
        self.nodes_version += 1
        self._nodes[name] = node
        if old is not None:
            self._index_labels(old, -1)
        self._index_labels(node, 1)
        if old is None or old.shape is not shape:
            if old is not None:
                self._count_capable(old.shape, -1)
            self._count_capable(shape, 1)
        if old is None:
            self._refresh(node, old_key=None, was_impaired=False)
        else:
            self._refresh(node, old_key=(old.hw, old.mask), was_impaired=old.impaired)

    def set_unavailable(self, name: str, devices: Iterable[str]) -> None:
        """Replace the set of unhealthy or cordoned device ids of ``name``."""
        node = self._need(name)
        was = node.impaired
        node.unavailable = tuple(devices)
        self._pv_forget(name)
        self._refresh(node, old_key=(node.hw, node.mask), was_impaired=was)

    def remove_node(self, name: str) -> None:
        """Forget the node's hardware (its holds stay until released)."""
        node = self._nodes.pop(name, None)
        self._pv_forget(name)
        if node is not None:
            self._mig.remove(name)
            self.nodes_version += 1
            self._index_labels(node, -1)
            self._count_capable(node.shape, -1)
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
        evicted (:mod:`.preempt`); the default is protected (a decision in flight, a claim).
        ``shares``: the GPUs of ``devices`` held as shares, device id -> (memory MiB, compute
        percent), as :meth:`Placement.shares` gives them; the other devices are held whole. A
        preemptible hold with shares may be a victim like any other: its GPUs count as held,
        so only evicting every share of a GPU frees it (:mod:`.preempt`). ``sharing``: how the
        shares are limited (the assignment's ``sharing``: ``mps``, else HAMi-core); a GPU takes
        further shares of its shares' mode only (:mod:`.shares`)."""
        devs = tuple(sorted(set(devices)))
        if preemptible and not any(is_mig_device(d) for d in devs):
            self._victims.setdefault(name, {})[request_id] = priority
            self._pv_forget(name)
        else:
            self._drop_victim(name, request_id)
        holds = self._holds.setdefault(name, {})
        mps = sharing == "mps"
        shared = tuple(sorted((d, m, c, mps) for d, (m, c) in shares.items())) if shares else ()
        node_shares = self._shares.get(name)
        old_shared = node_shares.get(request_id, ()) if node_shares else ()
        if holds.get(request_id) == devs and old_shared == shared:
            return
        holds[request_id] = devs
        if shared:
            self._share_index_on()
            self._shares.setdefault(name, {})[request_id] = shared
        elif old_shared and node_shares is not None:
            del node_shares[request_id]
            if not node_shares:
                del self._shares[name]
        node = self._nodes.get(name)
        if node is not None:
            self._refresh(node, old_key=(node.hw, node.mask), was_impaired=node.impaired)

    def release(self, name: str, request_id: str) -> None:
        """Free ``request_id``'s hold on ``name``; releasing an unknown hold does nothing."""
        self._drop_victim(name, request_id)
        holds = self._holds.get(name)
        if not holds or request_id not in holds:
            return
        del holds[request_id]
        if not holds:
            del self._holds[name]
        node_shares = self._shares.get(name)
        if node_shares and node_shares.pop(request_id, None) is not None and not node_shares:
            del self._shares[name]
        node = self._nodes.get(name)
        if node is not None:
            self._refresh(node, old_key=(node.hw, node.mask), was_impaired=node.impaired)

    # ------------------------------------------------------------------------------------
    # queries

    def nodes(self) -> list[str]:
        return list(self._nodes)

    def topology(self, name: str) -> NodeTopology:
        return self._need(name).topology

    def labels(self, name: str) -> dict[str, str]:
        return dict(self._need(name).labels)

    def held(self, name: str) -> list[str]:
        """The requests (and reservation keys) holding devices on ``name``."""
        holds = self._holds.get(name)
        return list(holds) if holds else []

    def holds(self, name: str) -> dict[str, frozenset[str]]:
        return {rid: frozenset(devs) for rid, devs in self._holds.get(name, {}).items()}

    def shares(self, name: str) -> dict[str, dict[str, tuple[int, int]]]:
        """The share holds of ``name``: request -> GPU device id -> (memory MiB, compute %)."""
        return {rid: {d: (m, c) for d, m, c, _ in per} for rid, per in self._shares.get(name, {}).items()}

    def gpu_shares(self, name: str) -> dict[str, GpuUse]:
        """Shared GPUs of ``name`` that can take more shares, by device id: (used memory MiB,
        used compute percent, shares); a shared GPU that is out of service is left out."""
        node = self._need(name)
        return {f"gpu{node.shape.gpu_index[s]}": use for s, use in gpu_use(node.shape, node.mask).items()}

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

    def totals(self) -> dict[str, int]:
        """Cluster-wide counts: gpus, free_gpus, nics, free_nics (physical functions)."""
        t = {"gpus": 0, "free_gpus": 0, "nics": 0, "free_nics": 0}
        for (hw, mask), members in self._whole.groups.items():
            shape = self._hw[hw][0]
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
        if spec.mig_profile:
            return self._mig.fit_count(spec, policy=self.policy)
        if spec.selector:
            return sum(
                isinstance(self._eval(spec, node.shape, node.mask), Choice) for node in self._matching(spec)
            )
        n = 0
        if spec.shared:
            self._share_index_on()
        for (hw, mask), members in (self._share if spec.shared else self._whole).groups.items():
            if isinstance(self._eval(spec, self._hw[hw][0], mask), Choice):
                n += len(members)
        return n

    def group_count(self) -> int:
        """Distinct (hardware, free-mask) groups: what a decision's work scales with."""
        return len(self._whole.groups)

    def grouping_labels(self) -> frozenset[str]:
        """The label keys nodes are grouped by: those of selectors that matched many nodes."""
        return self._keyed

    def cache_stats(self) -> dict[str, int]:
        """Sizes of the index and caches, for metrics and benchmarks: every one is bounded
        (see the module docstring), whatever the stream of requests and selectors."""
        return {
            "nodes": len(self._nodes),
            "groups": len(self._whole.groups),
            "hardware_ids": len(self._hw),
            "selector_matches": len(self._selector_match),
            "grouping_labels": len(self._keyed),
            "signatures": len(self._sigs),
            "signature_records": self._sig_records,
            "evaluations": len(self._evals),
            "share_evaluations": len(self._sevals),
            "change_log": len(self._whole.log),
            "share_groups": len(self._share.groups),
            "share_change_log": len(self._share.log),
            "stack_groups": len(self._stack.groups),
            "share_fit_indexes": len(self._fits) + len(self._stacks),
        }

    # ------------------------------------------------------------------------------------
    # preemption support (the search itself is in .preempt)

    def preemptible(self) -> dict[str, dict[str, tuple[tuple[str, ...], int]]]:
        """Per known node that has any: its preemptible holds, as request id -> (devices,
        priority)."""
        out: dict[str, dict[str, tuple[tuple[str, ...], int]]] = {}
        for name, victims in self._victims.items():
            if name in self._nodes:
                holds = self._holds.get(name, {})
                out[name] = {rid: (holds.get(rid, ()), prio) for rid, prio in victims.items()}
        return out

    def matches(self, name: str, spec: Spec) -> bool:
        """Whether node ``name`` matches the request's node selector."""
        labels = self._need(name).labels
        return all(labels.get(k) == v for k, v in spec.selector)

    def preemption_groups(self) -> dict[PreemptionView, dict[str, None]]:
        """Nodes with preemptible holds, grouped by their *preemption view* ``(shape id,
        blocked, holds)``: ``blocked`` is the slot mask of everything but those holds
        (unavailable devices, protected holds), ``holds`` the preemptible holds' ``(priority,
        slot mask)`` sorted. Nodes of one group offer the same placements for the same
        evictions. A node's free mask with some holds released is ``shape.effective_free(
        blocked | the other holds' masks)``. Maintained lazily: only the nodes whose holds or
        hardware changed since the last call are looked at again."""
        for name in self._pv_dirty:
            victims = self._victims.get(name)
            node = self._nodes.get(name)
            if victims is None or node is None:
                continue
            view = self._pv[name] = self._preemption_view(node, victims)
            members = self._pv_groups.get(view)
            if members is None:
                members = self._pv_groups[view] = {}
            members[name] = None
        self._pv_dirty.clear()
        return self._pv_groups

    def preemptible_holds(self, name: str) -> dict[str, tuple[int, int]]:
        """The preemptible holds of ``name``: request id -> (priority, slot mask)."""
        victims = self._victims.get(name, {})
        node = self._need(name)
        slot_of = node.shape.slot_of
        out = {}
        for rid, devs in self._holds.get(name, {}).items():
            if rid in victims:
                out[rid] = (victims[rid], _slot_mask(slot_of, devs))
        return out

    def shape_of(self, name: str) -> Shape:
        return self._need(name).shape

    def _preemption_view(self, node: _Node, victims: dict[str, int]) -> PreemptionView:
        slot_of = node.shape.slot_of
        blocked = _slot_mask(slot_of, (*node.unavailable, *node.port_down)) | node.mig_block
        holds: list[tuple[int, int]] = []
        for rid, devs in self._holds.get(node.name, {}).items():
            prio = victims.get(rid)
            if prio is None:
                blocked |= _slot_mask(slot_of, devs)
            else:
                holds.append((prio, _slot_mask(slot_of, devs)))
        holds.sort(reverse=True)
        return (node.shape.id, blocked, tuple(holds))

    def _pv_forget(self, name: str) -> None:
        """A node's holds or hardware changed: its preemption view is rebuilt when next asked."""
        view = self._pv.pop(name, None)
        if view is not None:
            members = self._pv_groups[view]
            del members[name]
            if not members:
                del self._pv_groups[view]
        if view is not None or name in self._victims:
            self._pv_dirty.add(name)

    def _drop_victim(self, name: str, request_id: str) -> None:
        self._pv_forget(name)
        victims = self._victims.get(name)
        if victims is not None and victims.pop(request_id, None) is not None and not victims:
            del self._victims[name]

    # ------------------------------------------------------------------------------------
    # decisions

    def normalise(self, request: AllocationRequest) -> Spec:
        """The request with class defaults applied; raises InvalidRequest."""
        return normalise(request, self.device_classes)

    def decide(
        self, request: AllocationRequest, *, last_of_equals: bool = False
    ) -> Placement | Unschedulable:
        """The best node and devices for ``request`` now; changes no hold.

        ``last_of_equals``: among equally good nodes (the members of one group) take the last
        instead of the first. An allocator replica deciding outside its own shard asks for it,
        so that it does not pick the very node the shard's owner picks next (see
        services/allocator/replicas.py)."""
        spec = normalise(request, self.device_classes)
        if spec.mig_profile:
            return self._decide_mig(spec)
        if spec.selector:
            few = self._few_matching(spec)
            if few is not None:
                return self._decide_among(spec, few)
            keys = frozenset(k for k, _ in spec.selector)
            if not keys <= self._keyed:
                self._regroup(self._keyed | keys)
        if spec.shared:
            self._share_index_on()
            if not spec.selector:
                if spec.gpus == 1 and spec.rdma == 0:
                    got = self._decide_share_one(spec)
                else:
                    got = self._decide_share_tiers(spec)
                if got is not None:
                    return got
        top = self._top(spec, last_of_equals=last_of_equals)
        if isinstance(top, _SigState):
            st = top
            impaired: dict[str, int] = {}
            for gkey, n in (self._share if spec.shared else self._whole).impaired.items():
                rec = st.groups.get(gkey)
                if rec is not None and isinstance(rec[1], Refusal):
                    impaired[rec[1].text] = impaired.get(rec[1].text, 0) + n
            return self._unschedulable(spec, st.refused, st.codes, impaired)
        node, status, candidates = top
        return self._placement(node, status, spec, candidates=candidates)

    def scope_reason(self, request: AllocationRequest, placement: Placement) -> str:
        """Why ``placement``, just decided for ``request``, pairs at a coarser scope than the
        request asked ("" when it met it), for the person reading ``tandem explain``.

        With ``binpack`` and the default node order (``used-first``) a ``preferred`` request
        goes to a used server that can take it before a free one, which may be better aligned
        (docs/benchmarks.md, "Node order"). Whether that is why is found by deciding again with
        the alignment-first order (a signature state of its own, built on first use): only for
        placements that missed their scope, which are rare."""
        if placement.met:
            return ""
        spec = normalise(request, self.device_classes)
        asked = spec.scope.wire
        if spec.shared or spec.mig_profile or spec.selector:
            return f"no node it may use could pair at {asked} now"
        if self.policy == "binpack" and self._pressure():
            return (
                f"few servers can still host a large aligned job, so placements that keep them whole "
                f"came first; none of those pairs at {asked}"
            )
        if self.policy != "binpack" or spec.dc.node_order == "alignment-first":
            return f"no node could pair at {asked} now"
        aligned = replace(
            spec,
            device_class=f"{spec.device_class}\x00alignment-first",
            dc=msgspec.structs.replace(spec.dc, node_order="alignment-first"),
        )
        top = self._top(aligned)
        if isinstance(top, _SigState):
            return f"no node could pair at {asked} now"
        node, status, _ = top
        if status.scope >= Scope.parse(placement.scope) or node.name == placement.node:
            return f"no node could pair at {asked} now"
        return (
            f"{_SCOPE[status.scope]} pairs were possible on {node.name}, a server not in use: the "
            f"class {spec.device_class!r} places on servers in use, else on the smallest free one "
            "(node_order: used-first), keeping big servers whole for large aligned jobs; a class "
            "with node_order: alignment-first puts alignment first"
        )

    def _top(self, spec: Spec, *, last_of_equals: bool = False) -> tuple[_Node, Choice, int] | _SigState:
        """The best node of the index for ``spec`` (node, in-node choice, candidates), or the
        signature state when no node can take it (its counters say why). The node is the first
        member of the best group (the last with ``last_of_equals``)."""
        st = self._state(spec)
        heap = st.heap
        while heap:
            entry = heap[0]
            gkey = entry[5]
            rec = st.groups.get(gkey)
            if rec is None or isinstance(rec[1], Refusal):
                heapq.heappop(heap)
                st.in_heap.discard(gkey)
                continue
            status = rec[1]
            if status is _PENDING:
                n = rec[0]
                hw, mask = gkey
                status = rec[1] = self._eval(spec, self._hw[hw][0], mask)
                st.pending -= n
                if isinstance(status, Refusal):
                    st.refused[status.text] = st.refused.get(status.text, 0) + n
                    st.codes[status.text] = status.code
                    heapq.heappop(heap)
                    st.in_heap.discard(gkey)
                    continue
                st.feasible += n
            assert isinstance(status, Choice)
            if not entry[6]:
                # A bound entry: put the exact key in and look at the top again.
                heapq.heapreplace(heap, self._entry(st, gkey, status, entry[4]))
                continue
            members = self._index(spec).groups[gkey]
            name = next(reversed(members)) if last_of_equals else next(iter(members))
            return self._nodes[name], status, st.feasible + st.pending
        return st

    def _index(self, spec: Spec) -> GroupIndex:
        """The index ``spec`` is decided in — whole, share, or stacking."""
        if spec.stack:
            return self._stack
        if spec.shared:
            return self._share
        return self._whole

    def _decide_share_one(self, spec: Spec) -> Placement | None:
        """A one-GPU, no-NIC share request without a node selector, by :mod:`.sharefit`: the
        best-fit (binpack) or worst-fit (spread) shared GPU from the class's fit index, or a
        fresh GPU from the whole-GPU index (binpack: only when no shared GPU fits; spread:
        first). None when neither has one: the caller's share index then says why."""
        fits = self._fits.get(spec.device_class)
        if fits is None:
            fits = self._fits[spec.device_class] = FitIndex(spec.device_class, spec.dc, policy=self.policy)
            for node in self._nodes.values():
                fits.update(node.name, node.shape, node.mask)
        limit = spec.dc.max_shares_per_gpu
        if self.policy == "binpack":
            hit = fits.best_fit(spec.memory_mib, spec.cores_percent, limit)
            if hit is None:
                return self._open_share(spec)
        else:
            got = self._open_share(spec)
            if got is not None:
                return got
            hit = fits.worst_fit(spec.memory_mib, spec.cores_percent, limit)
            if hit is None:
                return None
        node = self._nodes[hit[0]]
        choice = stacked_choice(node.shape, node.mask, hit[1], spec, policy=self.policy)
        # Candidates: the nodes with a shared GPU of the class that can take more shares.
        return self._placement(node, choice, spec, candidates=fits.node_count())

    def _stacked_one(self, spec: Spec) -> tuple[_Node, Choice, int] | None:
        """The best placement of a one-GPU share with NICs on a shared GPU (binpack), from the
        :class:`.sharefit.StackIndex` of the request's shape (built on first use, O(nodes))."""
        shape_key = spec.key[:6]
        index = self._stacks.get(shape_key)
        if index is None:
            cache = self._sevals
            base = spec

            def search(shape: Shape, free: int) -> Choice | Refusal:
                # The same cache and key as evaluate_shared's exact searches.
                key = (shape_key, shape.id, free)
                got = cache.get(key)
                if got is None:
                    if len(cache) >= _EVAL_MAX:
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
        node = self._nodes[hit[0]]
        got = stacked_with_nics(node.shape, node.mask, hit[1], spec, search=index.evaluate)
        return node, got, index.node_count()

    def _open_share(self, spec: Spec) -> Placement | None:
        """A share on fresh GPUs only: the whole-GPU decision of the same request with the
        share's memory as the minimum GPU memory (see :meth:`_open_spec`)."""
        top = self._top(self._open_spec(spec))
        if isinstance(top, _SigState):
            return None
        node, status, candidates = top
        return self._placement(node, status, spec, candidates=candidates)

    def _open_spec(self, spec: Spec) -> Spec:
        """The whole-GPU request that finds the best placement of share ``spec`` on fresh GPUs
        only: a fresh GPU has all its memory and compute, so the share's size matters only as
        a minimum GPU memory, normalised to the smallest GPU memory of the fleet that is at
        least the share's (so that all the sizes every GPU holds are one signature)."""
        mems = self._gpu_memories
        i = bisect.bisect_left(mems, spec.memory_mib)
        floor = mems[i] if i < len(mems) else spec.memory_mib
        okey = (spec.key, floor)
        whole = self._open_specs.get(okey)
        if whole is None:
            if len(self._open_specs) >= _SIG_MAX:
                self._open_specs.clear()
            whole = self._open_specs[okey] = spec.whole_with_min_memory(floor)
        return whole

    def _decide_share_tiers(self, spec: Spec) -> Placement | None:
        """A share request without a node selector (other than one GPU without NICs), in two
        tiers: the best placement on fresh GPUs only, from the whole-GPU index (one signature
        for all share sizes, :meth:`_open_spec`), and the best placement on the nodes where a
        shared GPU fits the share, from the share index with the share's *stacking* view
        (``Spec.stack``: every other group is refused at its cheap check, so the signature's
        heap holds only those nodes). The better of the two by the node order wins (the
        stacking one on a tie). A node with a fitting shared GPU is in both tiers, and its
        stacking result is at least as good as its fresh-only one, so the answer is the one
        the full share index gives, without the state per size on every node. None when
        neither tier has a node: the full share index then says why."""
        stack = self._stack_specs.get(spec.key)
        if stack is None:
            if len(self._stack_specs) >= _SIG_MAX:
                self._stack_specs.clear()
            stack = self._stack_specs[spec.key] = replace(spec, stack=True)
        pressure = self.policy == "binpack" and self._pressure()
        best: tuple[tuple[tuple[int, ...], ...], _Node, Choice] | None = None
        candidates = 0
        if spec.gpus == 1 and self.policy == "binpack" and not pressure:
            # One GPU with NICs: the stacked placements come from a per-GPU index instead.
            top: tuple[_Node, Choice, int] | _SigState | None = self._stacked_one(spec)
        else:
            top = self._top(stack)
        if top is not None and not isinstance(top, _SigState):
            node, choice, candidates = top
            best = (self._order(spec, (node.hw, node.mask), choice, pressure=pressure), node, choice)
        top = self._top(self._open_spec(spec))
        if not isinstance(top, _SigState):
            node, choice, n = top
            candidates += n
            # As a share choice: every GPU opened, no fit terms (see .shares.evaluate_shared).
            term = spec.gpus if self.policy == "binpack" else -spec.gpus
            choice = replace(choice, cross=(*choice.cross[:-1], term, 0, 0, 0, choice.cross[-1]))
            order = self._order(spec, (node.hw, node.mask), choice, pressure=pressure)
            if best is None or order < best[0]:
                best = (order, node, choice)
        if best is None:
            return None
        return self._placement(best[1], best[2], spec, candidates=candidates)

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
            yield self._hw[hw][0], mask, members.keys()

    def evaluate_free(self, spec: Spec, shape: Shape, mask: int) -> Choice | Refusal:
        """The cached in-node search of ``spec`` on ``shape`` with free slots ``mask`` (which
        need not be a node's current mask: a job asks what is left after its earlier pods)."""
        return self._eval(spec, shape, mask)

    def placement_of(self, name: str, choice: Choice, spec: Spec, *, candidates: int = 1) -> Placement:
        """``choice`` (slot-level, on ``name``'s shape, found for ``spec``) as a
        :class:`Placement` (the wire-level one a decision returns)."""
        return self._placement(self._need(name), choice, spec, candidates=candidates)

    # ------------------------------------------------------------------------------------
    # internals

    def _need(self, name: str) -> _Node:
        node = self._nodes.get(name)
        if node is None:
            raise KeyError(f"unknown node {name!r}")
        return node

    def _hw_id(self, shape: Shape, labels: Mapping[str, str]) -> int:
        """The hardware id of a shape with these labels: only grouping keys count."""
        grouping = tuple((k, labels[k]) for k in self._keyed_order if k in labels)
        hw_key = (shape.id, grouping)
        hw = self._hw_ids.get(hw_key)
        if hw is None:
            hw = self._hw_ids[hw_key] = len(self._hw)
            self._hw.append((shape, dict(grouping)))
        return hw

    def _index_labels(self, node: _Node, delta: int) -> None:
        index = self._labelled
        for pair in node.labels.items():
            names = index.get(pair)
            if delta > 0:
                if names is None:
                    names = index[pair] = {}
                names[node.name] = None
            elif names is not None:
                names.pop(node.name, None)
                if not names:
                    del index[pair]

    def _few_matching(self, spec: Spec) -> list[_Node] | None:
        """The nodes matching the selector when its rarest label has at most ``pinned_max``
        nodes; None when it has more (decide through the groups)."""
        smallest: dict[str, None] | None = None
        for pair in spec.selector:
            names = self._labelled.get(pair)
            if not names:
                return []
            if smallest is None or len(names) < len(smallest):
                smallest = names
        assert smallest is not None
        if len(smallest) > self.pinned_max:
            return None
        nodes = self._nodes
        return [
            node
            for node in (nodes[name] for name in smallest)
            if all(node.labels.get(k) == v for k, v in spec.selector)
        ]

    def _matching(self, spec: Spec) -> list[_Node]:
        """Every node matching the selector (reports only)."""
        few = self._few_matching(spec)
        if few is not None:
            return few
        return [n for n in self._nodes.values() if all(n.labels.get(k) == v for k, v in spec.selector)]

    def _decide_mig(self, spec: Spec) -> Placement | Unschedulable:
        """A MIG request: decided by :mod:`.mig` on the nodes with a free instance of the
        profile (O(those nodes)); the other nodes are counted as having none."""
        res = self._mig.decide(spec, policy=self.policy)
        if isinstance(res, tuple):
            choice, feasible = res
            return self._mig_placement(choice, spec, candidates=feasible)
        refused = {text: n for text, (_code, n) in res.items()}
        codes = {text: code for text, (code, _n) in res.items()}
        others = len(self._nodes) - sum(refused.values())
        if others > 0:
            text = f"no free MIG instance {spec.mig_profile}"
            refused[text] = others
            codes[text] = "gpus"
        return self._unschedulable(spec, refused, codes, {})

    def _mig_placement(self, choice: MigChoice, spec: Spec, *, candidates: int) -> Placement:
        node = self._nodes[choice.node]
        gpus = [
            AssignedGpu(
                index=p.gpu_index,
                uuid=p.gpu_uuid,
                pci_bus_id=p.gpu_bus_id,
                mig=AssignedMig(
                    profile=p.profile,
                    uuid=p.uuid,
                    device=p.device,
                    gpu_instance_id=p.gpu_instance_id,
                    compute_instance_id=p.compute_instance_id,
                ),
            )
            for p in choice.picks
        ]
        pairs = [Pair(gpu=g, nic=node.shape.slot_id[ns], scope=_SCOPE[sc]) for g, ns, sc in choice.pairs]
        return self._assembled(node, choice.choice, gpus, choice.nics, pairs, candidates=candidates)

    def mig_instances(self, name: str) -> dict[str, list[str]]:
        """Free MIG instances of ``name`` by profile (device ids); empty without MIG GPUs."""
        return self._mig.free_instances(name)

    def _decide_among(self, spec: Spec, nodes: list[_Node]) -> Placement | Unschedulable:
        """Decide on a few nodes (a pinned request): the same cached in-node results and the
        same node order as the heap, without a signature state; O(len(nodes))."""
        pressure = self.policy == "binpack" and self._pressure()
        refused: dict[str, int] = {}
        codes: dict[str, str] = {}
        impaired: dict[str, int] = {}
        best: tuple[tuple[tuple[int, ...], ...], _Node, Choice] | None = None
        feasible = 0
        for node in nodes:
            res = self._eval(spec, node.shape, node.mask)
            if isinstance(res, Refusal):
                refused[res.text] = refused.get(res.text, 0) + 1
                codes[res.text] = res.code
                if node.impaired:
                    impaired[res.text] = impaired.get(res.text, 0) + 1
                continue
            feasible += 1
            order = self._order(spec, (node.hw, node.mask), res, pressure=pressure)
            if best is None or order < best[0]:
                best = (order, node, res)
        if best is not None:
            return self._placement(best[1], best[2], spec, candidates=feasible)
        others = len(self._nodes) - len(nodes)
        if others:
            text = _SELECTOR_REFUSAL.text
            refused[text] = refused.get(text, 0) + others
            codes[text] = _SELECTOR_REFUSAL.code
        return self._unschedulable(spec, refused, codes, impaired)

    def _regroup(self, keyed: frozenset[str]) -> None:
        """Group nodes by ``keyed`` label keys from now on: every node gets a new hardware id,
        so the groups, the change log and every signature state start over (O(nodes), once
        per new grouping key)."""
        self._keyed = keyed
        self._keyed_order = tuple(sorted(keyed))
        self._hw_ids.clear()
        self._hw.clear()
        self._selector_match.clear()
        self._whole.reset()
        self._sigs.clear()
        self._sig_records = 0
        hw_id = self._hw_id
        for node in self._nodes.values():
            node.hw = hw = hw_id(node.shape, node.labels)
            self._whole.put(node.name, (hw, slot_bits(node.shape, node.mask)), impaired=node.impaired)
        if self._share_index:
            self._share_index = False
            self._share_index_on()

    def _share_index_on(self) -> None:
        """Build the share index from the nodes' current groups, once (see the module
        docstring); from then on every move keeps it up to date."""
        if self._share_index:
            return
        self._share_index = True
        self._share.reset()
        for node in self._nodes.values():
            self._share.put(node.name, (node.hw, node.mask), impaired=node.impaired)
        self._stack.reset()
        for gkey, members in self._share.groups.items():
            if gkey[1] >> self._hw[gkey[0]][0].n_slots:
                self._stack.groups[gkey] = dict(members)

    def _refresh(self, node: _Node, *, old_key: GroupKey | None, was_impaired: bool) -> None:
        shape = node.shape
        blocked = 0
        slot_of = shape.slot_of
        for dev in (*node.unavailable, *node.port_down):
            s = slot_of.get(dev)
            if s is not None:
                blocked |= 1 << s
        blocked |= node.mig_block
        node_shares = self._shares.get(node.name)
        if node_shares is None:
            for devs in self._holds.get(node.name, {}).values():
                for dev in devs:
                    s = slot_of.get(dev)
                    if s is not None:
                        blocked |= 1 << s
            node.mask = shape.effective_free(blocked)
        else:
            node.mask = self._share_mask(node, blocked, node_shares)
        if node.mig_block:
            self._mig.refresh(
                node.name,
                held=self.used_devices(node.name),
                unavailable={*node.unavailable, *node.port_down},
                nic_free=slot_bits(shape, node.mask) & ~shape.gpu_all,
            )
        self._move(
            node.name, old_key, (node.hw, node.mask), was_impaired=was_impaired, now_impaired=node.impaired
        )

    def _share_mask(
        self, node: _Node, blocked: int, node_shares: Mapping[str, tuple[tuple[str, int, int, bool], ...]]
    ) -> int:
        """The group mask of a node with shares: shared GPUs leave the free slots like held
        ones, and their usage goes into the share bits (:func:`.shares.pack`), except for a
        GPU that is also out of service or held whole, which takes no more shares."""
        shape = node.shape
        slot_of = shape.slot_of
        use: dict[int, list[int]] = {}
        mps = hami = 0  # slots with shares of each mode
        for per in node_shares.values():
            for dev, mem, cores, is_mps in per:
                s = slot_of.get(dev)
                if s is not None and s < shape.n_gpus:
                    u = use.get(s)
                    if u is None:
                        u = use[s] = [0, 0, 0]
                    u[0] += mem
                    u[1] += cores
                    u[2] += 1
                    if is_mps:
                        mps |= 1 << s
                    else:
                        hami |= 1 << s
        # A GPU with shares of both modes (records no commit lets through) takes no more.
        blocked |= mps & hami
        for rid, devs in self._holds.get(node.name, {}).items():
            shared = {d for d, _m, _c, _x in node_shares.get(rid, ())}
            for dev in devs:
                if dev in shared:
                    continue
                s = slot_of.get(dev)
                if s is not None:
                    blocked |= 1 << s
        share_bits = pack(
            shape, {s: (u[0], u[1], u[2]) for s, u in use.items() if not blocked >> s & 1}, mps=mps
        )
        for s in use:
            blocked |= 1 << s
        return shape.effective_free(blocked) | share_bits

    def _move(
        self,
        name: str,
        old: GroupKey | None,
        new: GroupKey | None,
        *,
        was_impaired: bool,
        now_impaired: bool,
    ) -> None:
        """A node moves from group ``old`` to ``new`` (full keys: slot and share bits): in the
        share index as they are, in the whole-GPU index by their slot bits. Without the share
        index no node has share bits (a share hold turns it on first)."""
        if self._share_index:
            self._move_share(name, old, new, was_impaired=was_impaired, now_impaired=now_impaired)
            self._move_stack(name, old, new)
            if (self._fits or self._stacks) and old != new:
                # The per-GPU indexes of share requests (see .sharefit) follow every move.
                shape = self._hw[new[0]][0] if new is not None else None
                mask = new[1] if new is not None else 0
                for fits in self._fits.values():
                    fits.update(name, shape, mask)
                for stack in self._stacks.values():
                    stack.update(name, shape, mask)
            if old is not None:
                old = (old[0], slot_bits(self._hw[old[0]][0], old[1]))
            if new is not None:
                new = (new[0], slot_bits(self._hw[new[0]][0], new[1]))
        index = self._whole
        if old == new:
            if old is not None and was_impaired != now_impaired:
                index.count_impaired(old, 1 if now_impaired else -1)
            return
        if index.move(name, old, new) and old is not None:
            self._count_capacity(old, -1)
            if was_impaired:
                index.count_impaired(old, -1)
        if new is not None:
            self._count_capacity(new, 1)
            if now_impaired:
                index.count_impaired(new, 1)
        if len(index.log) > _LOG_MAX:
            self._compact(index, shared=False)

    def _move_share(
        self,
        name: str,
        old: GroupKey | None,
        new: GroupKey | None,
        *,
        was_impaired: bool,
        now_impaired: bool,
    ) -> None:
        """:meth:`_move` in the share index (no reserve bookkeeping: that is the whole index's)."""
        index = self._share
        if old == new:
            if old is not None and was_impaired != now_impaired:
                index.count_impaired(old, 1 if now_impaired else -1)
            return
        if index.move(name, old, new) and old is not None and was_impaired:
            index.count_impaired(old, -1)
        if new is not None and now_impaired:
            index.count_impaired(new, 1)
        if len(index.log) > _LOG_MAX:
            self._compact(index, shared=True)

    def _move_stack(self, name: str, old: GroupKey | None, new: GroupKey | None) -> None:
        """:meth:`_move` in the stacking index: only groups with share bits are in it."""
        hw = self._hw
        if old is not None and not old[1] >> hw[old[0]][0].n_slots:
            old = None
        if new is not None and not new[1] >> hw[new[0]][0].n_slots:
            new = None
        if old == new:
            return
        index = self._stack
        index.move(name, old, new)
        if len(index.log) > _LOG_MAX:
            self._compact(index, shared=True, stack=True)

    def _compact(self, index: GroupIndex, *, shared: bool, stack: bool = False) -> None:
        """Drop the log prefix no signature state of ``index`` still needs; states that lag
        by more than half the log are dropped (rebuilt from the groups when next used)."""
        end = index.end
        keep_from = end - _LOG_MAX // 2
        mine = {k: st for k, st in self._sigs.items() if st.spec.shared == shared and st.spec.stack == stack}
        for k in [k for k, st in mine.items() if st.cursor < keep_from]:
            self._drop_sig(k)
            del mine[k]
        index.trim(min((st.cursor for st in mine.values()), default=end))

    def _eval(self, spec: Spec, shape: Shape, mask: int) -> Choice | Refusal:
        """The cached in-node search (the caller has checked the node selector). A whole-GPU
        search depends on the slot bits only; a share search on the share usage too."""
        key = (spec.key, shape.id, mask)
        if spec.shared:
            cache = self._sevals
            res = cache.get(key)
            if res is None:
                if len(cache) >= _EVAL_MAX:
                    cache.clear()
                res = cache[key] = evaluate_shared(shape, mask, spec, policy=self.policy, cache=cache)
            return res
        free = slot_bits(shape, mask)
        key = (spec.key, shape.id, free)
        res = self._evals.get(key)
        if res is None:
            if len(self._evals) >= _EVAL_MAX:
                self._evals.clear()
            res = self._evals[key] = evaluate(shape, free, spec)
        return res

    def _state(self, spec: Spec) -> _SigState:
        pressure = self.policy == "binpack" and self._pressure()
        sk = (spec.key, spec.selector, pressure)
        st = self._sigs.get(sk)
        index = self._index(spec)
        all_groups, log, base = index.groups, index.log, index.base
        end = index.end
        if st is not None:
            # Most recently used last, so the LRU drop below takes the stalest.
            self._sigs[sk] = self._sigs.pop(sk)
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
                    st.heap = [e for e in st.heap if e[5] in st.groups]
                    heapq.heapify(st.heap)
                    st.in_heap = {e[5] for e in st.heap}
                self._sig_records += len(st.groups) + len(st.heap) - before
                self._trim_sigs(keep=sk)
                return st
            # A long-unused signature: rebuilding from the groups is cheaper than replaying.
            self._drop_sig(sk)
        st = _SigState(spec=spec, cursor=end, pressure=pressure)
        self._replay(st, [(gkey, len(members)) for gkey, members in all_groups.items()])
        if len(self._sigs) >= _SIG_MAX:
            self._drop_sig(next(iter(self._sigs)))
        self._sigs[sk] = st
        self._sig_records += len(st.groups) + len(st.heap)
        self._trim_sigs(keep=sk)
        return st

    def _drop_sig(self, sk: tuple[object, ...]) -> None:
        st = self._sigs.pop(sk)
        self._sig_records -= len(st.groups) + len(st.heap)

    def _trim_sigs(self, *, keep: tuple[object, ...]) -> None:
        """Drop the least recently used signature states while their records exceed the budget."""
        while self._sig_records > _SIG_RECORDS and len(self._sigs) > 1:
            oldest = next(iter(self._sigs))
            if oldest == keep:
                break
            self._drop_sig(oldest)

    def _replay(self, st: _SigState, changes: Iterable[tuple[GroupKey, int]]) -> None:
        """Replay group membership changes into a signature's state (hot path; kept flat)."""
        groups = st.groups
        refused = st.refused
        spec = st.spec
        first = self._first_status
        stack = spec.stack
        for gkey, delta in changes:
            rec = groups.get(gkey)
            if rec is None:
                status = first(spec, gkey)
                if stack and status is NO_STACK:
                    # A stacking view never reports its refusals (the share index does), so a
                    # group that stacks nothing is not kept: the next change looks again.
                    continue
                rec = groups[gkey] = [delta, status]
                if status.__class__ is not Refusal and gkey not in st.in_heap:
                    self._push(st, gkey, status)
            else:
                status = rec[1]
                n = rec[0] + delta
                if n:
                    rec[0] = n
                else:
                    del groups[gkey]
            if status is _PENDING:
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

    def _push(self, st: _SigState, gkey: GroupKey, status: Choice | Refusal | None) -> None:
        self._seq += 1
        heapq.heappush(st.heap, self._entry(st, gkey, status, self._seq))
        st.in_heap.add(gkey)

    def _entry(self, st: _SigState, gkey: GroupKey, status: Choice | Refusal | None, seq: int) -> HeapEntry:
        """A heap entry: the node order of :meth:`_order`, then ``seq`` (first pushed first).

        A bound entry (group not searched yet) must sort no later than the group's exact entry:
        its key is a prefix of, or smaller than, the exact one."""
        a, b, c, d = self._order(st.spec, gkey, status, pressure=st.pressure)
        return (a, b, c, d, seq, gkey, isinstance(status, Choice))

    def _order(
        self, spec: Spec, gkey: GroupKey, status: Choice | Refusal | None, *, pressure: bool
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Node order (see the module docstring). For binpack: alignment, then the less capable
        server, fragmentation before fullness (packing that breaks no whole switch / partition
        first); under reserve pressure capacity cost before alignment, then fullness. For
        spread: alignment, emptiness, fragmentation. ``status`` not a Choice: a lower bound."""
        hw, group_mask = gkey
        shape = self._hw[hw][0]
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
            key, frag, full = share_bound(shape, group_mask, spec, policy=self.policy), _NO_FRAG, ()
            exact = True  # the bound's fragmentation part is a valid (zero) bound too
        else:
            key, frag, full = cross_bound(spec), (), ()
        if self.policy == "binpack":
            fresh = fresh_cost(shape, mask, spec)
            # used-first (default): a used node that can take it, whatever its scope, and the
            # smallest free server otherwise, keep the big servers whole for large aligned
            # jobs. alignment-first: the best scope anywhere, used nodes among equals; it costs
            # refusals near full (docs/benchmarks.md, "Node order", also for the orders tried).
            key = (*key, fresh) if spec.dc.node_order == "alignment-first" else (fresh, *key)
            # Among equal placements the less capable server first (fewer GPUs that can pair
            # with a NIC on their own switch, then fewer GPUs): the servers that can host the
            # big aligned jobs stay whole for them.
            size_frag = (shape.aligned, shape.n_gpus, *frag) if exact else (shape.aligned, shape.n_gpus)
            return (key, size_frag, (free_g, free_n, shape.id), full)
        return (key, (-free_g, -free_n), frag, full)

    def _count_capable(self, shape: Shape, delta: int) -> None:
        """A node of ``shape`` joins (+1) or leaves (-1) the fleet: the reserve level changes."""
        cap = shape.aligned
        if cap <= 0:
            return
        left = self._capable.get(cap, 0) + delta
        if left:
            self._capable[cap] = left
        else:
            del self._capable[cap]
        self._reserve_level = None

    def _count_capacity(self, gkey: GroupKey, delta: int) -> None:
        """A node enters (+1) or leaves (-1) group ``gkey``: count its aligned capacity now."""
        shape = self._hw[gkey[0]][0]
        if shape.aligned <= 0:
            return
        now = shape.aligned_free(slot_bits(shape, gkey[1]))
        left = self._aligned_now.get(now, 0) + delta
        if left:
            self._aligned_now[now] = left
        else:
            del self._aligned_now[now]

    def _pressure(self) -> bool:
        """Is the reserve of nodes that can take the largest aligned job below its target?

        ``K`` is the largest aligned job size (``Shape.aligned``: GPU/NIC pairs on shared PCIe
        switches) that at least ``1 / reserve`` nodes can host when free, so that the reserve
        is at least one node: the largest job a real part of the fleet, not one odd server, is
        built for. The target is ``ceil(reserve x nodes able to host K)``; the count is the
        nodes whose free devices can host K now (``Shape.aligned_free``)."""
        if self.reserve <= 0.0:
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

    def _first_status(self, spec: Spec, gkey: GroupKey) -> Choice | Refusal | None:
        """A group's status without searching: a cheap refusal, a cached result, or pending.
        A selector here has only grouping keys (see :meth:`decide`), so the group's labels say."""
        hw, mask = gkey
        shape, labels = self._hw[hw]
        if spec.selector:
            # Memoized per hardware id: a replica's shard selector meets every change of the
            # other shards' groups here (docs/architecture.md, "Replicas").
            match = self._selector_match.get((spec.selector, hw))
            if match is None:
                if len(self._selector_match) >= _SELECTOR_MATCH_MAX:
                    self._selector_match.clear()
                match = all(labels.get(k) == v for k, v in spec.selector)
                self._selector_match[(spec.selector, hw)] = match
            if not match:
                return _SELECTOR_REFUSAL
        if spec.shared:
            if spec.stack:
                # The stacking view: most groups have no shared GPU the share fits on, and
                # that check is one cached lookup (see _replay, which then keeps no record).
                refusal = precheck_shared(shape, mask, spec)
                if refusal is not None:
                    return refusal
            cached = self._sevals.get((spec.key, shape.id, mask))
            if cached is not None:
                return cached
            return precheck_shared(shape, mask, spec)
        mask = slot_bits(shape, mask)
        cached = self._evals.get((spec.key, shape.id, mask))
        if cached is not None:
            return cached
        return precheck(shape, mask, spec)

    def _placement(self, node: _Node, res: Choice, spec: Spec, *, candidates: int) -> Placement:
        shape = node.shape
        topo = node.topology
        gpus: list[AssignedGpu] = []
        mem = spec.memory_mib if spec.shared and spec.memory_mib else None
        cores = spec.cores_percent if spec.shared and spec.cores_percent else None
        for s in res.gpus:
            g = device_at(topo, shape.paths[s], nic=False)
            assert isinstance(g, Gpu)
            gpus.append(
                AssignedGpu(
                    index=g.index, uuid=g.uuid, pci_bus_id=g.pci_bus_id, memory_mib=mem, cores_percent=cores
                )
            )
        pairs = [
            Pair(gpu=shape.gpu_index[gs], nic=shape.slot_id[ns], scope=_SCOPE[sc]) for gs, ns, sc in res.pairs
        ]
        return self._assembled(
            node,
            res,
            gpus,
            res.nics,
            pairs,
            candidates=candidates,
            sharing=spec.dc.sharing if spec.shared else "",
            memory_limit=spec.dc.memory_limit,
        )

    def _assembled(
        self,
        node: _Node,
        res: Choice,
        gpus: list[AssignedGpu],
        nic_slots: Iterable[int],
        pairs: list[Pair],
        *,
        candidates: int,
        sharing: str = "",
        memory_limit: str = "hard",
    ) -> Placement:
        """A placement from its GPUs and pairs (whole, shared or MIG) and the in-node search's
        result: the NICs of ``nic_slots``, the scope and quality."""
        nics = [self._assigned_nic(node.topology, node.shape, s) for s in nic_slots]
        return Placement(
            node=node.name,
            gpus=gpus,
            nics=nics,
            pairs=pairs,
            scope=_SCOPE[res.scope],
            candidates=candidates,
            met=res.met,
            quality=res.key + res.frag,
            sharing=sharing,
            memory_limit=memory_limit,
        )

    @staticmethod
    def _assigned_nic(topo: NodeTopology, shape: Shape, slot: int) -> AssignedNic:
        path = shape.paths[slot]
        pf = device_at(topo, path, nic=True)
        assert isinstance(pf, Nic)
        if path[5] < 0:
            return AssignedNic(name=pf.name, pf=pf.name, pci_bus_id=pf.pci_bus_id, netdev=pf.netdev)
        vf = pf.vfs[path[5]]
        return AssignedNic(name=vf.name, pf=pf.name, vf=vf.index, pci_bus_id=vf.pci_bus_id, netdev=vf.netdev)

    def _unschedulable(
        self,
        spec: Spec,
        refused: Mapping[str, int],
        codes: Mapping[str, str],
        impaired: Mapping[str, int],
    ) -> Unschedulable:
        """The aggregated reason. ``impaired``: per refusal text, how many of its nodes hold
        devices out of service (from per-group counters, not a walk over nodes), so that a
        person reading "fewer than 4 free GPUs" learns that a failed GPU is part of why."""
        if not self._nodes:
            return Unschedulable(reason="no nodes", counts={}, reasons=[])
        items = sorted(refused.items(), key=lambda kv: (-kv[1], kv[0]))
        reasons = [NodeReason(codes.get(t, ""), t, n) for t, n in items]

        def sick(text: str) -> int:
            return impaired.get(text, 0) if codes.get(text) in ("gpus", "nics", "scope") else 0

        text = "; ".join(
            f"{n} node{'' if n == 1 else 's'}: {t}"
            + (f" ({sick(t)} of them with unhealthy or cordoned devices)" if sick(t) else "")
            for t, n in items
        )
        what = f"{spec.gpus} GPUs + {spec.rdma} NICs"
        if spec.mig_profile:
            what = f"{spec.gpus} MIG instances {spec.mig_profile} + {spec.rdma} NICs"
        return Unschedulable(
            reason=f"no node can take {what}: {text}" if text else f"no node can take {what}",
            counts=dict(items),
            reasons=reasons,
        )


def _slot_mask(slot_of: Mapping[str, int], devices: Iterable[str]) -> int:
    m = 0
    for dev in devices:
        s = slot_of.get(dev)
        if s is not None:
            m |= 1 << s
    return m


_NO_FRAG = (0, 0, 0, 0, 0)  # the least fragmentation: a lower bound of Choice.frag
_SCOPE: tuple[ScopeName, ...] = ("pcie-switch", "pcie-root", "numa", "socket", "node")
_SELECTOR_REFUSAL = Refusal("selector", "labels do not match the node selector")


def _port_down(topo: NodeTopology) -> tuple[str, ...]:
    """NICs whose port is down or still initialising (and their VFs) cannot be handed out."""
    out: list[str] = []
    for nic in topo.nics():
        if nic.port_state in ("down", "init"):
            out.append(nic.name)
            out.extend(vf.name for vf in nic.vfs)
    return tuple(out)
