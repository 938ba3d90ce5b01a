"""Requests as the core sees them: defaults applied, names parsed, one hashable key.

:func:`normalise` turns a wire :class:`~schemas.messages.AllocationRequest` into a
:class:`Spec`: the device class fills in scope, policy and pairing the request left out, and
``pairing=None`` becomes ``per-gpu`` when the request asks as many NICs as GPUs (and at least
one), ``shared`` otherwise. Everything that can never work is an
:class:`~services.allocator.core.errors.InvalidRequest` here, before any node is looked at.

:func:`pending_order` is the queue order the allocator service retries pending requests in:
higher priority first, then older first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from schemas.config import DeviceClass
from schemas.messages import AllocationRequest
from schemas.topology import Scope

from .errors import InvalidRequest

__all__ = ["Spec", "normalise", "pending_order"]


@dataclass(frozen=True, slots=True)
class Spec:
    """A normalised request. ``key`` is what two requests must share to share a decision."""

    gpus: int
    rdma: int
    scope: Scope
    required: bool
    per_gpu: bool
    device_class: str
    dc: DeviceClass
    selector: tuple[tuple[str, str], ...]
    # A share of each GPU (see .shares): ``shared`` set, memory / compute 0 when not asked.
    shared: bool = False
    memory_mib: int = 0
    cores_percent: int = 0

    key: tuple[object, ...] = ()
    """Everything node-independent the in-node search depends on (set on creation; the index
    reads it for every group a signature meets, so it is computed once)."""

    # MIG (see .mig): ``gpus`` existing MIG instances of this profile; "" for GPUs.
    mig_profile: str = ""
    # A share request's *stacking* view (see .shares): only nodes with a shared GPU the share
    # fits on can take it; the cluster index keeps it apart from the full share search.
    stack: bool = False

    def __post_init__(self) -> None:
        base = (self.gpus, self.rdma, int(self.scope), self.required, self.per_gpu, self.device_class)
        key: tuple[object, ...] = base
        if self.shared:
            key = (*base, "share", self.memory_mib, self.cores_percent)
        if self.mig_profile:
            key = (*base, "mig", self.mig_profile)
        if self.stack:
            key = (*key, "stack")
        object.__setattr__(self, "key", key)

    @property
    def pairing(self) -> str:
        return "per-gpu" if self.per_gpu else "shared"

    def whole_with_min_memory(self, floor: int) -> Spec:
        """This request as one for whole GPUs of at least ``floor`` MiB, without a selector:
        how a share is searched on fresh GPUs (.shares, .cluster). The class gets a name per
        floor because a class's view of a shape is cached by name (``Shape.view``)."""
        return Spec(
            gpus=self.gpus,
            rdma=self.rdma,
            scope=self.scope,
            required=self.required,
            per_gpu=self.per_gpu,
            device_class=f"{self.device_class}\x00{floor}",
            dc=msgspec.structs.replace(self.dc, gpu_min_memory_mib=max(self.dc.gpu_min_memory_mib, floor)),
            selector=(),
        )


def normalise(req: AllocationRequest, classes: Mapping[str, DeviceClass]) -> Spec:
    dc = classes.get(req.device_class)
    if dc is None:
        known = ", ".join(sorted(classes)) or "none"
        raise InvalidRequest(
            f"request {req.request_id}: unknown device class {req.device_class!r} (known: {known})"
        )
    try:
        scope = Scope.parse(req.scope if req.scope is not None else dc.scope)
    except ValueError as exc:
        raise InvalidRequest(f"request {req.request_id}: {exc}") from None
    policy = req.policy if req.policy is not None else dc.policy
    if policy not in ("required", "preferred"):
        raise InvalidRequest(f"request {req.request_id}: unknown policy {policy!r}")
    if req.gpus < 0 or req.rdma < 0:
        raise InvalidRequest(f"request {req.request_id}: negative device count")
    if req.gpus == 0 and req.rdma == 0:
        raise InvalidRequest(f"request {req.request_id}: asks for no GPU and no NIC")
    pairing = req.pairing if req.pairing is not None else dc.pairing
    if pairing is None or (req.pairing is None and pairing == "per-gpu" and req.gpus != req.rdma):
        # A class default of per-gpu cannot apply to a request with unequal counts.
        pairing = "per-gpu" if req.gpus == req.rdma else "shared"
    if pairing not in ("per-gpu", "shared"):
        raise InvalidRequest(f"request {req.request_id}: unknown pairing {pairing!r}")
    if pairing == "per-gpu" and req.gpus != req.rdma:
        raise InvalidRequest(
            f"request {req.request_id}: pairing per-gpu needs as many NICs as GPUs "
            f"(asked {req.gpus} GPUs, {req.rdma} NICs); use pairing shared"
        )
    shared = req.gpu_memory_mib is not None or req.gpu_cores_percent is not None
    if shared and req.mig_profile is not None:
        raise InvalidRequest(
            f"request {req.request_id}: mig_profile cannot be combined with gpu_memory_mib / "
            "gpu_cores_percent (a MIG instance is not shared); ask one or the other"
        )
    if shared:
        if dc.sharing == "none":
            raise InvalidRequest(
                f"request {req.request_id}: device class {req.device_class!r} does not allow GPU "
                "shares (sharing: none); drop gpu_memory_mib / gpu_cores_percent to ask whole "
                "GPUs, or use a class with sharing: hami or mps"
            )
        if req.gpus < 1:
            raise InvalidRequest(
                f"request {req.request_id}: gpu_memory_mib / gpu_cores_percent are per GPU; "
                "ask at least one GPU (gpus: N means N shared GPUs)"
            )
        if (req.gpu_memory_mib is not None and req.gpu_memory_mib < 1) or (
            req.gpu_cores_percent is not None and not 1 <= req.gpu_cores_percent <= 100
        ):
            raise InvalidRequest(
                f"request {req.request_id}: gpu_memory_mib must be at least 1 and "
                "gpu_cores_percent between 1 and 100"
            )
    if req.mig_profile is not None and req.gpus < 1:
        raise InvalidRequest(
            f"request {req.request_id}: mig_profile {req.mig_profile!r} needs gpus >= 1 "
            "(gpus: N means N MIG instances of the profile)"
        )
    return Spec(
        gpus=req.gpus,
        rdma=req.rdma,
        scope=scope,
        required=policy == "required",
        per_gpu=pairing == "per-gpu",
        device_class=req.device_class,
        dc=dc,
        selector=tuple(sorted(req.node_selector.items())),
        shared=shared,
        memory_mib=req.gpu_memory_mib or 0,
        cores_percent=req.gpu_cores_percent or 0,
        mig_profile=req.mig_profile or "",
    )


R = TypeVar("R", bound=AllocationRequest)


def pending_order(requests: Iterable[R]) -> list[R]:
    """Retry order for pending requests: priority descending, then creation time, then id."""
    return sorted(requests, key=lambda r: (-r.priority, r.created_at, r.request_id))
