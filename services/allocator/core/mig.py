"""MIG instances: existing Multi-Instance GPU devices handed out one request each.

A GPU in MIG mode (``Gpu.mig_mode``) is split by the operator into MIG instances
(``Gpu.mig_instances``: profile such as ``1g.10gb``, ``MIG-`` UUID); Tandem never creates or
destroys them. A request with ``mig_profile`` (a :class:`.request.Spec` with ``mig_profile``
set) asks ``gpus`` free instances of that profile, with its ``rdma`` NICs paired and scoped
exactly as for whole GPUs. The rules:

* a MIG-mode GPU is never given whole and never shared: :meth:`MigIndex.set_node` returns its
  slot, which the cluster keeps out of the node's free mask for good (like an unavailable
  device), so whole-GPU and share requests, their caches and the preemption search never see
  it;
* an instance is held by at most one request: it is free only while no hold names its device
  id (``gpu<parent>-mig<gi>-<ci>``, :func:`schemas.topology.mig_device_id`); an instance of a
  GPU that is unhealthy or cordoned, or that is itself marked unavailable, is not free;
* NICs stay exclusive and come from the node's free mask like any request's.

How a node is searched. An instance sits where its GPU sits, so the node is seen as a
*virtual topology*: the same PCIe tree and NICs, each GPU replaced by its free instances of
the profile (as many "GPUs" at the GPU's place, without NVLink: MIG instances have no NVLink
peer-to-peer). The exact in-node search (:func:`.search.evaluate`) runs on it unchanged, so
alignment is exactly as good as for whole GPUs (the property tests check it against the
exhaustive reference). Virtual topologies are compiled once per signature (nodes with the
same hardware and the same free-instance layout share one) and searches are cached by
(request key, virtual shape, free NICs).

Packing. The search's quality comes first. Then ``binpack`` fills a GPU's instances before
opening another GPU and ``spread`` does the opposite: the search runs a second time on the
instances of GPUs that already have (binpack) or have no (spread) instance in use, and that
answer is taken when its quality is equal; then, within each PCIe location (where instances
are interchangeable for alignment), the instances are picked from the fullest GPUs first
(binpack) or one per GPU from the emptiest (spread). Across nodes: alignment, then the number
of GPUs the placement opens (fewer for binpack, more for spread), then the one-sided waste as
for whole GPUs, then the fullest (binpack) or emptiest (spread) node in instances of the
profile, then the node registered first.

Cost. MIG is a minority path: the index keeps, per profile, the nodes with at least one free
instance of it, and a decision looks at those nodes only (matching the selector), each search
cached. It is O(nodes with a free instance of the profile), never O(all nodes).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

from schemas.topology import Gpu, NodeTopology, NumaNode, PcieRoot, PcieSwitch, Socket

from .model import Shape, compile_shape, shape_signature
from .request import Spec
from .search import Choice, Refusal, evaluate

__all__ = ["MigChoice", "MigIndex", "MigPick", "is_mig_device"]

_MIG_ID = re.compile(r"^gpu[0-9]+-mig[0-9]+-[0-9]+$")
_VSHAPE_BASE = 1 << 40  # virtual shape ids: far from the cluster's own shape ids
_VSHAPE_MAX = 4096  # compiled virtual shapes kept before the cache is cleared
_EVAL_MAX = 50_000
_LAYOUTS_PER_NODE = 16  # candidate layouts kept per node (one per profile x class, mostly)


def is_mig_device(device: str) -> bool:
    """Whether a device id names a MIG instance (``gpu3-mig1-0``)."""
    return "-mig" in device and _MIG_ID.match(device) is not None


@dataclass(frozen=True, slots=True)
class MigPick:
    """One instance handed out: its device id, parent GPU and instance facts."""

    device: str
    gpu_index: int
    gpu_uuid: str
    gpu_bus_id: str | None
    profile: str
    uuid: str
    gpu_instance_id: int
    compute_instance_id: int


@dataclass(frozen=True, slots=True)
class MigChoice:
    """A MIG decision on one node: instances in GPU order, NIC slots of the node's real shape,
    pairs as (parent GPU index, NIC slot, scope level); ``choice`` is the virtual search's."""

    node: str
    picks: tuple[MigPick, ...]
    nics: tuple[int, ...]
    pairs: tuple[tuple[int, int, int], ...]
    choice: Choice


