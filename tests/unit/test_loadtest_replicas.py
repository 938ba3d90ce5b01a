"""``by_replica`` of ``tandem loadtest`` (tools/loadtest/replicastats.py): each allocator
replica's latency and counters, pure. A run with two replicas reports it in
``tests/integration/test_loadtest.py``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tools.loadtest import replicastats
from tools.loadtest.driver import Req
from tools.loadtest.replicastats import Decided
from tools.loadtest.report import CeilingFigures, Percentiles, ReplicaFigures, Report, RssFigures, summary


def _req(submitted: float, *, assigned: float | None, first: float | None, allocator: str) -> Req:
    return Req(
        gpus=100, submitted=submitted, traceparent="", first=first, assigned=assigned, allocator=allocator
    )


def test_only_requests_whose_first_answer_was_an_assignment_are_counted_for_their_replica() -> None:
    reqs = [
        _req(0.0, assigned=0.010, first=0.010, allocator="allocator-0"),
        _req(0.0, assigned=0.500, first=0.500, allocator="allocator-1"),
        # Answered unschedulable first, placed later: the fleet was full, not the replica slow.
        _req(0.0, assigned=9.0, first=1.0, allocator="allocator-1"),
        _req(0.0, assigned=None, first=1.0, allocator=""),  # never placed
    ]
    decided = replicastats.decided(reqs)
    assert decided == [Decided("allocator-0", 10.0), Decided("allocator-1", 500.0)]


def test_each_replica_gets_its_own_percentiles_and_counters() -> None:
    decided = [Decided("allocator-1", float(ms)) for ms in range(1, 101)] + [Decided("allocator-0", 5.0)]
    counters = {"allocator-0": {"commit_conflicts": 3.0}, "allocator-2": {"commit_conflicts": 0.0}}
    out = replicastats.by_replica(decided, counters)
    assert list(out) == ["allocator-0", "allocator-1", "allocator-2"]  # sorted; an idle one listed
    one = out["allocator-1"]
    assert (one.assigned, one.submit_to_assigned_ms.p50, one.submit_to_assigned_ms.p99) == (100, 50.0, 99.0)
    assert one.counters == {}
    assert out["allocator-0"].assigned == 1 and out["allocator-0"].counters == {"commit_conflicts": 3.0}
    assert out["allocator-2"].assigned == 0 and out["allocator-2"].submit_to_assigned_ms.p50 is None


def test_counters_are_read_from_a_metrics_page_as_the_allocator_renders_it() -> None:
    registry = CollectorRegistry()
    decisions = Counter("tandem_allocator_decisions_total", "", ["outcome"], registry=registry)
    decisions.labels("assigned").inc(7)
    decisions.labels("unschedulable").inc(2)
    Counter("tandem_allocator_commit_conflicts_total", "", registry=registry).inc(4)
    redeliveries = Counter("tandem_redeliveries_total", "", ["service", "why"], registry=registry)
    redeliveries.labels("allocator", "retry").inc(3)
    redeliveries.labels("allocator", "handler_failed").inc(5)  # not a Retry: not counted
    Counter("tandem_allocator_catch_up_seconds_total", "", registry=registry).inc(0.25)
    seconds = Histogram("tandem_allocator_decision_seconds", "", registry=registry)
    seconds.observe(0.001)
    seconds.observe(0.003)
    got = replicastats.parse_counters(generate_latest(registry).decode())
    assert got == {
        "decisions_assigned": 7.0,
        "decisions_unschedulable": 2.0,
        "commit_conflicts": 4.0,
        "redeliveries": 3.0,
        "catch_up_s": 0.25,
        "decide_ms_mean": 2.0,
    }  # claims_busy and shard_fallbacks not exported: absent, not 0


def test_the_summary_names_each_replica_only_when_there_are_several() -> None:
    def report(by: dict[str, ReplicaFigures]) -> Report:
        return Report(
            nodes=1,
            requests=1,
            assigned=1,
            unschedulable=0,
            lost=0,
            double_held=0,
            replicas=len(by),
            rate=None,
            decisions_per_s=1.0,
            submit_to_assigned_ms=Percentiles(),
            submit_to_applied_ms=Percentiles(),
            jetstream_ceiling=CeilingFigures(),
            rss_mb=RssFigures(),
            ready_s=1.0,
            by_replica=by,
        )

    busy = ReplicaFigures(
        assigned=3,
        submit_to_assigned_ms=Percentiles(p50=1.0, p99=2.0, max=3.0),
        counters={"commit_conflicts": 2.0, "shard_fallbacks": 5.0},
    )
    two = summary(report({"allocator-0": busy, "allocator-1": ReplicaFigures()}))
    assert (
        "per replica: allocator-0 3 assigned, p50 1 ms, p99 2 ms, max 3 ms (conflicts 2, fallbacks 5)" in two
    )
    assert "allocator-1 0 assigned, n/a" in two
    assert "per replica" not in summary(report({"allocator-0": busy}))
