"""``tandem plan``'s claims and reservations: ``claim`` and ``tick`` lines, pods that use a claim.

The planner replays what the pod bridge does with ``DeviceClaim``\\ s (docs/sharing.md), with the
real allocator core deciding:

* ``{"kind":"claim","id":"r1","gpus":4,"rdma":4,"expires_after":600,"shareable":false,...}``
  places the claim like an ``alloc`` (same fields) and holds its devices under its id: status
  ``claimed`` (or ``unschedulable``);
* ``{"kind":"alloc","id":"p1","claim":"r1"}`` is a pod that uses the claim: it gets exactly the
  claim's devices (status ``assigned``, the claim's node and devices), or ``unschedulable`` with
  the reason the bridge would give (no such claim, not shareable and in use, other counts);
* ``{"kind":"free","id":"p1"}`` of such a pod frees nothing (reason says the devices stay with
  the claim); ``{"kind":"free","id":"r1"}`` releases the claim's devices;
* **time**: the planner's clock starts at 0 and only ``{"kind":"tick","seconds":S}`` moves it.
  A claim with ``expires_after`` (seconds) is a reservation: once the clock reaches its
  deadline and no pod uses it, it expires — one ``expired`` line, printed by the ``tick`` (or
  by the ``free`` of its last pod) that made it so, and its devices are free for later lines.
  A ``tick`` prints nothing else. The planner keeps no queue: an ``unschedulable`` line stays
  so; replay the request after the ``expired`` line to see where it goes then.

Everything else is :mod:`tools.cli.plan`'s; it hands this book the lines that are about
claims (:meth:`ClaimBook.wants`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from schemas.messages import AllocationRequest, AssignedGpu
from services.allocator.core import Cluster, InvalidRequest, Placement
from tools.cli.errors import CliError

__all__ = ["ClaimBook"]

CLAIM_EXTRA_KEYS = {"expires_after", "shareable"}
# What kind of GPU device the claim holds; on a pod line each must equal the claim's (left out:
# the claim's), as the pod bridge wants a pod to ask tandem.io/mig or tandem.io/gpu-share alike.
KIND_KEYS = ("mig_profile", "gpu_memory_mib", "gpu_cores_percent")
POD_KEYS = {"kind", "id", "claim", "gpus", "rdma", *KIND_KEYS}
TICK_KEYS = {"kind", "seconds"}

Line = dict[str, Any]


@dataclass(slots=True)
class _Claim:
    id: str
    placement: Placement
    deadline: float | None
    shareable: bool
    request: AllocationRequest
    users: set[str] = field(default_factory=set)


class ClaimBook:
    """Claims held in a planned cluster, the pods using them, and the planner's clock."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        alloc_keys: set[str],
        make_request: Callable[[dict[str, Any], str], AllocationRequest],
        make_line: Callable[..., Line],
        no_extra: Callable[[dict[str, Any], set[str], str], None],
        is_live: Callable[[str], bool],
        gpu_line: Callable[[AssignedGpu], dict[str, Any]] | None = None,
    ) -> None:
        self.cluster = cluster
        self.claim_keys = alloc_keys | CLAIM_EXTRA_KEYS
        self.make_request = make_request
        self.make_line = make_line
        self.no_extra = no_extra
        self.is_live = is_live
        # How a line shows a GPU (plan.py's: a share's size, a MIG instance's profile and UUID).
        self.gpu_line = gpu_line or (lambda g: {"index": g.index, "uuid": g.uuid})
        self.now = 0.0
        self.claims: dict[str, _Claim] = {}
        self.pods: dict[str, str] = {}  # pod id -> claim id
        self.counts = {"claimed": 0, "expired": 0, "released": 0, "pods_on_claims": 0}

    def wants(self, obj: dict[str, Any]) -> bool:
        kind = obj.get("kind")
        if kind in ("claim", "tick"):
            return True
        if kind == "alloc":
            return "claim" in obj
        if kind == "free":
            return obj.get("id") in self.claims or obj.get("id") in self.pods
        return False

    def holds(self, rid: str) -> bool:
        return rid in self.claims or rid in self.pods

    def summary(self) -> dict[str, int]:
        return dict(self.counts)

    # -- lines ---------------------------------------------------------------------------------

    def handle(self, obj: dict[str, Any], *, where: str) -> Iterator[Line]:
        kind = obj.get("kind")
        if kind == "tick":
            self.no_extra(obj, TICK_KEYS, where)
            seconds = obj.get("seconds")
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
                raise CliError(f"{where}: 'seconds' must be a number >= 0, got {seconds!r}")
            self.now += float(seconds)
            yield from self._expire()
            return
        rid = obj.get("id")
        if not isinstance(rid, str) or not rid:
            raise CliError(f"{where}: 'id' must be a non-empty string")
        if kind == "claim":
            yield self._claim(rid, obj, where)
        elif kind == "alloc":
            yield self._use(rid, obj, where)
        else:  # free
            yield from self._free(rid)

    def _claim(self, rid: str, obj: dict[str, Any], where: str) -> Line:
        self.no_extra(obj, self.claim_keys, where)
        if self.holds(rid) or self.is_live(rid):
            raise CliError(f"{where}: id {rid!r} is already allocated (free it first)")
        after = obj.get("expires_after")
        if after is not None and (
            isinstance(after, bool) or not isinstance(after, int | float) or after <= 0
        ):
            raise CliError(f"{where}: 'expires_after' must be a number of seconds > 0, got {after!r}")
        shareable = obj.get("shareable", False)
        if not isinstance(shareable, bool):
            raise CliError(f"{where}: 'shareable' must be true or false, got {shareable!r}")
        req = self.make_request({k: v for k, v in obj.items() if k not in CLAIM_EXTRA_KEYS}, where)
        try:
            result = self.cluster.decide(req)
        except InvalidRequest as exc:
            raise CliError(f"{where}: {exc}") from None
        if not isinstance(result, Placement):
            return self.make_line(rid, "unschedulable", reason=result.reason)
        # A claim's hold is never a victim (not preemptible); shares are held as shares, so
        # the rest of such a GPU stays free for other shares, as for a pod's share.
        self.cluster.hold(
            result.node,
            rid,
            result.devices(),
            priority=req.priority,
            shares=result.shares(),
            sharing=result.sharing,
        )
        deadline = self.now + float(after) if after is not None else None
        self.claims[rid] = _Claim(rid, result, deadline, shareable, req)
        self.counts["claimed"] += 1
        return self._placed(rid, "claimed", result)

    def _use(self, rid: str, obj: dict[str, Any], where: str) -> Line:
        self.no_extra(obj, POD_KEYS, where)
        if self.holds(rid) or self.is_live(rid):
            raise CliError(f"{where}: id {rid!r} is already allocated (free it first)")
        cid = obj["claim"]
        claim = self.claims.get(cid) if isinstance(cid, str) else None
        if claim is None:
            return self.make_line(
                rid, "unschedulable", reason=f"claim {cid!r} does not exist (never claimed, freed or expired)"
            )
        p = claim.placement
        counts = (obj.get("gpus", len(p.gpus)), obj.get("rdma", len(p.nics)))
        if counts != (len(p.gpus), len(p.nics)):
            return self.make_line(
                rid,
                "unschedulable",
                reason=f"asks {counts[0]} GPUs + {counts[1]} NICs, but claim {cid!r} holds "
                f"{len(p.gpus)} + {len(p.nics)}; a pod using a claim asks for exactly its counts",
            )
        for key in KIND_KEYS:
            held = getattr(claim.request, key)
            if obj.get(key, held) != held:
                return self.make_line(
                    rid,
                    "unschedulable",
                    reason=f"asks {key} {obj[key]!r}, but claim {cid!r} holds {key} {held!r}; a pod "
                    "using a claim asks for exactly its kind of GPU",
                )
        if claim.users and not claim.shareable:
            return self.make_line(
                rid,
                "unschedulable",
                reason=f"claim {cid!r} is not shareable and is used by {min(claim.users)}",
            )
        claim.users.add(rid)
        self.pods[rid] = cid
        self.counts["pods_on_claims"] += 1
        return self._placed(rid, "assigned", p)

    def _free(self, rid: str) -> Iterator[Line]:
        if rid in self.pods:
            cid = self.pods.pop(rid)
            claim = self.claims[cid]
            claim.users.discard(rid)
            yield self.make_line(
                rid, "freed", node=claim.placement.node, reason=f"devices stay with claim {cid!r}"
            )
            yield from self._expire()
            return
        claim = self.claims.pop(rid)
        for pod in claim.users:
            self.pods.pop(pod, None)
        self.cluster.release(claim.placement.node, rid)
        self.counts["released"] += 1
        n = len(claim.users)
        users = f"; {n} pod{'s' if n != 1 else ''} {'were' if n != 1 else 'was'} using it" if n else ""
        yield self.make_line(rid, "freed", node=claim.placement.node, reason=f"claim released{users}")

    def _expire(self) -> Iterator[Line]:
        due = [
            c
            for c in self.claims.values()
            if c.deadline is not None and c.deadline <= self.now and not c.users
        ]
        for claim in sorted(due, key=lambda c: (c.deadline or 0.0, c.id)):
            del self.claims[claim.id]
            self.cluster.release(claim.placement.node, claim.id)
            self.counts["expired"] += 1
            yield self.make_line(
                claim.id,
                "expired",
                node=claim.placement.node,
                reason=f"reservation expired at t={claim.deadline:g}s with no pod using it",
            )

    def _placed(self, rid: str, status: str, p: Placement) -> Line:
        return self.make_line(
            rid,
            status,
            node=p.node,
            gpus=[self.gpu_line(g) for g in p.gpus],
            nics=[{"name": n.name} for n in p.nics],
            pairs=[{"gpu": x.gpu, "nic": x.nic, "scope": x.scope} for x in p.pairs],
        )
