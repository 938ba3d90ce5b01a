"""The pod rules of the Kubernetes edge (pure: no HTTP, no NATS, no Kubernetes client).

Reading a pod (:func:`read_pod`), judging what it asks (:func:`resolve`, with the class
defaults and validation of :mod:`services.request`), the webhook's verdict and JSONPatch
(:func:`admit`) and the bridge's allocation request (:func:`allocation_request`); what the bridge
writes back once devices are chosen (binding patch, Events) is :mod:`.podwrites`.

The webhook and the bridge both call :func:`resolve`, so a pod is judged by one rule whether it
is being admitted or, later, turned into an allocation request (annotations stay mutable while
the pod is gated, so the bridge re-checks them).

What counts as a Tandem request (documented for pod authors in ``docs/kubernetes.md``):

* ``tandem.io/gpu`` / ``tandem.io/rdma`` in ``resources.limits`` of the containers; ``requests``
  may be omitted or must equal the limit (extended resources cannot be overcommitted).
* The pod's total is the sum over its containers plus its sidecar init containers
  (``restartPolicy: Always``: they run alongside). An ordinary init container runs before the
  app containers and shares the pod's one set of devices, so it may ask at most the total.
* Counts are whole numbers 0..64; a pod whose total is 0 for both is not a Tandem pod.
* ``spec.nodeName`` must be empty: Tandem chooses the node.
* Annotations choose a device class (default ``default``) and may override its scope, policy
  and pairing; ``priority`` orders the allocator's queue; ``preemption: lower-priority`` lets the
  pod evict pods of lower priority when nothing else makes room; ``network-*`` shape the RDMA
  netdevs.
* Shares of GPUs (docs/sharing.md): ``tandem.io/gpu-share: N`` instead of ``tandem.io/gpu``
  asks N shared GPUs, each sized by the annotations ``tandem.io/gpu-memory-mib`` and/or
  ``tandem.io/gpu-cores-percent``; the device class must allow sharing.
* MIG instances (docs/sharing.md, "MIG"): ``tandem.io/mig: N`` instead of ``tandem.io/gpu``
  asks N existing MIG instances of the profile in the annotation ``tandem.io/mig-profile``
  (``1g.10gb``); not together with whole GPUs or shares.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, NetworkSpec, PodRef
from schemas.topology import ScopeName
from services.admission import names
from services.admission.errors import InvalidPod, PolicyError
from services.request import Ask, Field, RequestError
from services.request import resolve as resolve_request

MAX_COUNT = 64
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
REQUEST_GENERATION = 1
"""A pod is gated and allocated once (gates can only be removed), so its first and only request
has generation 1; the allocator's re-queue of a pod keeps the same request id."""

Policy = Literal["required", "preferred"]
Pairing = Literal["per-gpu", "shared"]
PreemptionMode = Literal["never", "lower-priority"]


# ---------------------------------------------------------------------------------------------
# the part of a pod Tandem reads (msgspec names the path of a bad field)


class _Resources(msgspec.Struct, omit_defaults=True):
    limits: dict[str, Any] | None = None
    requests: dict[str, Any] | None = None


class _Container(msgspec.Struct, omit_defaults=True):
    name: str = ""
    resources: _Resources | None = None
    restartPolicy: str | None = None


class _Gate(msgspec.Struct):
    name: str


class _PodClaim(msgspec.Struct, omit_defaults=True):
    """One of ``spec.resourceClaims`` (DRA): a ResourceClaim named, or one made from a template."""

    name: str = ""
    resourceClaimName: str | None = None
    resourceClaimTemplateName: str | None = None


class _PodClaimStatus(msgspec.Struct, omit_defaults=True):
    """One of ``status.resourceClaimStatuses``: the claim the controller made from a template."""

    name: str = ""
    resourceClaimName: str | None = None