@dataclass(frozen=True, slots=True)
class _Virtual:
    """A search on a node's virtual topology: the choice, each virtual GPU slot's instance,
    and the virtual shape (its NIC slot ids are the node's NIC names)."""

    choice: Choice
    insts: list[_Inst]
    shape: Shape


@dataclass(slots=True)
class _Inst:
    device: str
    gpu_slot: int
    gpu: Gpu
    profile: str
    uuid: str
    gi: int
    ci: int

    def pick(self) -> MigPick:
        """This instance as handed out."""
        return MigPick(
            device=self.device,
            gpu_index=self.gpu.index,
            gpu_uuid=self.gpu.uuid,
            gpu_bus_id=self.gpu.pci_bus_id,
            profile=self.profile,
            uuid=self.uuid,
            gpu_instance_id=self.gi,
            compute_instance_id=self.ci,
        )


# A MIG group: (layout id, free instances, free NIC slots, GPU slots with an instance held).
GroupKey = tuple[int, frozenset[str], int, frozenset[int]]
# A group's cached result: a refusal, or (order without the node, the choice on its first node).
_Result = Refusal | tuple[tuple[int, ...], "MigChoice"]


@dataclass(slots=True)
class _MigNode:
    name: str
    seq: int
    topology: NodeTopology
    shape: Shape
    labels: Mapping[str, str]
    instances: list[_Inst]
    shard: str | None = None  # see .scores (shard preference)
    nic_free: int = 0
    free: frozenset[str] = frozenset()
    used_gpus: frozenset[int] = frozenset()  # GPU slots with an instance held
    free_by_profile: dict[str, int] = field(default_factory=dict)
    layout: int = 0  # nodes with equal layout ids have the same shape and MIG instances
    gkey: GroupKey | None = None  # its group (see MigIndex): layout and free state
    by_device: dict[str, _Inst] = field(default_factory=dict)
    # Candidate set (device ids) -> (virtual shape, instance per virtual GPU slot): the layout
    # is rebuilt only when the node's free instances change.
    layouts: dict[tuple[str, ...], tuple[Shape, list[_Inst]]] = field(default_factory=dict)


