"""GPU shares (fractional GPUs, :mod:`..shares`): a share request's kind.

A hold may give some of its GPUs as shares (memory MiB, compute percent); a shared GPU leaves
the free mask like a held one, and the node's share usage is packed into its group mask above
the slot bits (:func:`node_mask`). The kind keeps the share holds itself (``Shares.holds``),
told of every hold by the registry's hooks (:class:`.base.Hooks`), and gives the registry the
group mask of a node with shares (:meth:`Shares.group_mask`). Whole-GPU requests are indexed
exactly as before, by ``(hardware, slot bits)``: a change of share usage alone is not a
change for them. Share requests go through a second, parallel :class:`..index.GroupIndex`
keyed by the full mask, with the framework's signature states, heaps, lazy search and a cache
of their own (their many share usages must never push the whole-GPU searches out). The share
index is built on first use (the first share request or share hold, O(nodes) once,
:meth:`Shares.turn_on`), so a fleet that never shares pays nothing for it, in time or memory;
from then on it is live (the registry's moves reach it, and the stacking view's).

A share request's signature includes its size, so a share request without a node selector is
decided by indexes that keep nothing per size (:meth:`Shares.place`): the placement on fresh
GPUs only comes from the whole-GPU index (a fresh GPU has all its memory and compute, so the
size is only a minimum GPU memory, normalised to the fleet's GPU memory sizes: one signature
for all sizes); a one-GPU share without NICs stacks through a per-class best-fit index of the
shared GPUs (:class:`..sharefit.FitIndex`); a share on several GPUs or with NICs stacks through
the stacking view (:mod:`.stack`). The better of the two tiers by the node order wins. The
share index itself still decides share requests with a node selector (through the groups) and
gives the reasons of a refusal.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from services.allocator.core.index import GroupIndex, GroupKey
from services.allocator.core.model import Shape
from services.allocator.core.nodes import Hardware, Node
from services.allocator.core.placement import Placement, Unschedulable, wire_placement
from services.allocator.core.request import Spec
from services.allocator.core.scores import NodeOrder, OrderKey
from services.allocator.core.search import Choice, Refusal
from services.allocator.core.sharefit import FitIndex
from services.allocator.core.shares import (
    GpuUse,
    evaluate_shared,
    gpu_use,
    pack,
    precheck_shared,
    stacked_choice,
)

from .base import NOT_SKIPPED, Best, Holds, Hooks, Status
from .stack import Stacking
from .whole import EVAL_MAX, WholeGpus

__all__ = ["ShareHolds", "Shares", "node_mask"]

_SPECS_MAX = 512  # fresh-GPU specs of share requests kept (cleared when full)

# node -> request -> its shares: (GPU device id, memory MiB, compute %, an MPS share)
ShareHolds = dict[str, dict[str, tuple[tuple[str, int, int, bool], ...]]]


class Shares(Hooks):
    """The share kind (see the module docstring). ``best``: the framework's top of an index
    for a spec (whole GPUs for the fresh-GPU tier, the stacking view for the other);
    ``went_live``: told when the share index is built (the registry's moves reach it then)."""

    __slots__ = (
        "_best",
        "_compact",
        "_log_max",
        "_nodes",
        "_open_specs",
        "_order",
        "_went_live",
        "fits",
        "gpu_memories",
        "holds",
        "hw",
        "index",
        "live",
        "node_policy",
        "sevals",
        "stack",
        "whole",
    )

    name = "shares"
    skip = NOT_SKIPPED

    def __init__(
        self,
        hw: list[Hardware],
        nodes: dict[str, Node],
        *,
        whole: WholeGpus,
        order: NodeOrder,
        best: Callable[[Spec], Best | None],
        log_max: int,
        compact: Callable[[GroupIndex], None],
        went_live: Callable[[], None],
    ) -> None:
        self.hw = hw
        self._nodes = nodes
        self.whole = whole
        self._order = order
        self.node_policy = order.node_policy
        self._best = best
        self.index = GroupIndex()  # keyed by the full group mask (slot and share bits)
        self.live = False  # built on first use (turn_on)
        self._went_live = went_live
        self.holds: ShareHolds = {}  # node -> request -> its shares
        # Share searches have their own cache (and bound): see the module docstring.
        self.sevals: dict[tuple[object, ...], Choice | Refusal] = {}
        # One-GPU, no-NIC share requests (see ..sharefit): per device class, its shared GPUs
        # by what they have left; the GPU memory sizes of the fleet, sorted (for open_spec);
        # the whole-GPU specs that open a fresh GPU for a share, by (share key, memory floor).
        self.fits: dict[str, FitIndex] = {}
        self.gpu_memories: list[int] = []
        self._open_specs: dict[tuple[object, ...], Spec] = {}
        self._log_max = log_max
        self._compact = compact
        self.stack = Stacking(
            hw,
            nodes,
            first_status=self.first_status,
            evaluate=self.evaluate,
            sevals=self.sevals,
            log_max=log_max,
            compact=compact,
        )

    def applies(self, spec: Spec) -> bool:
        return spec.shared

    def fit_count(self, spec: Spec) -> int | None:
        return None

    def ready(self) -> None:
        if not self.live:
            self.turn_on()

    def turn_on(self) -> None:
        """Build the share index from the nodes' current groups, once; from then on every move
        keeps it up to date (and whole-GPU keys are cut to their slot bits)."""
        if self.live:
            return
        self.live = self.stack.live = True
        self.whole.split = True
        self.index.reset()
        for node in self._nodes.values():
            self.index.put(node.name, (node.hw, node.mask), impaired=node.impaired)
        self.stack.rebuild(self.index.groups)
        self._went_live()

    # -- the registry's hooks (.base.Hooks) ---------------------------------------------------

    def new_shape(self, shape: Shape) -> None:
        self.gpu_memories = sorted({*self.gpu_memories, *shape.gpu_memory})

    def regrouped(self, nodes: Iterable[Node]) -> None:
        if self.live:
            self.live = False
            self.turn_on()

    def hold_set(
        self, name: str, request_id: str, *, shares: Mapping[str, tuple[int, int]] | None, sharing: str
    ) -> bool:
        """Keep the hold's shares (a share hold builds the share index: its usage is in the
        node's group mask from now on)."""
        node_shares = self.holds.get(name)
        old = node_shares.get(request_id, ()) if node_shares else ()
        if not shares:
            if not old:
                return False
            assert node_shares is not None
            del node_shares[request_id]
            if not node_shares:
                del self.holds[name]
            return True
        mps = sharing == "mps"
        shared = tuple(sorted((d, m, c, mps) for d, (m, c) in shares.items()))
        if old == shared:
            return False
        self.turn_on()
        self.holds.setdefault(name, {})[request_id] = shared
        return True

    def hold_removed(self, name: str, request_id: str) -> None:
        node_shares = self.holds.get(name)
        if node_shares and node_shares.pop(request_id, None) is not None and not node_shares:
            del self.holds[name]

    def group_mask(self, node: Node, blocked: int, holds: Holds) -> int | None:
        node_shares = self.holds.get(node.name)
        if node_shares is None:
            return None
        return node_mask(node, blocked, shares=node_shares, holds=holds)

    def stats(self) -> dict[str, int]:
        return {
            "share_evaluations": len(self.sevals),
            "share_groups": len(self.index.groups),
            "share_change_log": len(self.index.log),
            "stack_groups": len(self.stack.index.groups),
            "share_fit_indexes": len(self.fits) + self.stack.indexes(),
        }

    # -- what the registry's queries read ---------------------------------------------------

    def shares_of(self, name: str) -> dict[str, dict[str, tuple[int, int]]]:
        """The share holds of node ``name``: request -> GPU device id -> (memory MiB, compute %)."""
        return {rid: {d: (m, c) for d, m, c, _ in per} for rid, per in self.holds.get(name, {}).items()}

    @staticmethod
    def gpu_shares(node: Node) -> dict[str, GpuUse]:
        """The node's shared GPUs that can take more shares, by device id."""
        return {f"gpu{node.shape.gpu_index[s]}": use for s, use in gpu_use(node.shape, node.mask).items()}

    # -- Filter -------------------------------------------------------------------------------

    def first_status(self, spec: Spec, gkey: GroupKey) -> Status:
        hw, mask = gkey
        shape = self.hw[hw].shape
        if spec.stack:
            # The stacking view: most groups have no shared GPU the share fits on, and that
            # check is one cached lookup (the framework's replay then keeps no record).
            refusal = precheck_shared(shape, mask, spec)
            if refusal is not None:
                return refusal
        cached = self.sevals.get((spec.key, shape.id, mask))
        if cached is not None:
            return cached
        return precheck_shared(shape, mask, spec)

    def evaluate(self, spec: Spec, shape: Shape, mask: int) -> Choice | Refusal:
        """The cached share search; it depends on the share usage too."""
        key = (spec.key, shape.id, mask)
        cache = self.sevals
        res = cache.get(key)
        if res is None:
            if len(cache) >= EVAL_MAX:
                cache.clear()
            res = cache[key] = evaluate_shared(shape, mask, spec, node_policy=self.node_policy, cache=cache)
        return res

    # -- Filter + Score without a signature per size --------------------------------------

    def place(self, spec: Spec, *, shard: str | None) -> Placement | Unschedulable | None:
        """A share request without a node selector or shard, by the indexes that keep nothing
        per size; None when neither tier has a node (the share index then says why). The
        share index is built here on first use: the framework reads it next."""
        if not self.live:
            self.turn_on()
        if spec.selector or shard is not None:
            return None
        if spec.gpus == 1 and spec.rdma == 0:
            return self._place_one(spec)
        return self._place_tiers(spec)

    def _place_one(self, spec: Spec) -> Placement | None:
        """A one-GPU, no-NIC share request, by :mod:`..sharefit`: the best-fit (binpack) or
        worst-fit (spread) shared GPU from the class's fit index, or a fresh GPU from the
        whole-GPU index (binpack: only when no shared GPU fits; spread: first)."""
        fits = self.fits.get(spec.device_class)
        if fits is None:
            fits = self.fits[spec.device_class] = FitIndex(
                spec.device_class, spec.dc, node_policy=self.node_policy
            )
            for node in self._nodes.values():
                fits.update(node.name, node.shape, node.mask)
        limit = spec.dc.max_shares_per_gpu
        if self.node_policy == "binpack":
            hit = fits.best_fit(spec.memory_mib, spec.cores_percent, limit)
            if hit is None:
                return self._open(spec)
        else:
            got = self._open(spec)
            if got is not None:
                return got
            hit = fits.worst_fit(spec.memory_mib, spec.cores_percent, limit)
            if hit is None:
                return None
        name, slot = hit
        node = self._nodes[name]
        choice = stacked_choice(node.shape, node.mask, slot, spec, node_policy=self.node_policy)
        # Candidates: the nodes with a shared GPU of the class that can take more shares.
        return wire_placement(node, choice, spec=spec, candidates=fits.node_count())

    def _open(self, spec: Spec) -> Placement | None:
        """A share on fresh GPUs only: the whole-GPU decision of the same request with the
        share's memory as the minimum GPU memory (see :meth:`open_spec`)."""
        top = self._best(self.open_spec(spec))
        if top is None:
            return None
        return wire_placement(top.node, top.choice, spec=spec, candidates=top.candidates)

    def open_spec(self, spec: Spec) -> Spec:
        """The whole-GPU request that finds the best placement of share ``spec`` on fresh GPUs
        only: a fresh GPU has all its memory and compute, so the share's size matters only as
        a minimum GPU memory, normalised to the smallest GPU memory of the fleet that is at
        least the share's (so that all the sizes every GPU holds are one signature)."""
        mems = self.gpu_memories
        i = bisect.bisect_left(mems, spec.memory_mib)
        floor = mems[i] if i < len(mems) else spec.memory_mib
        okey = (spec.key, floor)
        whole = self._open_specs.get(okey)
        if whole is None:
            if len(self._open_specs) >= _SPECS_MAX:
                self._open_specs.clear()
            whole = self._open_specs[okey] = spec.whole_with_min_memory(floor)
        return whole

    def _place_tiers(self, spec: Spec) -> Placement | None:
        """A share request other than one GPU without NICs, in two tiers: the best placement
        on fresh GPUs only, from the whole-GPU index (one signature for all share sizes,
        :meth:`open_spec`), and the best placement on the nodes where a shared GPU fits the
        share, from the stacking view (:mod:`.stack`). The better of the two by the node order
        wins (the stacking one on a tie). A node with a fitting shared GPU is in both tiers,
        and its stacking result is at least as good as its fresh-only one, so the answer is
        the one the full share index gives, without the state per size on every node."""
        pressure = self._order.pressure()
        order = self._order.order
        best: tuple[OrderKey, Node, Choice] | None = None
        candidates = 0
        if spec.gpus == 1 and self.node_policy == "binpack" and not pressure:
            # One GPU with NICs: the stacked placements come from a per-GPU index instead.
            top = self.stack.stacked_one(spec)
        else:
            top = self._best(self.stack.view(spec))
        if top is not None:
            node, choice, candidates = top
            best = (order(spec, (node.hw, node.mask), choice, pressure=pressure), node, choice)
        top = self._best(self.open_spec(spec))
        if top is not None:
            node, choice, n = top
            candidates += n
            # As a share choice: every GPU opened, no fit terms (see ..shares.evaluate_shared).
            term = spec.gpus if self.node_policy == "binpack" else -spec.gpus
            choice = replace(choice, cross=(*choice.cross[:-1], term, 0, 0, 0, choice.cross[-1]))
            key = order(spec, (node.hw, node.mask), choice, pressure=pressure)
            if best is None or key < best[0]:
                best = (key, node, choice)
        if best is None:
            return None
        _key, node, choice = best
        return wire_placement(node, choice, spec=spec, candidates=candidates)

    # -- Reserve ----------------------------------------------------------------------------

    def follow(
        self, name: str, old: GroupKey | None, new: GroupKey | None, *, was_impaired: bool, now_impaired: bool
    ) -> None:
        """A node moved: in the share index as it is (no reserve bookkeeping: that is the
        whole kind's), and in the per-class fit indexes."""
        if self.fits and old != new:
            shape = self.hw[new[0]].shape if new is not None else None
            mask = new[1] if new is not None else 0
            for fits in self.fits.values():
                fits.update(name, shape, mask)
        index = self.index
        if old == new:
            if old is not None and was_impaired != now_impaired:
                index.count_impaired(old, 1 if now_impaired else -1)
            return
        if index.move(name, old, new) and old is not None and was_impaired:
            index.count_impaired(old, -1)
        if new is not None and now_impaired:
            index.count_impaired(new, 1)
        if len(index.log) > self._log_max:
            self._compact(index)


def node_mask(
    node: Node,
    blocked: int,
    *,
    shares: Mapping[str, tuple[tuple[str, int, int, bool], ...]],
    holds: Mapping[str, tuple[str, ...]],
) -> int:
    """The group mask of a node with shares: shared GPUs leave the free slots like held
    ones, and their usage goes into the share bits (:func:`..shares.pack`), except for a
    GPU that is also out of service or held whole, which takes no more shares."""
    shape = node.shape
    slot_of = shape.slot_of
    use: dict[int, list[int]] = {}
    mps = hami = 0  # slots with shares of each mode
    for per in shares.values():
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
    for rid, devs in holds.items():
        shared = {d for d, _m, _c, _x in shares.get(rid, ())}
        for dev in devs:
            if dev in shared:
                continue
            s = slot_of.get(dev)
            if s is not None:
                blocked |= 1 << s
    share_bits = pack(shape, {s: (u[0], u[1], u[2]) for s, u in use.items() if not blocked >> s & 1}, mps=mps)
    for s in use:
        blocked |= 1 << s
    return shape.effective_free(blocked) | share_bits