class _Spec(msgspec.Struct, omit_defaults=True):
    containers: list[_Container] = []
    resourceClaims: list[_PodClaim] | None = None
    initContainers: list[_Container] | None = None
    nodeName: str | None = None
    nodeSelector: dict[str, str] | None = None
    schedulingGates: list[_Gate] | None = None


class _Meta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    generateName: str | None = None
    namespace: str | None = None
    uid: str | None = None
    resourceVersion: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    deletionTimestamp: str | None = None


class _Status(msgspec.Struct, omit_defaults=True):
    phase: str | None = None
    resourceClaimStatuses: list[_PodClaimStatus] | None = None


class PodView(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)
    spec: _Spec = msgspec.field(default_factory=_Spec)
    status: _Status | None = None

    @property
    def annotations(self) -> dict[str, str]:
        return self.metadata.annotations or {}

    @property
    def labels(self) -> dict[str, str]:
        return self.metadata.labels or {}

    @property
    def gates(self) -> list[str]:
        return [g.name for g in self.spec.schedulingGates or []]

    @property
    def display_name(self) -> str:
        """The pod's name, or ``<generateName>*`` while it has none (mutating admission)."""
        if self.metadata.name:
            return self.metadata.name
        return f"{self.metadata.generateName or ''}*"

    @property
    def terminal(self) -> bool:
        return self.status is not None and self.status.phase in TERMINAL_PHASES


def read_pod(obj: Any) -> PodView:
    """Read the fields Tandem uses; :class:`InvalidPod` names the bad field's JSON path."""
    if not isinstance(obj, dict):
        raise InvalidPod(f"expected a pod object, got {type(obj).__name__}")
    try:
        return msgspec.convert(obj, PodView, strict=True)
    except msgspec.ValidationError as exc:
        raise InvalidPod(f"not a valid pod: {exc}") from None


# ---------------------------------------------------------------------------------------------
# validation


@dataclass(frozen=True, slots=True)
class TandemRequest:
    """A validated, defaulted Tandem request: what the pod will be allocated."""

    gpus: int
    rdma: int
    device_class: str
    scope: ScopeName
    policy: Policy
    pairing: Pairing
    priority: int = names.DEFAULT_PRIORITY
    network: NetworkSpec | None = None
    preemption: PreemptionMode = "never"
    gpu_memory_mib: int | None = None
    gpu_cores_percent: int | None = None
    mig_profile: str | None = None

    def annotations(self) -> dict[str, str]:
        """The normalised annotations the webhook writes (defaults made explicit; preemption
        only when allowed, so pods that never preempt look as they always did)."""
        out = {
            names.DEVICE_CLASS: self.device_class,
            names.SCOPE: self.scope,
            names.POLICY: self.policy,
            names.PAIRING: self.pairing,
            names.PRIORITY: str(self.priority),
        }
        if self.preemption != "never":
            out[names.PREEMPTION] = self.preemption
        if self.gpu_memory_mib is not None:
            out[names.GPU_MEMORY_MIB] = str(self.gpu_memory_mib)
        if self.gpu_cores_percent is not None:
            out[names.GPU_CORES_PERCENT] = str(self.gpu_cores_percent)
        if self.mig_profile is not None:
            out[names.MIG_PROFILE] = self.mig_profile
        return out


_INT = re.compile(r"^[+-]?\d+$")


