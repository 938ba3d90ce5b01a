"""Resolve a request once, the same way everywhere.

A request reaches Tandem through a pod's resources and annotations (the admission webhook and
the pod bridge), a DeviceClaim's spec (the claim bridge), the CLI's flags, a `tandem plan` line
and, at the end, the allocator, which decides every request it receives. Each of them used to
apply the device class's defaults and check the rules itself, and they differed (a class whose
default pairing is ``per-gpu`` made the webhook refuse a pod with unequal counts that the
allocator would have placed with ``shared`` pairing; a claim could ask a share of a class that
does not share, which only the allocator refused). Now each of them describes what was asked as
an :class:`Ask` and calls :func:`resolve`:

* the class's defaults fill what the ask left out (scope, policy, pairing, preemption); a
  class's default pairing ``per-gpu`` applies only where it can (as many NICs as GPUs), else
  the pairing follows the counts;
* every rule that does not depend on a node is checked here, so what admission accepts the
  allocator does not reject for a rule (only for want of room);
* an error is a :class:`RequestError` naming the field, in the words of the caller's user:
  ``names`` maps each :data:`Field` to how that user writes it (``annotation tandem.io/scope``
  for a pod author, ``spec.scope`` for a claim's, ``--scope`` for the CLI's).

The allocator resolves again what admission resolved (a class may have changed meanwhile):
resolving a resolved request changes nothing.

A caller that does not know the classes the request will be decided with — the CLI: the
running system's classes are its allocator's configuration, not the command's — calls
:func:`check`: the rules of :func:`resolve` that hold whatever the class, and nothing filled in;
the class's rules (its name, whether it shares) stay the allocator's to answer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal, NamedTuple, NoReturn, Protocol, cast

from schemas.config import DeviceClass
from schemas.topology import MIG_PROFILE_PATTERN, SCOPES, ScopeName

__all__ = ["CLASS_DEFAULTED", "WIRE_NAMES", "Ask", "Field", "RequestError", "Resolved", "check", "resolve"]

Field = Literal[
    "gpus",
    "rdma",
    "device_class",
    "scope",
    "policy",
    "pairing",
    "preemption",
    "gpu_memory_mib",
    "gpu_cores_percent",
    "mig_profile",
]
# The fields a device class gives a default for.
CLASS_DEFAULTED: tuple[Field, ...] = ("scope", "policy", "pairing", "preemption")
# How the wire (and the allocator's log) names each field.
WIRE_NAMES: Mapping[Field, str] = {f: f for f in Field.__args__}  # type: ignore[attr-defined]

POLICIES = ("required", "preferred")
PAIRINGS = ("per-gpu", "shared")
PREEMPTIONS = ("never", "lower-priority")
MAX_SHARE_MIB = 2**24
_SCOPES, _POLICIES = frozenset(SCOPES), frozenset(POLICIES)
_PAIRINGS, _PREEMPTIONS = frozenset(PAIRINGS), frozenset(PREEMPTIONS)
_MIG_PROFILE = re.compile(MIG_PROFILE_PATTERN)


class RequestError(ValueError):
    """A request that can never be placed; ``field`` is what is wrong, and the message names
    it in the caller's words."""

    def __init__(self, field: Field, message: str) -> None:
        super().__init__(message)
        self.field = field


class Ask(NamedTuple):
    """What was asked, before defaults; ``None`` means "the class's". (Named tuples, not
    frozen dataclasses: the allocator resolves every request it decides, and a frozen
    dataclass's construction cost several times a tuple's.)"""

    gpus: int
    rdma: int
    device_class: str
    scope: str | None = None
    policy: str | None = None
    pairing: str | None = None
    preemption: str | None = None
    gpu_memory_mib: int | None = None
    gpu_cores_percent: int | None = None
    mig_profile: str | None = None


