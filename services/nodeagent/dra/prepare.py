"""What a claim may have on this node: its ``tandem.io`` results, checked against Tandem's own
record; pure, no I/O (docs/dra.md, "The kubelet side").

kubelet asks the node agent to prepare a ResourceClaim by namespace, name and uid. Its
``status.allocation`` says which devices of which pool it got, but the status is only a
claim's word: anyone allowed to update claim status could write one naming any device. So
the agent prepares only what Tandem itself assigned: every result of driver ``tandem.io``
must be a device of this node's pool that an allocation in the node's record (KV
``tandem-allocs``, state ``assigned``) holds for a pod the claim is reserved for
(``status.reservedFor``; the assignment's pod uid, or the pod uid its request id starts with,
``<pod uid>.<n>``). A GPU share must be allocated as a share (``shareID``) and a whole GPU
without one. Anything else is refused with a :class:`PrepareError` naming the claim, the
device and what is wrong; kubelet shows it in the pod's events and does not start the pod.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from schemas.messages import AssignedGpu, AssignedNic, Assignment, NodeAllocations

__all__ = ["DRIVER", "PrepareError", "Prepared", "Result", "check", "claim_results", "reserved_pods"]

DRIVER = "tandem.io"
Obj = dict[str, Any]


class PrepareError(ValueError):
    """Tandem will not prepare the claim: the message names the claim and why."""


class Result(NamedTuple):
    """One device result of the claim's allocation (driver ``tandem.io``, this node's pool)."""

    request: str
    device: str  # the DRA device name (slices.device_names)
    share_id: str | None


class Prepared(NamedTuple):
    """A result checked against Tandem's record: the device and the assignment holding it."""

    result: Result
    device_id: str  # Tandem's id: gpu0, gpu0-mig1-0, mlx5_0, a VF's name
    assignment: Assignment
    gpu: AssignedGpu | None
    nic: AssignedNic | None


def where(namespace: str, name: str) -> str:
    return f"ResourceClaim {namespace}/{name}"


def claim_results(claim: Obj, *, node: str, uid: str) -> list[Result]:
    """The claim's results for driver ``tandem.io``; every one must be of ``node``'s pool."""
    meta = claim.get("metadata") or {}
    at = where(str(meta.get("namespace", "")), str(meta.get("name", "")))
    if meta.get("uid") != uid:
        raise PrepareError(
            f"{at}: its uid is {meta.get('uid')!r}, kubelet asked for {uid!r} (the claim was replaced)"
        )
    allocation = (claim.get("status") or {}).get("allocation")
    if not isinstance(allocation, dict):
        raise PrepareError(f"{at}: not allocated (status.allocation is empty)")
    out: list[Result] = []
    for i, res in enumerate((allocation.get("devices") or {}).get("results") or []):
        if not isinstance(res, dict) or res.get("driver") != DRIVER:
            continue
        path = f"status.allocation.devices.results[{i}]"
        if res.get("pool") != node:
            raise PrepareError(
                f"{at} {path}: device {res.get('device')!r} is of pool {res.get('pool')!r}, "
                f"not of this node's pool {node!r}"
            )
        share = res.get("shareID")
        out.append(Result(str(res.get("request", "")), str(res.get("device", "")), share and str(share)))
    return out


def reserved_pods(claim: Obj) -> list[str]:
    """The uids of the pods the claim is reserved for (``status.reservedFor``)."""
    return [
        str(ref["uid"])
        for ref in (claim.get("status") or {}).get("reservedFor") or []
        if isinstance(ref, dict)
        and ref.get("resource") == "pods"
        and not ref.get("apiGroup")
        and ref.get("uid")
    ]


def _owner(assignment: Assignment) -> str:
    return assignment.pod.uid or assignment.request_id.split(".", 1)[0]


def check(
    results: Iterable[Result],
    *,
    claim: str,
    pods: list[str],
    record: NodeAllocations | None,
    names: Mapping[str, str],
) -> list[Prepared]:
    """Each result with the assignment that holds its device, or :class:`PrepareError`.

    ``claim`` names the claim in messages, ``pods`` are the uids it is reserved for, ``names``
    maps DRA device names to Tandem's ids (``slices.tandem_ids``)."""
    if not pods:
        raise PrepareError(f"{claim}: reserved for no pod (status.reservedFor is empty)")
    owned = [
        rec.assignment
        for rec in (record.allocations.values() if record is not None else [])
        if rec.state == "assigned" and _owner(rec.assignment) in pods
    ]
    node = record.node if record is not None else "this node"
    if not owned:
        raise PrepareError(
            f"{claim}: Tandem assigned no devices on {node} to the pod(s) it is reserved for"
            f" ({', '.join(pods)}); only Tandem writes the allocation of a claim of its classes"
        )
    out: list[Prepared] = []
    for res in results:
        dev_id = names.get(res.device)
        if dev_id is None:
            raise PrepareError(
                f"{claim}: device {res.device!r} (request {res.request!r}) is not a device of {node}"
            )
        found = _holder(owned, dev_id)
        if found is None:
            raise PrepareError(
                f"{claim}: device {res.device!r} (request {res.request!r}) was not assigned by Tandem to"
                f" the pod(s) the claim is reserved for ({', '.join(pods)}); refusing to hand it out"
            )
        assignment, gpu, nic = found
        if gpu is not None and gpu.shared != (res.share_id is not None):
            raise PrepareError(
                f"{claim}: device {res.device!r} (request {res.request!r}) is "
                + (
                    "a share in Tandem's assignment but allocated whole (no shareID)"
                    if gpu.shared
                    else "a whole GPU in Tandem's assignment but allocated as a share (shareID)"
                )
            )
        out.append(Prepared(res, dev_id, assignment, gpu, nic))
    return out


def _holder(
    owned: list[Assignment], dev_id: str
) -> tuple[Assignment, AssignedGpu | None, AssignedNic | None] | None:
    for a in owned:
        for g in a.gpus:
            if g.device_id == dev_id:
                return a, g, None
        for n in a.nics:
            if n.name == dev_id:
                return a, None, n
    return None
