"""Bridge paths the emulator cannot produce (it has no optimistic locking), with the fake
Kubernetes wrapper and a real nats-server: a pod changed between read and bind is re-read and
bound without losing the other writer's change; an Event left by an earlier bridge keeps counting.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from schemas import subjects
from schemas.config import DeviceClass
from schemas.messages import AllocationFailed, AssignedGpu, Assignment, PodRef
from services.admission import names, podrules, podwrites
from services.admission.bridge import Bridge
from tests.conftest import BusFactory
from tests.unit.test_admission_helpers import FakeKube, deployment_pod

pytestmark = pytest.mark.integration

UID = "3f2d8a51-0c3e-4f6b-9b8e-5d7c1a2b3c4d"
RID = f"{UID}.1"
REF = PodRef("ml", "p", UID)


@pytest.fixture
def event_interval() -> float:
    return 0.0


@pytest.fixture
async def running(bus_factory: BusFactory, event_interval: float) -> AsyncIterator[tuple[FakeKube, Any]]:
    kube = FakeKube()
    pod = deployment_pod(gpu="1", rdma=None)
    pod["metadata"].update(name="p", uid=UID, labels={names.MANAGED: "true"})
    pod["spec"]["schedulingGates"] = [{"name": names.GATE}]
    kube.objects[("pod", "ml", "p")] = pod
    kube._bump(pod)
    allocator = await bus_factory("allocator")
    bridge = Bridge(
        kube=kube,
        bus=await bus_factory("admission"),
        device_classes={"default": DeviceClass()},
        event_interval=event_interval,
    )
    stop = asyncio.Event()
    task = asyncio.get_running_loop().create_task(bridge.run(stop))
    await asyncio.wait_for(bridge.synced.wait(), 10)
    yield kube, allocator
    stop.set()
    await asyncio.wait_for(task, 10)


async def until(cond: Any, timeout: float = 10.0) -> None:
    async def loop() -> None:
        while not cond():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(loop(), timeout)


async def test_pod_changed_between_read_and_bind_is_reread_and_bound(running: tuple[FakeKube, Any]) -> None:
    kube, allocator = running

    async def someone_else_writes() -> None:
        kube._patch("pod", "ml", "p", {"metadata": {"annotations": {"example.com/owner": "team-b"}}})

    # Changed after the bridge's list (its copy is stale: the watch has not delivered the
    # change yet), and changed again right after the bridge reads it back.
    await someone_else_writes()
    kube.after_get.append(someone_else_writes)
    a = Assignment(request_id=RID, pod=REF, node="n1", gpus=[AssignedGpu(index=0, uuid="GPU-0")])
    await allocator.publish(subjects.alloc_assigned("n1"), a, msg_id="assigned-1")

    def bound() -> bool:
        pod = kube.objects[("pod", "ml", "p")]
        return not pod["spec"].get("schedulingGates") and names.ASSIGNMENT in pod["metadata"].get(
            "annotations", {}
        )

    await until(bound)
    pod = kube.objects[("pod", "ml", "p")]
    assert pod["metadata"]["annotations"]["example.com/owner"] == "team-b"  # not overwritten
    assert json.loads(pod["metadata"]["annotations"][names.ASSIGNMENT])["node"] == "n1"
    # theirs, ours from the watch's copy (409), theirs after our read, ours (409), ours
    assert [c for c in kube.calls if c[:2] == ("patch", "pod")] == [("patch", "pod", "p")] * 5
    assert [c for c in kube.calls if c[:2] == ("get", "pod")] == [("get", "pod", "p")] * 2


async def test_event_left_by_an_earlier_bridge_keeps_counting(running: tuple[FakeKube, Any]) -> None:
    kube, allocator = running
    name = podwrites.event_name("p", f"{UID}/{names.EVENT_REASON_FAILED}")
    earlier = podwrites.event_body(
        podrules.read_pod(kube.objects[("pod", "ml", "p")]),
        name=name,
        reason=names.EVENT_REASON_FAILED,
        message="no room",
        count=5,
        now=0,
        instance="old",
    )
    kube._create("event", "ml", earlier)
    await allocator.publish(
        subjects.ALLOC_FAILED, AllocationFailed(request_id=RID, pod=REF, reason="still no room"), msg_id="f1"
    )
    await until(lambda: kube.objects[("event", "ml", name)].get("count") == 6)
    event = kube.objects[("event", "ml", name)]
    assert event["message"] == "still no room"
    assert [k for k in kube.objects if k[0] == "event"] == [("event", "ml", name)]


@pytest.mark.parametrize("event_interval", [1.0])
async def test_throttled_repeats_are_written_later_not_dropped(running: tuple[FakeKube, Any]) -> None:
    kube, allocator = running
    name = podwrites.event_name("p", f"{UID}/{names.EVENT_REASON_FAILED}")
    for i in range(3):
        failed = AllocationFailed(request_id=RID, pod=REF, reason="no room")
        await allocator.publish(subjects.ALLOC_FAILED, failed, msg_id=f"f{i}")
    await until(lambda: ("event", "ml", name) in kube.objects)
    await asyncio.sleep(0.4)  # the two repeats are handled well within the 1 s interval
    writes = [c for c in kube.calls if c[1] == "event" and c[0] in ("create", "patch")]
    assert writes == [("create", "event", name)]  # repeats within the interval are held back
    assert kube.objects[("event", "ml", name)]["count"] == 1
    await until(lambda: kube.objects[("event", "ml", name)].get("count") == 3, timeout=5)
