"""The pod bridge end to end: real kubernetes-asyncio client ⇄ kmock API emulator, real NATS.

The test plays the allocator: it reads ``alloc.request`` from the stream, writes the
``RequestRecord``\\ s the allocator would, and publishes ``Assignment`` / ``AllocationFailed``.
Pods are admitted by the real webhook rules (so they carry the gate, label, defaults and the
``tandem.io/traceparent`` a real pod would) and then created through the emulator's HTTP API
with the name and UID the API server would assign.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
import kubernetes_validate
import nats.errors
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from schemas import codec, subjects
from schemas.config import DeviceClass
from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    AllocRecord,
    AssignedGpu,
    AssignedNic,
    Assignment,
    NodeAllocations,
    Pair,
    Release,
    RequestRecord,
)
from services.admission import names, podrules
from services.admission.bridge import Bridge
from services.kube.client import KubeClient
from services.runtime.nats.bus import Bus
from services.runtime.observe.tracing import current_traceparent, extract, setup_tracing, tracer
from tests.conftest import BusFactory
from tests.unit.test_admission_helpers import deployment_pod

pytestmark = pytest.mark.integration

CLASSES = {"default": DeviceClass()}
NODE = "gpu-node-1.example"


EVICTION_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction$")


def _status(code: int, reason: str, message: str, **details: Any) -> aiohttp.web.Response:
    """A ``v1 Status`` answer shaped like kube-apiserver's."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "code": code,
    }
    if code >= 400:
        body.update(message=message, reason=reason)
    if details:
        body["details"] = details
    return aiohttp.web.json_response(body, status=code)


class Apiserver(kmock.KubernetesEmulator):  # type: ignore[misc]
    """kmock's emulator, accepting ``watch=True`` as kube-apiserver does, and serving the pod
    ``eviction`` subresource (kmock has none).

    kubernetes-asyncio spells the flag with a capital T; the real API server parses it with Go's
    ``strconv.ParseBool`` (which accepts it), kmock 0.8 only matches ``true``.

    Evictions are answered as kube-apiserver's ``policy/v1`` Eviction REST handler does: 400 for
    a body that is not an Eviction of the pod in the URL, 404 for a missing pod, 409 when a uid
    precondition does not match, 429 ``TooManyRequests`` with a ``DisruptionBudget`` cause
    while a PodDisruptionBudget forbids the eviction (``pdb_blocked``: (namespace, pod) → PDB
    name), else the pod is deleted (a ``DELETED`` watch event) and the answer is 201 Success.
    ``evictions`` records every eviction request as (namespace, pod, status).
    """

    pdb_blocked: dict[tuple[str, str], str]
    evictions: list[tuple[str, str, int]]

    async def __call__(self, raw_request: Any) -> Any:
        match = EVICTION_PATH.match(raw_request.path)
        if match is not None and raw_request.method == "POST":
            return await self._evict(raw_request, match.group(1), match.group(2))
        if raw_request.query.get("watch") == "True":
            query = raw_request.query.copy()
            query["watch"] = "true"
            raw_request = raw_request.clone(rel_url=raw_request.rel_url.with_query(query))
        return await super().__call__(raw_request)

    async def _evict(self, raw_request: Any, namespace: str, name: str) -> aiohttp.web.Response:
        answer = await self._eviction_answer(raw_request, namespace, name)
        self.evictions.append((namespace, name, answer.status))
        return answer

    async def _eviction_answer(self, raw_request: Any, namespace: str, name: str) -> aiohttp.web.Response:
        body = await raw_request.json()
        if body.get("kind") != "Eviction" or body.get("apiVersion") not in ("policy/v1", "policy/v1beta1"):
            return _status(400, "BadRequest", f"not an Eviction: {body.get('apiVersion')}/{body.get('kind')}")
        if (body.get("metadata") or {}).get("name") != name:
            return _status(400, "BadRequest", "name in URL does not match name in Eviction object")
        try:
            pod = self.objects["v1/pods", namespace, name]
        except KeyError:
            pod = None
        if pod is None or pod.deleted:
            return _status(404, "NotFound", f'pods "{name}" not found', name=name, kind="pods")
        uid = (((body.get("deleteOptions") or {}).get("preconditions")) or {}).get("uid")
        have = pod.raw["metadata"].get("uid")
        if uid and uid != have:
            why = f"Precondition failed: UID in precondition: {uid}, UID in object meta: {have}"
            return _status(409, "Conflict", why)
        budget = self.pdb_blocked.get((namespace, name))
        if budget is not None:
            return _status(
                429,
                "TooManyRequests",
                "Cannot evict pod as it would violate the pod's disruption budget.",
                causes=[
                    {
                        "reason": "DisruptionBudget",
                        "message": f"The disruption budget {budget} needs 1 healthy pods and has 1 currently",
                    }
                ],
            )
        # Through the emulator's own HTTP API: the DELETE watch event and the object's state
        # are exactly those of a plain pod deletion.
        deleted = await self.delete(f"/api/v1/namespaces/{namespace}/pods/{name}")
        assert deleted.status == 200, await deleted.text()
        return _status(201, "", "")


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    setup_tracing("test-bridge", exporter=exporter)
    return exporter


