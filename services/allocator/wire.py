"""Wire messages the allocator builds from the core's decisions."""

from __future__ import annotations

import msgspec

from schemas import limits
from schemas.messages import AllocationRequest, AssignedNic, Assignment
from services.allocator.core import Placement

__all__ = ["build_assignment"]


def build_assignment(
    req: AllocationRequest, placement: Placement, *, instance: str, scope_note: str = ""
) -> Assignment:
    """The wire assignment for a placement, with the pod's network wishes applied per NIC;
    ``scope_note``: why its pairs are coarser than asked (``Cluster.scope_reason``)."""
    net = req.network
    nics: list[AssignedNic] = []
    for i, nic in enumerate(placement.nics):
        if net is not None:
            nic = msgspec.structs.replace(
                nic,
                ifname=f"{net.ifname_prefix}{i + 1}",
                mtu=net.mtu,
                addresses=[net.addresses[i]] if i < len(net.addresses) else [],
            )
        nics.append(nic)
    return Assignment(
        request_id=req.request_id,
        pod=req.pod,
        node=placement.node,
        gpus=list(placement.gpus),
        nics=nics,
        pairs=list(placement.pairs),
        scope=placement.scope,
        candidates=placement.candidates,
        allocator=instance,
        requested_at=req.created_at,
        sharing="hami" if placement.sharing == "hami" else "mps" if placement.sharing == "mps" else "",
        memory_limit="soft" if placement.memory_limit == "soft" else "hard",
        scope_note=limits.clip(scope_note),
    )
