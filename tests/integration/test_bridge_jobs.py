"""Jobs at the Kubernetes edge: the bridge (against the kmock API emulator) gathers a job's
pods, requests the job once all of them exist, and the real allocator places it whole on
simulated nodes over real NATS; a job missing pods gets an Event and holds nothing; deleting
one pod of a placed job releases that pod's devices alone."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import jsonpatch
import pytest

from schemas import codec, subjects
from schemas.messages import JobRecord, JobRequest
from services.admission import jobwatch, names, podrules, podwrites
from services.runtime.kv.watch import read_bucket
from services.runtime.nats.bus import Bus
from tests.conftest import BusFactory, make_settings
from tests.integration.test_bridge import CLASSES, StartBridge, apiserver, start_bridge, stream_messages
from tests.unit.test_admission_helpers import deployment_pod
from tests.waiting import wait_until
from tools.localstack import FleetEntry, LocalStack

__all__ = ["apiserver", "start_bridge"]  # fixtures shared with test_bridge

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
async def nodes(nats_url: str, bus_factory: BusFactory) -> AsyncIterator[LocalStack]:
    """Inventory, one allocator and eight simulated 8-GPU + 8-NIC servers."""
    settings = make_settings(nats_url, "test", heartbeat_interval=0.5)
    stack = await LocalStack(settings, fleet=[FleetEntry("dgx-h100", 8, "h100")], retry_interval=0.3).start()
    await wait_until(lambda: len(stack.allocators[0].nodes) == 8, timeout=30, what="8 nodes registered")
    try:
        yield stack
    finally:
        await stack.stop()


async def create_job_pod(emu: Any, job: str, index: int, *, size: int) -> dict[str, Any]:
    """A pod of ``job`` admitted by the webhook rules and persisted as the API server would."""
    pod = deployment_pod(
        gpu="8", rdma="8", annotations={jobwatch.JOB_SIZE: str(size), jobwatch.JOB_INDEX: str(index)}
    )
    pod["metadata"]["labels"][jobwatch.JOB] = job
    verdict = podrules.admit(pod, operation="CREATE", device_classes=CLASSES, traceparent=None)
    assert verdict.allowed, verdict.message
    admitted: dict[str, Any] = jsonpatch.apply_patch(pod, verdict.patch)
    admitted["metadata"].update(name=f"{job}-{index}", uid=str(uuid.uuid4()), resourceVersion="1")
    resp = await emu.post("/api/v1/namespaces/ml/pods", json=admitted)
    assert resp.status == 200, await resp.text()
    return admitted


def pod(emu: Any, name: str) -> dict[str, Any]:
    return dict(emu.objects["v1/pods", "ml", name].raw)


def gated(emu: Any, name: str) -> bool:
    return bool(pod(emu, name)["spec"].get("schedulingGates"))


async def held(bus: Bus) -> dict[str, tuple[str, str]]:
    """Allocation id → (node, state) for every allocation the server holds."""
    records = await read_bucket(bus.js, subjects.KV_ALLOCS, codec.NODE_ALLOCS)
    return {
        rid: (key, rec.state) for key, record in records.items() for rid, rec in record.allocations.items()
    }


async def test_an_eight_pod_job_is_requested_once_and_bound_whole(
    apiserver: tuple[Any, str], start_bridge: StartBridge, nodes: LocalStack, bus_factory: BusFactory
) -> None:
    emu, _ = apiserver
    watcher = await bus_factory("test-watcher")
    running = await start_bridge()
    for i in range(7):
        await create_job_pod(emu, "train", i, size=8)
    # Seven of eight pods: nothing is requested, nothing held, every pod still gated.
    await wait_until(
        lambda: sum(len(g.pods) for g in running.bridge.jobs.groups.values()) == 7,
        what="the bridge saw 7 pods of the job",
    )
    assert await stream_messages(watcher, subjects.ALLOC_JOB) == []
    assert await held(watcher) == {}

    await create_job_pod(emu, "train", 7, size=8)

    async def all_bound() -> bool:
        return not any(gated(emu, f"train-{i}") for i in range(8))

    await wait_until(all_bound, timeout=30, what="all 8 pods bound")
    requested = await stream_messages(watcher, subjects.ALLOC_JOB)
    assert len(requested) == 1, "the job is requested once"
    job = requested[0][0]
    assert job.pods == 8 and (job.gpus, job.rdma) == (8, 8)
    assert [m.name for m in job.members] == [f"train-{i}" for i in range(8)]
    nodes_used = set()
    for i in range(8):
        ann = podwrites.read_assignment_annotation(podrules.read_pod(pod(emu, f"train-{i}")))
        assert ann is not None and ann.request_id == f"{job.job_id}/{i}"
        nodes_used.add(ann.node)
    assert len(nodes_used) == 8
    allocs = await held(watcher)
    assert sorted(allocs) == sorted(f"{job.job_id}/{i}" for i in range(8))

    # Deleting one pod of the running job releases its devices alone.
    resp = await emu.delete("/api/v1/namespaces/ml/pods/train-3")
    assert resp.status == 200

    async def one_freed() -> bool:
        return f"{job.job_id}/3" not in await held(watcher)

    await wait_until(one_freed, timeout=30, what="the deleted pod's devices freed")
    assert sorted(await held(watcher)) == sorted(f"{job.job_id}/{i}" for i in range(8) if i != 3)


async def test_a_job_missing_pods_gets_an_event_and_holds_nothing(
    apiserver: tuple[Any, str], start_bridge: StartBridge, nodes: LocalStack, bus_factory: BusFactory
) -> None:
    emu, _ = apiserver
    watcher = await bus_factory("test-watcher")
    await start_bridge(job_wait_timeout=0.5, event_interval=0.2)
    for i in range(3):
        await create_job_pod(emu, "sweep", i, size=4)

    def waiting_events() -> list[dict[str, Any]]:
        return [
            dict(obj.raw)
            for key, obj in emu.objects.items()
            if key[0] == "v1/events" and obj.raw.get("reason") == jobwatch.EVENT_REASON_WAITING
        ]

    await wait_until(lambda: len(waiting_events()) == 3, timeout=20, what="an Event on each of the 3 pods")
    event = waiting_events()[0]
    assert "3 of 4 pods exist" in event["message"] and "nothing is held" in event["message"]
    assert event["involvedObject"]["kind"] == "Pod"
    assert await stream_messages(watcher, subjects.ALLOC_JOB) == []
    assert await held(watcher) == {}
    assert all(gated(emu, f"sweep-{i}") for i in range(3))
    assert names.GATE in [g["name"] for g in pod(emu, "sweep-0")["spec"]["schedulingGates"]]


async def test_fabric_labels_on_nodes_reach_the_allocator_and_keep_a_job_in_one_leaf(
    apiserver: tuple[Any, str], start_bridge: StartBridge, nodes: LocalStack, bus_factory: BusFactory
) -> None:
    emu, _ = apiserver
    watcher = await bus_factory("test-watcher")
    for i in range(8):
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": f"h100-{i}",
                "labels": {
                    "kubernetes.io/hostname": f"h100-{i}",
                    "tandem.io/fabric-leaf": "leaf-a" if i < 4 else "leaf-b",
                    "tandem.io/fabric-spine": "spine-1",
                },
            },
        }
        resp = await emu.post("/api/v1/nodes", json=node)
        assert resp.status == 200, await resp.text()
    await start_bridge()
    allocator = nodes.allocators[0]
    await wait_until(
        lambda: all(
            allocator.cluster.labels(f"h100-{i}").get("tandem.io/fabric-leaf")
            == ("leaf-a" if i < 4 else "leaf-b")
            for i in range(8)
        ),
        timeout=20,
        what="the Nodes' fabric labels in the allocator",
    )
    kv = await watcher.kv(subjects.KV_NODE_LABELS)
    record = codec.NODE_LABELS.decode((await kv.get("h100-5")).value)
    assert record.labels == {"tandem.io/fabric-leaf": "leaf-b", "tandem.io/fabric-spine": "spine-1"}

    # Five pods of 8+8 within one leaf of four servers: impossible, so nothing is held.
    wide = JobRequest(job_id="wide", pods=5, gpus=8, rdma=8, fabric="leaf", fabric_policy="required")
    await watcher.publish(subjects.ALLOC_JOB, wide, msg_id="job:wide")
    # Four fit in one leaf: every pod lands in the same one.
    fits = JobRequest(job_id="fits", pods=4, gpus=8, rdma=8, fabric="leaf", fabric_policy="required")
    await watcher.publish(subjects.ALLOC_JOB, fits, msg_id="job:fits")

    # (The bridge gives the devices back, as these pods do not exist in the API: the job's
    # record says where they went.)
    jobs_kv = await watcher.kv(subjects.KV_JOBS)

    async def committed(job_id: str) -> JobRecord | None:
        try:
            record = codec.JOB_RECORD.decode((await jobs_kv.get(job_id)).value)
        except Exception:
            return None
        return record if record.state in ("committed", "released") else None

    await wait_until(lambda: committed("fits"), timeout=30, what="job fits placed")
    record = await committed("fits")
    assert record is not None and len(record.placement) == 4
    assert len({allocator.cluster.labels(node)["tandem.io/fabric-leaf"] for node in record.placement}) == 1
    wide_record = codec.JOB_RECORD.decode((await jobs_kv.get("wide")).value)
    assert wide_record.state == "pending" and "no leaf can take 5" in wide_record.reason

    # A node relabelled in the cluster moves to the other leaf in the allocator.
    resp = await emu.patch(
        "/api/v1/nodes/h100-0",
        json={"metadata": {"labels": {"tandem.io/fabric-leaf": "leaf-b"}}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert resp.status == 200, await resp.text()
    await wait_until(
        lambda: allocator.cluster.labels("h100-0").get("tandem.io/fabric-leaf") == "leaf-b",
        timeout=20,
        what="the relabelled node in its new leaf",
    )
