"""Hypothesis fuzzing of the admission webhook's body handling (issue 9 finding 10).

``Webhook.answer`` is exactly what ``POST /mutate`` returns for a body (the HTTP tests in
tests/unit/test_admission_webhook.py show the wiring), so fuzzing it sync covers the parsing,
the typed decoding and the policy without a server per example. The property: whatever the
body, the answer is 200 with a response for the request's uid, or 400 with a reason — never an
exception (a 500).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.config import DeviceClass
from services.admission.webhook import MAX_DEPTH, Webhook, json_depth
from tests.unit.test_admission_helpers import deployment_pod, review

WEBHOOK = Webhook(device_classes={"default": DeviceClass()})
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)


def depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


def check(body: bytes) -> tuple[int, dict[str, Any]]:
    status, doc = WEBHOOK.answer(body)  # raising here is what a 500 was
    json.dumps(doc)  # and the answer can be sent
    assert status in (200, 400), (status, doc)
    if status == 400:
        assert doc["error"].startswith("tandem: ") and len(doc["error"]) > len("tandem: ")
    else:
        assert doc["apiVersion"] == "admission.k8s.io/v1" and doc["kind"] == "AdmissionReview"
        assert isinstance(doc["response"]["allowed"], bool)
    return status, doc


@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_fail(body: bytes) -> None:
    check(body)


@FUZZ
@given(json_values)
def test_arbitrary_json_never_fails(value: Any) -> None:
    status, _ = check(json.dumps(value).encode())
    assert status == 400  # nothing random is an AdmissionReview with a request uid


@FUZZ
@given(request=json_values, api_version=st.sampled_from(["admission.k8s.io/v1"]) | json_values)
def test_envelope_with_arbitrary_request_never_fails(request: Any, api_version: Any) -> None:
    check(json.dumps({"apiVersion": api_version, "kind": "AdmissionReview", "request": request}).encode())


REQUEST_FIELDS = ["uid", "kind", "operation", "subResource", "namespace", "object", "name", "dryRun"]


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(REQUEST_FIELDS), json_values, max_size=4))
def test_request_fields_of_any_type_never_fail(fields: dict[str, Any]) -> None:
    doc = review(deployment_pod())
    doc["request"].update(fields)
    status, answer = check(json.dumps(doc).encode())
    if status == 200:
        assert answer["response"]["uid"] == doc["request"]["uid"]


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


POD = deployment_pod(annotations={"tandem.io/scope": "numa"})
POD_PATHS = paths(POD)[1:]


@FUZZ
@given(where=st.sampled_from(POD_PATHS), value=json_values)
def test_a_tandem_pod_with_any_field_replaced_never_fails(where: tuple[Any, ...], value: Any) -> None:
    pod = copy.deepcopy(POD)
    target = pod
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    status, answer = check(json.dumps(review(pod, uid="fuzz")).encode())
    assert status == 200 and answer["response"]["uid"] == "fuzz"  # a pod verdict, not a 400


@FUZZ
@given(json_values)
def test_json_depth_is_the_nesting_depth(value: Any) -> None:
    assert json_depth(json.dumps(value).encode()) == depth(value)


@pytest.mark.parametrize("levels", [MAX_DEPTH, MAX_DEPTH + 1])
def test_the_depth_limit_is_exact(levels: int) -> None:
    doc = review(deployment_pod())
    doc["request"]["object"]["metadata"]["annotations"] = {"x": "y"}
    inner: Any = 1
    for _ in range(levels - 6):  # review > request > object > spec > containers > [0] > ...
        inner = [inner]
    doc["request"]["object"]["spec"]["containers"][0]["extra"] = inner
    body = json.dumps(doc).encode()
    assert json_depth(body) == levels
    status, answer = check(body)
    assert (status == 400) == (levels > MAX_DEPTH), answer