@pytest.fixture
async def apiserver() -> AsyncIterator[tuple[Any, str]]:
    async with Apiserver() as emu, kmock.Server(emu) as srv:
        emu.resources["v1/pods"] = {}
        emu.resources["v1/events"] = {}
        emu.resources["v1/nodes"] = {}
        # The DeviceClaim custom resource, served like kube-apiserver serves a CRD's objects
        # (list / watch / get / status merge patch; crds/deviceclaims.yaml).
        emu.resources[f"{names.CLAIM_GROUP}/{names.CLAIM_VERSION}/{names.CLAIM_PLURAL}"] = {
            "namespaced": True,
            "kind": names.CLAIM_KIND,
            "subresources": ["status"],
        }
        emu.pdb_blocked = {}
        emu.evictions = []
        yield emu, str(srv.url).rstrip("/")


class Running:
    def __init__(
        self, bridge: Bridge, task: asyncio.Task[None], stop: asyncio.Event, kube: KubeClient
    ) -> None:
        self.bridge, self.task, self.stop_event, self.kube = bridge, task, stop, kube
        self.published: list[tuple[str, str | None]] = []

    async def stop(self) -> None:
        self.stop_event.set()
        await asyncio.wait_for(self.task, 10)
        await self.kube.close()


StartBridge = Callable[..., Awaitable[Running]]


@pytest.fixture
async def start_bridge(apiserver: tuple[Any, str], bus_factory: BusFactory) -> AsyncIterator[StartBridge]:
    running: list[Running] = []

    async def start(**kwargs: Any) -> Running:
        bus = await bus_factory("admission")
        kube = KubeClient.for_host(apiserver[1])
        bridge = Bridge(kube=kube, bus=bus, device_classes=CLASSES, **kwargs)
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(bridge.run(stop))
        handle = Running(bridge, task, stop, kube)
        publish = bus.publish

        async def counting_publish(
            subject: str, message: Any, *, msg_id: str | None = None, **kw: Any
        ) -> None:
            handle.published.append((subject, msg_id))
            await publish(subject, message, msg_id=msg_id, **kw)

        bus.publish = counting_publish  # type: ignore[method-assign]
        await asyncio.wait_for(bridge.synced.wait(), 10)
        running.append(handle)
        return handle

    yield start
    for r in running:
        if not r.task.done():
            await r.stop()


