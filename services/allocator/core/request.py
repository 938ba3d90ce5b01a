"""Requests as the core sees them: defaults applied, names parsed, one hashable key.

:func:`normalise` turns a wire :class:`~schemas.messages.AllocationRequest` into a
:class:`Spec`: the request is resolved by :mod:`services.request` (the class's defaults, the
rules every entry point shares), so everything that can never work is an
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
from services.request import RequestError, resolve

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
    # What the PostFilter (.preempt) reads, resolved here once and never part of ``key``: the
    # request may evict allocations of a priority below this one (its own); None: it may not.
    preempt_below: int | None = None

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
    """The request resolved (:mod:`services.request`) and made a :class:`Spec`.

    ``preempt_below`` (the request's priority) is set when the resolved ``preemption`` (the
    request's own, else its class's) is ``lower-priority`` and the request asks whole GPUs. A
    request for GPU *shares* never
    preempts: its room would be a part of a GPU, which the preemption search, counting whole
    devices, does not plan (docs/sharing.md); nor does one for *MIG instances*: no preemptible
    hold holds an instance (a MIG hold is never a victim), so evicting frees none."""
    try:
        r = resolve(req, classes=classes)
    except RequestError as exc:
        raise InvalidRequest(f"request {req.request_id}: {exc}") from None
    shared = r.shared
    preempts = r.preemption == "lower-priority" and not shared and r.mig_profile is None
    return Spec(
        gpus=r.gpus,
        rdma=r.rdma,
        scope=Scope.parse(r.scope),
        required=r.policy == "required",
        per_gpu=r.pairing == "per-gpu",
        device_class=r.device_class,
        dc=r.dc,
        selector=tuple(sorted(req.node_selector.items())),
        shared=shared,
        memory_mib=r.gpu_memory_mib or 0,
        cores_percent=r.gpu_cores_percent or 0,
        mig_profile=r.mig_profile or "",
        preempt_below=req.priority if preempts else None,
    )


R = TypeVar("R", bound=AllocationRequest)


def pending_order(requests: Iterable[R]) -> list[R]:
    """Retry order for pending requests: priority descending, then creation time, then id."""
    return sorted(requests, key=lambda r: (-r.priority, r.created_at, r.request_id))
