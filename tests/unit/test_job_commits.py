"""The job commit protocol's decision points (services/allocator/jobcommits.py), as pure
mutations: exactly one of commit and abort of an epoch wins, a stale attempt is superseded,
prepare is all-or-nothing per node, roll-back never touches a committed pod.

The last test drives the protocol's steps for two replicas in random interleavings, with
crashes, against an in-memory compare-and-set store, and checks the invariants after every
step (Hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.messages import (
    AllocRecord,
    AssignedGpu,
    Assignment,
    JobRecord,
    JobRequest,
    NodeAllocations,
    PodRef,
)
from services.allocator import jobcommits
from services.allocator.commits import AlreadyDone, DifferentRequest
from services.runtime.kv.records import Conflict
from services.runtime.nats.bus import Retry

JOB = JobRequest(job_id="train", pods=2, gpus=1, namespace="ml")


def alloc(
    rid: str, node: str, gpu: int, *, job: str = "train", epoch: int = 1, state: str = "prepared"
) -> AllocRecord:
    a = Assignment(
        request_id=rid,
        pod=PodRef(namespace="ml", name=rid.replace("/", "-")),
        node=node,
        gpus=[AssignedGpu(index=gpu, uuid=f"GPU-{node}-{gpu}")],
    )
    return AllocRecord(assignment=a, state=state, job=job, epoch=epoch)  # type: ignore[arg-type]


def begin(
    record: JobRecord | None, *, now: float = 100.0, instance: str = "a", timeout: float = 5.0
) -> JobRecord:
    mutate, got = jobcommits.begin(JOB, nodes=["n1", "n2"], instance=instance, now=now, claim_timeout=timeout)
    out = mutate(record)
    assert out is not None and out.epoch == got[0]
    return out


def test_begin_takes_a_new_epoch_and_refuses_a_live_attempt() -> None:
    r1 = begin(None)
    assert (r1.state, r1.epoch, r1.owner, r1.nodes) == ("committing", 1, "a", ["n1", "n2"])
    with pytest.raises(Retry):
        begin(r1, now=102.0, instance="b")
    with pytest.raises(jobcommits.Superseded) as stale:
        begin(r1, now=106.0, instance="b")  # older than claim_timeout: abort it first
    assert str(stale.value) == "1"
    aborted = jobcommits.abort(1, reason="abandoned")(r1)
    assert aborted is not None and aborted.state == "aborted"
    r2 = begin(aborted, now=107.0, instance="b")
    assert (r2.epoch, r2.owner) == (2, "b")


def test_exactly_one_of_commit_and_abort_wins() -> None:
    r1 = begin(None)
    committed = jobcommits.commit(1, placement=["n1", "n2"])(r1)
    assert committed is not None and committed.state == "committed"
    with pytest.raises(AlreadyDone):
        jobcommits.abort(1, reason="late")(committed)
    aborted = jobcommits.abort(1, reason="abandoned")(r1)
    assert aborted is not None
    with pytest.raises(jobcommits.Superseded):
        jobcommits.commit(1, placement=["n1", "n2"])(aborted)
    # An abort of another epoch changes nothing.
    assert jobcommits.abort(7, reason="x")(r1) is None


def test_a_job_id_reused_for_another_job_is_refused() -> None:
    r1 = begin(None)
    other = JobRequest(job_id="train", pods=3, gpus=1, namespace="ml")
    mutate, _ = jobcommits.begin(other, nodes=["n1"], instance="a", now=100.0, claim_timeout=5.0)
    with pytest.raises(DifferentRequest):
        mutate(r1)


def test_prepare_is_all_or_nothing_per_node_and_idempotent() -> None:
    base = NodeAllocations(
        node="n1", allocations={"other": alloc("other", "n1", 0, job="", epoch=0, state="assigned")}
    )
    pods = {"train/0": alloc("train/0", "n1", 1), "train/1": alloc("train/1", "n1", 0)}
    with pytest.raises(Conflict):
        jobcommits.prepare("n1", pods)(base)  # GPU 0 is held: neither pod is added
    ok = {"train/0": alloc("train/0", "n1", 1), "train/1": alloc("train/1", "n1", 2)}
    after = jobcommits.prepare("n1", ok)(base)
    assert after is not None and sorted(after.allocations) == ["other", "train/0", "train/1"]
    assert jobcommits.prepare("n1", ok)(after) is None  # a retried write that had landed


def test_roll_back_and_forward_touch_only_their_epoch() -> None:
    record = NodeAllocations(
        node="n1",
        allocations={
            "train/0": alloc("train/0", "n1", 0, epoch=1),
            "train/1": alloc("train/1", "n1", 1, epoch=2),
            "train/2": alloc("train/2", "n1", 2, epoch=1, state="assigned"),
        },
    )
    back = jobcommits.roll_back("train", 1)(record)
    assert back is not None and sorted(back.allocations) == ["train/1", "train/2"]
    fwd = jobcommits.roll_forward("train", 2)(record)
    assert fwd is not None and fwd.allocations["train/1"].state == "assigned"
    assert fwd.allocations["train/0"].state == "prepared"


# -- two replicas, random interleavings, crashes --------------------------------------------------

NODES = ("n1", "n2", "n3")
PLAN = {"train/0": ("n1", 0), "train/1": ("n2", 0), "train/2": ("n3", 0)}  # three pods, three nodes


class World:
    """The records, an in-memory stand-in for the KV buckets (each mutation is one CAS)."""

    def __init__(self) -> None:
        self.job: JobRecord | None = None
        self.nodes: dict[str, NodeAllocations | None] = dict.fromkeys(NODES)

    def write_job(self, mutate: jobcommits.Mutation[JobRecord]) -> None:
        out = mutate(self.job)
        if out is not None:
            self.job = out

    def write_node(self, node: str, mutate: jobcommits.Mutation[NodeAllocations]) -> None:
        out = mutate(self.nodes[node])
        if out is not None:
            self.nodes[node] = out

    def pods(self) -> dict[str, AllocRecord]:
        return {rid: r for rec in self.nodes.values() if rec for rid, r in rec.allocations.items()}


class Replica:
    """One replica's attempt as a sequence of steps (services/allocator/jobplacement.py, _attempt)."""

    def __init__(self, world: World, name: str) -> None:
        self.world, self.name = world, name
        self.epoch = 0
        self.step = 0  # 0 begin, 1..3 prepare node i, 4 commit, 5..7 roll forward, 8 done
        self.dead = False
        self.done = False

    def advance(self, now: float) -> None:
        w = self.world
        try:
            if self.step == 0:
                mutate, got = jobcommits.begin(
                    JOB, nodes=list(NODES), instance=self.name, now=now, claim_timeout=5.0
                )
                try:
                    w.write_job(mutate)
                except jobcommits.Superseded as stale:
                    self._abort(int(str(stale)))
                    return  # begins again next time
                self.epoch = got[0]
            elif 1 <= self.step <= 3:
                node = NODES[self.step - 1]
                rid = next(r for r, (n, _) in PLAN.items() if n == node)
                w.write_node(
                    node, jobcommits.prepare(node, {rid: alloc(rid, node, PLAN[rid][1], epoch=self.epoch)})
                )
            elif self.step == 4:
                w.write_job(jobcommits.commit(self.epoch, placement=list(NODES)))
            elif 5 <= self.step <= 7:
                w.write_node(NODES[self.step - 5], jobcommits.roll_forward("train", self.epoch))
            self.step += 1
            self.done = self.step == 8
        except (Conflict, jobcommits.Superseded):
            self._abort(self.epoch)
            self.step = 0
        except (AlreadyDone, Retry):
            self.done = True  # committed by someone, or someone else's live attempt: stop here

    def _abort(self, epoch: int) -> None:
        try:
            self.world.write_job(jobcommits.abort(epoch, reason="x"))
        except AlreadyDone:
            return
        for node in NODES:
            self.world.write_node(node, jobcommits.roll_back("train", epoch))


