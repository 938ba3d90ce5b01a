"""A whole job's pods through DRA claims, placed all or nothing, against the real control plane
(issue "Tandem speaks DRA", item 3: "a whole job's claims ... keep their meaning"; docs/dra.md,
"Jobs").

Two pods of a job (``tandem.io/job`` + ``tandem.io/job-size``, or the labels a LeaderWorkerSet
group's or a JobSet's pods carry), each with a claim made by
the real resourceclaim controller from a ResourceClaimTemplate of Tandem's classes: while only
one exists nothing is requested or held (its claim carries no request, no job record exists);
once both exist the job is requested once and committed by the allocator, each pod's claim gets
its allocation on the node Tandem chose for that pod (under the pod's id ``JOB/i``), and the
real kube-scheduler binds each pod there. Deleting the pods deletes the claims, which Tandem
holds until the node agents' verified cleanup freed each pod's devices.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from schemas.messages import JobRecord
from services.admission import jobwatch, names
from tests.cluster.release import Release, eventually
from tests.cluster.test_dra_bridge import claims_in, own_namespace, template
from tests.cluster.test_dra_classes import claim_pod
from tests.cluster.test_pod_life import pod_of

TEMPLATES = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates"


@pytest.fixture
def ns(release: Release) -> Iterator[str]:
    yield from own_namespace(release)


# How a job's pods say so: Tandem's own labels, and what the LeaderWorkerSet and JobSet
# controllers put on the pods they make (written here by hand: those controllers are not
# installed; services/admission/jobwatch.py reads the same labels from them).
STYLES = {
    "tandem": lambda i: (
        {jobwatch.JOB: "allreduce"},
        {jobwatch.JOB_SIZE: "2", jobwatch.JOB_INDEX: str(i)},
    ),
    "leaderworkerset": lambda i: (
        {jobwatch.LWS_NAME: "allreduce", jobwatch.LWS_GROUP: "0", jobwatch.LWS_WORKER: str(i)},
        {jobwatch.LWS_SIZE: "2"},
    ),
    "jobset": lambda i: (
        {jobwatch.JOBSET_NAME: "allreduce", jobwatch.COMPLETION_INDEX: str(i)},
        {jobwatch.JOB_SIZE: "2"},
    ),
}


def worker(index: int, style: str = "tandem") -> dict[str, Any]:
    pod = claim_pod(f"worker-{index}", "pairs")
    pod["metadata"]["labels"], pod["metadata"]["annotations"] = STYLES[style](index)
    return pod


def jobs_in(release: Release, ns: str) -> list[JobRecord]:
    return [r for r in release._read(lambda c: c.job_records()).values() if r.job.namespace == ns]


def claim_of(release: Release, ns: str, pod: str) -> dict[str, Any]:
    uid = pod_of(release.cp, ns, pod)["metadata"]["uid"]
    (claim,) = [
        c for c in claims_in(release.cp, ns) if any(o["uid"] == uid for o in c["metadata"]["ownerReferences"])
    ]
    return claim


@pytest.mark.parametrize("style", sorted(STYLES))
def test_a_jobs_pods_through_claims_are_placed_all_or_nothing(release: Release, ns: str, style: str) -> None:
    cp = release.cp
    cp.request("POST", TEMPLATES.format(ns=ns), template("pairs", gpus=2, nics=2))
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", worker(0, style))
    eventually(lambda: claims_in(cp, ns), what="worker-0's claim made by the resourceclaim controller")
    eventually(
        lambda: release.logged("admission", "dra_job_waiting", namespace=ns, pod="worker-0", size=2),
        what="the bridge judging worker-0 with its claim: its job waits for worker-1",
    )
    (alone,) = claims_in(cp, ns)
    assert names.DRA_REQUEST not in (alone["metadata"].get("annotations") or {})  # nothing held
    assert "allocation" not in (alone.get("status") or {})
    assert {"name": names.GATE} in pod_of(cp, ns, "worker-0")["spec"]["schedulingGates"]
    assert jobs_in(release, ns) == [] and release.live_requests_in(ns) == []  # nothing requested

    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", worker(1, style))
    try:
        nodes = [
            eventually(
                lambda i=i: pod_of(cp, ns, f"worker-{i}")["spec"].get("nodeName"), what=f"worker-{i} bound"
            )
            for i in (0, 1)
        ]
    except BaseException:
        print(release.logs(), claims_in(cp, ns))
        raise
    (record,) = jobs_in(release, ns)  # one job, requested once, no pod's own request
    assert record.state == "committed" and record.placement == nodes, record
    assert [m.name for m in record.job.members] == ["worker-0", "worker-1"]
    assert (record.job.gpus, record.job.rdma) == (2, 2) and release.live_requests_in(ns) == []
    for i, node in enumerate(nodes):
        claim = claim_of(release, ns, f"worker-{i}")
        assert claim["metadata"]["annotations"][names.DRA_REQUEST] == record.job.pod_id(i)
        assert names.DRA_FINALIZER in claim["metadata"]["finalizers"]
        results = claim["status"]["allocation"]["devices"]["results"]
        assert len(results) == 4 and {(r["driver"], r["pool"]) for r in results} == {("tandem.io", node)}
        assert [r["name"] for r in claim["status"]["reservedFor"]] == [f"worker-{i}"]
        held = release._read(lambda c, i=i: c.holder(record.job.pod_id(i)))
        assert held is not None and held[0] == node
        devices = {r["device"] for r in results}
        assert len(devices) == 4  # the pod's own devices, as the node's record holds them
        assert len(held[1].assignment.device_ids()) == 4

    for i in (0, 1):
        cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/worker-{i}")
    eventually(lambda: not claims_in(cp, ns), timeout=90, what="the claims gone once their devices are clean")
    for i in (0, 1):
        assert release._read(lambda c, i=i: c.holder(record.job.pod_id(i))) is None  # freed
