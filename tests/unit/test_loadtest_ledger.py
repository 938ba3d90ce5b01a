"""The ledger of ``tandem loadtest`` (tools/loadtest/ledger.py), fed crafted revision sequences.

Each invariant gets the fault it exists to catch — written into a revision as a broken
allocator would write it — and must count it; the legal lives next to each fault must count
nothing. Several faults here are invisible to a snapshot of the records' latest values (the
checks of tools/loadtest/invariants.py), which the tests show where it matters.
"""

from __future__ import annotations

import msgspec

from schemas.messages import (
    AllocationRequest,
    AllocRecord,
    AssignedGpu,
    AssignedNic,
    Assignment,
    Freed,
    NodeAllocations,
    PodRef,
    RequestRecord,
)
from tools.loadtest import invariants
from tools.loadtest.fleet import fails_first
from tools.loadtest.ledger import DeviceHolds, Ledger, LedgerCounts
from tools.loadtest.report import CeilingFigures, Percentiles, Report, RssFigures, violations


def alloc(
    rid: str,
    node: str = "n1",
    *,
    gpus: tuple[int, ...] = (),
    nics: tuple[str, ...] = (),
    state: str = "assigned",
) -> AllocRecord:
    return AllocRecord(
        assignment=Assignment(
            request_id=rid,
            pod=PodRef("ns", rid),
            node=node,
            gpus=[AssignedGpu(index=i, uuid=f"GPU-{node}-{i}") for i in gpus],
            nics=[AssignedNic(name=n, pf=n) for n in nics],
        ),
        state=state,  # type: ignore[arg-type]
    )


def share(rid: str, gpu: int, node: str = "n1") -> AllocRecord:
    gpus = [AssignedGpu(index=gpu, uuid=f"GPU-{node}-{gpu}", memory_mib=4096, cores_percent=10)]
    return AllocRecord(assignment=Assignment(request_id=rid, pod=PodRef("ns", rid), node=node, gpus=gpus))


def releasing(rec: AllocRecord) -> AllocRecord:
    return msgspec.structs.replace(rec, state="releasing")


def record(node: str, *recs: AllocRecord) -> NodeAllocations:
    return NodeAllocations(node=node, allocations={r.assignment.request_id: r for r in recs})


def request_record(rid: str, state: str, node: str | None = None) -> RequestRecord:
    req = AllocationRequest(request_id=rid, pod=PodRef("ns", rid), gpus=1)
    return RequestRecord(request=req, state=state, node=node)  # type: ignore[arg-type]


