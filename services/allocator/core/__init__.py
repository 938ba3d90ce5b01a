"""Pure allocation core: joint GPU + RDMA NIC placement (no I/O; see ``.importlinter``).

Public API::

    cluster = Cluster(node_policy="binpack", device_classes={...})
    cluster.set_node(name, topology, labels=..., unavailable=..., shard=...)
    cluster.hold(name, request_id, devices) / cluster.release(name, request_id)
    cluster.decide(request) -> Placement | Unschedulable      # does not change holds
    cluster.decide(request, prefer_shard=..., before_fallback=...)   # a replica's own shard first
    cluster.preempt(why.spec)           # after a failed decision ``why``: victims, or None
    place_job(cluster, job, tiers=("leaf", "spine"))          # a whole job: JobPlacement |
                                                              # JobUnschedulable; holds nothing
    cluster.cache_stats()                                     # sizes of the (bounded) caches

Labels unique per node (the service's ``kubernetes.io/hostname``) cost nothing: a selector
that few nodes match is decided on those nodes; see :mod:`.cluster`.

Modules — the framework: :mod:`.cluster` (the node registry and the decision pipeline),
:mod:`.signatures` (filter and score over a group index: the signature heaps), :mod:`.index`
(the generic group index), :mod:`.labels` (labels, shards, hardware ids), :mod:`.scores` (the
node order as named terms: shard preference, reserve pressure, alignment, binpack/spread),
:mod:`.placement` (what a decision returns), :mod:`.nodes` (the registry's node record).
The device kinds, one plugin each: :mod:`.plugins` (whole GPUs, shares, stacking, MIG; the
interface in :mod:`.plugins.base`), on the in-node searches :mod:`.search` (exact, whole GPUs
and NICs), :mod:`.shares` / :mod:`.sharefit` (GPU shares) and :mod:`.mig`; :mod:`.model`
compiles a node topology into a bit-mask *shape*. After a decision that found no node:
:mod:`.preempt` finds the allocations of lower priority to evict (over :mod:`.victims`, the
preemptible holds). :mod:`.gang` places whole jobs (N pods, all or nothing, by fabric tier);
:mod:`.request` makes the core's request (:class:`Spec`) and orders pending requests.

Exception tree: ``ValueError`` → :class:`InvalidRequest` (the only exception for bad input);
"cannot place now" is the :class:`Unschedulable` value, not an exception.
"""

from . import preempt
from .cluster import Cluster
from .errors import InvalidRequest
from .gang import JobPlacement, JobUnschedulable, place_job
from .model import HOPPER_PARTITIONS, nvlink_partitions
from .placement import NodeReason, Placement, Unschedulable
from .request import Spec, normalise, pending_order

__all__ = [
    "HOPPER_PARTITIONS",
    "Cluster",
    "InvalidRequest",
    "JobPlacement",
    "JobUnschedulable",
    "NodeReason",
    "Placement",
    "Spec",
    "Unschedulable",
    "normalise",
    "nvlink_partitions",
    "pending_order",
    "place_job",
    "preempt",
]
