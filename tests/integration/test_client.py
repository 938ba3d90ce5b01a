"""The client the CLI speaks through, against a real nats-server: a release a person sends
again is stored again (not dropped by the duplicate window), records are read in one pass, and
the CLI's own connection fails at once, with a reason, where a service's bus would wait."""

from __future__ import annotations

import time

import pytest

from schemas import codec, subjects
from schemas.messages import AllocationRequest, PodRef, RequestRecord
from services.client import TandemClient
from tests.conftest import BusFactory
from tools.cli.conn import CliConnection
from tools.cli.errors import CliError, CliFailure, describe

pytestmark = pytest.mark.integration


async def stored(client: TandemClient, subject: str) -> int:
    info = await client.bus.js.stream_info(subjects.ALLOC_STREAM, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def test_a_repeated_release_is_stored_each_time(bus_factory: BusFactory, nats_url: str) -> None:
    await bus_factory("provisioner")  # streams and buckets exist
    conn = await CliConnection.open(nats_url)
    client = await TandemClient(conn).start()
    try:
        subject = subjects.alloc_release("node-a")
        for _ in range(3):  # within the 2-minute duplicate window
            await client.release("r1.1", node="node-a", pod=PodRef("ns", "p"))
        assert await stored(client, subject) == 3
    finally:
        await client.close()
        await conn.close()


async def test_records_are_read_in_one_pass_and_found_by_pod(bus_factory: BusFactory) -> None:
    bus = await bus_factory("allocator")
    kv = await bus.kv(subjects.KV_REQUESTS)
    for i, (ns, name) in enumerate([("a", "x"), ("a", "y"), ("a", "x")]):
        req = AllocationRequest(request_id=f"u{i}.1", pod=PodRef(ns, name), gpus=1, created_at=1000.0 + i)
        await kv.put(f"u{i}.1", codec.encode(RequestRecord(request=req, state="pending")))
    await kv.put("u1.1", codec.encode(RequestRecord(request=req, state="freed")))
    await kv.delete("u1.1")
    client = TandemClient(bus)
    records = await client.request_records()
    assert sorted(records) == ["u0.1", "u2.1"]
    newest_first = [r.request.request_id for r in await client.requests_of_pod(PodRef("a", "x"))]
    assert newest_first == ["u2.1", "u0.1"]
    assert await client.requests_of_pod(PodRef("a", "z")) == []


async def test_cli_connection_fails_at_once_without_tandem(nats_url: str, clean_jetstream: None) -> None:
    conn = await CliConnection.open(nats_url)
    client = TandemClient(conn)
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception) as err:
            await client.submit(AllocationRequest(request_id="u.1", pod=PodRef("ns", "p"), gpus=1))
        assert time.monotonic() - t0 < 6  # the service bus retries for 30 s
        known = describe(err.value, nats_url=conn.url)
        assert isinstance(known, CliFailure) and "has no Tandem streams" in str(known)
    finally:
        await conn.close()


async def test_bad_urls_are_usage_errors_and_dead_ports_failures() -> None:
    with pytest.raises(CliError) as usage:
        await CliConnection.open("nats://127.0.0.1:99999")
    assert usage.value.code == 2 and "Port out of range" in str(usage.value)
    with pytest.raises(CliFailure) as down:
        await CliConnection.open("nats://user:secret@127.0.0.1:1")
    assert "connection refused" in str(down.value) and "secret" not in str(down.value)
