"""The ledger of ``tandem loadtest`` on a real nats-server: faults written for real into the
buckets' streams (and one made by the real allocator) are counted; the simulated fleet refuses
an overlapping assignment and fails cleanups the way a node agent reports them.

The pure judging is tested with crafted sequences in tests/unit/test_loadtest_ledger.py; here
the reading is: every revision of the KV streams, the baseline at start, ``Freed`` events,
the process's protocol, and a whole ``tandem loadtest`` run with many cleanups failing first.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.msg import Msg

from schemas import codec, subjects
from schemas.messages import (
    AllocationRequest,
    AllocRecord,
    AssignedGpu,
    Assignment,
    Cleaned,
    Freed,
    NodeAllocations,
    PodRef,
    RequestRecord,
)
from services.client import TandemClient
from services.runtime.nats.bus import Bus
from services.runtime.settings import load_settings
from tests.conftest import BusFactory, make_settings
from tests.waiting import wait_until
from tools.loadtest import fleet, harness, invariants, ledgerwatch
from tools.loadtest.fleet import Fleet
from tools.loadtest.ledgerwatch import LedgerAnswer, LedgerWatch
from tools.loadtest.mix import fleet_plan
from tools.localstack import FleetEntry, LocalStack

pytestmark = pytest.mark.integration


def alloc(rid: str, node: str, gpus: tuple[int, ...], state: str = "assigned") -> AllocRecord:
    assignment = Assignment(
        request_id=rid,
        pod=PodRef("ns", rid),
        node=node,
        gpus=[AssignedGpu(index=i, uuid=f"GPU-{node}-{i}") for i in gpus],
    )
    return AllocRecord(assignment=assignment, state=state)  # type: ignore[arg-type]


def record(node: str, *recs: AllocRecord) -> bytes:
    return codec.encode(NodeAllocations(node=node, allocations={r.assignment.request_id: r for r in recs}))


def request_record(rid: str, state: str, node: str | None = None) -> bytes:
    req = AllocationRequest(request_id=rid, pod=PodRef("ns", rid), gpus=1)
    return codec.encode(RequestRecord(request=req, state=state, node=node))  # type: ignore[arg-type]


async def test_faults_written_into_the_buckets_are_counted_at_every_revision(bus_factory: BusFactory) -> None:
    """Written as a broken allocator would write them: a device held twice in one revision and
    let go in the next (a snapshot afterwards sees nothing), an allocation removed without a
    release, a claim no node record holds, and the cancel of a held request announced as
    ``Freed``. What was there before the reader started is its baseline: an old freed request
    is not judged, a double hold already there is."""
    bus = await bus_factory("test")
    allocs = await bus.kv(subjects.KV_ALLOCS)
    requests = await bus.kv(subjects.KV_REQUESTS)
    await requests.put("old", request_record("old", "freed", "n9"))  # an earlier run's
    await allocs.put("n0", record("n0", alloc("x", "n0", (0,)), alloc("y", "n0", (0,))))  # before the reader
    watch = LedgerWatch(bus.js)
    await watch.start()
    try:
        a, b = alloc("a", "n1", (0, 1)), alloc("b", "n1", (1,))
        await allocs.put("n1", record("n1", a))
        await allocs.put("n1", record("n1", a, b))  # gpu1 twice
        await allocs.put("n1", record("n1", a, alloc("b", "n1", (1,), "releasing")))
        await requests.put("b", request_record("b", "freed", "n1"))
        await allocs.put("n1", record("n1", a))  # b released and dropped: a snapshot sees a alone
        await bus.publish(subjects.ALLOC_FREED, Freed(request_id="b", node="n1"), msg_id="b:freed")

        await allocs.put("n2", record("n2", alloc("c", "n2", (0,))))
        await allocs.put("n2", record("n2"))  # c removed without a release
        await requests.put("c", request_record("c", "cancelled"))
        cancel = Freed(request_id="c")  # the cancel of a request a node record held
        await bus.publish(subjects.ALLOC_FREED, cancel, msg_id="c:freed")

        await requests.put("d", request_record("d", "assigned", "n3"))  # a claim no node record holds

        counts = await watch.finish(timeout=20)
    finally:
        await watch.stop()
    assert (counts.double_held, counts.vanished, counts.freed_unknown, counts.double_placed) == (2, 2, 1, 0)
    assert (counts.revisions_missed, counts.freed_events, counts.frees, counts.releases) == (0, 2, 1, 1)
    assert counts.revisions_seen == 2 + 5 + 3 + 1  # the baseline, then every write
    assert watch.ledger.end_examples() == [
        "n0: gpu0 held by x and y (revision 1)",  # each bucket its own stream
        "n1: gpu1 held by a and b (revision 3)",
        "c: left n2's record while assigned, never released (revision 7)",
        "d: its record says assigned to n3, whose record does not hold it",
        "c: cancelled (freed without a node) though a node record held it",
    ]
    snapshot = invariants.Violations()
    invariants.check(await invariants.snapshot(bus.js), snapshot)
    assert snapshot.double_held == {("n0", "gpu0")}  # n1's double hold is invisible to it


@pytest.fixture
async def stack(nats_url: str, clean_jetstream: None) -> AsyncIterator[tuple[LocalStack, TandemClient]]:
    settings = make_settings(nats_url, "test", heartbeat_interval=0.2, node_lost_after=5.0)
    local = LocalStack(settings, fleet=[FleetEntry("dgx-h100", 1, "h100")], retry_interval=0.3)
    await local.start()
    await local.wait_ready()
    client = await TandemClient(local.buses[0]).start()
    try:
        yield local, client
    finally:
        await client.close()
        await local.stop()


async def test_a_placement_lost_from_its_node_record_is_vanished_and_its_cancel_freed_unknown(
    stack: tuple[LocalStack, TandemClient], bus_factory: BusFactory
) -> None:
    """The fault the ledger exists for, on the real allocator and node agent: an assigned
    allocation removed from its node's record behind the allocator's back (what a broken
    compare-and-set would write). The allocator then takes the request's release for the
    release of a request never placed and answers it with a cancel and ``Freed``; the ledger
    counts the allocation vanished and that ``Freed`` as the release of an unknown one."""
    local, client = stack
    bus: Bus = await bus_factory("test-fault")
    watch = LedgerWatch(bus.js)
    await watch.start()
    try:
        req = AllocationRequest(request_id="uid-lost.1", pod=PodRef("ns", "lost", "uid-lost"), gpus=2)
        await client.submit(req)
        placed = await client.wait_for(req.request_id)
        assert isinstance(placed, Assignment)
        allocs = await bus.kv(subjects.KV_ALLOCS)
        entry = await allocs.get(placed.node)
        held = codec.NODE_ALLOCS.decode(entry.value or b"")
        gone = {k: v for k, v in held.allocations.items() if k != req.request_id}
        await allocs.update(
            placed.node,
            codec.encode(NodeAllocations(node=placed.node, allocations=gone)),
            last=entry.revision,
        )
        allocator = local.allocators[0]
        await wait_until(
            lambda: req.request_id not in allocator.model.placed, timeout=10, what="the allocator to see it"
        )

        await client.release(req.request_id)
        freed = await client.wait_for(req.request_id, (Freed,))
        assert isinstance(freed, Freed) and freed.node is None  # a cancel, as if never placed
        counts = await watch.finish(timeout=20)
    finally:
        await watch.stop()
    assert (counts.vanished, counts.freed_unknown) == (1, 1)
    assert (counts.double_held, counts.revisions_missed) == (0, 0)


async def _start_serving(nats_url: str) -> tuple[asyncio.StreamReader, asyncio.Task[None]]:
    commands = asyncio.StreamReader()
    settings = make_settings(nats_url, "loadtest-ledger")
    return commands, asyncio.create_task(ledgerwatch.serve(settings, commands))


def _lines(capsysbinary: pytest.CaptureFixture[bytes]) -> list[dict[str, Any]]:
    out = capsysbinary.readouterr().out
    return [json.loads(line) for line in out.splitlines() if line.startswith(b"{")]


async def test_the_ledger_process_says_ready_then_answers_finish_with_its_counts(
    bus_factory: BusFactory, nats_url: str, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    """The protocol of ``python -m tools.loadtest.ledgerwatch`` with the harness: ready once
    following, one answer per ``finish``, nothing for an unknown command, done at EOF."""
    bus = await bus_factory("test")
    commands, serving = await _start_serving(nats_url)
    seen: list[dict[str, Any]] = []

    def said(n: int) -> bool:
        seen.extend(_lines(capsysbinary))
        return len(seen) >= n

    await wait_until(lambda: said(1), timeout=10, what="the ledger's ready line")
    assert seen == [{"event": "ready"}]
    allocs = await bus.kv(subjects.KV_ALLOCS)
    await allocs.put("n1", record("n1", alloc("a", "n1", (0,)), alloc("b", "n1", (0,))))
    commands.feed_data(b"bogus\nfinish\n")
    commands.feed_eof()
    await asyncio.wait_for(serving, 20)
    said(2)
    answer = msgspec.convert(seen[1], type=LedgerAnswer)
    assert (answer.counts.double_held, answer.counts.revisions_seen, answer.counts.error) == (1, 1, None)
    assert answer.examples == ["n1: gpu0 held by a and b (revision 1)"]


# -- the simulated fleet -----------------------------------------------------------------------------


@pytest.fixture
async def fleet_of_two(bus_factory: BusFactory) -> AsyncIterator[tuple[Fleet, list[Msg]]]:
    """A fleet of two nodes, not started (no inventories, no follower): records are handed to
    it directly; what it publishes on its nodes' subjects is collected."""
    bus = await bus_factory("fleet")
    plan = fleet_plan(2)
    nodes = Fleet(bus, plan=plan, heartbeat_interval=1.0, cleanup_fail_share=0.0, cleanup_retry_s=0.05)
    published: list[Msg] = []

    async def collect(msg: Msg) -> None:
        published.append(msg)

    await bus.nc.subscribe(subjects.node_applied("*"), cb=collect)
    await bus.nc.subscribe(subjects.node_cleaned("*"), cb=collect)
    publishing = asyncio.create_task(nodes.links[plan[0].name].publisher.run())  # one window for both
    try:
        yield nodes, published
    finally:
        publishing.cancel()
        await asyncio.gather(publishing, return_exceptions=True)


