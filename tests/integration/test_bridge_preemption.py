"""Priority preemption at the Kubernetes edge: the bridge evicts the victims' pods through the
Eviction API of the API emulator (tests/integration/test_bridge.py's ``Apiserver``, which
answers 429 for a PodDisruptionBudget as kube-apiserver does), real kubernetes-asyncio client,
real NATS. The test plays the allocator, as test_bridge.py does: it publishes the preemption
plan, reads the releases, and assigns the preemptor once its victims are gone."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import REGISTRY

from schemas import subjects
from schemas.messages import PreemptionPlan, Release, Victim
from services.admission import names
from tests.conftest import BusFactory, make_settings
from tests.integration.test_bridge import (
    NODE,
    StartBridge,
    assignment_for,
    create_pod,
    eventually,
    requests_for,
    stream_messages,
)
from tests.integration.test_bridge import apiserver as apiserver
from tests.integration.test_bridge import start_bridge as start_bridge
from tools.localstack import FleetEntry, LocalStack

pytestmark = pytest.mark.integration


def events(emu: Any, reason: str) -> list[dict[str, Any]]:
    return [
        dict(o.raw)
        for (res, _, _), o in emu.objects.items()
        if res.plural == "events" and not o.deleted and o.raw.get("reason") == reason
    ]


async def test_preempting_pod_evicts_victims_respecting_pdb_then_starts(
    apiserver: tuple[Any, str],
    start_bridge: StartBridge,
    bus_factory: BusFactory,
) -> None:
    emu, _ = apiserver
    allocator = await bus_factory("allocator")
    await start_bridge(event_interval=0.0, eviction_backoff=0.2)

    pods = {name: await create_pod(emu, name, gpu="4", rdma="4") for name in ("low-0", "low-1", "hi-0")}
    reqs = {}
    for name, pod in pods.items():
        ((req, _),) = await eventually(lambda p=pod: requests_for(allocator, p["metadata"]["uid"]))
        reqs[name] = req
    # The victims run: assigned and bound (gate removed, node affinity set).
    for name in ("low-0", "low-1"):
        await allocator.publish(
            subjects.alloc_assigned(NODE),
            assignment_for(reqs[name]),
            msg_id=subjects.msg_id("assigned", reqs[name].request_id),
        )

    async def bound(name: str) -> bool:
        return not emu.objects["v1/pods", "ml", name].raw["spec"].get("schedulingGates")

    for name in ("low-0", "low-1"):
        await eventually(lambda n=name: bound(n))

    def evictions(result: str) -> float:
        return REGISTRY.get_sample_value("tandem_bridge_evictions_total", {"result": result}) or 0.0

    before = {r: evictions(r) for r in ("evicted", "blocked")}
    # A PodDisruptionBudget protects low-1 for now.
    emu.pdb_blocked[("ml", "low-1")] = "trainers"
    hi = reqs["hi-0"]
    plan = PreemptionPlan(
        request_id=hi.request_id,
        pod=hi.pod,
        node=NODE,
        priority=5,
        victims=[
            Victim(request_id=reqs[n].request_id, pod=reqs[n].pod, node=NODE, priority=0)
            for n in ("low-0", "low-1")
        ],
    )
    await allocator.publish(subjects.ALLOC_PREEMPT, plan, msg_id=subjects.msg_id(hi.request_id, "preempt"))

    async def released(name: str) -> Release | None:
        for msg, _ in await stream_messages(allocator, subjects.alloc_release(NODE)):
            if isinstance(msg, Release) and msg.request_id == reqs[name].request_id:
                return msg
        return None

    # low-0: evicted through the Eviction API (201), its pod deleted, its allocation released.
    rel = await eventually(lambda: released("low-0"))
    assert rel.node == NODE and rel.pod.uid == pods["low-0"]["metadata"]["uid"]
    assert ("ml", "low-0", 201) in emu.evictions
    assert emu.objects["v1/pods", "ml", "low-0"].deleted
    (victim_event,) = await eventually(lambda: _async(events(emu, names.EVENT_REASON_PREEMPTED)))
    assert victim_event["involvedObject"]["name"] == "low-0"
    assert "hi-0" in victim_event["message"] and "priority 5" in victim_event["message"]

    # low-1: the PDB answers 429; the preemptor gets a Warning Event saying so, low-1 runs on.
    (blocked,) = await eventually(lambda: _async(events(emu, names.EVENT_REASON_PREEMPTION_BLOCKED)))
    assert blocked["involvedObject"]["name"] == "hi-0" and blocked["type"] == "Warning"
    assert "ml/low-1" in blocked["message"] and "PodDisruptionBudget" in blocked["message"]
    assert "trainers" in blocked["message"]
    assert ("ml", "low-1", 429) in emu.evictions
    assert not emu.objects["v1/pods", "ml", "low-1"].deleted
    assert await released("low-1") is None
    # Retried with back-off while blocked (the Event counts the attempts).
    await eventually(lambda: _async(sum(1 for e in emu.evictions if e[1] == "low-1") >= 2))

    # The budget allows it now: the next retry evicts low-1 and releases it.
    del emu.pdb_blocked[("ml", "low-1")]
    await eventually(lambda: released("low-1"))
    assert ("ml", "low-1", 201) in emu.evictions
    # Exactly one successful eviction per victim, whatever the redeliveries.
    assert sorted(e for e in emu.evictions if e[2] == 201) == [("ml", "low-0", 201), ("ml", "low-1", 201)]
    assert evictions("evicted") - before["evicted"] == 2
    assert evictions("blocked") - before["blocked"] == sum(1 for e in emu.evictions if e[2] == 429)

    # The victims' devices are cleaned and freed; the allocator assigns the preemptor: it starts.
    assert emu.objects["v1/pods", "ml", "hi-0"].raw["spec"]["schedulingGates"] == [{"name": names.GATE}]
    await allocator.publish(
        subjects.alloc_assigned(NODE), assignment_for(hi), msg_id=subjects.msg_id("assigned", hi.request_id)
    )
    await eventually(lambda: bound("hi-0"))


async def test_preemption_for_a_gone_preemptor_evicts_nothing(
    apiserver: tuple[Any, str],
    start_bridge: StartBridge,
    bus_factory: BusFactory,
) -> None:
    emu, _ = apiserver
    allocator = await bus_factory("allocator")
    running = await start_bridge()
    victim = await create_pod(emu, "low-0", gpu="1", rdma="1")
    gone = await create_pod(emu, "hi-0", gpu="1", rdma="1")
    ((vreq, _),) = await eventually(lambda: requests_for(allocator, victim["metadata"]["uid"]))
    ((hreq, _),) = await eventually(lambda: requests_for(allocator, gone["metadata"]["uid"]))
    resp = await emu.delete("/api/v1/namespaces/ml/pods/hi-0")
    assert resp.status == 200
    plan = PreemptionPlan(
        request_id=hreq.request_id,
        pod=hreq.pod,
        node=NODE,
        priority=5,
        victims=[Victim(request_id=vreq.request_id, pod=vreq.pod, node=NODE)],
    )
    await allocator.publish(subjects.ALLOC_PREEMPT, plan, msg_id=subjects.msg_id(hreq.request_id, "preempt"))

    # The plan is handled (acked) without any eviction: the bridge's consumer has nothing left.
    async def handled() -> bool:
        js = running.bridge.bus.js
        info = await js.consumer_info(subjects.ALLOC_STREAM, subjects.CONSUMER_BRIDGE_PREEMPT)
        return info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.stream_seq > 0

    await eventually(handled)
    assert emu.evictions == []
    assert not emu.objects["v1/pods", "ml", "low-0"].deleted


async def _async(value: Any) -> Any:
    return value


async def test_pod_preempts_through_the_real_allocator_and_bridge(
    apiserver: tuple[Any, str],
    start_bridge: StartBridge,
    nats_url: str,
    clean_jetstream: None,
) -> None:
    """End to end: pods in the API emulator, the real bridge, the real allocator and a
    simulated node agent. A pod of priority 5 that may preempt finds the node full: the
    allocator plans, the bridge evicts the victim pod through the Eviction API, the victim's
    release is cleaned up on the node, and the preemptor is bound to the freed devices."""
    emu, _ = apiserver
    settings = make_settings(nats_url, "test", heartbeat_interval=0.2, node_lost_after=1.0)
    stack = LocalStack(settings, fleet=[FleetEntry("dgx-h100", 1, "h100")], retry_interval=0.3)
    await stack.start()
    try:
        await stack.wait_ready()
        await start_bridge(eviction_backoff=0.2)

        async def bound(name: str) -> dict[str, Any] | None:
            obj = emu.objects["v1/pods", "ml", name]
            return None if obj.deleted or obj.raw["spec"].get("schedulingGates") else dict(obj.raw)

        await create_pod(emu, "batch", gpu="8", rdma="8")
        low = await eventually(lambda: bound("batch"))
        await create_pod(
            emu,
            "urgent",
            gpu="4",
            rdma="4",
            annotations={names.PRIORITY: "5", names.PREEMPTION: "lower-priority"},
        )
        hi = await eventually(lambda: bound("urgent"))
        assert ("ml", "batch", 201) in emu.evictions
        assert emu.objects["v1/pods", "ml", "batch"].deleted
        low_devices = json.loads(low["metadata"]["annotations"][names.ASSIGNMENT])
        hi_devices = json.loads(hi["metadata"]["annotations"][names.ASSIGNMENT])
        assert hi_devices["node"] == low_devices["node"] == "h100-0"
        assert {p["scope"] for p in hi_devices["pairs"]} == {"pcie-switch"}
        record = stack.allocators[0].node_allocs.cached("h100-0")
        assert record is not None and record[0] is not None
        assert [r.assignment.pod.name for r in record[0].allocations.values()] == ["urgent"]
    finally:
        await stack.stop()
