"""A pod's DRA ResourceClaims as one Tandem request, and Tandem's answer as each claim's
allocation: pure, no I/O (docs/dra.md, "Joint allocation").

**Reading.** A pod's claims (``resource.k8s.io/v1`` ResourceClaim specs, made from templates
or named directly) are Tandem's when a request names one of Tandem's DeviceClasses
(:data:`KINDS`). :func:`pod_devices` reads every claim of the pod into one :class:`Ask` —
the GPUs and NICs of all of them, so they are placed in one joint search — and the *slots*
that say which claim and request each device goes back to. What Tandem allocates by its own
rules it reads from the claim's opaque configuration for driver ``tandem.io``
(:data:`PARAMETERS_KIND`): the device class, ``scope``, ``policy``, ``pairing``,
``preemption`` and, for MIG, ``migProfile``. A GPU request's ``capacity.requests``
(``memory``, ``cores``) asks a share of each GPU. What the scheduler's allocator would read
and Tandem does not evaluate is refused with the claim and field named, never ignored:
CEL selectors, constraints (``matchAttribute`` puts every device under one value; Tandem pairs
each GPU with its own NIC — say ``scope``), ``allocationMode: All``, ``firstAvailable``,
``adminAccess``, and a claim mixing Tandem's classes with another driver's.

**Writing.** :func:`allocations` turns the :class:`~schemas.messages.Assignment` into each
claim's ``status.allocation``: results by request name and DRA device name, the node
selector naming the node, and Tandem's configuration. Each claim gets the GPUs and the NICs
paired with them where the pairs allow, so a claim's GPUs keep their own NICs. A whole GPU is
allocated without a ``shareID`` (the scheduler then counts it as taken), a share with one and
its ``consumedCapacity``.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from schemas.messages import AssignedGpu, AssignedNic, Assignment
from services.admission.errors import InvalidClaim
from services.kube.quantity import quantity
from services.request import Ask, Field

DRIVER = "tandem.io"
PARAMETERS_API = "tandem.io/v1alpha1"
PARAMETERS_KIND = "AllocationParameters"
Kind = Literal["gpu", "nic", "mig"]
# Tandem's DeviceClasses (deploy/helm/tandem/templates/dra/deviceclasses.yaml) and what each
# asks; the NIC classes differ by function (the Tandem device class's nic_function decides).
KINDS: Mapping[str, Kind] = {
    "gpu.tandem.io": "gpu",
    "nic.tandem.io": "nic",
    "nic-vf.tandem.io": "nic",
    "mig.tandem.io": "mig",
}
# Parameters a claim's opaque configuration may carry, and the request field each sets.
_PARAMETERS: Mapping[str, Field] = {
    "deviceClass": "device_class",
    "scope": "scope",
    "policy": "policy",
    "pairing": "pairing",
    "preemption": "preemption",
    "migProfile": "mig_profile",
}
Obj = dict[str, Any]


class Claim(NamedTuple):
    """One ResourceClaim the pod uses: its identity and its ``spec``."""

    namespace: str
    name: str
    uid: str
    spec: Obj
    # What the author wrote: the claim itself, or (at admission, before the claim exists) the
    # ResourceClaimTemplate it will be made from.
    kind: str = "ResourceClaim"

    def where(self, path: str) -> str:
        return f"{self.kind} {self.namespace}/{self.name} {path}"


class Slot(NamedTuple):
    """Devices of one kind that one request of one claim asks."""

    claim: str  # the claim's name
    request: str
    kind: Kind
    number: int  # how many


class PodDevices(NamedTuple):
    """What the pod's claims ask, as one request, and where each device goes back to."""

    ask: Ask
    slots: tuple[Slot, ...]
    parameters: Obj  # the opaque configuration read (written back into each allocation)


