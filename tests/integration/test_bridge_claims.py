"""DeviceClaims through the pod bridge: real kubernetes-asyncio client ⇄ kmock API emulator
(serving the ``DeviceClaim`` custom resource), real NATS.

The first tests play the allocator, as ``test_bridge.py`` does (they read ``alloc.request`` and
publish ``Assignment``); the last ones run the real allocator, inventory and simulated node
agents (``LocalStack``), so a released claim really goes through the node agent's verified
cleanup before its devices are freed and given to a pending pod.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest

from schemas import codec, subjects
from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, AllocRecord, Freed, NodeAllocations, Release, RequestRecord
from services.admission import names, podrules
from services.admission.bridge import Bridge
from services.kube.client import KubeClient
from services.nodeagent.deviceplugin import logic as plugin
from services.runtime.nats.bus import Bus
from tests.conftest import BusFactory, make_settings
from tests.e2e.test_cli_up import TANDEM
from tests.integration import test_bridge as tb
from tests.integration.test_bridge import (
    CLASSES,
    NODE,
    Running,
    StartBridge,
    assignment_for,
    create_pod,
    eventually,
    requests_for,
    stream_messages,
)
from tests.unit.test_admission_helpers import deployment_pod
from tests.waiting import wait_until
from tools.localstack import FleetEntry, LocalStack

pytestmark = pytest.mark.integration

# The bridge tests' fixtures: the API emulator (serving DeviceClaims too) and a running bridge.
apiserver = tb.apiserver
start_bridge = tb.start_bridge
spans = tb.spans

CLAIMS = f"/apis/{names.CLAIM_GROUP}/{names.CLAIM_VERSION}/namespaces/ml/{names.CLAIM_PLURAL}"


def stamp(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def create_claim(emu: Any, name: str, *, created: float | None = None, **spec: Any) -> dict[str, Any]:
    """A DeviceClaim as the API server stores it (uid and creationTimestamp set)."""
    obj = {
        "apiVersion": f"{names.CLAIM_GROUP}/{names.CLAIM_VERSION}",
        "kind": names.CLAIM_KIND,
        "metadata": {
            "name": name,
            "namespace": "ml",
            "uid": str(uuid.uuid4()),
            "creationTimestamp": stamp(created if created is not None else 1.7e9),
        },
        "spec": spec,
    }
    resp = await emu.post(CLAIMS, json=obj)
    assert resp.status == 200, await resp.text()
    return obj


def claim_obj(emu: Any, name: str) -> dict[str, Any]:
    return dict(
        emu.objects[f"{names.CLAIM_GROUP}/{names.CLAIM_VERSION}/{names.CLAIM_PLURAL}", "ml", name].raw
    )


def status(emu: Any, name: str) -> dict[str, Any]:
    return dict(claim_obj(emu, name).get("status") or {})


def pod_obj(emu: Any, name: str) -> dict[str, Any]:
    return dict(emu.objects["v1/pods", "ml", name].raw)


def events_for(emu: Any, pod: str) -> list[dict[str, Any]]:
    return [
        dict(o.raw)
        for (res, _, _), o in emu.objects.items()
        if res.plural == "events" and not o.deleted and o.raw["involvedObject"]["name"] == pod
    ]


async def claim_request(bus: Bus, claim: dict[str, Any]) -> AllocationRequest:
    ((req, _),) = await eventually(lambda: requests_for(bus, claim["metadata"]["uid"]))
    assert isinstance(req, AllocationRequest)
    return req


async def test_pod_using_a_claim_gets_its_devices_and_its_end_frees_nothing(
    apiserver: tuple[Any, str], start_bridge: StartBridge, bus_factory: BusFactory
) -> None:
    emu, _ = apiserver
    allocator = await bus_factory("allocator")
    running = await start_bridge()
    claim = await create_claim(emu, "train-claim", gpus=2, rdma=2, scope="pcie-switch")
    req = await claim_request(allocator, claim)
    assert req.request_id == f"claim-{claim['metadata']['uid']}"
    assert req.claim is not None and req.claim.name == "train-claim" and not req.claim.shareable
    assert (req.gpus, req.rdma, req.scope, req.pod.name) == (2, 2, "pcie-switch", "train-claim")
    await eventually(lambda: _true(status(emu, "train-claim").get("phase") == "Pending"))

    # A pod that names the claim before it is allocated waits, and says why.
    pod = await create_pod(emu, "user-0", gpu="2", rdma="2", annotations={names.CLAIM: "train-claim"})
    (waiting,) = await eventually(lambda: _async(events_for(emu, "user-0")))
    assert waiting["reason"] == names.EVENT_REASON_CLAIM
    assert "'train-claim' is not allocated yet" in waiting["message"]

    await allocator.publish(
        subjects.alloc_assigned(NODE), assignment_for(req), msg_id=subjects.msg_id("assigned", req.request_id)
    )
    await eventually(lambda: _true(not pod_obj(emu, "user-0")["spec"].get("schedulingGates")))
    ann = json.loads(pod_obj(emu, "user-0")["metadata"]["annotations"][names.ASSIGNMENT])
    assert ann["request_id"] == req.request_id and ann["node"] == NODE
    assert [g["index"] for g in ann["gpus"]] == [0, 1]
    st = await eventually(
        lambda: _async(status(emu, "train-claim") if status(emu, "train-claim").get("pods") else None)
    )
    assert st["phase"] == "Allocated" and st["node"] == NODE
    assert st["devices"] == ["gpu0", "gpu1", "mlx5_0", "mlx5_1"] and st["pods"] == ["user-0"]
    # The pod made no request of its own.
    assert await requests_for(allocator, pod["metadata"]["uid"]) == []

    # The pod ends: the claim keeps its devices (no release), and says no pod uses it now.
    assert (await emu.delete("/api/v1/namespaces/ml/pods/user-0")).status == 200
    await eventually(lambda: _true(status(emu, "train-claim").get("pods") in (None, [])))
    assert await stream_messages(allocator, subjects.alloc_release(NODE)) == []
    assert status(emu, "train-claim")["phase"] == "Allocated"
    kv = await allocator.kv(subjects.KV_CLAIMS)
    record = codec.CLAIM_RECORD.decode((await kv.get(req.request_id)).value)
    assert (record.phase, record.node, record.pods) == ("Allocated", NODE, [])

    # Deleting the claim releases its request on the node, which cleans up and frees it.
    assert (await emu.delete(f"{CLAIMS}/train-claim")).status == 200
    ((release, _),) = await eventually(lambda: stream_messages(allocator, subjects.alloc_release(NODE)))
    assert isinstance(release, Release)
    assert (release.request_id, release.node, release.reason) == (req.request_id, NODE, "claim deleted")
    assert [p for p in running.published if p[0] == subjects.ALLOC_REQUEST] == [
        (subjects.ALLOC_REQUEST, subjects.msg_id("request", req.request_id))
    ]


async def test_a_claim_that_is_not_shareable_refuses_a_second_pod_until_the_first_ends(
    apiserver: tuple[Any, str], start_bridge: StartBridge, bus_factory: BusFactory
) -> None:
    emu, _ = apiserver
    allocator = await bus_factory("allocator")
    await start_bridge(event_interval=0.0)
    claim = await create_claim(emu, "solo", gpus=1, rdma=1)
    req = await claim_request(allocator, claim)
    await allocator.publish(subjects.alloc_assigned(NODE), assignment_for(req), msg_id="a-solo")
    await eventually(lambda: _true(status(emu, "solo").get("phase") == "Allocated"))

    await create_pod(emu, "first", gpu="1", rdma="1", annotations={names.CLAIM: "solo"})
    await eventually(lambda: _true(not pod_obj(emu, "first")["spec"].get("schedulingGates")))
    await create_pod(emu, "second", gpu="1", rdma="1", annotations={names.CLAIM: "solo"})
    (event,) = await eventually(lambda: _async(events_for(emu, "second")))
    assert event["reason"] == names.EVENT_REASON_CLAIM
    assert event["message"] == (
        "DeviceClaim 'solo' is not shareable and is used by pod first; the pod waits until that pod "
        "ends (set spec.shareable: true to let pods share it)"
    )
    assert pod_obj(emu, "second")["spec"]["schedulingGates"] == [{"name": names.GATE}]
    assert status(emu, "solo")["pods"] == ["first"]

    # A pod asking other counts than the claim's is told so.
    await create_pod(emu, "wrong", gpu="2", rdma="2", annotations={names.CLAIM: "solo"})
    (wrong,) = await eventually(lambda: _async(events_for(emu, "wrong")))
    assert "holds 1 and 1; a pod using a claim asks for exactly the claim's counts" in wrong["message"]

    # The first pod ends: the second gets the claim's devices.
    assert (await emu.delete("/api/v1/namespaces/ml/pods/first")).status == 200
    await eventually(lambda: _true(not pod_obj(emu, "second")["spec"].get("schedulingGates")))
    await eventually(lambda: _true(status(emu, "solo").get("pods") == ["second"]))


async def test_a_shareable_claim_serves_several_pods(
    apiserver: tuple[Any, str], start_bridge: StartBridge, bus_factory: BusFactory
) -> None:
    emu, _ = apiserver
    allocator = await bus_factory("allocator")
    await start_bridge()
    claim = await create_claim(emu, "shared", gpus=1, rdma=0, shareable=True)
    req = await claim_request(allocator, claim)
    assert req.claim is not None and req.claim.shareable
    await allocator.publish(subjects.alloc_assigned(NODE), assignment_for(req), msg_id="a-shared")
    for name in ("s1", "s2"):
        await create_pod(emu, name, gpu="1", rdma="0", annotations={names.CLAIM: "shared"})
    for name in ("s1", "s2"):
        await eventually(lambda n=name: _true(not pod_obj(emu, n)["spec"].get("schedulingGates")))
    await eventually(lambda: _true(status(emu, "shared").get("pods") == ["s1", "s2"]))


async def test_an_invalid_claim_is_marked_invalid_naming_the_field_and_requests_nothing(
    apiserver: tuple[Any, str], start_bridge: StartBridge, bus_factory: BusFactory
) -> None:
    emu, _ = apiserver
    allocator = await bus_factory("allocator")
    running = await start_bridge()
    await create_claim(emu, "bad", gpus=1, deviceClass="h100-ib")
    st = await eventually(lambda: _async(status(emu, "bad") or None))
    assert st["phase"] == "Invalid"
    assert (
        st["reason"]
        == "DeviceClaim ml/bad: spec.deviceClass: unknown device class 'h100-ib' (known: default)"
    )
    assert [p for p in running.published if p[0] == subjects.ALLOC_REQUEST] == []
    assert await stream_messages(allocator, subjects.ALLOC_REQUEST) == []


async def test_a_claim_deleted_while_the_bridge_was_away_is_released_at_restart(
    apiserver: tuple[Any, str], start_bridge: StartBridge, bus_factory: BusFactory
) -> None:
    emu, _ = apiserver
    allocator = await bus_factory("allocator")
    records = await allocator.kv(subjects.KV_REQUESTS)
    first = await start_bridge()
    claim = await create_claim(emu, "gone", gpus=1, rdma=1)
    hard = await create_claim(emu, "hard", gpus=1, rdma=0)  # its finalizer will be stripped
    req, r_hard = await claim_request(allocator, claim), await claim_request(allocator, hard)
    other = "gpu-node-2.example"
    await records.put(req.request_id, codec.encode(RequestRecord(request=req, state="assigned", node=NODE)))
    await records.put(
        r_hard.request_id, codec.encode(RequestRecord(request=r_hard, state="assigned", node=other))
    )
    await eventually(lambda: _true(bool(claim_obj(emu, "hard")["metadata"].get("finalizers"))))
    await first.stop()
    assert (await emu.delete(f"{CLAIMS}/gone")).status == 200
    # Someone removes the finalizer by hand: the claim is gone before the bridge is back.
    resp = await emu.patch(f"{CLAIMS}/hard", json={"metadata": {"finalizers": []}})
    assert resp.status == 200, await resp.text()
    assert (await emu.delete(f"{CLAIMS}/hard")).status == 200
    assert _gone(emu, "hard")
    second = await start_bridge()
    ((release, _),) = await eventually(lambda: stream_messages(allocator, subjects.alloc_release(NODE)))
    # The finalizer kept the deleted claim for the restarted bridge, which releases it on the
    # node of the allocator's record and then lets the claim go.
    assert (release.request_id, release.reason) == (req.request_id, "claim deleted")
    await eventually(lambda: _true(_gone(emu, "gone")))
    # The claim that went without its finalizer is found from the allocator's record.
    ((hard_release, _),) = await eventually(lambda: stream_messages(allocator, subjects.alloc_release(other)))
    assert (hard_release.request_id, hard_release.reason) == (
        r_hard.request_id,
        "claim deleted while the bridge was away",
    )
    assert [p for p in second.published if p[0] == subjects.ALLOC_REQUEST] == []


async def test_a_restarted_bridge_rebuilds_claims_users_and_releases_what_expired_meanwhile(
    apiserver: tuple[Any, str], start_bridge: StartBridge, bus_factory: BusFactory
) -> None:
    emu, _ = apiserver
    allocator = await bus_factory("allocator")
    records = await allocator.kv(subjects.KV_REQUESTS)
    allocs = await allocator.kv(subjects.KV_ALLOCS)
    clock = Clock(1_800_000_000.0)
    first = await start_bridge(clock=clock, claim_tick=0.05, event_interval=0.0)
    held = await create_claim(emu, "held", created=clock.now, gpus=1, rdma=1, expiresAfter="5m")
    spare = await create_claim(emu, "spare", created=clock.now, gpus=1, rdma=0, expiresAfter="10m")
    r_held, r_spare = await claim_request(allocator, held), await claim_request(allocator, spare)
    a_held, a_spare = assignment_for(r_held), assignment_for(r_spare, node="gpu-node-2.example")
    # What the allocator would have recorded for both.
    for req, a in ((r_held, a_held), (r_spare, a_spare)):
        await records.put(
            req.request_id, codec.encode(RequestRecord(request=req, state="assigned", node=a.node))
        )
        await allocs.put(
            a.node,
            codec.encode(
                NodeAllocations(node=a.node, allocations={req.request_id: AllocRecord(assignment=a)})
            ),
        )
        await allocator.publish(
            subjects.alloc_assigned(a.node), a, msg_id=subjects.msg_id("assigned", req.request_id)
        )
    await create_pod(emu, "user", gpu="1", rdma="1", annotations={names.CLAIM: "held"})
    await eventually(lambda: _true(status(emu, "held").get("pods") == ["user"]))
    await first.stop()

    # While the bridge is away, the reservation's deadline passes.
    clock.now += 601
    second = await start_bridge(clock=clock, claim_tick=0.05, event_interval=0.0)
    ((release, _),) = await eventually(
        lambda: stream_messages(allocator, subjects.alloc_release(a_spare.node))
    )
    assert (release.request_id, release.reason) == (r_spare.request_id, "reservation expired")
    await eventually(lambda: _true(status(emu, "spare").get("phase") == "Released"))
    # The held claim was not requested again, and still knows its pod: a second pod waits.
    assert [p for p in second.published if p[0] == subjects.ALLOC_REQUEST] == []
    await create_pod(emu, "second", gpu="1", rdma="1", annotations={names.CLAIM: "held"})
    (event,) = await eventually(lambda: _async(events_for(emu, "second")))
    assert "is not shareable and is used by pod user" in event["message"]
    assert status(emu, "held")["phase"] == "Allocated" and status(emu, "held")["node"] == NODE
    # Past its deadline too, but in use: it was not released at the restart (its users were
    # known before any expiry check). It goes when its pods have ended.
    assert await stream_messages(allocator, subjects.alloc_release(NODE)) == []
    for pod in ("second", "user"):
        assert (await emu.delete(f"/api/v1/namespaces/ml/pods/{pod}")).status == 200
    ((expired, _),) = await eventually(lambda: stream_messages(allocator, subjects.alloc_release(NODE)))
    assert (expired.request_id, expired.reason) == (r_held.request_id, "reservation expired")


# ---------------------------------------------------------------------------------------------
# with the real allocator and node agents


@pytest.fixture
async def stack(nats_url: str, clean_jetstream: None) -> AsyncIterator[LocalStack]:
    settings = make_settings(nats_url, "test", heartbeat_interval=0.2, node_lost_after=5.0)
    s = LocalStack(settings, fleet=[FleetEntry("pcie-4gpu-2nic", 1, "box")], retry_interval=0.3)
    await s.start()
    await s.wait_ready()
    yield s
    await s.stop()


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def freed(bus: Bus, rid: str) -> list[Freed]:
    return [
        m
        for m, _ in await stream_messages(bus, subjects.ALLOC_FREED)
        if isinstance(m, Freed) and m.request_id == rid
    ]


async def test_claim_deletion_frees_the_devices_after_the_node_cleans_up(
    apiserver: tuple[Any, str], stack: LocalStack, bus_factory: BusFactory
) -> None:
    emu, url = apiserver
    observer = await bus_factory("observer")
    cleaned = await observer.nc.subscribe(subjects.node_cleaned("box-0"))
    bridge = Bridge(kube=KubeClient.for_host(url), bus=stack.buses[0], device_classes={"default": _cls()})
    running = await _run(bridge)
    try:
        claim = await create_claim(emu, "hold", gpus=4, rdma=0)
        await eventually(lambda: _true(status(emu, "hold").get("phase") == "Allocated"))
        assert status(emu, "hold")["devices"] == ["gpu0", "gpu1", "gpu2", "gpu3"]
        await create_pod(emu, "user", gpu="4", rdma="0", annotations={names.CLAIM: "hold"})
        await eventually(lambda: _true(not pod_obj(emu, "user")["spec"].get("schedulingGates")))
        rid = f"claim-{claim['metadata']['uid']}"
        await eventually(lambda: _true(status(emu, "hold").get("pods") == ["user"]))

        # The CLI (NATS only) shows the claim and the pod using it.
        rows = json.loads(await tandem(stack, "requests", "-o", "json"))
        (row,) = [r for r in rows if r["request_id"] == rid]
        assert (row["pod"], row["state"], row["node"]) == ("ml/hold", "assigned", "box-0")
        assert row["claim"]["name"] == "hold" and row["claim"]["pods"] == ["user"]
        assert "claim, used by user" in await tandem(stack, "requests")
        table = await tandem(stack, "status")
        assert "ml/hold" in table and "Allocated" in table and "gpu0-3" in table, table

        # Deleted while a pod uses it: the finalizer holds the claim, and its devices, until
        # the pod ends (cleaning up under a running pod would fail the node's verification).
        assert claim_obj(emu, "hold")["metadata"]["finalizers"] == [names.CLAIM_FINALIZER]
        assert (await emu.delete(f"{CLAIMS}/hold")).status == 200
        await eventually(
            lambda: _true(status(emu, "hold").get("reason") == "deleting: waiting for pods user to end")
        )
        assert claim_obj(emu, "hold")["metadata"]["deletionTimestamp"]
        assert await stream_messages(observer, subjects.alloc_release("box-0")) == []
        assert (await emu.delete("/api/v1/namespaces/ml/pods/user")).status == 200
        msg = await cleaned.next_msg(timeout=20)
        verdict = codec.NODE_EVENT.decode(msg.data)
        assert verdict.request_id == rid and verdict.ok  # type: ignore[union-attr]
        (f,) = await eventually(lambda: freed(observer, rid))
        assert sorted(f.devices) == ["gpu0", "gpu1", "gpu2", "gpu3"]
        await eventually(lambda: _true(_gone(emu, "hold")))  # finalizer removed: the claim is gone
    finally:
        await running.stop()


def _gone(emu: Any, name: str) -> bool:
    return bool(
        emu.objects[f"{names.CLAIM_GROUP}/{names.CLAIM_VERSION}/{names.CLAIM_PLURAL}", "ml", name].deleted
    )


async def test_an_expired_reservation_is_freed_and_its_devices_go_to_a_pending_pod(
    apiserver: tuple[Any, str], stack: LocalStack, bus_factory: BusFactory
) -> None:
    emu, url = apiserver
    observer = await bus_factory("observer")
    clock = Clock(1_800_000_000.0)
    bridge = Bridge(
        kube=KubeClient.for_host(url),
        bus=stack.buses[0],
        device_classes={"default": _cls()},
        clock=clock,
        claim_tick=0.05,
    )
    running = await _run(bridge)
    try:
        claim = await create_claim(emu, "reserve", created=clock.now, gpus=4, rdma=0, expiresAfter="30m")
        await eventually(lambda: _true(status(emu, "reserve").get("phase") == "Allocated"))
        assert status(emu, "reserve")["expiresAt"] == stamp(clock.now + 1800)
        # A pod asking for the whole node waits behind the reservation.
        pod = await create_pod(emu, "late", gpu="4", rdma="0")
        rid = f"{pod['metadata']['uid']}.1"
        records = await observer.kv(subjects.KV_REQUESTS)

        async def pending() -> bool:
            try:
                return codec.REQUEST_RECORD.decode((await records.get(rid)).value).state == "pending"
            except Exception:
                return False

        await wait_until(pending, timeout=20, what="the pod's request pending behind the reservation")
        clock.now += 1801  # past the deadline, and no pod uses the reservation
        await eventually(lambda: _true(status(emu, "reserve").get("phase") == "Released"))
        assert status(emu, "reserve")["reason"] == "reservation expired"
        (f,) = await eventually(lambda: freed(observer, f"claim-{claim['metadata']['uid']}"))
        assert sorted(f.devices) == ["gpu0", "gpu1", "gpu2", "gpu3"]
        await eventually(lambda: _true(not pod_obj(emu, "late")["spec"].get("schedulingGates")))
        ann = json.loads(pod_obj(emu, "late")["metadata"]["annotations"][names.ASSIGNMENT])
        assert ann["node"] == "box-0" and sorted(g["index"] for g in ann["gpus"]) == [0, 1, 2, 3]
    finally:
        await running.stop()


MIG_NODE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "mig" / "dgx-h100-mig.yaml"


@pytest.fixture
async def mig_stack(nats_url: str, clean_jetstream: None) -> AsyncIterator[LocalStack]:
    """The documented DGX H100 with GPUs 0-3 in MIG mode (docs/sharing.md, "MIG")."""
    settings = make_settings(nats_url, "test", heartbeat_interval=0.2, node_lost_after=5.0)
    s = LocalStack(settings, fleet=[FleetEntry(str(MIG_NODE), 1, "mig")], retry_interval=0.3)
    await s.start()
    await s.wait_ready()
    yield s
    await s.stop()


async def create_mig_pod(emu: Any, name: str, *, count: str, rdma: str, annotations: dict[str, str]) -> None:
    """A pod asking ``tandem.io/mig`` (admitted by the webhook rules, persisted)."""
    pod = deployment_pod(gpu=None, rdma=rdma, annotations=annotations)
    pod["spec"]["containers"][0]["resources"]["limits"][names.RESOURCE_MIG] = count
    verdict = podrules.admit(pod, operation="CREATE", device_classes=CLASSES)
    assert verdict.allowed, verdict.message
    admitted: dict[str, Any] = jsonpatch.apply_patch(pod, verdict.patch)
    admitted["metadata"].update(name=name, uid=str(uuid.uuid4()), resourceVersion="1")
    resp = await emu.post("/api/v1/namespaces/ml/pods", json=admitted)
    assert resp.status == 200, await resp.text()


async def test_a_mig_claim_gives_its_pods_its_instances_and_frees_them_when_deleted(
    apiserver: tuple[Any, str], mig_stack: LocalStack, bus_factory: BusFactory
) -> None:
    """A claim with ``migProfile``: the real allocator holds existing MIG instances for it; a
    pod asking ``tandem.io/mig`` with the profile is bound to exactly them (and the device
    plugin's MIG resource answers that pod with their ``MIG-`` UUIDs); a pod asking whole GPUs
    on it waits, told what to ask; deleting the claim frees the instances after cleanup."""
    emu, url = apiserver
    observer = await bus_factory("observer")
    bridge = Bridge(kube=KubeClient.for_host(url), bus=mig_stack.buses[0], device_classes={"default": _cls()})
    running = await _run(bridge)
    try:
        claim = await create_claim(
            emu, "infer", gpus=2, rdma=1, pairing="shared", migProfile="1g.10gb", shareable=True
        )
        rid = f"claim-{claim['metadata']['uid']}"
        await eventually(lambda: _true(status(emu, "infer").get("phase") == "Allocated"))
        st = status(emu, "infer")
        instances = [d for d in st["devices"] if "-mig" in d]
        assert st["node"] == "mig-0" and len(instances) == 2 and len(st["devices"]) == 3
        assignment = bridge.claims.states[("ml", "infer")].assignment
        assert assignment is not None and assignment.request_id == rid
        migs = [g.mig for g in assignment.gpus]
        assert all(m is not None and m.profile == "1g.10gb" for m in migs)
        uuids = [m.uuid for m in migs if m is not None]
        assert sorted(m.device for m in migs if m is not None) == sorted(instances)

        # A pod asking the claim's instances as MIG instances of its profile is bound to them.
        uses = {names.CLAIM: "infer", names.MIG_PROFILE: "1g.10gb"}
        await create_mig_pod(emu, "infer-0", count="2", rdma="1", annotations=uses)
        await eventually(lambda: _true(not pod_obj(emu, "infer-0")["spec"].get("schedulingGates")))
        ann = json.loads(pod_obj(emu, "infer-0")["metadata"]["annotations"][names.ASSIGNMENT])
        assert ann["request_id"] == rid and ann["node"] == "mig-0"
        assert [g["mig"]["uuid"] for g in ann["gpus"]] == uuids
        await eventually(lambda: _true(status(emu, "infer").get("pods") == ["infer-0"]))

        # On the node, kubelet asks the tandem.io/mig plugin for 2 instances: the preferred ones
        # are the claim's, and Allocate hands exactly those to the container.
        topo = mig_stack.allocators[0].model.cluster.topology("mig-0")
        available = [d.id for d in plugin.plugin_devices(topo, {}, plugin.MIG_RESOURCE)]
        chosen = plugin.preferred(
            [assignment], plugin.MIG_RESOURCE, available=available, must_include=[], size=2
        )
        assert chosen == uuids
        answer = plugin.allocate(plugin.MIG_RESOURCE, chosen, known=set(available), uverbs=lambda _: [])
        assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": ",".join(uuids)}
        assert all(u.startswith("MIG-") for u in uuids)

        # A pod asking whole GPUs on the MIG claim waits and is told what to ask.
        await create_pod(emu, "whole", gpu="2", rdma="1", annotations={names.CLAIM: "infer"})
        (event,) = await eventually(lambda: _async(events_for(emu, "whole")))
        assert event["reason"] == names.EVENT_REASON_CLAIM
        assert event["message"] == (
            "the pod asks for whole GPUs, but DeviceClaim 'infer' holds MIG instances 1g.10gb; a pod "
            "using it asks for tandem.io/mig with annotation tandem.io/mig-profile: 1g.10gb"
        )
        assert pod_obj(emu, "whole")["spec"]["schedulingGates"] == [{"name": names.GATE}]

        # The pod ends, the claim is deleted: the instances are cleaned and freed.
        assert (await emu.delete("/api/v1/namespaces/ml/pods/infer-0")).status == 200
        assert (await emu.delete("/api/v1/namespaces/ml/pods/whole")).status == 200
        assert (await emu.delete(f"{CLAIMS}/infer")).status == 200
        (f,) = await eventually(lambda: freed(observer, rid))
        assert sorted(f.devices) == sorted(st["devices"])
        model = mig_stack.allocators[0].model.cluster
        await wait_until(
            lambda: set(instances) <= set(model.mig_instances("mig-0").get("1g.10gb", [])),
            what="the claim's instances free again",
        )
        await eventually(lambda: _true(_gone(emu, "infer")))
    finally:
        await running.stop()


# ---------------------------------------------------------------------------------------------


async def tandem(stack: LocalStack, *args: str) -> str:
    """The ``tandem`` CLI as an operator runs it, against the stack's NATS."""
    proc = await asyncio.create_subprocess_exec(
        TANDEM,
        *args,
        "--nats",
        stack.settings.nats_url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


def _cls() -> DeviceClass:
    return DeviceClass()


async def _run(bridge: Bridge) -> Running:
    stop = asyncio.Event()
    task = asyncio.get_running_loop().create_task(bridge.run(stop))
    await asyncio.wait_for(bridge.synced.wait(), 10)
    return Running(bridge, task, stop, bridge.kube)  # type: ignore[arg-type]


async def _true(value: bool) -> bool:
    return value


async def _async(value: Any) -> Any:
    return value