class Feed:
    """A stream: every write gets the next sequence, as in one bucket's stream."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.seq = 0

    def node(self, node: str, *recs: AllocRecord, deleted: bool = False) -> None:
        self.seq += 1
        self.ledger.node_record(node, None if deleted else record(node, *recs), seq=self.seq)

    def request(self, rid: str, state: str, node: str | None = None, *, baseline: bool = False) -> None:
        self.seq += 1
        self.ledger.request_record(rid, request_record(rid, state, node), seq=self.seq, baseline=baseline)

    def hole(self, count: int) -> None:
        self.seq += count
        self.ledger.missed(count, before=self.seq + 1)

    def counts(self) -> LedgerCounts:
        return self.ledger.counts()


def released_and_freed(feed: Feed, node: str, rec: AllocRecord, *rest: AllocRecord) -> None:
    """The legal end of an allocation: releasing, then dropped, request freed, Freed out."""
    rid = rec.assignment.request_id
    feed.node(node, releasing(rec), *rest)
    feed.request(rid, "freed", node)
    feed.node(node, *rest)
    feed.ledger.freed(Freed(request_id=rid, node=node))


# -- double_held ---------------------------------------------------------------------------------


def test_a_device_held_twice_between_two_snapshots_is_counted() -> None:
    """b takes gpu1 while a holds it, and is released and dropped again before any snapshot: the
    latest values are clean, every revision was not."""
    feed = Feed()
    a, b = alloc("a", gpus=(0, 1), nics=("mlx5_0",)), alloc("b", gpus=(1,))
    feed.node("n1", a)
    feed.node("n1", a, b)  # the fault: gpu1 in two allocations of one revision
    released_and_freed(feed, "n1", b, a)
    found = invariants.Violations()
    invariants.check({"n1": record("n1", a)}, found)
    assert not found.double_held  # what a snapshot sees now
    counts = feed.counts()
    assert (counts.double_held, counts.vanished, counts.freed_unknown) == (1, 0, 0)
    assert feed.ledger.examples == ["n1: gpu1 held by a and b (revision 2)"]
    assert counts.violations() == 1


def test_a_double_hold_is_counted_once_per_device_however_long_it_lasts() -> None:
    feed = Feed()
    a, b = alloc("a", gpus=(0, 1)), alloc("b", gpus=(0, 1))
    feed.node("n1", a, b)
    feed.node("n1", a, releasing(b))  # b's record changed, still listing both GPUs
    feed.node("n1", releasing(a), releasing(b))
    assert feed.counts().double_held == 2  # gpu0 and gpu1 of n1


def test_shares_of_one_gpu_share_it_but_a_whole_gpu_and_a_share_do_not() -> None:
    feed = Feed()
    feed.node("n1", share("s1", 0), share("s2", 0), alloc("w", gpus=(1,)))
    assert feed.counts().double_held == 0
    feed.node("n1", share("s1", 0), share("s2", 0), alloc("w", gpus=(1,)), share("s3", 1))
    assert feed.counts().double_held == 1  # gpu1: whole for w, a share for s3


def test_the_same_device_on_two_nodes_is_two_devices() -> None:
    feed = Feed()
    feed.node("n1", alloc("a", gpus=(0,)))
    feed.node("n2", alloc("b", "n2", gpus=(0,)))
    assert feed.counts().double_held == 0


# -- double_placed -------------------------------------------------------------------------------


def test_a_request_held_by_two_node_records_at_once_is_double_placed() -> None:
    feed = Feed()
    feed.node("n1", alloc("a", gpus=(0,)))
    feed.node("n2", alloc("a", "n2", gpus=(0,)))  # the fault: n1 still holds a
    assert feed.counts().double_placed == 1
    later = Feed()  # held on n1, released and freed there, then on n2: never at once
    later.node("n1", alloc("a", gpus=(0,)))
    released_and_freed(later, "n1", alloc("a", gpus=(0,)))
    later.node("n2", alloc("a", "n2", gpus=(0,)))
    assert later.counts().double_placed == 0


# -- vanished ------------------------------------------------------------------------------------


def test_an_allocation_that_leaves_its_record_without_release_has_vanished() -> None:
    """What a compare-and-set applied to a stale record would write: the record without a."""
    feed = Feed()
    a, b = alloc("a", gpus=(0,)), alloc("b", gpus=(1,))
    feed.request("a", "assigned", "n1")
    feed.node("n1", a, b)
    feed.node("n1", b)  # the fault: a is gone, nobody released it
    counts = feed.counts()
    assert (counts.vanished, counts.frees, counts.assignments) == (1, 0, 2)
    assert feed.ledger.examples == ["a: left n1's record while assigned, never released (revision 3)"]


def test_a_released_allocation_and_a_rolled_back_job_pod_leave_legally() -> None:
    feed = Feed()
    a, pod = alloc("a", gpus=(0,)), alloc("job/0", gpus=(1,), state="prepared")
    feed.node("n1", a, pod)
    released_and_freed(feed, "n1", a, pod)
    feed.node("n1")  # the job's attempt aborted: its prepared pod rolled back
    counts = feed.counts()
    assert (counts.vanished, counts.frees, counts.releases, counts.assignments) == (0, 1, 1, 1)
    assert counts.violations() == 0


def test_a_node_record_deleted_under_an_assigned_allocation_loses_it() -> None:
    feed = Feed()
    feed.node("n1", alloc("a", gpus=(0,)))
    feed.node("n1", deleted=True)
    assert feed.counts().vanished == 1


def test_a_request_assigned_in_its_record_but_held_by_no_node_at_the_end_has_vanished() -> None:
    """The claim says n1, no node record holds it: lost (a node record written without it
    from the start is never seen leaving, so only the end can tell)."""
    feed = Feed()
    feed.request("a", "assigned", "n1")
    feed.node("n1", alloc("other", gpus=(0,)))
    assert feed.counts().vanished == 1
    assert feed.ledger.end_examples() == ["a: its record says assigned to n1, whose record does not hold it"]
    feed.node("n1", alloc("other", gpus=(0,)), alloc("a", gpus=(1,)))  # the commit after the claim
    assert feed.counts().vanished == 0


def test_a_request_record_moving_on_from_assigned_is_not_held_to_it() -> None:
    feed = Feed()
    feed.request("a", "assigned", "n1")
    feed.request("a", "pending")  # the commit lost its race; decided again later
    feed.request("b", "assigned", "n1")
    feed.request("b", "cancelled")  # its owner died before the commit; cancelled after
    assert feed.counts().vanished == 0 and feed.counts().freed_unknown == 0


# -- freed_unknown -------------------------------------------------------------------------------


def test_freed_on_a_node_where_it_was_never_releasing_is_unknown() -> None:
    feed = Feed()
    feed.node("n1", alloc("a", gpus=(0,)))
    feed.ledger.freed(Freed(request_id="a", node="n1"))  # the fault: a is still assigned there
    feed.ledger.freed(Freed(request_id="ghost", node="n1"))  # never on any node
    counts = feed.counts()
    assert (counts.freed_unknown, counts.freed_events) == (2, 2)
    assert feed.ledger.end_examples() == [
        "a: freed on n1, never seen releasing there",
        "ghost: freed on n1, never seen releasing there",
    ]


def test_the_cancel_of_a_vanished_allocation_is_an_unknown_release_reported_freed() -> None:
    """The allocator's answer to the release of an allocation it no longer finds: the request
    is cancelled and ``Freed`` goes out without a node (services/allocator/frees.py)."""
    feed = Feed()
    feed.node("n1", alloc("a", gpus=(0,)))
    feed.node("n1")  # vanished
    feed.request("a", "cancelled")
    feed.ledger.freed(Freed(request_id="a"))
    counts = feed.counts()
    assert (counts.vanished, counts.freed_unknown) == (1, 1)
    said = "a: cancelled (freed without a node) though a node record held it"
    assert feed.ledger.end_examples()[-1] == said


def test_a_request_record_freed_without_a_release_on_its_node_is_unknown() -> None:
    feed = Feed()
    feed.node("n1", alloc("a", gpus=(0,)))
    feed.node("n1")  # and gone without release (vanished)
    feed.request("a", "freed", "n1")  # recorded freed, though n1 never said releasing
    assert feed.counts().freed_unknown == 1


def test_the_cancel_of_a_request_never_placed_and_a_proper_free_are_known() -> None:
    feed = Feed()
    feed.request("p", "pending")
    feed.request("p", "cancelled")
    feed.ledger.freed(Freed(request_id="p"))
    a = alloc("a", gpus=(0,))
    feed.node("n1", a)
    released_and_freed(feed, "n1", a)
    feed.ledger.freed(Freed(request_id="a", node="n1"))  # announced again (a redelivery)
    assert feed.counts() == LedgerCounts(
        revisions_seen=feed.counts().revisions_seen,
        assignments=1,
        releases=1,
        frees=1,
        freed_events=3,
    )


def test_finished_records_of_the_baseline_are_not_judged() -> None:
    """A run on a server used before: records freed long ago are the state the ledger starts
    from, not releases it has to have seen."""
    feed = Feed()
    feed.request("old", "freed", "n1", baseline=True)
    feed.request("older", "cancelled", baseline=True)
    assert feed.counts().freed_unknown == 0


# -- what it could not see -----------------------------------------------------------------------


def test_missed_revisions_are_counted_and_judge_nothing_they_could_hide() -> None:
    """A revision removed before it was read may have been a's release: a leaving afterwards
    is not judged, and neither is its Freed; b, seen after the hole, still is."""
    feed = Feed()
    a, b = alloc("a", gpus=(0,)), alloc("b", gpus=(1,))
    feed.node("n1", a)
    feed.hole(2)  # perhaps a releasing; the ledger cannot know
    feed.node("n1", b)
    feed.ledger.freed(Freed(request_id="a", node="n1"))
    counts = feed.counts()
    assert (counts.revisions_missed, counts.vanished, counts.freed_unknown) == (2, 0, 0)
    feed.node("n1")  # b gone, unreleased, after the hole
    assert feed.counts().vanished == 1


def test_cleanups_reported_unverified_are_counted_once_per_request() -> None:
    feed = Feed()
    feed.request("a", "assigned", "n1")
    feed.request("a", "releasing", "n1")
    feed.request("a", "releasing", "n1")  # the reason rewritten
    feed.request("a", "freed", "n1")
    assert feed.counts().cleanups_unverified == 1


# -- the pieces around it ------------------------------------------------------------------------


def test_device_holds_name_each_clash_and_let_go_of_what_left() -> None:
    holds = DeviceHolds()
    assert holds.add("a", alloc("a", gpus=(0, 1), nics=("mlx5_0",)).assignment) == []
    b = alloc("b", gpus=(1, 2), nics=("mlx5_0",)).assignment
    assert holds.clashes("b", b) == [("gpu1", "a"), ("mlx5_0", "a")]
    assert "b" not in holds  # clashes() adds nothing
    holds.remove("a")
    assert holds.clashes("b", b) == [] and "a" not in holds
    assert holds.add("a", alloc("a", gpus=(0,)).assignment) == []
    assert holds.add("a", alloc("a", gpus=(0,)).assignment) == []  # itself is no clash


def test_the_report_counts_the_ledgers_and_the_fleets_faults_as_violations() -> None:
    report = Report(
        nodes=1,
        replicas=1,
        requests=1,
        rate=None,
        assigned=1,
        unschedulable=0,
        decisions_per_s=None,
        submit_to_assigned_ms=Percentiles(),
        submit_to_applied_ms=Percentiles(),
        lost=0,
        double_held=0,
        jetstream_ceiling=CeilingFigures(),
        rss_mb=RssFigures(),
        ready_s=None,
    )
    assert violations(report) == 0
    report.ledger = LedgerCounts(cleanup_failures_injected=5, cleanups_unverified=5, revisions_seen=9)
    assert violations(report) == 0  # injected failures are the load, not faults
    for field in ("double_held", "double_placed", "vanished", "freed_unknown", "overlap_at_apply"):
        report.ledger = LedgerCounts(**{field: 1})
        assert violations(report) == 1, field


def test_the_cleanups_that_fail_first_are_a_stable_share_of_the_requests() -> None:
    ids = [f"lt1234abcd-{i:07d}" for i in range(20_000)]
    chosen = [rid for rid in ids if fails_first(rid, 0.02)]
    assert 0.015 < len(chosen) / len(ids) < 0.025
    assert chosen == [rid for rid in ids if fails_first(rid, 0.02)]  # the same, asked again
    assert not any(fails_first(rid, 0.0) for rid in ids) and all(fails_first(rid, 1.0) for rid in ids)
