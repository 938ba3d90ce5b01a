"""Configuration types more than one component reads: device classes.

A device class is a named template (DESIGN.md "unified device template"): which GPUs and NICs
qualify, and the scope / policy / pairing a request gets when it does not say. The admission
webhook validates class names against it, the allocator core applies it, and operators set
classes in Helm values (``deviceClasses``) or the services' config file.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from schemas.topology import LinkType, ScopeName


class DeviceClass(msgspec.Struct, gc=False, omit_defaults=True, forbid_unknown_fields=True, kw_only=True):
    gpu_models: list[str] = []
    """GPU model substrings that qualify (case-insensitive); empty means any model."""
    gpu_min_memory_mib: int = 0
    nic_link_type: LinkType | None = None
    nic_min_speed_gbps: int = 0
    nic_function: Literal["pf", "vf", "any"] = "pf"
    scope: ScopeName = "pcie-switch"
    policy: Literal["required", "preferred"] = "preferred"
    pairing: Literal["per-gpu", "shared"] | None = None
    """None: ``per-gpu`` when the request asks as many NICs as GPUs, else ``shared``."""
    node_order: Literal["alignment-first", "used-first"] = "alignment-first"
    """With the ``binpack`` policy, where a ``preferred`` request goes. ``alignment-first``
    (the default): the best scope any node offers now, packing (a used node, then the less
    capable server) only among equals. ``used-first``: a used node that can take it, even at
    a worse scope, else the smallest free server, so that the big servers stay whole for large
    aligned jobs (fewer refusals near full, weaker pairs: docs/benchmarks.md, "Node order")."""
    preemption: Literal["never", "lower-priority"] = "never"
    """Whether a request of this class that cannot be placed may evict allocations of lower
    priority (a request's own ``preemption`` overrides it; docs/sharing.md)."""
    sharing: Literal["none", "hami", "mps"] = "none"
    """Whether requests of this class may take a *share* of a GPU (``gpu_memory_mib`` /
    ``gpu_cores_percent``) and how the node agent limits it: ``hami`` hands the limits to the
    container as HAMi-core environment variables, ``mps`` as CUDA MPS limits; ``none``
    (the default) refuses share requests. See docs/sharing.md."""
    max_shares_per_gpu: Annotated[int, msgspec.Meta(ge=1, le=255)] = 8
    """At most this many shares on one GPU (counted when a share of this class is placed)."""
    memory_limit: Literal["hard", "soft"] = "hard"
    """``hard``: the container gets its memory share as a limit; ``soft``: the allocator still
    never hands out more than the GPU's memory, but the container is not limited."""


def default_device_classes() -> dict[str, DeviceClass]:
    return {"default": DeviceClass()}