class MigIndex:
    """The MIG instances of every node with a GPU in MIG mode (see the module docstring)."""

    def __init__(self) -> None:
        self._nodes: dict[str, _MigNode] = {}
        self._seq = 0
        # Nodes in the same layout and free state decide alike: one search per group and
        # request; per profile, the groups with a free instance of it.
        self._groups: dict[GroupKey, dict[str, None]] = {}
        self._by_profile: dict[str, dict[GroupKey, None]] = {}
        self._layouts: dict[tuple[object, ...], int] = {}
        self._results: dict[tuple[object, ...], _Result] = {}
        self._vshapes: dict[tuple[object, ...], Shape] = {}
        self._evals: dict[tuple[object, ...], Choice | Refusal] = {}
        self._vshape_seq = 0

    # -- state ------------------------------------------------------------------------------

    def set_node(
        self,
        name: str,
        topology: NodeTopology,
        shape: Shape,
        labels: Mapping[str, str],
        *,
        shard: str | None = None,
    ) -> int:
        """Register (or replace) a node; returns the slot mask of its MIG-mode GPUs, which the
        cluster must keep out of the free mask. A node without MIG GPUs is forgotten here."""
        block = 0
        instances: list[_Inst] = []
        for gpu in topology.gpus():
            if not gpu.mig_mode:
                continue
            slot = shape.slot_of[gpu.id]
            block |= 1 << slot
            for dev, m in gpu.mig_ids():
                instances.append(
                    _Inst(dev, slot, gpu, m.profile, m.uuid, m.gpu_instance_id, m.compute_instance_id)
                )
        old = self._nodes.get(name)
        if not block:
            if old is not None:
                self.remove(name)
            return 0
        if old is None:
            self._seq += 1
            seq = self._seq
        else:
            seq = old.seq
            self._index(old, -1)
        node = self._nodes[name] = _MigNode(name, seq, topology, shape, dict(labels), instances, shard)
        lkey = (shape.id, tuple((i.device, i.gpu_slot, i.profile) for i in instances))
        node.layout = self._layouts.setdefault(lkey, len(self._layouts))
        node.by_device = {i.device: i for i in instances}
        return block

    def remove(self, name: str) -> None:
        node = self._nodes.pop(name, None)
        if node is not None:
            self._index(node, -1)

    def refresh(self, name: str, *, held: Iterable[str], unavailable: Collection[str], nic_free: int) -> None:
        """A node's holds, health or free NICs changed: recompute its free instances."""
        node = self._nodes.get(name)
        if node is None:
            return
        self._index(node, -1)
        taken = set(held)
        free: set[str] = set()
        used: set[int] = set()
        for inst in node.instances:
            if inst.device in taken:
                used.add(inst.gpu_slot)
            elif (
                inst.gpu.id not in unavailable
                and inst.device not in unavailable
                and inst.uuid not in unavailable
            ):
                free.add(inst.device)
        node.free = frozenset(free)
        node.used_gpus = frozenset(used)
        node.nic_free = nic_free
        self._index(node, 1)

    def _index(self, node: _MigNode, delta: int) -> None:
        """Take the node out of its group (-1) or put it in the group of its state (+1)."""
        if delta < 0:
            gkey = node.gkey
            if gkey is None:
                return
            node.gkey = None
            members = self._groups[gkey]
            del members[node.name]
            if not members:
                del self._groups[gkey]
                for profile in node.free_by_profile:
                    groups = self._by_profile[profile]
                    del groups[gkey]
                    if not groups:
                        del self._by_profile[profile]
            return
        counts: dict[str, int] = {}
        for inst in node.instances:
            if inst.device in node.free:
                counts[inst.profile] = counts.get(inst.profile, 0) + 1
        node.free_by_profile = counts
        gkey = node.gkey = (node.layout, node.free, node.nic_free, node.used_gpus)
        group = self._groups.get(gkey)
        if group is None:
            group = self._groups[gkey] = {}
            for profile in counts:
                self._by_profile.setdefault(profile, {})[gkey] = None
        group[node.name] = None

    # -- queries ----------------------------------------------------------------------------

    def free_instances(self, name: str) -> dict[str, list[str]]:
        """Free MIG instances of ``name`` by profile (device ids in tree order)."""
        node = self._nodes.get(name)
        if node is None:
            return {}
        out: dict[str, list[str]] = {}
        for inst in node.instances:
            if inst.device in node.free:
                out.setdefault(inst.profile, []).append(inst.device)
        return out

    def decide(
        self, spec: Spec, *, node_policy: str, shard: str | None = None
    ) -> tuple[MigChoice, int] | dict[str, tuple[str, int]]:
        """The best node for a MIG request: ``(choice, candidate nodes)``, or the refusals
        ``{text: (code, nodes)}`` of the nodes that have a free instance of the profile.
        ``shard``: only the nodes of that shard (the first tier of a shard preference, whose
        refusals nobody reads: the other nodes count as not matching the selector)."""
        refused: dict[str, tuple[str, int]] = {}
        best: tuple[int, ...] | None = None
        # (choice, nodes) of the groups whose order equals the best: the node registered
        # first wins, with its group's choice (groups of equal order may differ in layout).
        tied: list[tuple[MigChoice, Collection[str]]] = []
        feasible = 0
        for gkey in self._by_profile.get(spec.mig_profile, {}):
            members = self._groups[gkey]
            names: Collection[str] = members
            if spec.selector or shard is not None:
                names = [
                    n
                    for n in members
                    if all(self._nodes[n].labels.get(k) == v for k, v in spec.selector)
                    and (shard is None or self._nodes[n].shard == shard)
                ]
                off = len(members) - len(names)
                if off:
                    text = "labels do not match the node selector"
                    code, n = refused.get(text, ("selector", 0))
                    refused[text] = (code, n + off)
                if not names:
                    continue
            count = len(names)
            res = self._group_result(gkey, spec, node_policy=node_policy)
            if isinstance(res, Refusal):
                code, n = refused.get(res.text, (res.code, 0))
                refused[res.text] = (code, n + count)
                continue
            feasible += count
            order, choice = res
            if best is None or order < best:
                best = order
                tied = [(choice, names)]
            elif order == best:
                tied.append((choice, names))
        if best is None:
            return refused
        _seq, choice, first = min(
            ((self._nodes[n].seq, c, n) for c, names in tied for n in names), key=lambda t: t[0]
        )
        return self._on(choice, self._nodes[first]), feasible

    def fit_count(self, spec: Spec, *, node_policy: str) -> int:
        """How many nodes could take the MIG request now (reports; walks the profile's groups)."""
        n = 0
        for gkey in self._by_profile.get(spec.mig_profile, {}):
            members = self._groups[gkey]
            if isinstance(self._group_result(gkey, spec, node_policy=node_policy), Refusal):
                continue
            n += sum(1 for m in members if all(self._nodes[m].labels.get(k) == v for k, v in spec.selector))
        return n

    def _group_result(self, gkey: GroupKey, spec: Spec, *, node_policy: str) -> _Result:
        """The cached search of a group (on any one of its nodes: they decide alike)."""
        key = (gkey, spec.key, node_policy)
        got = self._results.get(key)
        if got is None:
            node = self._nodes[next(iter(self._groups[gkey]))]
            res = self.evaluate(node, spec, node_policy=node_policy)
            got = res if isinstance(res, Refusal) else (res[1][:-1], res[0])
            if len(self._results) >= _EVAL_MAX:
                self._results.clear()
            self._results[key] = got
        return got

    @staticmethod
    def _on(choice: MigChoice, node: _MigNode) -> MigChoice:
        """A group's choice (made on one of its nodes) for ``node`` of the same group: the same
        instance and NIC ids, with this node's name, GPU UUIDs and instance UUIDs."""
        picks = tuple(node.by_device[p.device].pick() for p in choice.picks)
        return replace(choice, node=node.name, picks=picks)

    def evaluate(
        self, node: _MigNode, spec: Spec, *, node_policy: str
    ) -> tuple[MigChoice, tuple[int, ...]] | Refusal:
        """The best placement on one node and its cross-node order key."""
        cands = [i for i in node.instances if i.device in node.free and i.profile == spec.mig_profile]
        view_spec = replace(spec, mig_profile="")
        models = [m.lower() for m in spec.dc.gpu_models]
        cands = [
            i
            for i in cands
            if (not models or any(m in i.gpu.model.lower() for m in models))
            and i.gpu.memory_mib >= spec.dc.gpu_min_memory_mib
        ]
        if len(cands) < spec.gpus:
            return Refusal("gpus", f"fewer than {spec.gpus} free MIG instances {spec.mig_profile}{_of(spec)}")
        virt = self._search(node, cands, view_spec)
        if isinstance(virt, Refusal):
            return _mig_refusal(spec, virt)
        used = node.used_gpus
        alt_set = (
            [i for i in cands if i.gpu_slot in used]
            if node_policy == "binpack"
            else [i for i in cands if i.gpu_slot not in used]
        )
        chosen = [virt.insts[s] for s in virt.choice.gpus]
        wants_alt = (
            any(i.gpu_slot not in used for i in chosen)
            if node_policy == "binpack"
            else any(i.gpu_slot in used for i in chosen)
        )
        if wants_alt and len(alt_set) >= spec.gpus:
            alt = self._search(node, alt_set, view_spec)
            if not isinstance(alt, Refusal) and alt.choice.key == virt.choice.key:
                virt = alt
        picks, pairs = _repick(node, virt, binpack=node_policy == "binpack")
        vchoice = virt.choice
        opened = len({p.gpu_slot for p in picks if p.gpu_slot not in used})
        free_here = node.free_by_profile.get(spec.mig_profile, 0)
        align, waste = vchoice.cross[:-1], vchoice.cross[-1]
        if node_policy == "binpack":
            order = (*align, opened, waste, free_here, node.seq)
        else:
            order = (*align, -opened, waste, -free_here, node.seq)
        nic_slots = tuple(node.shape.slot_of[virt.shape.slot_id[s]] for s in vchoice.nics)
        choice = MigChoice(
            node=node.name,
            picks=tuple(i.pick() for i in picks),
            nics=nic_slots,
            pairs=pairs,
            choice=vchoice,
        )
        return choice, order

    # -- the virtual search -------------------------------------------------------------------

    def _search(self, node: _MigNode, cands: list[_Inst], spec: Spec) -> _Virtual | Refusal:
        """Run the exact search on the node's virtual topology with ``cands`` as its GPUs:
        the choice (slots of the virtual shape), the instance of each virtual GPU slot, and
        the virtual shape."""
        lkey = tuple(i.device for i in cands)
        layout = node.layouts.get(lkey)
        if layout is None:
            layout = node.layouts[lkey] = self._layout(node, cands)
            if len(node.layouts) > _LAYOUTS_PER_NODE:
                del node.layouts[next(iter(node.layouts))]
        vshape, insts = layout
        # Free mask of the virtual shape: every virtual GPU, and the NICs free on the node.
        free = vshape.gpu_all
        real = node.shape
        for s in range(real.n_gpus, real.n_slots):
            if node.nic_free >> s & 1:
                free |= 1 << vshape.slot_of[real.slot_id[s]]
        key = (spec.key, vshape.id, free)
        res = self._evals.get(key)
        if res is None:
            if len(self._evals) >= _EVAL_MAX:
                self._evals.clear()
            res = self._evals[key] = evaluate(vshape, free, spec)
        if isinstance(res, Refusal):
            return res
        return _Virtual(res, insts, vshape)

    def _layout(self, node: _MigNode, cands: list[_Inst]) -> tuple[Shape, list[_Inst]]:
        """The virtual shape of ``cands`` on ``node`` (compiled once per signature: nodes with
        the same hardware and free-instance layout share it) and each virtual GPU slot's
        instance."""
        vtopo, order = _virtual(node.topology, cands)
        sig = shape_signature(vtopo)
        vshape = self._vshapes.get(sig)
        if vshape is None:
            if len(self._vshapes) >= _VSHAPE_MAX:
                # Cached searches name the shapes by id; ids are never reused (_vshape_seq).
                self._vshapes.clear()
                self._evals.clear()
            self._vshape_seq += 1
            vshape = self._vshapes[sig] = compile_shape(
                vtopo, shape_id=_VSHAPE_BASE + self._vshape_seq, signature=sig
            )
        # Virtual GPU slot -> instance: slots follow tree order, as _virtual laid them out.
        by_index = {v.index: inst for v, inst in order}
        return vshape, [by_index[vshape.gpu_index[s]] for s in range(vshape.n_gpus)]


