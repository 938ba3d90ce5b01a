"""Lease leader election against the fake Kubernetes wrapper (optimistic locking included)."""

from __future__ import annotations

import asyncio

import pytest

from services.kube.leader import LeaderElector, LeaseView, decide
from tests.unit.test_admission_helpers import FakeKube


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def lease(holder: str, renew: float | None, duration: int = 15) -> LeaseView:
    return LeaseView(
        holder=holder, renew_time=renew, duration_s=duration, transitions=0, resource_version="1"
    )


@pytest.mark.parametrize(
    ("view", "now", "expected"),
    [
        (None, 0, "create"),
        (lease("me", 100), 200, "renew"),
        (lease("other", 100), 110, "wait"),
        (lease("other", 100), 115, "acquire"),
        (lease("", 100), 101, "acquire"),
        (lease("other", None), 0, "acquire"),
    ],
)
def test_decide(view: LeaseView | None, now: float, expected: str) -> None:
    assert decide(view, me="me", now=now) == expected


def elector(kube: FakeKube, identity: str, clock: Clock, **kw: float) -> LeaderElector:
    return LeaderElector(kube, namespace="tandem", name="tandem-bridge", identity=identity, clock=clock, **kw)  # type: ignore[arg-type]


async def test_one_holder_until_the_lease_expires_then_a_takeover() -> None:
    kube, clock = FakeKube(), Clock()
    a, b = elector(kube, "a", clock), elector(kube, "b", clock)
    assert await a.try_acquire_or_renew() is True
    assert await b.try_acquire_or_renew() is False
    clock.now += 10
    assert await a.try_acquire_or_renew() is True  # renewed
    clock.now += 14
    assert await b.try_acquire_or_renew() is False  # 14 s < 15 s since the renewal
    clock.now += 2
    assert await b.try_acquire_or_renew() is True
    spec = kube.objects[("lease", "tandem", "tandem-bridge")]["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    assert await a.try_acquire_or_renew() is False  # a sees b's fresh lease


async def test_two_candidates_racing_for_an_expired_lease_cannot_both_win() -> None:
    kube, clock = FakeKube(), Clock()
    a, b, c = elector(kube, "a", clock), elector(kube, "b", clock), elector(kube, "c", clock)
    assert await a.try_acquire_or_renew() is True
    clock.now += 60  # a is gone

    results: dict[str, bool] = {}

    async def c_takes_it_meanwhile() -> None:
        results["c"] = await c.try_acquire_or_renew()

    kube.after_get.append(c_takes_it_meanwhile)  # c writes between b's read and b's write
    results["b"] = await b.try_acquire_or_renew()
    assert results == {"c": True, "b": False}
    assert kube.objects[("lease", "tandem", "tandem-bridge")]["spec"]["holderIdentity"] == "c"


async def test_leader_runs_work_steps_down_when_renewal_fails_and_hands_over_on_stop() -> None:
    kube = FakeKube()
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    a = LeaderElector(
        kube, namespace="t", name="l", identity="a", lease_duration=2, renew_deadline=0.4, retry_period=0.05
    )  # type: ignore[arg-type]
    b = LeaderElector(
        kube, namespace="t", name="l", identity="b", lease_duration=2, renew_deadline=0.4, retry_period=0.05
    )  # type: ignore[arg-type]
    started: list[str] = []
    lost_seen: list[str] = []

    def work(name: str):  # type: ignore[no-untyped-def]
        async def lead(lost: asyncio.Event) -> None:
            started.append(name)
            await lost.wait()
            lost_seen.append(name)

        return lead

    task_a = asyncio.get_running_loop().create_task(a.run(work("a"), stop_a))
    await asyncio.wait_for(_until(lambda: a.is_leader), 2)
    task_b = asyncio.get_running_loop().create_task(b.run(work("b"), stop_b))
    await asyncio.sleep(0.2)
    assert started == ["a"] and not b.is_leader

    kube.fail_writes = True  # the API server is unreachable for writes: a must step down
    await asyncio.wait_for(_until(lambda: not a.is_leader), 2)
    assert lost_seen == ["a"]
    kube.fail_writes = False

    # a campaigns again and, as the lease (2 s) has not expired under its own name, renews it;
    # stopping a releases the lease so b takes over without waiting for expiry.
    await asyncio.wait_for(_until(lambda: a.is_leader), 2)
    stop_a.set()
    await asyncio.wait_for(task_a, 5)
    assert kube.objects[("lease", "t", "l")]["spec"].get("holderIdentity") is None
    await asyncio.wait_for(_until(lambda: b.is_leader), 2)
    assert started == ["a", "a", "b"]
    stop_b.set()
    await asyncio.wait_for(task_b, 5)


async def _until(cond) -> None:  # type: ignore[no-untyped-def]
    while not cond():
        await asyncio.sleep(0.01)