class Resolved(NamedTuple):
    """A request with nothing left to default; ``dc`` is its device class."""

    gpus: int
    rdma: int
    device_class: str
    dc: DeviceClass
    scope: ScopeName
    policy: Literal["required", "preferred"]
    pairing: Literal["per-gpu", "shared"]
    preemption: Literal["never", "lower-priority"]
    gpu_memory_mib: int | None = None
    gpu_cores_percent: int | None = None
    mig_profile: str | None = None

    @property
    def shared(self) -> bool:
        """Asks a share of each GPU rather than whole GPUs."""
        return self.gpu_memory_mib is not None or self.gpu_cores_percent is not None


class Asked(Protocol):
    """What :func:`resolve` reads: an :class:`Ask`, or a wire
    :class:`~schemas.messages.AllocationRequest` as it is (the allocator's path, no copy)."""

    @property
    def gpus(self) -> int: ...
    @property
    def rdma(self) -> int: ...
    @property
    def device_class(self) -> str: ...
    @property
    def scope(self) -> str | None: ...
    @property
    def policy(self) -> str | None: ...
    @property
    def pairing(self) -> str | None: ...
    @property
    def preemption(self) -> str | None: ...
    @property
    def gpu_memory_mib(self) -> int | None: ...
    @property
    def gpu_cores_percent(self) -> int | None: ...
    @property
    def mig_profile(self) -> str | None: ...


def resolve(
    ask: Asked, *, classes: Mapping[str, DeviceClass], names: Mapping[Field, str] = WIRE_NAMES
) -> Resolved:
    """``ask`` with its class's defaults applied, or :class:`RequestError` (module docstring)."""
    n = names
    if ask.gpus < 0 or ask.rdma < 0:
        field: Field = "gpus" if ask.gpus < 0 else "rdma"
        raise RequestError(field, f"{n[field]}: {min(ask.gpus, ask.rdma)} is negative; ask 0 or more")
    if ask.gpus == 0 and ask.rdma == 0:
        raise RequestError("gpus", f"{n['gpus']} and {n['rdma']} are both 0; ask for GPUs, NICs or both")
    dc = classes.get(ask.device_class)
    if dc is None:
        known = ", ".join(sorted(classes)) or "none configured"
        raise RequestError(
            "device_class", f"{n['device_class']}: unknown device class {ask.device_class!r} (known: {known})"
        )
    # The allocator resolves every request it decides: the common path is a few membership
    # tests and one tuple, the messages are built only for an error.
    scope = ask.scope if ask.scope is not None else dc.scope
    if scope not in _SCOPES:
        _refuse("scope", scope, SCOPES, names=n)
    policy = ask.policy if ask.policy is not None else dc.policy
    if policy not in _POLICIES:
        _refuse("policy", policy, POLICIES, names=n)
    preemption = ask.preemption if ask.preemption is not None else dc.preemption
    if preemption not in _PREEMPTIONS:
        _refuse("preemption", preemption, PREEMPTIONS, names=n)
    equal = ask.gpus == ask.rdma
    pairing = ask.pairing
    if pairing is not None:
        if pairing not in _PAIRINGS:
            _refuse("pairing", pairing, PAIRINGS, names=n)
    elif dc.pairing is not None and (dc.pairing != "per-gpu" or equal):
        pairing = dc.pairing  # the class's default, where it can apply
    else:
        pairing = "per-gpu" if equal else "shared"
    if pairing == "per-gpu" and not equal:
        _unequal_per_gpu(ask, names=n)
    if ask.gpu_memory_mib is not None or ask.gpu_cores_percent is not None:
        _check_share(ask, dc, names=n)
    if ask.mig_profile is not None:
        _check_mig(ask, names=n)
    return Resolved(
        ask.gpus,
        ask.rdma,
        ask.device_class,
        dc,
        cast(ScopeName, scope),
        cast(Literal["required", "preferred"], policy),
        cast(Literal["per-gpu", "shared"], pairing),
        cast(Literal["never", "lower-priority"], preemption),
        ask.gpu_memory_mib,
        ask.gpu_cores_percent,
        ask.mig_profile,
    )


