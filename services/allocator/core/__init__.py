"""Pure allocation core: joint GPU + RDMA NIC placement (no I/O; see ``.importlinter``).

Public API::

    cluster = Cluster(policy="binpack", device_classes={...})
    cluster.set_node(name, topology, labels=..., unavailable=...)
    cluster.hold(name, request_id, devices) / cluster.release(name, request_id)
    cluster.decide(request) -> Placement | Unschedulable      # does not change holds
    place_job(cluster, job, tiers=("leaf", "spine"))          # a whole job: JobPlacement |
                                                              # JobUnschedulable; holds nothing
    cluster.cache_stats()                                     # sizes of the (bounded) caches

Labels unique per node (the service's ``kubernetes.io/hostname``) cost nothing: a selector
that few nodes match is decided on those nodes; see :mod:`.cluster`.

Modules: :mod:`.gang` places whole jobs (N pods, all or nothing, by fabric tier);
:mod:`.model` compiles a node topology into a bit-mask *shape*; :mod:`.search` is the
exact in-node search and its quality order; :mod:`.cluster` is the node index and cache;
:mod:`.request` applies device-class defaults and orders pending requests; :mod:`.preempt`
finds the allocations of lower priority to evict for a request that cannot be placed.

Exception tree: ``ValueError`` → :class:`InvalidRequest` (the only exception for bad input);
"cannot place now" is the :class:`Unschedulable` value, not an exception.
"""

from . import preempt
from .cluster import Cluster, NodeReason, Placement, Unschedulable
from .errors import InvalidRequest
from .gang import JobPlacement, JobUnschedulable, place_job
from .model import HOPPER_PARTITIONS, nvlink_partitions
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