def is_tandems(spec: Obj) -> bool:
    """Whether a claim spec asks any of Tandem's DeviceClasses (the webhook gates such pods)."""
    for req in (spec.get("devices") or {}).get("requests") or []:
        if not isinstance(req, dict):
            continue
        names = [(req.get("exactly") or {}).get("deviceClassName")]
        names += [
            sub.get("deviceClassName") for sub in req.get("firstAvailable") or [] if isinstance(sub, dict)
        ]
        if any(n in KINDS for n in names):
            return True
    return False


def pod_devices(claims: Sequence[Claim], *, default_class: str) -> PodDevices | None:
    """The pod's Tandem claims read into one request (module docstring), or None when none of
    them asks Tandem's classes; :class:`InvalidClaim` names the claim and the field."""
    slots: list[Slot] = []
    parameters: Obj = {}
    shares: dict[str, int] = {}
    for claim in claims:
        if not is_tandems(claim.spec):
            continue
        devices = claim.spec.get("devices") or {}
        _refuse_unsupported(claim, devices)
        for i, req in enumerate(devices.get("requests") or []):
            slot, share = _slot(claim, req, index=i)
            slots.append(slot)
            for key, value in share.items():
                if shares.setdefault(key, value) != value:
                    raise InvalidClaim(
                        claim.where(f"spec.devices.requests[{i}].exactly.capacity.requests.{key}")
                        + f": {value} differs from another request's {shares[key]}; every shared GPU"
                        " of a pod gets the same share"
                    )
        _merge(parameters, _parameters(claim, devices), claim=claim)
    if not slots:
        return None
    gpus = sum(s.number for s in slots if s.kind in ("gpu", "mig"))
    nics = sum(s.number for s in slots if s.kind == "nic")
    ask = Ask(
        gpus,
        nics,
        str(parameters.get("deviceClass", default_class)),
        scope=parameters.get("scope"),
        policy=parameters.get("policy"),
        pairing=parameters.get("pairing"),
        preemption=parameters.get("preemption"),
        gpu_memory_mib=shares.get("memory"),
        gpu_cores_percent=shares.get("cores"),
        mig_profile=parameters.get("migProfile"),
    )
    kinds = {s.kind for s in slots}
    if {"gpu", "mig"} <= kinds:
        raise InvalidClaim(
            f"ResourceClaims {', '.join(sorted({s.claim for s in slots}))}: a pod asks whole GPUs (or"
            " shares of them) or MIG instances, not both"
        )
    if "mig" in kinds and ask.mig_profile is None:
        raise InvalidClaim(
            f"{slots[0].claim}: a request of mig.tandem.io needs migProfile in the claim's"
            f" {PARAMETERS_KIND} (spec.devices.config[].opaque.parameters)"
        )
    return PodDevices(ask, tuple(slots), parameters)


def field_names(claims: Sequence[Claim]) -> dict[Field, str]:
    """How the resolver names each field to the author of these claims (its errors)."""
    where = ", ".join(f"{c.kind} {c.namespace}/{c.name}" for c in claims) or "the pod's claims"
    params = f"the {PARAMETERS_KIND} of {where}"
    out: dict[Field, str] = {f: f"{params}: {key}" for key, f in _PARAMETERS.items()}
    out["gpus"] = f"the GPU requests of {where}"
    out["rdma"] = f"the NIC requests of {where}"
    out["gpu_memory_mib"] = f"capacity.requests.memory of {where}"
    out["gpu_cores_percent"] = f"capacity.requests.cores of {where}"
    return out


