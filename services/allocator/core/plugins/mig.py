"""MIG instances (:mod:`..mig`): a request with ``mig_profile`` asks existing instances.

The kind decides alone: its :class:`..mig.MigIndex` keeps, per profile, the nodes with a free
instance of it, so a decision looks at those nodes only (O(nodes with a free instance), never
O(all nodes)); the other nodes are counted as having none. A MIG-mode GPU is kept out of its
node's free mask for good (the registry's ``mig_block``), so the other kinds never see it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from schemas.messages import AssignedGpu, AssignedMig, Pair
from schemas.topology import NodeTopology
from services.allocator.core.mig import MigChoice, MigIndex
from services.allocator.core.model import Shape
from services.allocator.core.nodes import Node
from services.allocator.core.placement import SCOPE, Placement, Unschedulable, assembled, unschedulable
from services.allocator.core.request import Spec

__all__ = ["MigInstances"]


class MigInstances:
    """The MIG kind. ``nodes``: the registry's nodes (read only)."""

    __slots__ = ("_nodes", "instances", "policy")

    name = "mig"  # decides alone, by its own index

    def __init__(self, nodes: dict[str, Node], *, policy: str) -> None:
        self._nodes = nodes
        self.policy = policy
        self.instances = MigIndex()

    def applies(self, spec: Spec) -> bool:
        return bool(spec.mig_profile)

    def fit_count(self, spec: Spec) -> int | None:
        return self.instances.fit_count(spec, policy=self.policy)

    def place(self, spec: Spec, *, shard: str | None) -> Placement | Unschedulable | None:
        res = self.instances.decide(spec, policy=self.policy, shard=shard)
        if isinstance(res, tuple):
            choice, feasible = res
            return self._placement(choice, spec, candidates=feasible)
        refused = {text: n for text, (_code, n) in res.items()}
        codes = {text: code for text, (code, _n) in res.items()}
        others = len(self._nodes) - sum(refused.values())
        if others > 0:
            text = f"no free MIG instance {spec.mig_profile}"
            refused[text] = others
            codes[text] = "gpus"
        return unschedulable(spec, refused=refused, codes=codes, impaired={}, any_nodes=bool(self._nodes))

    # -- Reserve: the registry tells the index what changed ---------------------------------

    def set_node(
        self, name: str, topology: NodeTopology, shape: Shape, labels: Mapping[str, str], *, shard: str | None
    ) -> int:
        """Register a node; returns the slots of its MIG-mode GPUs (never free as GPUs)."""
        return self.instances.set_node(name, topology, shape, labels, shard=shard)

    def remove(self, name: str) -> None:
        self.instances.remove(name)

    def refresh(self, name: str, *, held: Iterable[str], unavailable: Collection[str], nic_free: int) -> None:
        self.instances.refresh(name, held=held, unavailable=unavailable, nic_free=nic_free)

    def free_instances(self, name: str) -> dict[str, list[str]]:
        return self.instances.free_instances(name)

    def _placement(self, choice: MigChoice, spec: Spec, *, candidates: int) -> Placement:
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
        pairs = [Pair(gpu=g, nic=node.shape.slot_id[ns], scope=SCOPE[sc]) for g, ns, sc in choice.pairs]
        return assembled(
            node, choice.choice, gpus=gpus, nic_slots=choice.nics, pairs=pairs, candidates=candidates
        )
