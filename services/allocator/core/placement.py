"""What a decision returns: :class:`Placement` (the node, the devices, the pairs) or
:class:`Unschedulable` (no node can take the request now, and why, aggregated over nodes).

The device-kind plugins (:mod:`.plugins`) find a slot-level :class:`~.search.Choice` on a
node; :func:`wire_placement` (whole GPUs and shares) and :func:`assembled` (any kind, from its
wire-level GPUs) turn it into the wire-level placement. :func:`unschedulable` writes the
aggregated reason from per-reason node counts, which the index keeps as counters (no walk over
the nodes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from schemas.messages import AssignedGpu, AssignedNic, Pair
from schemas.topology import Gpu, Nic, NodeTopology, ScopeName

from .model import Shape, device_at
from .nodes import Node
from .request import Spec
from .search import Choice, Refusal

__all__ = [
    "SCOPE",
    "SELECTOR_REFUSAL",
    "NodeReason",
    "Placement",
    "Unschedulable",
    "assembled",
    "unschedulable",
    "wire_placement",
]

SCOPE: tuple[ScopeName, ...] = ("pcie-switch", "pcie-root", "numa", "socket", "node")
SELECTOR_REFUSAL = Refusal("selector", "labels do not match the node selector")


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
    # The request as the decision resolved it: what the stages after the decision read
    # (the class's share limit at commit), so the request is resolved once.
    spec: Spec = field(kw_only=True, repr=False, compare=False)

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
    """No node can take the request now. ``reason`` aggregates ``reasons`` for people.

    ``spec``: the request as the decision resolved it, what the step after a failed decision
    (the PostFilter, :mod:`.preempt`) works on, so the request is resolved once."""

    reason: str
    counts: dict[str, int]
    reasons: list[NodeReason] = field(default_factory=list)
    candidates: int = 0
    spec: Spec = field(kw_only=True, repr=False, compare=False)


def wire_placement(node: Node, res: Choice, *, spec: Spec, candidates: int) -> Placement:
    """A whole-GPU or share choice on ``node`` as the wire-level placement."""
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
        Pair(gpu=shape.gpu_index[gs], nic=shape.slot_id[ns], scope=SCOPE[sc]) for gs, ns, sc in res.pairs
    ]
    return assembled(
        node,
        res,
        spec=spec,
        gpus=gpus,
        nic_slots=res.nics,
        pairs=pairs,
        candidates=candidates,
        sharing=spec.dc.sharing if spec.shared else "",
        memory_limit=spec.dc.memory_limit,
    )


def assembled(
    node: Node,
    res: Choice,
    *,
    spec: Spec,
    gpus: list[AssignedGpu],
    nic_slots: Iterable[int],
    pairs: list[Pair],
    candidates: int,
    sharing: str = "",
    memory_limit: str = "hard",
) -> Placement:
    """A placement of ``spec`` from its GPUs and pairs (whole, shared or MIG) and the in-node
    search's result: the NICs of ``nic_slots``, the scope and quality."""
    nics = [_assigned_nic(node.topology, node.shape, s) for s in nic_slots]
    return Placement(
        node=node.name,
        gpus=gpus,
        nics=nics,
        pairs=pairs,
        scope=SCOPE[res.scope],
        candidates=candidates,
        met=res.met,
        quality=res.key + res.frag,
        sharing=sharing,
        memory_limit=memory_limit,
        spec=spec,
    )


def _assigned_nic(topo: NodeTopology, shape: Shape, slot: int) -> AssignedNic:
    path = shape.paths[slot]
    pf = device_at(topo, path, nic=True)
    assert isinstance(pf, Nic)
    if path[5] < 0:
        return AssignedNic(name=pf.name, pf=pf.name, pci_bus_id=pf.pci_bus_id, netdev=pf.netdev)
    vf = pf.vfs[path[5]]
    return AssignedNic(name=vf.name, pf=pf.name, vf=vf.index, pci_bus_id=vf.pci_bus_id, netdev=vf.netdev)


def unschedulable(
    spec: Spec,
    *,
    refused: Mapping[str, int],
    codes: Mapping[str, str],
    impaired: Mapping[str, int],
    any_nodes: bool,
) -> Unschedulable:
    """The aggregated reason. ``impaired``: per refusal text, how many of its nodes hold
    devices out of service (from per-group counters, not a walk over nodes), so that a
    person reading "fewer than 4 free GPUs" learns that a failed GPU is part of why."""
    if not any_nodes:
        return Unschedulable(reason="no nodes", counts={}, reasons=[], spec=spec)
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
        spec=spec,
    )