def allocations(
    devices: PodDevices, assignment: Assignment, *, names: Mapping[str, str], at: datetime.datetime
) -> dict[str, Obj]:
    """Each claim's ``status.allocation`` (by claim name) for ``assignment``; ``names`` maps
    Tandem's device ids to the slice's device names (``slices.device_names``).

    ``at`` becomes the allocation's ``allocationTimestamp``: an allocation is immutable once
    written, and kube-scheduler (device binding conditions on, as in 1.36) adds a missing
    timestamp when it reserves the claim — a write the API server then refuses."""
    gpus = list(assignment.gpus)
    paired = {p.gpu: p.nic for p in assignment.pairs}
    nics = {n.name: n for n in assignment.nics}
    results: dict[str, list[Obj]] = {s.claim: [] for s in devices.slots}
    claim_gpus: dict[str, list[int]] = {}
    for slot in devices.slots:
        if slot.kind != "nic":
            taken, gpus = gpus[: slot.number], gpus[slot.number :]
            claim_gpus.setdefault(slot.claim, []).extend(g.index for g in taken)
            rid = assignment.request_id
            results[slot.claim] += [
                _gpu_result(slot, g, node=assignment.node, names=names, rid=rid) for g in taken
            ]
    for slot in devices.slots:
        if slot.kind == "nic":
            # The NICs paired with this claim's GPUs first: a claim's GPUs keep their own NICs.
            own = list(
                dict.fromkeys(paired[i] for i in claim_gpus.get(slot.claim, []) if paired.get(i) in nics)
            )
            chosen = [nics.pop(name) for name in own[: slot.number]]
            chosen += [nics.pop(name) for name in list(nics)[: slot.number - len(chosen)]]
            results[slot.claim] += [_nic_result(slot, n, node=assignment.node, names=names) for n in chosen]
    if gpus or nics or sum(len(r) for r in results.values()) != sum(s.number for s in devices.slots):
        raise ValueError(f"assignment {assignment.request_id} does not match the claims' requests")
    config = [
        {
            "source": "FromClaim",
            "opaque": {
                "driver": DRIVER,
                "parameters": {"apiVersion": PARAMETERS_API, "kind": PARAMETERS_KIND, **devices.parameters},
            },
        }
    ]
    selector = {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [assignment.node]}]}
        ]
    }
    return {
        claim: {
            "devices": {"results": res, "config": config},
            "nodeSelector": selector,
            "allocationTimestamp": at.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        for claim, res in results.items()
    }


# -- reading ------------------------------------------------------------------------------------


def _refuse_unsupported(claim: Claim, devices: Obj) -> None:
    if devices.get("constraints"):
        raise InvalidClaim(
            claim.where("spec.devices.constraints")
            + ": Tandem pairs each GPU with a NIC by its own scope; write scope (pcie-switch, pcie-root,"
            f" numa, socket, node) in the claim's {PARAMETERS_KIND} instead of constraints"
        )
    for i, req in enumerate(devices.get("requests") or []):
        path = f"spec.devices.requests[{i}]"
        if not isinstance(req, dict) or not isinstance(req.get("exactly"), dict):
            raise InvalidClaim(
                claim.where(path) + ": Tandem's classes take an exact request (exactly:), not firstAvailable"
            )
        exact = req["exactly"]
        cls = exact.get("deviceClassName")
        if cls not in KINDS:
            raise InvalidClaim(
                claim.where(f"{path}.exactly.deviceClassName")
                + f": {cls!r} is not one of Tandem's classes ({', '.join(KINDS)}); a claim is allocated"
                " by one driver, so put other devices in a claim of their own"
            )
        for key, why in (
            ("selectors", "Tandem does not evaluate CEL selectors; its device class's rules choose devices"),
            ("adminAccess", "admin access is not offered for Tandem's devices"),
            ("tolerations", "Tandem never allocates a tainted (unhealthy or cordoned) device"),
        ):
            if exact.get(key):
                raise InvalidClaim(claim.where(f"{path}.exactly.{key}") + f": {why}")
        if exact.get("allocationMode", "ExactCount") != "ExactCount":
            raise InvalidClaim(
                claim.where(f"{path}.exactly.allocationMode")
                + ": Tandem's classes are asked by count (ExactCount), not All"
            )


def _slot(claim: Claim, req: Obj, *, index: int) -> tuple[Slot, dict[str, int]]:
    exact = req["exactly"]
    path = f"spec.devices.requests[{index}].exactly"
    kind = KINDS[exact["deviceClassName"]]
    count = exact.get("count", 1)
    if not isinstance(count, int) or count < 1:
        raise InvalidClaim(claim.where(f"{path}.count") + f": {count!r} is not a count of 1 or more")
    share: dict[str, int] = {}
    requests = (exact.get("capacity") or {}).get("requests") or {}
    for key, value in requests.items():
        if kind != "gpu" or key not in ("memory", "cores"):
            raise InvalidClaim(
                claim.where(f"{path}.capacity.requests.{key}")
                + ": only a GPU request (gpu.tandem.io) asks capacity, memory or cores"
            )
        share[key] = _quantity(claim, f"{path}.capacity.requests.{key}", str(value), memory=key == "memory")
    return Slot(claim.name, str(req.get("name", "")), kind, count), share


def _quantity(claim: Claim, path: str, value: str, *, memory: bool) -> int:
    """A capacity request as MiB (memory) or percent (cores)."""
    if not memory:
        if value.isdigit():
            return int(value)
        raise InvalidClaim(claim.where(path) + f": {value!r} is not a whole percent of the GPU's compute")
    size = quantity(value)
    if size is not None and size % 2**20 == 0:
        return size // 2**20
    raise InvalidClaim(
        claim.where(path) + f": {value!r} is not a memory size in whole MiB (e.g. 20Gi, 512Mi)"
    )


def _parameters(claim: Claim, devices: Obj) -> Obj:
    out: Obj = {}
    for i, cfg in enumerate(devices.get("config") or []):
        opaque = (cfg or {}).get("opaque") or {}
        if opaque.get("driver") != DRIVER:
            continue
        path = f"spec.devices.config[{i}].opaque.parameters"
        params = opaque.get("parameters")
        if not isinstance(params, dict) or params.get("kind") != PARAMETERS_KIND:
            raise InvalidClaim(
                claim.where(path)
                + f": Tandem's configuration is kind {PARAMETERS_KIND}, apiVersion {PARAMETERS_API}"
            )
        for key, value in params.items():
            if key in ("apiVersion", "kind"):
                continue
            if key not in _PARAMETERS:
                known = ", ".join(_PARAMETERS)
                raise InvalidClaim(claim.where(f"{path}.{key}") + f": unknown parameter (known: {known})")
            if not isinstance(value, str):
                raise InvalidClaim(claim.where(f"{path}.{key}") + f": {value!r} is not a string")
            out[key] = value
    return out


def _merge(into: Obj, params: Obj, *, claim: Claim) -> None:
    for key, value in params.items():
        if into.setdefault(key, value) != value:
            raise InvalidClaim(
                claim.where(f"spec.devices.config: {key}")
                + f": {value!r} differs from {into[key]!r} in another claim of the pod (one placement a pod)"
            )


# -- writing ------------------------------------------------------------------------------------


def _gpu_result(slot: Slot, gpu: AssignedGpu, *, node: str, names: Mapping[str, str], rid: str) -> Obj:
    out: Obj = {"request": slot.request, "driver": DRIVER, "pool": node, "device": names[gpu.device_id]}
    if gpu.shared:
        # A share is one of several allocations of the device: the scheduler counts its capacity.
        out["shareID"] = str(uuid.uuid5(uuid.NAMESPACE_URL, f"tandem:{rid}:{gpu.device_id}"))
        consumed: Obj = {}
        if gpu.memory_mib:
            consumed["memory"] = f"{gpu.memory_mib}Mi"
        if gpu.cores_percent:
            consumed["cores"] = str(gpu.cores_percent)
        out["consumedCapacity"] = consumed
    return out


def _nic_result(slot: Slot, nic: AssignedNic, *, node: str, names: Mapping[str, str]) -> Obj:
    return {"request": slot.request, "driver": DRIVER, "pool": node, "device": names[nic.name]}
