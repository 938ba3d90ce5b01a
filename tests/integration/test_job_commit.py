"""Whole jobs over real NATS: placed all or nothing, released per pod or whole, and a job
commit killed half-way (SIGKILL of a real allocator process) leaves nothing held and is
placed once (services/allocator/jobplacement.py)."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from nats.js.errors import NotFoundError

from schemas import codec, subjects
from schemas.messages import AllocRecord, JobRecord, JobRequest, NodeAllocations, PodRef, Release
from services.runtime.kv.watch import read_bucket
from services.runtime.nats.bus import Bus
from tests.conftest import make_settings
from tests.waiting import wait_until
from tools.localstack import FleetEntry, LocalStack

# Generous: four allocator processes start one after another, and this machine is shared.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FLEET = [FleetEntry("dgx-h100", 4, "h100")]  # four 8-GPU + 8-NIC servers


def job(job_id: str, pods: int, *, gpus: int = 8, rdma: int = 8) -> JobRequest:
    return JobRequest(
        job_id=job_id,
        pods=pods,
        gpus=gpus,
        rdma=rdma,
        namespace="ml",
        members=[PodRef(namespace="ml", name=f"{job_id}-{i}", uid=f"uid-{job_id}-{i}") for i in range(pods)],
    )


async def allocations(bus: Bus) -> dict[str, dict[str, AllocRecord]]:
    """Every node's allocations, as the server holds them now (one complete read: a listing
    of keys can end early, and then this returned nothing for a job just placed)."""
    records = await read_bucket(bus.js, subjects.KV_ALLOCS, codec.NODE_ALLOCS)
    return {key: dict(record.allocations) for key, record in records.items()}


async def pods_of(bus: Bus, job_id: str) -> dict[str, tuple[str, AllocRecord]]:
    """``JOB/i`` → (node, allocation) for every allocation of the job."""
    return {
        rid: (node, rec)
        for node, recs in (await allocations(bus)).items()
        for rid, rec in recs.items()
        if rec.job == job_id
    }


async def job_record(bus: Bus, job_id: str) -> JobRecord | None:
    kv = await bus.kv(subjects.KV_JOBS)
    try:
        entry = await kv.get(job_id)
    except Exception:
        return None
    return codec.JOB_RECORD.decode(entry.value) if entry.value else None


async def stream_records(bus: Bus, bucket: str) -> list[tuple[str, bytes | None]]:
    """Every revision the bucket's stream still holds, in the order the server stored them:
    (key, value or None for a delete)."""
    stream = subjects.kv_stream(bucket)
    info = await bus.js.stream_info(stream)
    prefix = subjects.kv_subject(bucket, "")
    out: list[tuple[str, bytes | None]] = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            raw = await bus.js.get_msg(stream, seq)
        except NotFoundError:
            continue
        deleted = (raw.headers or {}).get("KV-Operation") in ("DEL", "PURGE")
        out.append(((raw.subject or "")[len(prefix) :], None if deleted or not raw.data else raw.data))
    return out


async def alloc_history(bus: Bus) -> list[tuple[str, NodeAllocations | None]]:
    return [
        (key, codec.NODE_ALLOCS.decode(data) if data else None)
        for key, data in await stream_records(bus, subjects.KV_ALLOCS)
    ]


async def job_history(bus: Bus, job_id: str) -> list[JobRecord]:
    return [
        codec.JOB_RECORD.decode(data)
        for key, data in await stream_records(bus, subjects.KV_JOBS)
        if key == job_id and data
    ]


def held_twice(allocs: dict[str, dict[str, AllocRecord]]) -> list[str]:
    out = []
    for node, recs in allocs.items():
        seen = Counter(d for r in recs.values() for d in r.assignment.device_ids())
        out += [f"{node}/{d}" for d, n in seen.items() if n > 1]
    return out


async def submit(bus: Bus, j: JobRequest, *, attempt: int = 0) -> None:
    await bus.publish(subjects.ALLOC_JOB, j, msg_id=subjects.msg_id("job", j.job_id, attempt))


@pytest.fixture
async def stack(nats_url: str, clean_jetstream: None) -> AsyncIterator[tuple[LocalStack, Bus]]:
    settings = make_settings(nats_url, "test", heartbeat_interval=0.5)
    s = await LocalStack(settings, fleet=FLEET, retry_interval=0.3).start()
    bus = await Bus.open(make_settings(nats_url, "test-client"))
    allocator = s.allocators[0]
    await wait_until(lambda: len(allocator.nodes) == 4, timeout=20, what="4 nodes registered")
    try:
        yield s, bus
    finally:
        await bus.close()
        await s.stop()


async def test_a_job_is_placed_whole_released_per_pod_and_whole(stack: tuple[LocalStack, Bus]) -> None:
    s, bus = stack
    await submit(bus, job("train", 3))

    async def placed() -> bool:
        pods = await pods_of(bus, "train")
        return len(pods) == 3 and all(rec.state in ("assigned", "applied") for _, rec in pods.values())

    await wait_until(placed, timeout=20, what="3 pods of job train assigned")
    pods = await pods_of(bus, "train")
    assert sorted(pods) == ["train/0", "train/1", "train/2"]
    assert len({node for node, _ in pods.values()}) == 3  # 8+8 each: one pod per server
    for rid, (_, rec) in pods.items():
        assert rec.assignment.request_id == rid
        assert rec.assignment.pod.name == "train-" + rid.split("/")[1]
        assert len(rec.assignment.gpus) == 8 and len(rec.assignment.nics) == 8
    assert held_twice(await allocations(bus)) == []
    record = await job_record(bus, "train")
    assert record is not None and record.state == "committed" and len(record.placement) == 3
    # Every pod's node agent applied its devices.
    await wait_until(
        lambda: sum(len(a.applied) for a in s.appliers.values()) == 3, timeout=10, what="3 pods applied"
    )

    # The same job again (a resubmission): nothing new is held.
    await submit(bus, job("train", 3), attempt=1)
    # A job that cannot fit now (one server is free, it asks two) waits, holding nothing.
    await submit(bus, job("wide", 2))

    async def wide_pending() -> bool:
        r = await job_record(bus, "wide")
        return r is not None and r.state == "pending"

    await wait_until(wide_pending, timeout=10, what="job wide pending")
    wide = await job_record(bus, "wide")
    assert wide is not None and "2 pods" in wide.reason, wide.reason if wide else None
    assert await pods_of(bus, "wide") == {}
    assert len(await pods_of(bus, "train")) == 3

    # Releasing one pod frees that pod alone; with two servers free, wide is placed.
    node1, _ = pods["train/1"]
    await bus.publish(
        subjects.alloc_release(node1),
        Release(request_id="train/1", pod=PodRef(namespace="ml", name="train-1"), node=node1),
        msg_id="release:train/1",
    )

    async def wide_placed() -> bool:
        return len(await pods_of(bus, "wide")) == 2

    await wait_until(wide_placed, timeout=20, what="job wide placed once train/1 was freed")
    assert sorted(await pods_of(bus, "train")) == ["train/0", "train/2"]
    assert held_twice(await allocations(bus)) == []

    # Releasing the job by its id releases every pod left; the job ends released.
    await bus.publish(
        subjects.alloc_release(None),
        Release(request_id="train", pod=PodRef(namespace="ml", name="train-0")),
        msg_id="release:train",
    )

    async def train_released() -> bool:
        r = await job_record(bus, "train")
        return await pods_of(bus, "train") == {} and r is not None and r.state == "released"

    await wait_until(train_released, timeout=20, what="job train released whole")


async def test_a_job_that_can_never_fit_holds_nothing(stack: tuple[LocalStack, Bus]) -> None:
    _, bus = stack
    await submit(bus, job("huge", 5))

    async def pending() -> bool:
        r = await job_record(bus, "huge")
        return r is not None and r.state == "pending"

    await wait_until(pending, timeout=10, what="job huge pending")
    record = await job_record(bus, "huge")
    assert record is not None and "5 pods" in record.reason
    assert await pods_of(bus, "huge") == {}


# -- a job commit killed half-way ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def start_allocator(
    nats_url: str, tmp_path: Path, name: str, *, module: str = "services.allocator", **settings: object
) -> tuple[asyncio.subprocess.Process, int]:
    port = free_port()
    cfg = tmp_path / f"{name}.yaml"
    lines = [f"nats_url: {nats_url}", f"ops_port: {port}", "log_level: info", f"instance: {name}"]
    lines += [f"{k}: {v}" for k, v in settings.items()]
    cfg.write_text("\n".join(lines) + "\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        "--config",
        str(cfg),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )

    async def ready() -> bool:
        assert proc.returncode is None, f"allocator {name} exited with {proc.returncode}"
        try:
            async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/readyz") as r:
                return r.status == 200
        except aiohttp.ClientConnectionError:
            return False

    await wait_until(ready, timeout=60, what=f"allocator {name} ready", poll=0.1)
    return proc, port


async def test_a_job_commit_killed_half_way_holds_nothing_and_is_placed_once(
    nats_url: str, clean_jetstream: None, tmp_path: Path
) -> None:
    # Nodes are not declared lost while a loaded machine delays heartbeats: the test is about
    # the commit, and a lost node would only make the job wait.
    settings = make_settings(nats_url, "test", heartbeat_interval=0.5, node_lost_after=60.0)
    fleet = await LocalStack(settings, fleet=FLEET, allocators=0).start()
    bus = await Bus.open(make_settings(nats_url, "test-client"))
    procs: list[asyncio.subprocess.Process] = []
    common = {"claim_timeout": 1.0, "ack_wait": 8.0}
    try:
        # Replica a pauses after preparing the first node of a job commit (a fault installed
        # from outside the allocator: tests/integration/pausing_allocator.py).
        a, _ = await start_allocator(
            nats_url, tmp_path, "alloc-a", module="tests.integration.pausing_allocator", **common
        )
        procs.append(a)
        await submit(bus, job("gang", 3))

        async def half_prepared() -> bool:
            pods = await pods_of(bus, "gang")
            return len(pods) >= 1 and all(rec.state == "prepared" for _, rec in pods.values())

        await wait_until(half_prepared, timeout=60, what="the first node of the job prepared")
        pods = await pods_of(bus, "gang")
        assert len(pods) < 3, "the pause comes after the first node's pods only"
        record = await job_record(bus, "gang")
        assert record is not None and record.state == "committing" and record.epoch == 1
        assert not any(a.applied for a in fleet.appliers.values()), "a prepared pod is never applied"

        a.send_signal(signal.SIGKILL)
        await a.wait()

        # A second replica settles the abandoned attempt (aborted, its pods dropped); the job
        # message was never acked, so it comes again and the job is placed, once.
        b, _ = await start_allocator(nats_url, tmp_path, "alloc-b", **common)
        procs.append(b)

        async def placed() -> bool:
            r = await job_record(bus, "gang")
            pods = await pods_of(bus, "gang")
            return (
                r is not None
                and r.state == "committed"
                and len(pods) == 3
                and all(rec.state in ("assigned", "applied") for _, rec in pods.values())
            )

        await wait_until(placed, timeout=60, what="the job placed after the crash")
        # The allocation records' history, in the order the server stored it: the crashed
        # attempt's pods were never handed out and were all gone before the next attempt
        # reserved anything — nothing of the job was held in between.
        history = await alloc_history(bus)
        latest: dict[str, dict[str, AllocRecord]] = {}
        first_attempt_seen = False
        for node, record in history:
            latest[node] = dict(record.allocations) if record is not None else {}
            pods_now = [r for recs in latest.values() for r in recs.values() if r.job == "gang"]
            assert all(r.state == "prepared" for r in pods_now if r.epoch == 1), "epoch 1 handed out"
            first_attempt_seen |= any(r.epoch == 1 for r in pods_now)
            if any(r.epoch > 1 for r in pods_now):
                assert not [r for r in pods_now if r.epoch == 1], "two attempts held at once"
        assert first_attempt_seen
        jobs_history = await job_history(bus, "gang")
        assert ("aborted", 1) in [(r.state, r.epoch) for r in jobs_history], jobs_history
        # The crashed replica comes back (without the fault): nothing changes.
        a2, _ = await start_allocator(nats_url, tmp_path, "alloc-a", **common)
        procs.append(a2)
        await wait_until(
            lambda: sum(len(x.applied) for x in fleet.appliers.values()) == 3,
            timeout=20,
            what="3 pods applied",
        )
        record = await job_record(bus, "gang")
        assert record is not None and record.state == "committed" and record.epoch >= 2
        pods = await pods_of(bus, "gang")
        assert sorted(pods) == ["gang/0", "gang/1", "gang/2"]
        assert {rec.epoch for _, rec in pods.values()} == {record.epoch}, "one attempt's pods only"
        assert len({node for node, _ in pods.values()}) == 3
        assert held_twice(await allocations(bus)) == []
    finally:
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            await asyncio.wait_for(p.wait(), 20)
        await bus.close()
        await fleet.stop()