def _of(spec: Spec) -> str:
    return f" of class {spec.device_class!r}" if spec.dc.gpu_models or spec.dc.gpu_min_memory_mib else ""


def _mig_refusal(spec: Spec, res: Refusal) -> Refusal:
    if res.code == "gpus":
        return Refusal("gpus", f"fewer than {spec.gpus} free MIG instances {spec.mig_profile}{_of(spec)}")
    return res


def _virtual(topo: NodeTopology, cands: list[_Inst]) -> tuple[NodeTopology, list[tuple[Gpu, _Inst]]]:
    """The node's tree with each GPU replaced by its candidate instances (see the module
    docstring). Virtual GPU indices count up in tree order; the parent's model and memory stay
    (the device class selects by the parent GPU)."""
    by_gpu: dict[int, list[_Inst]] = {}
    for inst in cands:
        by_gpu.setdefault(inst.gpu.index, []).append(inst)
    order: list[tuple[Gpu, _Inst]] = []

    def swap(gpus: list[Gpu]) -> list[Gpu]:
        out: list[Gpu] = []
        for g in gpus:
            for inst in by_gpu.get(g.index, ()):
                v = Gpu(index=len(order), uuid=inst.uuid, model=g.model, memory_mib=g.memory_mib)
                order.append((v, inst))
                out.append(v)
        return out

    sockets = [
        Socket(
            id=sock.id,
            numa_nodes=[
                NumaNode(
                    id=numa.id,
                    roots=[
                        PcieRoot(
                            id=root.id,
                            gpus=swap(root.gpus),
                            nics=root.nics,
                            switches=[
                                PcieSwitch(id=sw.id, gpus=swap(sw.gpus), nics=sw.nics) for sw in root.switches
                            ],
                        )
                        for root in numa.roots
                    ],
                )
                for numa in sock.numa_nodes
            ],
        )
        for sock in topo.sockets
    ]
    return NodeTopology(name=topo.name, sockets=sockets), order


