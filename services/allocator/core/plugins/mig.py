"""MIG instances (:mod:`..mig`): a request with ``mig_profile`` asks existing instances.

The kind decides alone: its :class:`..mig.MigIndex` keeps, per profile, the nodes with a free
instance of it, so a decision looks at those nodes only (O(nodes with a free instance), never
O(all nodes)); the other nodes are counted as having none. A MIG-mode GPU is kept out of its
node's free mask for good (the slots :meth:`MigInstances.node_set` returns, the registry's
``kind_block``), so the other kinds never see it; a hold of an instance is never a
preemption victim (:meth:`MigInstances.protects`).
"""

from __future__ import annotations

from collections.abc import Mapping

from schemas.messages import AssignedGpu, AssignedMig, Pair
from schemas.topology import NodeTopology
from services.allocator.core.mig import MigChoice, MigIndex, is_mig_device
from services.allocator.core.model import Shape
from services.allocator.core.nodes import Node
from services.allocator.core.placement import SCOPE, Placement, Unschedulable, assembled, unschedulable
from services.allocator.core.request import Spec
from services.allocator.core.shares import slot_bits

from .base import Holds, Hooks

__all__ = ["MigInstances"]


class MigInstances(Hooks):
    """The MIG kind. ``nodes``: the registry's nodes (read only)."""

    __slots__ = ("_nodes", "instances", "node_policy")

    name = "mig"  # decides alone, by its own index

    def __init__(self, nodes: dict[str, Node], *, node_policy: str) -> None:
        self._nodes = nodes
        self.node_policy = node_policy
        self.instances = MigIndex()

    def applies(self, spec: Spec) -> bool:
        return bool(spec.mig_profile)

    def fit_count(self, spec: Spec) -> int | None:
        return self.instances.fit_count(spec, node_policy=self.node_policy)

    def ready(self) -> None:
        pass  # the index follows every node from its registration

    def place(self, spec: Spec, *, shard: str | None) -> Placement | Unschedulable | None:
        res = self.instances.decide(spec, node_policy=self.node_policy, shard=shard)
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

    # -- Reserve: the registry tells the index what changed (.base.Hooks) --------------------

    def node_set(
        self, name: str, topology: NodeTopology, shape: Shape, labels: Mapping[str, str], *, shard: str | None
    ) -> int:
        """Register a node; returns the slots of its MIG-mode GPUs (never free as GPUs)."""
        return self.instances.set_node(name, topology, shape, labels, shard=shard)

    def node_removed(self, name: str) -> None:
        self.instances.remove(name)

    def protects(self, devices: tuple[str, ...]) -> bool:
        """A hold of a MIG instance is never a victim: no request preempts for instances."""
        return any(is_mig_device(d) for d in devices)

    def refreshed(self, node: Node, holds: Holds) -> None:
        """The node's free instances, from its holds, health and free NICs."""
        self.instances.refresh(
            node.name,
            held={d for devs in holds.values() for d in devs},
            unavailable={*node.unavailable, *node.port_down},
            nic_free=slot_bits(node.shape, node.mask) & ~node.shape.gpu_all,
        )

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
            node,
            choice.choice,
            spec=spec,
            gpus=gpus,
            nic_slots=choice.nics,
            pairs=pairs,
            candidates=candidates,
        )
