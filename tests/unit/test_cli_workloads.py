"""What `tandem submit` builds from its flags for a pod, a claim (a reservation) and a job, and
what it refuses before connecting (tools/cli/workloads.py); no NATS."""

from __future__ import annotations

import time

import pytest

from schemas.messages import AllocationRequest, JobRecord, JobRequest, PodRef, RequestRecord
from tools.cli.errors import CliError
from tools.cli.main import build_parser
from tools.cli.workloads import build, claims_named, job_name, jobs_named


def submission(*args: str):  # type: ignore[no-untyped-def]
    return build(build_parser().parse_args(["submit", *args]))


def test_a_pod_a_claim_and_a_reservation() -> None:
    pod = submission("--pod", "team/p", "--gpus", "2", "--rdma", "2")
    assert pod.kind == "pod" and pod.request is not None and pod.request.claim is None
    assert pod.id.endswith(".1") and pod.placed_ids == (pod.id,) and pod.watch_ids == (pod.id,)
    assert pod.headline() == f"request {pod.id} (pod team/p)"
    claim = submission("--claim", "ml/team-a", "--gpus", "4", "--rdma", "4", "--shareable")
    req = claim.request
    assert req is not None and req.claim is not None
    assert req.request_id == f"claim-{req.pod.uid}" and (req.pod.namespace, req.pod.name) == ("ml", "team-a")
    assert (req.claim.name, req.claim.shareable, req.claim.expires_at) == ("team-a", True, None)
    # Left out, scope and policy are the class's: the running system's, which the CLI does not know.
    assert (req.scope, req.policy, req.pairing) == (None, None, None)
    before = time.time()
    night = submission("--claim", "ml/night", "--gpus", "8", "--expires-after", "1h30m")
    assert night.request is not None and night.request.claim is not None
    deadline = night.request.claim.expires_at
    assert deadline is not None and before + 5400 <= deadline <= time.time() + 5400
    assert night.headline().startswith(f"request {night.id} (claim ml/night, a reservation until 20")
    at = submission("--claim", "ml/n2", "--gpus", "1", "--expires-at", "2099-01-01T00:00:00Z")
    assert at.request is not None and at.request.claim is not None
    assert at.request.claim.expires_at == 4070908800.0


