"""Recognising a job's pods and turning them into one job request (services/admission/jobwatch.py)."""

from __future__ import annotations

import uuid
from typing import Any

import jsonpatch
import pytest

from schemas.config import DeviceClass
from services.admission import jobwatch, podrules
from services.admission.errors import PolicyError
from tests.unit.test_admission_helpers import deployment_pod

CLASSES = {"default": DeviceClass()}


def job_pod(
    name: str, *, labels: dict[str, str], annotations: dict[str, str], gpu: str = "8", rdma: str = "8"
) -> podrules.PodView:
    raw = deployment_pod(gpu=gpu, rdma=rdma, annotations=dict(annotations))
    raw["metadata"]["labels"].update(labels)
    verdict = podrules.admit(raw, operation="CREATE", device_classes=CLASSES, traceparent=None)
    assert verdict.allowed, verdict.message
    admitted: dict[str, Any] = jsonpatch.apply_patch(raw, verdict.patch)
    admitted["metadata"].update(name=name, uid=str(uuid.uuid4()))
    return podrules.read_pod(admitted)


def tandem_pod(i: int, *, size: int = 4, **kw: Any) -> podrules.PodView:
    return job_pod(
        f"train-{i}",
        labels={jobwatch.JOB: "train"},
        annotations={jobwatch.JOB_SIZE: str(size), jobwatch.JOB_INDEX: str(i)},
        **kw,
    )


def test_tandem_lws_and_jobset_pods_are_recognised() -> None:
    m = jobwatch.membership(tandem_pod(2))
    assert m == jobwatch.Membership(group="job/train", size=4, index=2)
    lws = job_pod(
        "infer-0-1",
        labels={jobwatch.LWS_NAME: "infer", jobwatch.LWS_GROUP: "0", jobwatch.LWS_WORKER: "1"},
        annotations={jobwatch.LWS_SIZE: "4"},
    )
    assert jobwatch.membership(lws) == jobwatch.Membership(group="lws/infer/0", size=4, index=1)
    js = job_pod(
        "sim-workers-0-3",
        labels={jobwatch.JOBSET_NAME: "sim", jobwatch.COMPLETION_INDEX: "3"},
        annotations={jobwatch.JOB_SIZE: "8"},
    )
    assert jobwatch.membership(js) == jobwatch.Membership(group="jobset/sim", size=8, index=3)
    alone = job_pod("solo", labels={}, annotations={})
    assert jobwatch.membership(alone) is None


@pytest.mark.parametrize(
    ("annotations", "error"),
    [
        ({}, "has no tandem.io/job-size"),
        ({jobwatch.JOB_SIZE: "eight"}, "tandem.io/job-size: 'eight' is not a whole number"),
        ({jobwatch.JOB_SIZE: "0"}, "tandem.io/job-size: 0 is outside 1..1024"),
        ({jobwatch.JOB_SIZE: "4", jobwatch.JOB_INDEX: "4"}, "tandem.io/job-index: 4 is outside 0..3"),
    ],
)
def test_bad_job_annotations_name_the_key(annotations: dict[str, str], error: str) -> None:
    pod = job_pod("p", labels={jobwatch.JOB: "train"}, annotations=annotations)
    with pytest.raises(PolicyError, match=error):
        jobwatch.membership(pod)


def test_the_pods_make_one_job_in_index_order_with_a_stable_id() -> None:
    pods = [tandem_pod(i) for i in (3, 1, 0, 2)]
    job = jobwatch.job_request(pods, device_classes=CLASSES)
    assert job.pods == 4 and (job.gpus, job.rdma) == (8, 8)
    assert [m.name for m in job.members] == ["train-0", "train-1", "train-2", "train-3"]
    again = jobwatch.job_request(list(reversed(pods)), device_classes=CLASSES)
    assert again.job_id == job.job_id and job.job_id.startswith("train.")
    other = jobwatch.job_request([tandem_pod(i) for i in range(4)], device_classes=CLASSES)
    assert other.job_id != job.job_id  # new pods (new UIDs): a new job


def test_pods_asking_different_devices_are_not_one_job() -> None:
    pods = [tandem_pod(0), tandem_pod(1), tandem_pod(2, gpu="4", rdma="4"), tandem_pod(3)]
    with pytest.raises(PolicyError, match="must ask the same devices; train-2 differ"):
        jobwatch.job_request(pods, device_classes=CLASSES)


def test_fabric_annotations_carry_over_and_must_agree() -> None:
    pods = [
        job_pod(
            f"t-{i}",
            labels={jobwatch.JOB: "t"},
            annotations={
                jobwatch.JOB_SIZE: "2",
                jobwatch.JOB_FABRIC: "leaf",
                jobwatch.JOB_FABRIC_POLICY: "required",
            },
        )
        for i in range(2)
    ]
    job = jobwatch.job_request(pods, device_classes=CLASSES)
    assert (job.fabric, job.fabric_policy) == ("leaf", "required")
    odd = job_pod(
        "t-9", labels={jobwatch.JOB: "t"}, annotations={jobwatch.JOB_SIZE: "2", jobwatch.JOB_FABRIC: "spine"}
    )
    with pytest.raises(PolicyError, match=r"disagree on annotation tandem\.io/job-fabric"):
        jobwatch.job_request([pods[0], odd], device_classes=CLASSES)


def test_the_gatherer_completes_a_job_once_and_reports_one_still_waiting() -> None:
    g = jobwatch.Gatherer()
    pods = [tandem_pod(i, size=3) for i in range(3)]
    m = jobwatch.membership(pods[0])
    assert m is not None
    key, complete = g.add(pods[0], m, now=0.0)
    assert complete is None
    g.add(pods[1], m, now=1.0)
    assert g.waiting(now=10.0, timeout=5.0) == [("job/train", 3, pods[:2])]
    _, complete = g.add(pods[2], m, now=2.0)
    assert complete is not None and len(complete) == 3
    g.requested(key, "train.abc")
    assert g.add(pods[2], m, now=3.0)[1] is None  # requested already: not again
    assert g.job_of("train.abc") == pods
    job, rest = g.remove(pods[1])
    assert job == "train.abc" and rest == [pods[0], pods[2]]