def sweep(world: World, now: float) -> None:
    """jobs.Jobs.sweep on the fresh records."""
    job = world.job
    for rec in list(world.pods().values()):
        if rec.state != "prepared":
            continue
        node = rec.assignment.node
        if job is not None and job.epoch == rec.epoch and job.state == "committed":
            world.write_node(node, jobcommits.roll_forward("train", rec.epoch))
        elif job is not None and job.epoch == rec.epoch and job.state == "committing":
            if jobcommits.stale(job, now=now, claim_timeout=5.0):
                try:
                    world.write_job(jobcommits.abort(rec.epoch, reason="abandoned"))
                except AlreadyDone:
                    continue
                for n in NODES:
                    world.write_node(n, jobcommits.roll_back("train", rec.epoch))
        else:
            world.write_node(node, jobcommits.roll_back("train", rec.epoch))


def check(world: World) -> None:
    pods = world.pods()
    job = world.job
    assigned = {rid: r for rid, r in pods.items() if r.state == "assigned"}
    # A pod is handed out (assigned) only by a committed epoch, and only that epoch's pods.
    for r in assigned.values():
        assert job is not None and job.state == "committed" and r.epoch == job.epoch
    # A committed job holds every one of its pods (prepared or assigned), all of its epoch.
    if job is not None and job.state == "committed":
        assert sorted(pods) == sorted(PLAN) and {r.epoch for r in pods.values()} == {job.epoch}
    # Prepared pods live only while their epoch is committing or committed.
    for r in pods.values():
        if r.state == "prepared":
            assert job is not None and r.epoch <= job.epoch
    # Never a device twice.
    for rec in world.nodes.values():
        if rec is not None:
            devices = [d for r in rec.allocations.values() for d in r.assignment.device_ids()]
            assert len(devices) == len(set(devices))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "sweep", "kill-a", "tick"]), st.integers(0, 3)), max_size=60
    )
)
def test_two_replicas_with_crashes_never_hand_out_a_partial_job(steps: list[tuple[str, int]]) -> None:
    world = World()
    replicas = {"a": Replica(world, "a"), "b": Replica(world, "b")}
    now = 100.0
    for what, _ in steps:
        if what == "tick":
            now += 3.0
        elif what == "kill-a":
            replicas["a"].dead = True
        elif what == "sweep":
            sweep(world, now)
        else:
            r = replicas[what]
            if not r.dead and not r.done:
                r.advance(now)
        check(world)
    # Afterwards: time passes (the dead replica's attempt goes stale), sweeps run, and the live
    # replica tries again until it is done: the job ends placed whole, exactly once.
    survivor = replicas["b"]
    for _ in range(10):
        now += 3.0
        sweep(world, now)
        check(world)
        if world.job is not None and world.job.state == "committed":
            break
        survivor.done, survivor.step = False, 0
        for _ in range(20):  # an attempt takes no time compared with claim_timeout
            if survivor.done:
                break
            survivor.advance(now)
            check(world)
    assert world.job is not None and world.job.state == "committed"
    pods = world.pods()
    assert sorted(pods) == sorted(PLAN)
    assert all(r.state == "assigned" and r.epoch == world.job.epoch for r in pods.values())
