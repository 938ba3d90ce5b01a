"""``tandem loadtest`` end to end, small: the harness starts nats-server, inventory, allocator
replicas and the simulated fleet as processes, drives requests through them and prints one
JSON line; the tests check its keys and the invariants it read from KV ``tandem-allocs``.
The production profile (the default: three servers, TLS, the auth callout, Prometheus) runs
once; the other runs use ``--profile dev``, one plain server, as the figures compare both.

Needs the node-side contract of issue 8 (``services.nodeagent.follow``: nodes follow their
allocation record; no per-node consumers). No timing assertions: the figures on a shared
2-core machine are noise; only counts and invariants are checked.

The pure pieces (fleet plan, percentiles, the invariant check) and the checker process's loop
are tested here too.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from opentelemetry import trace

from schemas import codec, subjects
from schemas.messages import (
    AllocRecord,
    AssignedGpu,
    AssignedNic,
    Assignment,
    NodeAllocations,
    PodRef,
    RequestRecord,
)
from services.runtime.observe.tracing import context_from_traceparent
from tests.conftest import BusFactory, make_settings
from tests.prometheus.conftest import Tools, prom_tools  # noqa: F401 (the fixture: installs or skips)
from tests.waiting import wait_until
from tools.loadtest import checker, harness, invariants
from tools.loadtest.driver import LoadDriver
from tools.loadtest.mix import (
    FLEET_MIX,
    SHARE_SIZES,
    SHARED_CLASS,
    RequestStream,
    Workload,
    fleet_gpus,
    fleet_plan,
    gpu_memory,
    node_topology,
    weight,
)
from tools.loadtest.publisher import AsyncPublisher
from tools.loadtest.report import percentiles

TANDEM = str(Path(sys.executable).parent / "tandem")
ISSUE_KEYS = [
    "nodes",
    "replicas",
    "requests",
    "rate",
    "assigned",
    "unschedulable",
    "decisions_per_s",
    "submit_to_assigned_ms",
    "submit_to_applied_ms",
    "lost",
    "double_held",
    "jetstream_ceiling",
    "rss_mb",
    "ready_s",
]


def loadtest(*args: str, timeout: float = 100) -> tuple[int, str, str]:
    proc = subprocess.run(
        [TANDEM, "loadtest", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    return proc.returncode, proc.stdout, proc.stderr


def one_json_line(stdout: str) -> dict[str, Any]:
    lines = stdout.strip().splitlines()
    assert len(lines) == 1, stdout
    result: dict[str, Any] = json.loads(lines[0])
    return result


@pytest.mark.integration
@pytest.mark.parametrize("replicas", [1, 2])
def test_small_run_prints_the_issue_keys_and_keeps_the_invariants(replicas: int) -> None:
    code, out, err = loadtest(
        *("--nodes", "20", "--requests", "200", "--replicas", str(replicas), "--profile", "dev"),
        *("--json", "--ceiling-msgs", "2000", "--drain", "30"),
    )
    assert code == 0, err[-3000:]
    result = one_json_line(out)
    assert list(result)[: len(ISSUE_KEYS)] == ISSUE_KEYS
    assert (result["nodes"], result["replicas"], result["requests"]) == (20, replicas, 200)
    assert (result["profile"], result["nats_servers"], result["security"]["auth"]) == ("dev", 1, "none")
    assert result["nodes_lost"] == 0  # read from the inventory; 20 nodes heartbeat in time
    assert result["rate"] is None
    assert result["lost"] == 0
    assert result["double_held"] == 0
    assert result["double_placed"] == 0
    assert result["assigned"] > 0
    assert result["assigned"] + result["unschedulable"] == 200
    # Every release of a held request was freed (cancels of pending ones need not be).
    assert result["released"] > 0 and result["freed"] >= result["released"] - result["cancelled"]
    assert result["drained"] is True
    # Three mid-run checks (each awaited before the final one) and the final check.
    assert result["snapshots"] == 4
    assert result["decisions_per_s"] > 0 and result["ready_s"] > 0
    for key in ("submit_to_assigned_ms", "submit_to_applied_ms"):
        assert set(result[key]) == {"p50", "p99", "max"}
        assert result[key]["p50"] is not None
    assert set(result["jetstream_ceiling"]) == {"publish_per_s", "pull_ack_per_s"}
    assert result["jetstream_ceiling"]["publish_per_s"] > 0
    assert all(result["rss_mb"][k] > 0 for k in ("allocator", "inventory", "nats", "fleet"))
    # Every revision of the run judged (tools/loadtest/ledger.py), 2 % of cleanups failing first.
    ledger = result["ledger"]
    assert result["cleanup_fail_share"] == 0.02
    assert ledger["error"] is None and ledger["revisions_missed"] == 0, ledger
    faults = ("double_held", "double_placed", "vanished", "freed_unknown", "overlap_at_apply")
    assert {k: ledger[k] for k in faults} == dict.fromkeys(faults, 0)
    assert ledger["revisions_seen"] > ledger["assignments"] >= result["assigned"]
    assert ledger["frees"] == ledger["releases"] and ledger["freed_events"] >= ledger["frees"]
    # Each replica's share (tools/loadtest/replicastats.py): the latency of what it assigned,
    # and its own counters, read from its /metrics.
    by_replica = result["by_replica"]
    assert set(by_replica) == {f"allocator-{i}" for i in range(replicas)}
    assert sum(r["assigned"] for r in by_replica.values()) <= result["assigned"]
    for r in by_replica.values():
        assert r["assigned"] > 0 and r["submit_to_assigned_ms"]["p99"] is not None, by_replica
        assert r["counters"]["decisions_assigned"] >= r["assigned"], by_replica
        assert {"commit_conflicts", "claims_busy", "shard_fallbacks", "decide_ms_mean"} <= set(r["counters"])
    if replicas == 1:  # alone, a replica has no shard to fall back from, nobody to race
        assert (by_replica["allocator-0"]["counters"]["shard_fallbacks"], result["replicas"]) == (0, 1)


@pytest.mark.integration
def test_the_default_profile_runs_nats_as_the_chart_installs_it_and_prometheus_scrapes_every_component(
    prom_tools: Tools,  # noqa: F811
) -> None:
    """The production profile: three JetStream servers with TLS and the auth callout (the
    harness checked, before the load, that they refuse a plain connection and one without a
    token), every component and every node on its own token, streams replicated on all three;
    a real Prometheus scraped every component during the run; the invariants held at every
    write; the CPU per decision names every process, the new ones included."""
    code, out, err = loadtest(
        *("--nodes", "20", "--requests", "100", "--json", "--ceiling-msgs", "2000", "--drain", "30"),
        *("--scrape-interval", "1"),
        timeout=300,
    )
    assert code == 0, err[-3000:]
    result = one_json_line(out)
    assert list(result)[: len(ISSUE_KEYS)] == ISSUE_KEYS
    assert (result["profile"], result["nats_servers"], result["stream_replicas"]) == ("production", 3, 3)
    assert result["security"] == {
        "tls": True,
        "auth": "callout",
        "plain_refused": True,
        "no_token_refused": True,
    }
    assert result["assigned"] > 0 and result["assigned"] + result["unschedulable"] == 100
    assert (result["lost"], result["double_held"], result["double_placed"], result["drained"]) == (
        0,
        0,
        0,
        True,
    )
    ledger = result["ledger"]
    assert ledger["error"] is None and ledger["revisions_missed"] == 0, ledger
    faults = ("double_held", "double_placed", "vanished", "freed_unknown", "overlap_at_apply")
    assert {k: ledger[k] for k in faults} == dict.fromkeys(faults, 0)
    assert ledger["assignments"] >= result["assigned"]
    scrape = result["scrape"]
    assert scrape["interval_s"] == 1 and scrape["error"] is None, scrape
    assert set(scrape["targets"]) == {"allocator-0", "inventory", "callout"}
    assert all(t["up"] and t["scrapes"] > 0 for t in scrape["targets"].values()), scrape
    processes = ("allocator", "inventory", "nats", "fleet", "harness", "callout", "prometheus")
    assert all(result["cpu_s"][p] > 0 for p in processes), result["cpu_s"]
    # Over the load only (a quiet callout may use no clock tick in it): every process measured.
    per_decision = result["cpu_ms_per_decision"]
    assert all(per_decision[p] is not None and per_decision[p] >= 0 for p in processes), per_decision
    assert all(per_decision[p] > 0 for p in ("allocator", "nats", "fleet")), per_decision
    assert result["cpu_ms_per_decision_total"] >= sum(per_decision[p] for p in processes) - 0.01
    assert all(result["rss_mb"][p] > 0 for p in ("allocator", "nats", "callout", "prometheus"))


NOT_ROOT = os.geteuid() != 0
FAULTS = [
    pytest.param(("--kill-server-at", "0.3", "--kill-down", "2"), "nats_kill", 2, id="killed"),
    pytest.param(
        ("--partition-server-at", "0.3", "--partition-for", "8"),
        "nats_partition",
        8,
        id="cut-off",
        marks=[
            pytest.mark.netns,
            pytest.mark.skipif(NOT_ROOT, reason="the servers run in network namespaces (ip netns add: root)"),
        ],
    ),
]


@pytest.mark.integration
@pytest.mark.parametrize(("flags", "key", "down"), FAULTS)
def test_a_nats_server_taken_away_in_the_middle_of_a_run_and_brought_back_loses_nothing(
    prom_tools: Tools,  # noqa: F811
    flags: tuple[str, ...],
    key: str,
    down: int,
) -> None:
    """Production profile: once 30 % of the requests are out, the server leading the
    allocation bucket is SIGKILLed and started again 2 s later (``--kill-server-at``), or cut
    off the network for 8 s — the servers in network namespaces of their own; it runs on
    alone, and its clients take the silence for a dead connection from their pings
    (``--partition-server-at``). The load goes on over the other two; every request is
    answered, nothing is lost or held twice at any write, the ledger missed no revision, and
    the JSON says which server went, when it was back, and the longest time without a
    decision (reported, not judged here: on a shared machine it is noise)."""
    code, out, err = loadtest(
        *("--nodes", "12", "--requests", "200", "--rate", "20", "--json", "--ceiling-msgs", "0"),
        *("--drain", "60", "--scrape-interval", "1", *flags),
        timeout=400,
    )
    assert code == 0, err[-3000:]
    result = one_json_line(out)
    other = "nats_partition" if key == "nats_kill" else "nats_kill"
    fault = result[key]
    assert result[other] is None
    assert fault["server"].startswith("tandem-") and fault["down_s"] == down, fault
    assert fault["at_s"] > 0 and fault["back_s"] is not None, fault
    assert result["assigned"] > 0 and result["assigned"] + result["unschedulable"] == 200
    assert (result["lost"], result["double_held"], result["double_placed"], result["drained"]) == (
        0,
        0,
        0,
        True,
    )
    ledger = result["ledger"]
    assert ledger["error"] is None and ledger["revisions_missed"] == 0, ledger
    faults = ("double_held", "double_placed", "vanished", "freed_unknown", "overlap_at_apply")
    assert {k: ledger[k] for k in faults} == dict.fromkeys(faults, 0)
    assert result["longest_stall_s"] > 0 and result["longest_stall_from_s"] >= 0
    assert result["nodes_lost"] is not None


@pytest.mark.integration
def test_a_small_run_with_gpu_shares_places_them_and_keeps_the_invariants() -> None:
    """Half the requests ask a share of one GPU, two replicas: shares are placed, and no GPU
    is held whole and shared, nor shared past its memory, compute or share count."""
    code, out, err = loadtest(
        *("--nodes", "20", "--requests", "300", "--replicas", "2", "--shares", "0.5", "--profile", "dev"),
        *("--json", "--ceiling-msgs", "2000", "--drain", "30"),
    )
    assert code == 0, err[-3000:]
    result = one_json_line(out)
    assert result["shares"] == 0.5 and result["shares_assigned"] > 50
    assert (result["lost"], result["double_held"], result["double_placed"], result["overcommitted"]) == (
        0,
        0,
        0,
        0,
    )
    assert result["assigned"] + result["unschedulable"] == 300 and result["drained"] is True


def test_unreachable_nats_is_one_line_not_a_hang() -> None:
    code, out, err = loadtest("--nats", "nats://127.0.0.1:1", "--json", "-q", timeout=60)
    assert (code, out) == (2, ""), err
    assert err.startswith("tandem: cannot reach NATS at nats://127.0.0.1:1"), err
    assert len(err.strip().splitlines()) == 1, err


def test_bad_input_is_one_line() -> None:
    code, out, err = loadtest("--util", "1.5")
    assert (code, out, err.strip()) == (2, "", "tandem: --util must be in (0, 1], got 1.5")
    code, out, err = loadtest("--no-services")
    assert (code, out, err.strip()) == (2, "", "tandem: --no-services needs --nats URL")
    code, out, err = loadtest("--shares", "2")
    assert (code, out, err.strip()) == (2, "", "tandem: --shares must be in [0, 1], got 2.0")
    code, out, err = loadtest("--cleanup-fail-share", "2")
    assert (code, out, err.strip()) == (2, "", "tandem: --cleanup-fail-share must be in [0, 1], got 2.0")
    code, out, err = loadtest("--profile", "production", "--nats", "nats://127.0.0.1:1")
    assert (code, out) == (2, "")
    assert err.strip() == (
        "tandem: --nats URL runs on that server as it is: give --profile dev (the production profile "
        "starts its own servers)"
    )
    code, out, err = loadtest("--profile", "dev", "--kill-server-at", "0.5")
    assert (code, out, err.strip()) == (
        2,
        "",
        "tandem: --kill-server-at needs the production profile (three servers)",
    )
    code, out, err = loadtest("--profile", "dev", "--partition-server-at", "0.5")
    assert (code, out, err.strip()) == (
        2,
        "",
        "tandem: --partition-server-at needs the production profile (three servers)",
    )
    code, out, err = loadtest("--partition-server-at", "0.5", "--kill-server-at", "0.5")
    one_fault = "tandem: --partition-server-at and --kill-server-at: one fault a run"
    assert (code, out, err.strip()) == (2, "", one_fault)
    code, out, err = loadtest("--scrape-interval", "0")
    assert (code, out, err.strip()) == (2, "", "tandem: --scrape-interval must be above 0, got 0.0")


# -- pure pieces ---------------------------------------------------------------------------------


def test_fleet_plan_is_deterministic_mixed_and_named_uniquely() -> None:
    plan = fleet_plan(1000)
    assert plan == fleet_plan(1000)
    assert len({s.name for s in plan}) == 1000
    counts = {kind: sum(1 for s in plan if s.kind == kind) for kind, _ in FLEET_MIX}
    assert counts == {"dgx-h100": 400, "dgx-a100": 300, "pcie-4gpu-2nic": 150, "gpu-only-8": 150}
    assert {s.kind for s in plan[:8]} == {kind for kind, _ in FLEET_MIX}  # any prefix is mixed
    assert fleet_gpus(plan) == 400 * 8 + 300 * 8 + 150 * 4 + 150 * 8
    a, b = node_topology(plan[0]), node_topology(plan[4])
    assert a.name == plan[0].name
    assert not {g.uuid for g in a.gpus()} & {g.uuid for g in b.gpus()}


def test_request_stream_is_seeded_and_mixed() -> None:
    names = [s.name for s in fleet_plan(10)]
    one = [RequestStream(seed=7, run="r", nodes=names).next() for _ in range(1)]
    stream = RequestStream(seed=7, run="r", nodes=names)
    reqs = [stream.next() for _ in range(2000)]
    assert reqs[0].gpus == one[0].gpus and reqs[0].request_id == "r-0000001"
    assert {r.gpus for r in reqs} == {1, 2, 4, 8}
    assert any(r.rdma == 0 for r in reqs) and any(r.rdma == r.gpus for r in reqs)
    assert {r.scope for r in reqs if r.policy == "required"} == {"pcie-switch", "numa"}
    assert not any(r.node_selector for r in reqs)  # pinned defaults to 0
    assert not any(r.shared for r in reqs)  # shares default to 0


def test_share_requests_ask_one_gpu_of_the_share_class_and_weigh_their_compute() -> None:
    stream = RequestStream(seed=7, run="r", nodes=[], workload=Workload(shares=0.3))
    reqs = [stream.next() for _ in range(2000)]
    shares = [r for r in reqs if r.shared]
    assert 0.25 < len(shares) / len(reqs) < 0.35
    assert {(r.gpus, r.device_class) for r in shares} == {(1, SHARED_CLASS)}
    assert {(r.gpu_memory_mib, r.gpu_cores_percent) for r in shares} == set(SHARE_SIZES)
    assert {weight(r) for r in shares} == {cores for _, cores in SHARE_SIZES}
    assert all(weight(r) == 100 * r.gpus for r in reqs if not r.shared)
    assert gpu_memory("dgx-h100-00001", "gpu3") == 81559 and gpu_memory("other-1", "gpu0") is None


async def test_the_driver_sends_each_request_and_its_release_in_one_pod_trace(
    bus_factory: BusFactory,
) -> None:
    """As the bridge does (its ``bridge.request`` span under the pod's annotated trace), every
    request goes out with a ``traceparent``, its release with the same one: behind a real
    bridge the allocator never handles a request outside its caller's trace."""
    bus = await bus_factory("loadtest")
    seen: list[Any] = []

    async def see(msg: Any) -> None:
        seen.append(msg)

    for subject in (subjects.ALLOC_REQUEST, subjects.alloc_release("node-a")):
        await bus.nc.subscribe(subject, cb=see)
    publisher = AsyncPublisher(bus.acks, window=16)
    publishing = asyncio.create_task(publisher.run())
    stream = RequestStream(seed=3, run="t", nodes=["node-a"])
    driver = LoadDriver(
        bus.nc,
        publisher,
        stream=stream,
        fleet_gpus=8,
        util=0.85,
        requests=2,
        rate=None,
        max_in_flight=2,
        seed=3,
    )
    try:
        first, second = stream.next(), stream.next()
        placed = driver.submit(first)
        driver.submit(second)
        placed.node = "node-a"  # as its Assignment would have said
        driver.release(first.request_id)
        await wait_until(lambda: len(seen) == 3, timeout=10, what="two requests and one release")
    finally:
        publishing.cancel()
        await asyncio.gather(publishing, return_exceptions=True)
    traces = [msg.headers["traceparent"] for msg in seen]
    contexts = [trace.get_current_span(context_from_traceparent(t)).get_span_context() for t in traces]
    assert all(c.is_valid and c.trace_flags.sampled for c in contexts), traces
    assert [msg.subject for msg in seen] == [subjects.ALLOC_REQUEST] * 2 + [subjects.alloc_release("node-a")]
    assert traces[0] != traces[1]  # one trace per pod
    assert traces[2] == traces[0] == placed.traceparent  # the release rides in its request's trace


async def test_a_missed_answer_is_read_back_only_once_the_node_record_holds_the_request(
    bus_factory: BusFactory,
) -> None:
    """An answer the harness's subscription missed is read back from the request record — but
    an ``assigned`` record is first only a claim, written before the commit, and a commit that
    fails sends the request elsewhere: the harness that took the claim once saw one request
    assigned to two nodes. It takes it only when the node's record holds the request."""
    bus = await bus_factory("loadtest")
    publisher = AsyncPublisher(bus.acks, window=16)
    stream = RequestStream(seed=5, run="t", nodes=["node-a"])
    driver = LoadDriver(
        bus.nc, publisher, stream=stream, fleet_gpus=8, util=0.85, requests=1, rate=None,
        max_in_flight=1, seed=5,
    )  # fmt: skip
    request = stream.next()
    rid = request.request_id
    driver.submit(request)  # queued only: the publisher does not run
    driver.reqs[rid].submitted -= 10  # unanswered for long enough to be looked up
    requests = await bus.kv(subjects.KV_REQUESTS)
    allocs = await bus.kv(subjects.KV_ALLOCS)
    claim = RequestRecord(request=request, state="assigned", node="node-a", owner="allocator-0")
    await requests.put(subjects.kv_key(rid), codec.encode(claim))

    assert await driver.recover_missed() == 0
    assert driver.reqs[rid].node is None and driver.reqs[rid].first is None

    held = AllocRecord(assignment=Assignment(request_id=rid, pod=PodRef("ns", rid), node="node-a", gpus=[]))
    record = NodeAllocations(node="node-a", allocations={rid: held})
    await allocs.put(subjects.kv_key("node-a"), codec.encode(record))
    driver._last_recovery = 0.0  # look again now rather than in MISSED_AFTER_S
    assert await driver.recover_missed() == 1
    assert driver.reqs[rid].node == "node-a" and driver.reqs[rid].first is not None


def test_percentiles_nearest_rank() -> None:
    p = percentiles([float(i) for i in range(1, 101)])
    assert (p.p50, p.p99, p.max) == (50.0, 99.0, 100.0)
    assert percentiles([]).p50 is None


def _alloc(rid: str, node: str, gpus: list[int], nics: list[str]) -> AllocRecord:
    return AllocRecord(
        assignment=Assignment(
            request_id=rid,
            pod=PodRef("ns", rid),
            node=node,
            gpus=[AssignedGpu(index=i, uuid=f"GPU-{i}") for i in gpus],
            nics=[AssignedNic(name=n, pf=n) for n in nics],
        )
    )


def test_invariant_check_finds_double_held_devices_and_double_placements() -> None:
    records: dict[str, NodeAllocations | None] = {
        "n1": NodeAllocations(
            node="n1",
            allocations={
                "a": _alloc("a", "n1", [0, 1], ["mlx5_0"]),
                "b": _alloc("b", "n1", [1], ["mlx5_0"]),  # gpu1 and mlx5_0 twice
            },
        ),
        "n2": NodeAllocations(node="n2", allocations={"a": _alloc("a", "n2", [0], [])}),  # a twice
        "n3": None,  # undecodable
    }
    found = invariants.Violations()
    placed = invariants.check(records, found)
    assert found.double_held == {("n1", "gpu1"), ("n1", "mlx5_0")}
    assert found.double_placed == {"a"}
    assert found.undecodable == {"n3"}
    assert placed["b"] == "n1"
    clean = invariants.Violations()
    invariants.check({"n1": NodeAllocations(node="n1", allocations={"a": _alloc("a", "n1", [0], [])})}, clean)
    assert not clean.double_held and not clean.double_placed and clean.snapshots == 1


def _share(rid: str, gpu: int, mem: int, cores: int) -> AllocRecord:
    gpus = [AssignedGpu(index=gpu, uuid=f"GPU-{gpu}", memory_mib=mem, cores_percent=cores)]
    return AllocRecord(assignment=Assignment(request_id=rid, pod=PodRef("ns", rid), node="n1", gpus=gpus))


def test_invariant_check_lets_shares_share_a_gpu_up_to_what_it_has() -> None:
    limits = invariants.ShareLimits(gpu_memory=lambda node, dev: 80_000, max_shares=3)

    def found_in(**allocs: AllocRecord) -> invariants.Violations:
        found = invariants.Violations()
        invariants.check({"n1": NodeAllocations(node="n1", allocations=allocs)}, found, shares=limits)
        return found

    fine = found_in(a=_share("a", 0, 40_000, 50), b=_share("b", 0, 40_000, 50))
    assert not fine.double_held and not fine.overcommitted
    assert found_in(a=_alloc("a", "n1", [0], []), b=_share("b", 0, 1_000, 10)).double_held == {("n1", "gpu0")}
    assert found_in(a=_share("a", 0, 50_000, 10), b=_share("b", 0, 40_000, 10)).overcommitted == {
        ("n1", "gpu0")
    }
    assert found_in(a=_share("a", 1, 1_000, 60), b=_share("b", 1, 1_000, 50)).overcommitted == {
        ("n1", "gpu1")
    }
    four = {r: _share(r, 0, 1_000, 10) for r in "abcd"}
    assert found_in(**four).overcommitted == {("n1", "gpu0")}  # 4 shares, at most 3


def _start_checker(nats_url: str) -> tuple[asyncio.StreamReader, asyncio.Task[None]]:
    """The checker's loop on a pipe of our own, asked for one snapshot already."""
    commands = asyncio.StreamReader()
    commands.feed_data(b"snapshot\n")
    return commands, asyncio.create_task(checker.serve(make_settings(nats_url, "loadtest-checker"), commands))


async def _first_answers(capsysbinary: pytest.CaptureFixture[bytes]) -> list[invariants.Found]:
    """Wait for the checker to answer; what it printed by then."""
    answers: list[invariants.Found] = []

    def answered() -> bool:
        answers.extend(_checker_answers(capsysbinary))
        return bool(answers)

    await wait_until(answered, timeout=10, what="the checker's answer")
    return answers


def _checker_answers(capsysbinary: pytest.CaptureFixture[bytes]) -> list[invariants.Found]:
    """The checker's answers printed since the last call, among this test process's log lines."""
    out = capsysbinary.readouterr().out
    return [
        msgspec.json.decode(line, type=invariants.Found) for line in out.splitlines() if line.startswith(b"{")
    ]


async def test_the_checker_answers_each_snapshot_with_what_the_records_violate(
    bus_factory: BusFactory, nats_url: str, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    """The checker process's loop (``python -m tools.loadtest.checker``), on a real server:
    one JSON answer per ``snapshot`` line, read from KV ``tandem-allocs`` as it is then; an
    unknown command gets none."""
    bus = await bus_factory()
    kv = await bus.kv(subjects.KV_ALLOCS)
    clean = NodeAllocations(node="n2", allocations={"c": _alloc("c", "n2", [0], [])})
    await kv.put(subjects.kv_key("n2"), codec.encode(clean))
    commands, serving = _start_checker(nats_url)
    answers = await _first_answers(capsysbinary)
    assert answers == [invariants.Found(double_held=[], double_placed=[], undecodable=[], snapshots=1)]

    double = NodeAllocations(
        node="n1",
        allocations={"a": _alloc("a", "n1", [0, 1], []), "b": _alloc("b", "n1", [1], [])},  # gpu1 twice
    )
    await kv.put(subjects.kv_key("n1"), codec.encode(double))
    await kv.put(subjects.kv_key("n3"), b"\xc1 not msgpack")
    commands.feed_data(b"bogus\nsnapshot\n")
    commands.feed_eof()
    await asyncio.wait_for(serving, 10)  # stdin closed: the checker is done
    assert _checker_answers(capsysbinary) == [
        invariants.Found(double_held=[("n1", "gpu1")], double_placed=[], undecodable=["n3"], snapshots=1)
    ]


async def test_the_final_check_waits_for_a_mid_run_check_still_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mid-run check still reading when the load ends is awaited (bounded) before the final
    check, so its snapshot counts; one that never answers is reported, not waited on forever."""
    said: list[str] = []
    run = harness.Harness(
        harness.LoadConfig(log_dir=str(tmp_path)),
        make_settings("nats://127.0.0.1:1", "loadtest"),
        progress=said.append,
    )
    clean = invariants.Found(double_held=[], double_placed=[], undecodable=[], snapshots=1)

    answered = asyncio.Event()  # the checker's answer, given only once the final check waits

    async def slow_check() -> None:
        await answered.wait()
        run.violations.add(clean)

    run._checks.append(run.tasks.spawn("snapshot-1", slow_check, restart=False))
    asyncio.get_running_loop().call_soon(answered.set)  # runs once _finish_checks yields
    await run._finish_checks()
    assert run.violations.snapshots == 1 and not said

    monkeypatch.setattr(harness, "SNAPSHOT_TIMEOUT_S", 0.2)
    never = asyncio.Event()  # a check whose answer never comes
    run._checks.append(run.tasks.spawn("snapshot-2", never.wait, restart=False))
    await run._finish_checks()
    assert said == ["warning: 1 mid-run check(s) unanswered after 0.2s"]
    await run.tasks.aclose()


async def test_the_checker_answers_an_error_when_it_cannot_read_the_records(
    bus_factory: BusFactory,
    nats_url: str,
    capsysbinary: pytest.CaptureFixture[bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No allocation records to read (here: the bucket does not exist yet; under the load, a
    server killed or a stream electing its leader): the checker tries again for
    ``READ_ATTEMPTS_S``, then answers with ``error`` set and no snapshot counted, and goes on
    answering — the harness reports it and the run continues."""
    monkeypatch.setattr(checker, "READ_ATTEMPTS_S", 0.3)
    monkeypatch.setattr(checker, "READ_RETRY_S", 0.05)
    commands, serving = _start_checker(nats_url)
    [failed] = await _first_answers(capsysbinary)
    assert failed.snapshots == 0 and failed.error is not None and "cannot read the records" in failed.error
    found = invariants.Violations()
    found.add(failed)
    assert found.snapshots == 0

    await bus_factory()  # provisions the buckets: the next read works
    commands.feed_data(b"snapshot\n")
    commands.feed_eof()
    await asyncio.wait_for(serving, 10)
    assert _checker_answers(capsysbinary) == [
        invariants.Found(double_held=[], double_placed=[], undecodable=[], snapshots=1)
    ]


@pytest.mark.parametrize(
    ("content", "nice"),
    [("/autogroup-12 nice 7\n", 7), ("/autogroup-3 nice -5\n", -5), ("", None), (None, None)],
)
def test_the_autogroup_file_is_read_as_the_kernel_writes_it(
    content: str | None, nice: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process in the kernel's default group (one started without a session, as on some CI
    runners) reads an empty file; a kernel without autogroups has none at all."""
    path = tmp_path / "autogroup"
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr(checker, "AUTOGROUP", str(path))
    assert checker.autogroup_nice() == nice


def _probe(code: str, *, own_session: bool) -> list[str]:
    return subprocess.run(
        [sys.executable, "-c", f"from tools.loadtest import checker; {code}"],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=own_session,
        check=True,
    ).stdout.split()


@pytest.mark.parametrize("own_session", [True, False])
def test_the_checker_lowers_its_scheduling_group_only_when_the_session_is_its_own(own_session: bool) -> None:
    """The harness starts the checker in a session of its own; with autogroups on, only the
    group's nice value ranks it against the services measured. Run by hand from a shell, the
    group is the shell's, which the checker must leave alone (only its own nice changes).
    Where this process sits in no autogroup of its own (a CI runner started without a session,
    whose file reads empty) it must stay so; a new session gets a group where the kernel makes
    one, which the probe without the checker shows first."""
    before = checker.autogroup_nice()
    fresh = _probe("print(checker.autogroup_nice())", own_session=own_session)[0]
    lowered = "checker.lower_priority(); print(checker.autogroup_nice(), checker.os.nice(0))"
    out = _probe(lowered, own_session=own_session)
    assert out[1] == "19"  # the process's own nice, in every case
    assert checker.autogroup_nice() == before  # this session's group untouched, in every case
    if not own_session:
        assert out[0] == fresh == str(before)  # the shell's group, as it was
    elif fresh == "None":
        assert out[0] == "None"
        pytest.skip("this kernel gives a new session no scheduler autogroup: only the nice value was checked")
    else:
        assert out[0] == "19"
