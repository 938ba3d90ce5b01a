"""Every Kubernetes name Tandem puts on or reads from a pod: resources, annotations, label, gate.

These are the pod author's and the operator's interface (documented in ``docs/kubernetes.md``);
they live in one module so the webhook, the bridge, the chart tests and the docs cannot drift.
All keys carry the ``tandem.io/`` prefix.
"""

from __future__ import annotations

from services.kube import resources

PREFIX = "tandem.io/"

# Extended resources a container asks for in ``resources.limits`` (requests, if given, equal).
RESOURCE_GPU = f"{PREFIX}gpu"
RESOURCE_RDMA = f"{PREFIX}rdma"
# Shares of GPUs (docs/sharing.md): N shared GPUs, sized by the two annotations below.
RESOURCE_GPU_SHARE = f"{PREFIX}gpu-share"
# MIG instances (docs/sharing.md, "MIG"): N existing instances of the profile annotated below.
RESOURCE_MIG = f"{PREFIX}mig"
RESOURCES = (RESOURCE_GPU, RESOURCE_RDMA, RESOURCE_GPU_SHARE, RESOURCE_MIG)

# Annotations a pod author may set; the webhook fills in the device class's defaults.
DEVICE_CLASS = f"{PREFIX}device-class"
SCOPE = f"{PREFIX}scope"
POLICY = f"{PREFIX}policy"
PAIRING = f"{PREFIX}pairing"
PRIORITY = f"{PREFIX}priority"
PREEMPTION = f"{PREFIX}preemption"
"""``never`` or ``lower-priority``: may the pod evict pods of lower priority (default: its class's)."""
NETWORK_IFNAME_PREFIX = f"{PREFIX}network-ifname-prefix"
NETWORK_MTU = f"{PREFIX}network-mtu"
NETWORK_ADDRESSES = f"{PREFIX}network-addresses"
NETWORK_KEYS = (NETWORK_IFNAME_PREFIX, NETWORK_MTU, NETWORK_ADDRESSES)
GPU_MEMORY_MIB = f"{PREFIX}gpu-memory-mib"
"""Memory of each shared GPU (``tandem.io/gpu-share``), MiB."""
GPU_CORES_PERCENT = f"{PREFIX}gpu-cores-percent"
"""Compute of each shared GPU (``tandem.io/gpu-share``), percent."""
SHARE_KEYS = (GPU_MEMORY_MIB, GPU_CORES_PERCENT)
MIG_PROFILE = f"{PREFIX}mig-profile"
"""The MIG profile (``1g.10gb``) of the instances a pod asks with ``tandem.io/mig``."""

# A pod that uses a DeviceClaim (same namespace) names it here; it gets exactly the claim's
# devices and makes no allocation request of its own (docs/sharing.md "Claims").
CLAIM = f"{PREFIX}claim"

# The DeviceClaim custom resource: its API coordinates live with the Kubernetes adapter that
# calls it (services.kube.resources); the pod-side code reads them here with the other names.
CLAIM_GROUP = resources.CLAIM_GROUP
CLAIM_VERSION = resources.CLAIM_VERSION
CLAIM_PLURAL = resources.CLAIM_PLURAL
CLAIM_KIND = resources.CLAIM_KIND
# Holds a deleted claim until no pod uses it, so its devices are never cleaned up under a
# running pod; the bridge removes it once it has released the claim.
CLAIM_FINALIZER = f"{PREFIX}claim-release"

# DRA (docs/dra.md, "Joint allocation"): a ResourceClaim whose devices Tandem holds carries
# this finalizer, so it is never gone before its devices' cleanup is verified, and the request
# that holds its devices (and that request's pod) in the two annotations below; a restarted
# bridge reads them back from the claims.
DRA_FINALIZER = f"{PREFIX}dra-allocation"
DRA_REQUEST = f"{PREFIX}request"
DRA_POD = f"{PREFIX}request-pod"

# Annotations Tandem writes.
TRACEPARENT = f"{PREFIX}traceparent"
"""W3C trace context of the pod's ``admission.admit`` span: every later span joins this trace."""
ASSIGNMENT = f"{PREFIX}assignment"
"""JSON of the devices the allocator chose (set by the bridge when it removes the gate)."""

# Label on every pod the webhook accepted as a Tandem pod; the bridge watches by it.
MANAGED = f"{PREFIX}managed"
MANAGED_SELECTOR = f"{MANAGED}=true"

# Scheduling gate that keeps the pod away from the scheduler until its devices are chosen.
GATE = f"{PREFIX}allocation"

# Namespace label that opts a namespace out of the webhook (used by the chart's namespaceSelector).
NAMESPACE_OPT_OUT = f"{PREFIX}admission"
NAMESPACE_OPT_OUT_VALUE = "disabled"

DEFAULT_CLASS = "default"
DEFAULT_PRIORITY = 0
PRIORITY_RANGE = (-1_000_000, 1_000_000)

# Event written on a pod whose allocation failed.
EVENT_REASON_FAILED = "AllocationFailed"
EVENT_REASON_INVALID = "InvalidTandemRequest"
EVENT_REASON_CLAIM = "WaitingForClaim"
# Events of a pod's DRA ResourceClaims: on a claim Tandem cannot allocate now or ever (a
# ResourceClaim's status has no conditions; the Event is what ``kubectl describe`` shows).
EVENT_REASON_CLAIM_INVALID = "InvalidTandemClaim"
# Events of priority preemption: on the preemptor while a PodDisruptionBudget blocks the
# eviction of a victim, and on each victim evicted for it.
EVENT_REASON_PREEMPTION_BLOCKED = "PreemptionBlocked"
EVENT_REASON_PREEMPTED = "Preempted"
EVENT_COMPONENT = "tandem-bridge"