def _count(value: Any, *, where: str) -> int:
    """A resource quantity as a whole number of devices, or a :class:`PolicyError` saying where."""
    if isinstance(value, bool) or not isinstance(value, int | str | float):
        raise PolicyError(f"{where}: expected a whole number of devices, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise PolicyError(f"{where}: {value!r} is not a whole number; devices cannot be shared")
        n = int(value)
    elif isinstance(value, str):
        text = value.strip()
        if not _INT.match(text):
            raise PolicyError(f'{where}: {value!r} is not a whole number; ask for whole devices, e.g. "4"')
        n = int(text)
    else:
        n = value
    if n < 0:
        raise PolicyError(f"{where}: {value!r} is negative; ask for 0 or more devices")
    if n > MAX_COUNT:
        raise PolicyError(f"{where}: {n} is more than the {MAX_COUNT} devices one pod can get")
    return n


def _container_counts(c: _Container, *, where: str) -> dict[str, int]:
    res = c.resources or _Resources()
    limits = res.limits or {}
    requests = res.requests or {}
    out: dict[str, int] = {}
    for r in names.RESOURCES:
        at = f"{where} {c.name!r}"
        limit = _count(limits[r], where=f"{at} limits[{r}]") if r in limits else None
        request = _count(requests[r], where=f"{at} requests[{r}]") if r in requests else None
        if request is not None and limit is None:
            raise PolicyError(
                f"{at}: {r} is in requests but not in limits; set it in limits "
                "(requests may be left out and then equal the limit)"
            )
        if request is not None and request != limit:
            raise PolicyError(
                f"{at}: requests[{r}]={request} differs from limits[{r}]={limit}; "
                "devices cannot be overcommitted, so requests must equal limits"
            )
        out[r] = limit or 0
    return out


def mentions_tandem(pod: PodView) -> bool:
    """Whether any container names a Tandem resource at all (cheap pre-check, no validation)."""
    for c in [*pod.spec.containers, *(pod.spec.initContainers or [])]:
        res = c.resources
        if res is None:
            continue
        keys = set(res.limits or {}) | set(res.requests or {})
        if keys & set(names.RESOURCES):
            return True
    return False


def _totals(pod: PodView) -> dict[str, int]:
    total = dict.fromkeys(names.RESOURCES, 0)
    for c in pod.spec.containers:
        for r, n in _container_counts(c, where="container").items():
            total[r] += n
    ordinary: list[tuple[_Container, dict[str, int]]] = []
    for c in pod.spec.initContainers or []:
        counts = _container_counts(c, where="init container")
        if c.restartPolicy == "Always":  # sidecar: runs alongside the app containers
            for r, n in counts.items():
                total[r] += n
        else:
            ordinary.append((c, counts))
    for c, counts in ordinary:
        for r, n in counts.items():
            if n > total[r]:
                raise PolicyError(
                    f"init container {c.name!r} asks for {n} {r} but the pod's containers ask "
                    f"for {total[r]} in total; a pod gets one set of devices, which its init "
                    f"containers share, so ask for {r} on an app container too (or less here)"
                )
    for r, n in total.items():
        if n > MAX_COUNT:
            raise PolicyError(f"the pod asks for {n} {r} in total, more than {MAX_COUNT}")
    return total


def _network(ann: dict[str, str], *, rdma: int) -> NetworkSpec | None:
    given = {k: ann[k] for k in names.NETWORK_KEYS if k in ann}
    if not given:
        return None
    if rdma == 0:
        raise PolicyError(
            f"annotations {', '.join(sorted(given))} shape RDMA netdevs, but the pod asks for "
            f"no {names.RESOURCE_RDMA}"
        )
    raw: dict[str, Any] = {}
    if names.NETWORK_IFNAME_PREFIX in given:
        raw["ifname_prefix"] = given[names.NETWORK_IFNAME_PREFIX]
    if names.NETWORK_MTU in given:
        mtu = given[names.NETWORK_MTU].strip()
        if not _INT.match(mtu):
            raise PolicyError(f"annotation {names.NETWORK_MTU}: {mtu!r} is not a whole number")
        raw["mtu"] = int(mtu)
    if names.NETWORK_ADDRESSES in given:
        addrs = [a.strip() for a in given[names.NETWORK_ADDRESSES].split(",") if a.strip()]
        for a in addrs:
            try:
                if "/" not in a:
                    raise ValueError("no prefix length")
                ipaddress.ip_interface(a)
            except ValueError as exc:
                raise PolicyError(
                    f"annotation {names.NETWORK_ADDRESSES}: {a!r} is not an address with a prefix "
                    f"length like 10.0.0.5/24 ({exc})"
                ) from None
        if len(addrs) > rdma:
            raise PolicyError(f"annotation {names.NETWORK_ADDRESSES}: {len(addrs)} addresses for {rdma} NICs")
        raw["addresses"] = addrs
    try:
        return msgspec.convert(raw, NetworkSpec)
    except msgspec.ValidationError as exc:
        key = {"ifname_prefix": names.NETWORK_IFNAME_PREFIX, "mtu": names.NETWORK_MTU}
        field_name = next((f for f in key if f"`$.{f}`" in str(exc)), "")
        raise PolicyError(f"annotation {key.get(field_name, 'network')}: {exc}") from None


def resolve(pod: PodView, *, device_classes: dict[str, DeviceClass]) -> TandemRequest | None:
    """The pod's validated Tandem request with class defaults applied; ``None`` if it asks none.

    Raises :class:`PolicyError` with a message for the pod author.
    """
    if not mentions_tandem(pod):
        return None
    total = _totals(pod)
    gpus, rdma = total[names.RESOURCE_GPU], total[names.RESOURCE_RDMA]
    shares = total[names.RESOURCE_GPU_SHARE]
    if gpus and shares:
        raise PolicyError(
            f"the pod asks for both {names.RESOURCE_GPU} ({gpus}) and {names.RESOURCE_GPU_SHARE} "
            f"({shares}); a pod gets either whole GPUs or shares of GPUs, so ask one of them"
        )
    mig = total[names.RESOURCE_MIG]
    if mig and (gpus or shares):
        other = names.RESOURCE_GPU if gpus else names.RESOURCE_GPU_SHARE
        raise PolicyError(
            f"the pod asks for both {names.RESOURCE_MIG} ({mig}) and {other} ({gpus or shares}); a pod "
            "gets either MIG instances, whole GPUs or shares of GPUs, so ask one of them"
        )
    gpus = gpus or shares or mig
    if gpus == 0 and rdma == 0:
        return None
    if pod.spec.nodeName:
        raise PolicyError(
            f"spec.nodeName is already set to {pod.spec.nodeName!r}; a pod asking for "
            f"{names.RESOURCE_GPU} or {names.RESOURCE_RDMA} must let Tandem choose the node, "
            "so remove nodeName (use a nodeSelector to restrict nodes)"
        )
    ann = pod.annotations
    memory, cores = _share_sizes(ann, shares=shares)
    mig_profile = _mig_profile(ann, mig=mig)
    prio_text = ann.get(names.PRIORITY, str(names.DEFAULT_PRIORITY)).strip()
    lo, hi = names.PRIORITY_RANGE
    if not _INT.match(prio_text) or not lo <= int(prio_text) <= hi:
        raise PolicyError(f"annotation {names.PRIORITY}: {prio_text!r} is not a whole number in {lo}..{hi}")
    ask = Ask(
        gpus=gpus,
        rdma=rdma,
        device_class=ann.get(names.DEVICE_CLASS, names.DEFAULT_CLASS),
        scope=ann.get(names.SCOPE),
        policy=ann.get(names.POLICY),
        pairing=ann.get(names.PAIRING),
        preemption=ann.get(names.PREEMPTION),
        gpu_memory_mib=memory,
        gpu_cores_percent=cores,
        mig_profile=mig_profile,
    )
    counted = names.RESOURCE_MIG if mig else names.RESOURCE_GPU_SHARE if shares else names.RESOURCE_GPU
    try:
        r = resolve_request(ask, classes=device_classes, names={**_POD_NAMES, "gpus": counted})
    except RequestError as exc:
        raise PolicyError(str(exc)) from None
    return TandemRequest(
        gpus=r.gpus,
        rdma=r.rdma,
        device_class=r.device_class,
        scope=r.scope,
        policy=r.policy,
        pairing=r.pairing,
        priority=int(prio_text),
        network=_network(ann, rdma=rdma),
        preemption=r.preemption,
        gpu_memory_mib=r.gpu_memory_mib,
        gpu_cores_percent=r.gpu_cores_percent,
        mig_profile=r.mig_profile,
    )


# How a pod author writes each field of a request (services.request names the field in errors).
_POD_NAMES: dict[Field, str] = {
    "gpus": names.RESOURCE_GPU,
    "rdma": names.RESOURCE_RDMA,
    "device_class": f"annotation {names.DEVICE_CLASS}",
    "scope": f"annotation {names.SCOPE}",
    "policy": f"annotation {names.POLICY}",
    "pairing": f"annotation {names.PAIRING}",
    "preemption": f"annotation {names.PREEMPTION}",
    "gpu_memory_mib": f"annotation {names.GPU_MEMORY_MIB}",
    "gpu_cores_percent": f"annotation {names.GPU_CORES_PERCENT}",
    "mig_profile": f"annotation {names.MIG_PROFILE}",
}


def _mig_profile(ann: dict[str, str], *, mig: int) -> str | None:
    """The MIG profile of a pod asking ``tandem.io/mig`` (None otherwise)."""
    text = ann.get(names.MIG_PROFILE)
    if not mig:
        if text is not None:
            raise PolicyError(
                f"annotation {names.MIG_PROFILE} chooses MIG instances, but the pod asks no "
                f"{names.RESOURCE_MIG}; ask {names.RESOURCE_MIG} instead of {names.RESOURCE_GPU}, "
                "or remove the annotation"
            )
        return None
    if text is None:
        raise PolicyError(
            f"{names.RESOURCE_MIG} needs the instances' profile: set annotation {names.MIG_PROFILE} "
            '(e.g. "1g.10gb")'
        )
    return text.strip()  # its form is the resolver's to check (services.request)


def _share_sizes(ann: dict[str, str], *, shares: int) -> tuple[int | None, int | None]:
    """The per-GPU share size of a pod asking ``tandem.io/gpu-share`` (None, None otherwise);
    whether its class allows shares is the resolver's to check (services.request)."""
    given = [k for k in names.SHARE_KEYS if k in ann]
    if not shares:
        if given:
            raise PolicyError(
                f"annotation {given[0]} sizes shares of GPUs, but the pod asks no "
                f"{names.RESOURCE_GPU_SHARE}; ask {names.RESOURCE_GPU_SHARE} instead of "
                f"{names.RESOURCE_GPU}, or remove the annotation"
            )
        return None, None
    if not given:
        raise PolicyError(
            f"{names.RESOURCE_GPU_SHARE} needs the share's size: set annotation "
            f"{names.GPU_MEMORY_MIB} and/or {names.GPU_CORES_PERCENT}"
        )
    out: list[int | None] = []
    for key, lo, hi in ((names.GPU_MEMORY_MIB, 1, 2**24), (names.GPU_CORES_PERCENT, 1, 100)):
        text = ann.get(key)
        if text is None:
            out.append(None)
            continue
        if not _INT.match(text.strip()) or not lo <= int(text) <= hi:
            raise PolicyError(f"annotation {key}: {text!r} is not a whole number in {lo}..{hi}")
        out.append(int(text))
    return out[0], out[1]


# ---------------------------------------------------------------------------------------------
# admission: verdict + JSONPatch


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    message: str = ""
    code: int = 200
    patch: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    request: TandemRequest | None = None


def _escape(key: str) -> str:
    """RFC 6901 JSON Pointer escaping: ``~`` → ``~0``, ``/`` → ``~1``."""
    return key.replace("~", "~0").replace("/", "~1")


def _set_map_entries(
    current: dict[str, str] | None, wanted: dict[str, str], *, path: str
) -> list[dict[str, Any]]:
    if current is None:
        return [{"op": "add", "path": path, "value": dict(wanted)}] if wanted else []
    return [
        {"op": "add", "path": f"{path}/{_escape(k)}", "value": v}
        for k, v in wanted.items()
        if current.get(k) != v
    ]


def admission_patch(
    pod: PodView, request: TandemRequest | None, *, traceparent: str | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """JSONPatch ops (and warnings) that gate, label and normalise an accepted Tandem pod
    (``request`` None: a pod asking through DRA claims, whose parameters live in the claims)."""
    warnings: list[str] = []
    ops: list[dict[str, Any]] = []
    wanted_ann = request.annotations() if request is not None else {}
    if traceparent:
        wanted_ann[names.TRACEPARENT] = traceparent
    ops += _set_map_entries(pod.metadata.annotations, wanted_ann, path="/metadata/annotations")
    if names.ASSIGNMENT in pod.annotations:
        # A copied manifest can carry another pod's devices; the bridge writes the real one.
        ops.append({"op": "remove", "path": f"/metadata/annotations/{_escape(names.ASSIGNMENT)}"})
        warnings.append(f"removed annotation {names.ASSIGNMENT}: Tandem sets it when devices are chosen")
    ops += _set_map_entries(pod.metadata.labels, {names.MANAGED: "true"}, path="/metadata/labels")
    if pod.spec.schedulingGates is None:
        ops.append({"op": "add", "path": "/spec/schedulingGates", "value": [{"name": names.GATE}]})
    elif names.GATE not in pod.gates:
        ops.append({"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": names.GATE}})
    return ops, warnings


def admit(
    obj: Any,
    *,
    operation: str,
    device_classes: dict[str, DeviceClass],
    traceparent: str | None = None,
) -> Verdict:
    """The whole admission decision for one pod object (pure)."""
    if operation != "CREATE":
        return Verdict(allowed=True)
    try:
        pod = read_pod(obj)
        request = resolve(pod, device_classes=device_classes)
    except InvalidPod as exc:
        return Verdict(allowed=False, code=400, message=f"tandem: {exc}")
    except PolicyError as exc:
        return Verdict(allowed=False, code=403, message=f"tandem: pod {pod.display_name}: {exc}")
    if request is None:
        return Verdict(allowed=True)
    ops, warnings = admission_patch(pod, request, traceparent=traceparent)
    return Verdict(allowed=True, patch=ops, warnings=warnings, request=request)


# ---------------------------------------------------------------------------------------------
# bridge: the allocation request of a persisted pod (what it writes back: podwrites)


def request_id_for(uid: str, generation: int = REQUEST_GENERATION) -> str:
    return f"{uid}.{generation}"


def pod_ref(pod: PodView) -> PodRef:
    return PodRef(
        namespace=pod.metadata.namespace or "", name=pod.metadata.name or "", uid=pod.metadata.uid or ""
    )


def allocation_request(pod: PodView, *, device_classes: dict[str, DeviceClass]) -> AllocationRequest | None:
    """The ``alloc.request`` for a persisted gated pod; ``None`` if it asks no Tandem devices.

    Raises :class:`PolicyError` (annotations edited into something invalid while gated) and
    :class:`InvalidPod` (no UID: not persisted yet).
    """
    if not pod.metadata.uid or not pod.metadata.name:
        raise InvalidPod("pod has no name or uid yet; only persisted pods get an allocation request")
    req = resolve(pod, device_classes=device_classes)
    if req is None:
        return None
    return AllocationRequest(
        request_id=request_id_for(pod.metadata.uid),
        pod=pod_ref(pod),
        gpus=req.gpus,
        rdma=req.rdma,
        scope=req.scope,
        policy=req.policy,
        pairing=req.pairing,
        device_class=req.device_class,
        priority=req.priority,
        node_selector=dict(pod.spec.nodeSelector or {}),
        network=req.network,
        preemption=req.preemption,
        gpu_memory_mib=req.gpu_memory_mib,
        gpu_cores_percent=req.gpu_cores_percent,
        mig_profile=req.mig_profile,
    )