def _emitted(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    """The fleet's lines to the harness (among the test's log lines, unconfigured here)."""
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def _of(published: list[Msg], rid: str) -> list[Any]:
    events = [codec.NODE_EVENT.decode(m.data) for m in published]
    return [e for e in events if e.request_id == rid]


async def test_the_fleet_refuses_an_assignment_that_overlaps_devices_it_applied(
    fleet_of_two: tuple[Fleet, list[Msg]], capsys: pytest.CaptureFixture[str]
) -> None:
    nodes, published = fleet_of_two
    node = nodes.names[0]
    a = alloc("a", node, (0, 1))
    await nodes._on_record(node, NodeAllocations(node=node, allocations={"a": a}), 1)
    b = alloc("b", node, (1, 2))  # gpu1 is a's: the fault
    await nodes._on_record(node, NodeAllocations(node=node, allocations={"a": a, "b": b}), 2)
    # a left the record; c gets gpu1 in the same revision: no overlap, a's devices are free
    c = alloc("c", node, (1,))
    await nodes._on_record(node, NodeAllocations(node=node, allocations={"b": b, "c": c}), 3)
    await wait_until(lambda: len(published) == 3, timeout=10, what="three apply reports")
    [refused] = _of(published, "b")
    assert (refused.ok, refused.error) == (False, "overlaps applied devices: gpu1 (held by a)")
    assert [m.ok for m in _of(published, "a") + _of(published, "c")] == [True, True]
    assert nodes.counts["overlap_refused"] == 1
    events = _emitted(capsys)
    assert events == [{"event": "overlap", "node": node, "request_id": "b", "devices": [["gpu1", "a"]]}]


async def test_the_fleet_fails_a_cleanup_first_then_verifies_it_as_the_agent_reports(
    fleet_of_two: tuple[Fleet, list[Msg]], capsys: pytest.CaptureFixture[str]
) -> None:
    """As ``services.nodeagent.service`` reports it: ``Cleaned(ok=False)`` with a problem and
    the msg id ``<id>:cleaned:failed``, then after the retry delay ``Cleaned(ok=True)`` with
    ``<id>:cleaned:ok``. A release whose allocation left the record before the retry gets no
    verified report."""
    nodes, published = fleet_of_two
    nodes.cleanup_fail_share = 1.0
    node = nodes.names[1]
    a, b = alloc("a", node, (0,)), alloc("b", node, (1,))
    await nodes._on_record(node, NodeAllocations(node=node, allocations={"a": a, "b": b}), 1)
    gone_before_retry = {"a": alloc("a", node, (0,), "releasing")}
    await nodes._on_record(node, NodeAllocations(node=node, allocations={**gone_before_retry, "b": b}), 2)
    await nodes._on_record(node, NodeAllocations(node=node, allocations=gone_before_retry), 3)  # b dropped
    await wait_until(lambda: nodes.counts["cleanup_retried"] == 1, timeout=10, what="the retry")
    await wait_until(lambda: len(_of(published, "a")) == 3, timeout=10, what="a's reports")
    _applied, failed, verified = _of(published, "a")
    assert isinstance(failed, Cleaned) and isinstance(verified, Cleaned)
    assert (failed.ok, failed.problems, failed.devices) == (False, [fleet.INJECTED_PROBLEM], ["gpu0"])
    assert verified.ok and not verified.problems
    ids = [m.headers["Nats-Msg-Id"] for m in published if codec.NODE_EVENT.decode(m.data).request_id == "a"]
    assert ids[1:] == ["a:cleaned:failed", "a:cleaned:ok"]
    assert nodes.counts["cleanup_failed"] == 1  # b was never released, only dropped
    events = _emitted(capsys)
    assert events == [{"event": "cleanup_failed", "node": node, "request_id": "a"}]


async def test_a_run_with_many_cleanups_failing_first_frees_everything_and_keeps_the_ledger_clean(
    tmp_path: Path,
) -> None:
    """The whole system with a quarter of the cleanups failing first: the allocator keeps
    those devices until the retry verifies them, every release is freed, and the ledger —
    every revision of the run — finds nothing."""
    said: list[str] = []
    cfg = harness.LoadConfig(
        nodes=20,
        requests=200,
        cleanup_fail_share=0.25,
        ceiling_msgs=2000,
        drain_s=30,
        profile="dev",  # the ledger's work is the same in both; the production run is test_loadtest's
        log_dir=str(tmp_path),
    )
    report = await harness.run_loadtest(cfg, load_settings("loadtest", environ={}), progress=said.append)
    g = report.ledger
    assert g.error is None and g.revisions_missed == 0, said
    assert g.cleanup_failures_injected > 10 and g.cleanups_unverified > 0, g
    assert (g.double_held, g.double_placed, g.vanished, g.freed_unknown) == (0, 0, 0, 0)
    assert g.overlap_at_apply == 0
    assert report.lost == 0 and report.drained and report.freed >= report.released - report.cancelled
    assert g.frees == g.releases and g.assignments >= report.assigned