def test_a_job() -> None:
    job = submission("--job", "training/ddp", "--pods", "3", "--gpus", "8", "--rdma", "8", "--fabric", "leaf",
                     "--fabric-policy", "required", "--mtu", "9000")  # fmt: skip
    j = job.job
    assert j is not None and job.kind == "job"
    assert job_name(j.job_id) == "ddp" and len(j.job_id) == len("ddp.") + 8
    assert (j.pods, j.gpus, j.rdma, j.namespace, j.fabric, j.fabric_policy) == (
        3,
        8,
        8,
        "training",
        "leaf",
        "required",
    )
    assert [m.name for m in j.members] == ["ddp-0", "ddp-1", "ddp-2"]
    assert j.network is not None and j.network.mtu == 9000
    assert job.placed_ids == (f"{j.job_id}/0", f"{j.job_id}/1", f"{j.job_id}/2")
    assert job.watch_ids == (j.job_id, f"{j.job_id}/0")
    assert job.headline() == f"job {j.job_id} (3 pods: training/ddp-0, training/ddp-1, training/ddp-2)"
    many = submission("--job", "t/w", "--pods", "12", "--gpus", "1")
    assert many.headline().endswith("(12 pods: t/w-0 … t/w-11)")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--job", "t/j", "--gpus", "1"], "--job needs --pods N"),
        (["--pods", "2", "--gpus", "1"], "--pods goes with --job"),
        (["--claim", "t/c", "--pods", "2", "--gpus", "1"], "--pods goes with --job"),
        (["--job", "t/j", "--pods", "2", "--gpus", "1", "--shareable"], "--shareable goes with --claim"),
        (["--job", "t/j", "--pods", "2", "--gpus", "1", "--mig-profile", "1g.10gb"], "whole GPUs"),
        (["--job", "t/j", "--pods", "2", "--gpus", "1", "--preemption", "never"], "never preempts"),
        (["--claim", "t/c", "--gpus", "1", "--mtu", "9000"], "--mtu does not go with --claim"),
        (["--claim", "t/c", "--gpus", "1", "--expires-after", "0s"], "must be more than 0s"),
        (["--claim", "t/c", "--gpus", "1", "--expires-at", "2099-01-01T00:00:00"], "has no time zone"),
        (["--claim", "t/C", "--gpus", "1"], "is not a Kubernetes DeviceClaim name"),
        (["--job", "T/j", "--pods", "1", "--gpus", "1"], "is not a Kubernetes namespace name"),
        (["--job", "t/j", "--pods", "1", "--gpus", "65"], "invalid request"),
        # The wire's bounds name the flag; the request resolver's rules (services.request.check)
        # too, for a pod, a claim and each pod of a job alike.
        (["--gpus", "65"], "invalid request: --gpus: Expected `int` <= 64"),
        (["--gpus", "1", "--mtu", "5"], "invalid request: --mtu: "),
        (["--gpus", "2", "--rdma", "1", "--pairing", "per-gpu"], "--pairing: per-gpu gives every GPU"),
        (["--gpus", "0"], "--gpus and --rdma are both 0"),
        (
            ["--claim", "t/c", "--gpus", "1", "--mig-profile", "1g.10gb", "--gpu-cores-percent", "5"],
            "--mig-profile and --gpu-cores-percent: a MIG instance is not shared",
        ),
        (
            ["--job", "t/j", "--pods", "2", "--gpus", "2", "--rdma", "1", "--pairing", "per-gpu"],
            "as many --rdma as --gpus",
        ),
    ],
)
def test_refused_before_connecting(args: list[str], said: str) -> None:
    with pytest.raises(CliError, match=said.replace("(", r"\(")):
        submission(*args)


def test_the_class_is_the_allocators_to_judge() -> None:
    """The CLI does not know the running system's classes: an unknown class, or shares of a
    class that may not share, go out as asked (the allocator answers `rejected: ...`)."""
    odd = submission("--gpus", "1", "--device-class", "nosuch", "--gpu-memory-mib", "4096")
    assert odd.request is not None and odd.request.device_class == "nosuch"
    assert (odd.request.scope, odd.request.pairing, odd.request.preemption) == (None, None, None)


def test_found_again_by_name() -> None:
    def claim(uid: str, name: str, created: float) -> RequestRecord:
        req = AllocationRequest(
            request_id=f"claim-{uid}", pod=PodRef("ml", name, uid), gpus=1, created_at=created,
            claim=None if name == "pod" else {"name": name},  # type: ignore[arg-type]
        )  # fmt: skip
        return RequestRecord(request=req, state="assigned")

    import msgspec

    records = {
        r.request.request_id: msgspec.convert(msgspec.to_builtins(r), RequestRecord)
        for r in (claim("a", "x", 1.0), claim("b", "x", 2.0), claim("c", "pod", 3.0))
    }
    assert [r.request.request_id for r in claims_named(records, PodRef("ml", "x"))] == ["claim-b", "claim-a"]
    assert claims_named(records, PodRef("ml", "pod")) == []  # a pod's request, not a claim's
    jobs = {
        jid: JobRecord(
            job=JobRequest(job_id=jid, pods=1, gpus=1, namespace=ns, created_at=t), state="pending"
        )
        for jid, ns, t in (("ddp.0000aaaa", "t", 1.0), ("ddp.0000bbbb", "t", 2.0), ("ddp.0000cccc", "u", 3.0))
    }
    assert [r.job.job_id for r in jobs_named(jobs, PodRef("t", "ddp"))] == ["ddp.0000bbbb", "ddp.0000aaaa"]
    assert job_name("allreduce.3f2a9c1d0e8b7a65") == "allreduce"
