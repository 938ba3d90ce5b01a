"""Leader election with a ``coordination.k8s.io/v1`` Lease, so one bridge replica acts at a time.

The decision (:func:`decide`) is pure: given the lease as read, who we are and the time, it says
create / acquire / renew / wait. :class:`LeaderElector` applies it through :class:`KubeApi`:
every write carries the lease's ``resourceVersion``, so two candidates racing for an expired
lease cannot both win (the loser gets 409 and reads again). A leader that cannot renew within
``renew_deadline`` steps down before its lease can expire under it, so two leaders never overlap
by more than clock skew. On a clean stop the leader empties ``holderIdentity`` so a standby
takes over at once instead of waiting out the lease.

This is the scheme client-go's ``leaderelection`` package uses with Lease locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from services.kube.client import KubeApi
from services.kube.errors import Conflict, KubeError, NotFound
from services.runtime.observe.logging import get_logger
from services.runtime.process.tasks import Supervisor

log = get_logger(__name__)

Action = Literal["create", "acquire", "renew", "wait"]


def micro_time(ts: float) -> str:
    """Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class LeaseView:
    holder: str
    renew_time: float | None
    duration_s: int
    transitions: int
    resource_version: str

    @classmethod
    def read(cls, obj: dict[str, Any]) -> LeaseView:
        spec = obj.get("spec") or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            renew_time=parse_time(spec.get("renewTime")),
            duration_s=int(spec.get("leaseDurationSeconds") or 0),
            transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=str((obj.get("metadata") or {}).get("resourceVersion") or ""),
        )


def decide(lease: LeaseView | None, *, me: str, now: float) -> Action:
    if lease is None:
        return "create"
    if lease.holder == me:
        return "renew"
    if not lease.holder or lease.renew_time is None or now >= lease.renew_time + lease.duration_s:
        return "acquire"
    return "wait"


class LeaderElector:
    def __init__(
        self,
        kube: KubeApi,
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_duration: int = 15,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not retry_period < renew_deadline < lease_duration:
            raise ValueError("leader election needs retry_period < renew_deadline < lease_duration")
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.clock = clock
        self.is_leader = False

    def _spec(self, now: float, *, acquire: bool, transitions: int) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_duration,
            "renewTime": micro_time(now),
        }
        if acquire:
            spec["acquireTime"] = micro_time(now)
            spec["leaseTransitions"] = transitions
        return spec

    async def try_acquire_or_renew(self) -> bool:
        """One round: return whether we hold the lease afterwards."""
        now = self.clock()
        try:
            lease: LeaseView | None = LeaseView.read(await self.kube.get_lease(self.namespace, self.name))
        except NotFound:
            lease = None
        action = decide(lease, me=self.identity, now=now)
        try:
            if action == "create":
                await self.kube.create_lease(
                    self.namespace,
                    {
                        "apiVersion": "coordination.k8s.io/v1",
                        "kind": "Lease",
                        "metadata": {"name": self.name, "namespace": self.namespace},
                        "spec": self._spec(now, acquire=True, transitions=0),
                    },
                )
                return True
            if action == "wait":
                return False
            assert lease is not None
            patch: dict[str, Any] = {
                "spec": self._spec(now, acquire=action == "acquire", transitions=lease.transitions + 1)
            }
            if lease.resource_version:
                patch["metadata"] = {"resourceVersion": lease.resource_version}
            await self.kube.patch_lease(self.namespace, self.name, patch)
            return True
        except Conflict:
            return False  # someone else wrote first; read again next round

    async def release(self) -> None:
        with contextlib.suppress(KubeError):
            lease = LeaseView.read(await self.kube.get_lease(self.namespace, self.name))
            if lease.holder != self.identity:
                return
            patch: dict[str, Any] = {"spec": {"holderIdentity": None, "renewTime": None}}
            if lease.resource_version:
                patch["metadata"] = {"resourceVersion": lease.resource_version}
            await self.kube.patch_lease(self.namespace, self.name, patch)

    async def run(self, lead: Callable[[asyncio.Event], Awaitable[None]], stop: asyncio.Event) -> None:
        """Campaign until ``stop``; while leading, run ``lead(lost)`` (``lost`` set on step-down)."""
        while not stop.is_set():
            try:
                won = await self.try_acquire_or_renew()
            except KubeError as exc:
                log.warning("lease_error", lease=self.name, error=str(exc))
                won = False
            if won:
                await self._lead(lead, stop)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.retry_period)

    async def _lead(self, lead: Callable[[asyncio.Event], Awaitable[None]], stop: asyncio.Event) -> None:
        log.info("leader_elected", lease=self.name, identity=self.identity)
        self.is_leader = True
        lost = asyncio.Event()
        sup = Supervisor("leader")
        work = sup.spawn("lead", lambda: lead(lost), restart=False)
        last_renew = self.clock()
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.retry_period)
                if stop.is_set():
                    break
                try:
                    if await self.try_acquire_or_renew():
                        last_renew = self.clock()
                        continue
                    log.warning("leadership_lost", lease=self.name, identity=self.identity)
                    break
                except KubeError as exc:
                    log.warning("lease_renew_failed", lease=self.name, error=str(exc))
                if self.clock() - last_renew >= self.renew_deadline:
                    log.warning("lease_renew_deadline_passed", lease=self.name)
                    break
        finally:
            lost.set()
            self.is_leader = False
            # Let the work stop cleanly (close consumers, finish a handler) while the lease we
            # last renewed still covers us; cancel whatever is left after that.
            grace = max(0.0, self.lease_duration - self.renew_deadline)
            await asyncio.wait({work}, timeout=grace)
            await sup.aclose()
            if stop.is_set():
                await self.release()