async def eventually(check: Callable[[], Awaitable[Any]], *, timeout: float = 30.0) -> Any:
    """Poll ``check`` until it returns something truthy; fail with the last value.

    The generous timeout is for CI machines shared with other jobs (seen: a gate removal that
    took over 10 s under load); a passing run returns as soon as the condition holds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.05)
    pytest.fail(f"condition not reached in {timeout}s; last value {last!r}")


async def stream_messages(bus: Bus, subject: str) -> list[tuple[Any, dict[str, str]]]:
    """Every message on ``subject`` in the alloc stream, decoded, with headers."""
    sub = await bus.js.subscribe(subject, stream=subjects.ALLOC_STREAM, ordered_consumer=True)
    out: list[tuple[Any, dict[str, str]]] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.3)
            except nats.errors.TimeoutError:
                break
            out.append((codec.ALLOC_EVENT.decode(msg.data), dict(msg.headers or {})))
    finally:
        await sub.unsubscribe()
    return out


async def create_pod(emu: Any, name: str, **pod_kwargs: Any) -> dict[str, Any]:
    """Admit a Deployment pod with the webhook rules, then persist it as the API server would."""
    pod = deployment_pod(**pod_kwargs)
    with tracer("test").start_as_current_span("admission.admit"):
        verdict = podrules.admit(
            pod, operation="CREATE", device_classes=CLASSES, traceparent=current_traceparent()
        )
    assert verdict.allowed, verdict.message
    admitted: dict[str, Any] = jsonpatch.apply_patch(pod, verdict.patch)
    admitted["metadata"].update(name=name, uid=str(uuid.uuid4()), resourceVersion="1")
    resp = await emu.post("/api/v1/namespaces/ml/pods", json=admitted)
    assert resp.status == 200, await resp.text()
    return admitted


def assignment_for(req: AllocationRequest, *, node: str = NODE) -> Assignment:
    gpus = [
        AssignedGpu(
            index=i, uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", pci_bus_id=f"0000:{0x18 + i:02x}:00.0"
        )
        for i in range(req.gpus)
    ]
    nics = [
        AssignedNic(name=f"mlx5_{i}", pf=f"mlx5_{i}", pci_bus_id=f"0000:{0x1A + i:02x}:00.0")
        for i in range(req.rdma)
    ]
    pairs = [Pair(gpu=i, nic=f"mlx5_{i}", scope="pcie-switch") for i in range(min(req.gpus, req.rdma))]
    return Assignment(
        request_id=req.request_id,
        pod=req.pod,
        node=node,
        gpus=gpus,
        nics=nics,
        pairs=pairs,
        scope="pcie-switch",
    )


async def requests_for(bus: Bus, uid: str) -> list[tuple[AllocationRequest, dict[str, str]]]:
    return [(m, h) for m, h in await stream_messages(bus, subjects.ALLOC_REQUEST) if m.pod.uid == uid]


def validate(pod: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"bound pod is not a valid v1 Pod: {exc.message} at {list(exc.path)}")


async def test_gated_pod_is_requested_bound_and_released(
    apiserver: tuple[Any, str],
    start_bridge: StartBridge,
    bus_factory: BusFactory,
    spans: InMemorySpanExporter,
) -> None:
    emu, _ = apiserver
    allocator = await bus_factory("allocator")
    await start_bridge()
    spans.clear()
    pod = await create_pod(emu, "trainer-0", gpu="2", rdma="2")
    uid = pod["metadata"]["uid"]
    trace_id = pod["metadata"]["annotations"][names.TRACEPARENT].split("-")[1]

    ((req, headers),) = await eventually(lambda: requests_for(allocator, uid))
    assert req.request_id == f"{uid}.1"
    assert (req.gpus, req.rdma, req.pairing, req.scope) == (2, 2, "per-gpu", "pcie-switch")
    assert (req.pod.namespace, req.pod.name) == ("ml", "trainer-0")
    assert headers["Nats-Msg-Id"] == subjects.msg_id("request", req.request_id)
    assert headers["traceparent"].split("-")[1] == trace_id  # bridge.request joined the pod's trace

    # Decide as the allocator does: in a span continuing the request's trace.
    with tracer("allocator").start_as_current_span("allocator.decide", context=extract(headers)):
        await allocator.publish(
            subjects.alloc_assigned(NODE),
            assignment_for(req),
            msg_id=subjects.msg_id("assigned", req.request_id),
        )

    async def bound() -> dict[str, Any] | None:
        obj = dict(emu.objects["v1/pods", "ml", "trainer-0"].raw)
        return obj if not obj["spec"].get("schedulingGates") else None

    obj = await eventually(bound)
    ann = json.loads(obj["metadata"]["annotations"][names.ASSIGNMENT])
    assert ann["request_id"] == req.request_id and ann["node"] == NODE
    assert [g["index"] for g in ann["gpus"]] == [0, 1]
    assert [n["name"] for n in ann["nics"]] == ["mlx5_0", "mlx5_1"]
    assert ann["pairs"] == [
        {"gpu": 0, "nic": "mlx5_0", "scope": "pcie-switch"},
        {"gpu": 1, "nic": "mlx5_1", "scope": "pcie-switch"},
    ]
    terms = obj["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]
    validate(obj)
    bind_spans = [s for s in spans.get_finished_spans() if s.name == "bridge.bind"]
    assert bind_spans and format(bind_spans[0].context.trace_id, "032x") == trace_id

    resp = await emu.delete("/api/v1/namespaces/ml/pods/trainer-0")
    assert resp.status == 200
    ((release, rheaders),) = await eventually(
        lambda: stream_messages(allocator, subjects.alloc_release(NODE))
    )
    assert isinstance(release, Release)
    assert (release.request_id, release.node, release.pod.uid) == (req.request_id, NODE, uid)
    assert rheaders["traceparent"].split("-")[1] == trace_id
    assert rheaders["Nats-Msg-Id"] == subjects.msg_id("release", req.request_id, subjects.alloc_release(NODE))


async def test_unschedulable_pod_gets_one_event_that_counts_and_stays_gated(
    apiserver: tuple[Any, str], start_bridge: StartBridge, bus_factory: BusFactory
) -> None:
    emu, _ = apiserver
    allocator = await bus_factory("allocator")
    await start_bridge(event_interval=0.0)
    pod = await create_pod(emu, "big-0", gpu="8", rdma="8")
    ((req, _),) = await eventually(lambda: requests_for(allocator, pod["metadata"]["uid"]))
    reason = "no node has 8 free GPUs with 8 NICs under one pcie-switch (3 nodes checked, best has 6)"
    for i in range(3):
        failed = AllocationFailed(request_id=req.request_id, pod=req.pod, reason=reason)
        await allocator.publish(
            subjects.ALLOC_FAILED, failed, msg_id=subjects.msg_id("failed", req.request_id, i)
        )

    def events() -> list[dict[str, Any]]:
        return [
            dict(o.raw) for (res, _, _), o in emu.objects.items() if res.plural == "events" and not o.deleted
        ]

    async def counted() -> list[dict[str, Any]] | None:
        evs = events()
        return evs if evs and evs[0].get("count") == 3 else None

    (event,) = await eventually(counted)
    assert event["reason"] == names.EVENT_REASON_FAILED and event["type"] == "Warning"
    assert event["message"] == reason
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "big-0",
        "namespace": "ml",
        "uid": pod["metadata"]["uid"],
    }
    try:
        kubernetes_validate.validate(event, kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"event is not a valid v1 Event: {exc.message}")
    assert emu.objects["v1/pods", "ml", "big-0"].raw["spec"]["schedulingGates"] == [{"name": names.GATE}]
    assert len(events()) == 1


async def test_bridge_restarted_mid_flow_loses_and_duplicates_nothing(
    apiserver: tuple[Any, str], start_bridge: StartBridge, bus_factory: BusFactory
) -> None:
    emu, _ = apiserver
    allocator = await bus_factory("allocator")
    records = await allocator.kv(subjects.KV_REQUESTS)
    allocs = await allocator.kv(subjects.KV_ALLOCS)

    first = await start_bridge()
    p1 = await create_pod(emu, "p1", gpu="1", rdma="1")  # requested, decided while the bridge is down
    p3 = await create_pod(emu, "p3", gpu="1", rdma="1")  # bound, deleted while the bridge is down
    ((r1, _),) = await eventually(lambda: requests_for(allocator, p1["metadata"]["uid"]))
    ((r3, _),) = await eventually(lambda: requests_for(allocator, p3["metadata"]["uid"]))
    a3 = assignment_for(r3)
    await records.put(r1.request_id, codec.encode(RequestRecord(request=r1, state="pending")))
    await records.put(r3.request_id, codec.encode(RequestRecord(request=r3, state="assigned", node=NODE)))
    await allocs.put(
        NODE,
        codec.encode(NodeAllocations(node=NODE, allocations={r3.request_id: AllocRecord(assignment=a3)})),
    )
    await allocator.publish(
        subjects.alloc_assigned(NODE), a3, msg_id=subjects.msg_id("assigned", r3.request_id)
    )
    await eventually(lambda: _gate_removed(emu, "p3"))
    await first.stop()

    # While the bridge is away: p1 is decided, p2 is created, p3 is deleted.
    a1 = assignment_for(r1)
    await allocator.publish(
        subjects.alloc_assigned(NODE), a1, msg_id=subjects.msg_id("assigned", r1.request_id)
    )
    p2 = await create_pod(emu, "p2", gpu="1", rdma="1")
    assert (await emu.delete("/api/v1/namespaces/ml/pods/p3")).status == 200

    second = await start_bridge()
    await eventually(lambda: _gate_removed(emu, "p1"))
    ((r2, _),) = await eventually(lambda: requests_for(allocator, p2["metadata"]["uid"]))
    releases = await eventually(lambda: stream_messages(allocator, subjects.alloc_release(NODE)))

    assert [(m.request_id, m.node) for m, _ in releases] == [(r3.request_id, NODE)]
    assert releases[0][0].reason == "pod deleted while the bridge was away"
    for uid in (p1["metadata"]["uid"], p2["metadata"]["uid"], p3["metadata"]["uid"]):
        assert len(await requests_for(allocator, uid)) == 1
    # Not merely deduplicated by the server: the restarted bridge did not re-request p1 (it has a
    # record) and published exactly one request (p2) and one release (p3).
    assert sorted(second.published) == sorted(
        [
            (subjects.ALLOC_REQUEST, subjects.msg_id("request", r2.request_id)),
            (
                subjects.alloc_release(NODE),
                subjects.msg_id("release", r3.request_id, subjects.alloc_release(NODE)),
            ),
        ]
    )
    p1_ann = json.loads(emu.objects["v1/pods", "ml", "p1"].raw["metadata"]["annotations"][names.ASSIGNMENT])
    assert p1_ann["request_id"] == r1.request_id


async def test_assignment_for_a_pod_deleted_before_binding_is_released(
    apiserver: tuple[Any, str], start_bridge: StartBridge, bus_factory: BusFactory
) -> None:
    emu, _ = apiserver
    allocator = await bus_factory("allocator")
    await start_bridge()
    pod = await create_pod(emu, "gone-0", gpu="1", rdma="0")
    ((req, _),) = await eventually(lambda: requests_for(allocator, pod["metadata"]["uid"]))
    assert (await emu.delete("/api/v1/namespaces/ml/pods/gone-0")).status == 200
    # The watch publishes the release to _unplaced (no node yet); the late assignment frees its node.
    await eventually(lambda: stream_messages(allocator, subjects.alloc_release(None)))
    await allocator.publish(subjects.alloc_assigned(NODE), assignment_for(req), msg_id="a-gone")
    ((release, _),) = await eventually(lambda: stream_messages(allocator, subjects.alloc_release(NODE)))
    assert release.request_id == req.request_id and release.reason == "pod gone before binding"


async def _gate_removed(emu: Any, name: str) -> bool:
    obj = emu.objects["v1/pods", "ml", name]
    return not obj.deleted and not obj.raw["spec"].get("schedulingGates")


async def test_watch_delivers_a_pod_larger_than_128_kib(apiserver: tuple[Any, str]) -> None:
    """A pod may carry up to 256 KiB of annotations: its event arrives in many reads and is
    still one event to the project's watch reader (aiohttp's default line limit is 128 KiB)."""
    emu, url = apiserver
    kube = KubeClient.for_host(url)
    try:
        _, version = await kube.list_pods(label_selector=names.MANAGED_SELECTOR)
        pod = deployment_pod(gpu="1", rdma="1")
        pod["metadata"].update(
            name="big-0",
            uid=str(uuid.uuid4()),
            labels={**pod["metadata"].get("labels", {}), names.MANAGED: "true"},
            annotations={"example.com/notes": "x" * 200_000},
        )
        assert (await emu.post("/api/v1/namespaces/ml/pods", json=pod)).status == 200
        seen: list[tuple[str, dict[str, Any]]] = []
        async for kind, obj in kube.watch_pods(
            label_selector=names.MANAGED_SELECTOR, resource_version=version, timeout_s=5
        ):
            seen.append((kind, obj))
            break
        ((kind, obj),) = seen
        assert kind == "ADDED" and obj["metadata"]["name"] == "big-0"
        assert len(obj["metadata"]["annotations"]["example.com/notes"]) == 200_000
    finally:
        await kube.close()