def _repick(
    node: _MigNode, virt: _Virtual, *, binpack: bool
) -> tuple[list[_Inst], tuple[tuple[int, int, int], ...]]:
    """Within each PCIe location the search's count of instances is what matters for
    alignment; which instances there is the packing policy's: the fullest GPUs first
    (binpack: most instances in use, then fewest free candidates left, then lowest index), or
    one per GPU from the emptiest (spread). Returns the instances and the pairs as (parent GPU
    index, NIC slot of the real shape, scope)."""
    real = node.shape
    vchoice, vcands, vshape = virt.choice, virt.insts, virt.shape
    used_count: dict[int, int] = {}
    held_free = node.free
    for inst in node.instances:
        if inst.device not in held_free:
            used_count[inst.gpu_slot] = used_count.get(inst.gpu_slot, 0) + 1
    loc_of = {i: real.gpu_loc[inst.gpu_slot] for i, inst in enumerate(vcands)}
    at: dict[tuple[int, int, int, int], list[int]] = {}
    for i in range(len(vcands)):
        at.setdefault(loc_of[i], []).append(i)
    remap: dict[int, int] = {}
    for loc, chosen in _group(vchoice.gpus, loc_of).items():
        pool = at[loc]
        per_gpu: dict[int, list[int]] = {}
        for i in pool:
            per_gpu.setdefault(vcands[i].gpu_slot, []).append(i)
        if binpack:
            picked = _fill(per_gpu, used_count, len(chosen))
        else:
            gpus = sorted(per_gpu, key=lambda g: (used_count.get(g, 0), -len(per_gpu[g]), g))
            picked = []
            depth = 0
            while len(picked) < len(chosen):
                for g in gpus:
                    if depth < len(per_gpu[g]) and len(picked) < len(chosen):
                        picked.append(per_gpu[g][depth])
                depth += 1
        for old, new in zip(sorted(chosen), sorted(picked), strict=True):
            remap[old] = new
    picks = sorted((vcands[remap[s]] for s in vchoice.gpus), key=lambda i: (i.gpu.index, i.gi, i.ci))
    pairs = sorted(
        (vcands[remap[gs]].gpu.index, real.slot_of[vshape.slot_id[ns]], sc) for gs, ns, sc in vchoice.pairs
    )
    return picks, tuple(pairs)