def check(ask: Asked, *, names: Mapping[Field, str] = WIRE_NAMES) -> None:
    """The rules of :func:`resolve` that hold whatever the device class (module docstring), or
    :class:`RequestError` naming the field; fills in nothing. What ``check`` accepts,
    :func:`resolve` refuses only for the class: unknown, or not sharing GPUs."""
    n = names
    if ask.gpus < 0 or ask.rdma < 0:
        field: Field = "gpus" if ask.gpus < 0 else "rdma"
        raise RequestError(field, f"{n[field]}: {min(ask.gpus, ask.rdma)} is negative; ask 0 or more")
    if ask.gpus == 0 and ask.rdma == 0:
        raise RequestError("gpus", f"{n['gpus']} and {n['rdma']} are both 0; ask for GPUs, NICs or both")
    given: tuple[tuple[Field, str | None, tuple[str, ...]], ...] = (
        ("scope", ask.scope, SCOPES),
        ("policy", ask.policy, POLICIES),
        ("preemption", ask.preemption, PREEMPTIONS),
        ("pairing", ask.pairing, PAIRINGS),
    )
    for name, value, allowed in given:
        if value is not None and value not in allowed:
            _refuse(name, value, allowed, names=n)
    if ask.pairing == "per-gpu" and ask.gpus != ask.rdma:
        _unequal_per_gpu(ask, names=n)
    _check_share(ask, None, names=n)
    _check_mig(ask, names=n)


def _unequal_per_gpu(ask: Asked, *, names: Mapping[Field, str]) -> NoReturn:
    n = names
    raise RequestError(
        "pairing",
        f"{n['pairing']}: per-gpu gives every GPU its own NIC, so it needs as many {n['rdma']} as "
        f"{n['gpus']} (asked {ask.rdma} and {ask.gpus}); ask for equal counts or pairing shared",
    )


def _refuse(field: Field, value: str, allowed: tuple[str, ...], *, names: Mapping[Field, str]) -> NoReturn:
    raise RequestError(field, f"{names[field]}: {value!r} is not one of {', '.join(allowed)}")


def _check_share(ask: Asked, dc: DeviceClass | None, *, names: Mapping[Field, str]) -> None:
    """A share's rules; ``dc`` None: those that hold whatever the class (:func:`check`)."""
    n = names
    memory, cores = ask.gpu_memory_mib, ask.gpu_cores_percent
    if memory is None and cores is None:
        return
    field: Field = "gpu_memory_mib" if memory is not None else "gpu_cores_percent"
    if ask.mig_profile is not None:
        raise RequestError(
            "mig_profile",
            f"{n['mig_profile']} and {n[field]}: a MIG instance is not shared, so ask MIG instances "
            "or shares of GPUs, not both",
        )
    if dc is not None and dc.sharing == "none":
        raise RequestError(
            field,
            f"{n[field]}: device class {ask.device_class!r} does not allow GPU shares (sharing: none); "
            f"ask whole GPUs, or choose a class with sharing hami or mps in {n['device_class']}",
        )
    if ask.gpus < 1:
        raise RequestError(
            "gpus", f"{n[field]} sizes a share of each GPU: ask at least one GPU in {n['gpus']}"
        )
    if memory is not None and not 1 <= memory <= MAX_SHARE_MIB:
        raise RequestError("gpu_memory_mib", f"{n['gpu_memory_mib']}: {memory} is not in 1..{MAX_SHARE_MIB}")
    if cores is not None and not 1 <= cores <= 100:
        raise RequestError("gpu_cores_percent", f"{n['gpu_cores_percent']}: {cores} is not in 1..100")


def _check_mig(ask: Asked, *, names: Mapping[Field, str]) -> None:
    n = names
    if ask.mig_profile is None:
        return
    if not _MIG_PROFILE.match(ask.mig_profile):
        raise RequestError(
            "mig_profile",
            f"{n['mig_profile']}: {ask.mig_profile!r} is not a MIG profile like 1g.10gb or 3g.40gb",
        )
    if ask.gpus < 1:
        raise RequestError(
            "gpus",
            f"{n['mig_profile']} {ask.mig_profile!r} needs at least one instance: ask it in {n['gpus']}",
        )