def _fill(per_gpu: dict[int, list[int]], used_count: Mapping[int, int], need: int) -> list[int]:
    """Binpack within one location: GPUs with instances in use first, the fullest first; then
    fresh GPUs: the one that can take all that is left with the fewest spare (best fit), else
    the one with the most (so the request opens as few GPUs as it can)."""
    out: list[int] = []
    for g in sorted((g for g in per_gpu if used_count.get(g, 0)), key=lambda g: (-used_count[g], g)):
        out.extend(per_gpu[g][: need - len(out)])
    fresh = sorted(g for g in per_gpu if not used_count.get(g, 0))
    while len(out) < need and fresh:
        want = need - len(out)
        fits = [g for g in fresh if len(per_gpu[g]) >= want]
        g = min(fits, key=lambda g: len(per_gpu[g])) if fits else max(fresh, key=lambda g: len(per_gpu[g]))
        out.extend(per_gpu[g][:want])
        fresh.remove(g)
    return out


def _group(
    slots: Iterable[int], loc_of: Mapping[int, tuple[int, int, int, int]]
) -> dict[tuple[int, int, int, int], list[int]]:
    out: dict[tuple[int, int, int, int], list[int]] = {}
    for s in slots:
        out.setdefault(loc_of[s], []).append(s)
    return out
