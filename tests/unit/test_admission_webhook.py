"""The admission webhook over real HTTPS with real AdmissionReview v1 JSON.

A self-signed certificate is generated per module; the client trusts exactly that certificate,
so the TLS path is the one kube-apiserver takes (caBundle = the serving cert's CA). Every
accepted pod is patched with ``jsonpatch`` and validated against the Kubernetes OpenAPI schema
(``kubernetes-validate --strict``), so a patch the API server would reject fails here.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import kubernetes_validate
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from schemas.config import DeviceClass
from services.admission import names
from services.admission.webhook import MAX_BODY, CertReloader, Webhook, start_server
from services.runtime.observe.tracing import setup_tracing
from tests.unit.test_admission_helpers import deployment_pod, review, write_self_signed

K8S_VERSION = kubernetes_validate.latest_version()
CLASSES = {
    "default": DeviceClass(),
    "h100-ib": DeviceClass(
        gpu_models=["H100"], nic_link_type="infiniband", scope="pcie-root", policy="required"
    ),
}


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    setup_tracing("test-admission", exporter=exporter)
    return exporter


@pytest.fixture(scope="module")
async def endpoint(
    tmp_path_factory: pytest.TempPathFactory, spans: InMemorySpanExporter
) -> AsyncIterator[tuple[str, ssl.SSLContext]]:
    cert, key = write_self_signed(tmp_path_factory.mktemp("tls"))
    reloader = CertReloader(cert_file=str(cert), key_file=str(key))
    server = await start_server(
        Webhook(device_classes=CLASSES), host="127.0.0.1", port=0, ssl_context=reloader.context
    )
    client_ctx = ssl.create_default_context(cafile=str(cert))
    yield f"https://127.0.0.1:{server.port}", client_ctx
    await server.close()


async def post(
    endpoint: tuple[str, ssl.SSLContext], body: Any, *, raw: bytes | None = None
) -> tuple[int, Any]:
    url, ctx = endpoint
    data = raw if raw is not None else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{url}/mutate", data=data, headers={"Content-Type": "application/json"}, ssl=ctx
        ) as resp,
    ):
        return resp.status, await resp.json()


def apply_patch(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    patched: dict[str, Any] = jsonpatch.apply_patch(copy.deepcopy(pod), ops)
    return patched


def validate(pod: dict[str, Any]) -> None:
    # kube-apiserver fills metadata.name from generateName before validation; do the same.
    pod = copy.deepcopy(pod)
    pod["metadata"].setdefault("name", pod["metadata"].get("generateName", "p") + "x1z2q")
    try:
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"patched pod is not a valid v1 Pod: {exc.message} at {list(exc.path)}")


async def test_deployment_pod_without_name_or_uid_is_gated_labelled_and_defaulted(
    endpoint: tuple[str, ssl.SSLContext], spans: InMemorySpanExporter
) -> None:
    pod = deployment_pod(gpu="4", rdma="4", annotations={names.DEVICE_CLASS: "h100-ib"})
    assert "name" not in pod["metadata"] and "uid" not in pod["metadata"]
    spans.clear()
    status, body = await post(endpoint, review(pod, uid="rev-1"))

    assert status == 200
    resp = body["response"]
    assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
    assert resp["uid"] == "rev-1" and resp["allowed"] is True
    patched = apply_patch(pod, resp)
    ann = patched["metadata"]["annotations"]
    assert ann[names.DEVICE_CLASS] == "h100-ib"
    assert ann[names.SCOPE] == "pcie-root"  # the class's default
    assert ann[names.POLICY] == "required"
    assert ann[names.PAIRING] == "per-gpu"  # 4 GPUs with 4 NICs
    assert ann[names.PRIORITY] == "0"
    assert patched["metadata"]["labels"] == {
        "app": "trainer",
        "pod-template-hash": "7d9f8b6c5d",
        names.MANAGED: "true",
    }
    assert patched["spec"]["schedulingGates"] == [{"name": names.GATE}]
    validate(patched)

    # The annotation carries the admission.admit span's context: the allocation's trace root.
    version, trace_id, span_id, _flags = ann[names.TRACEPARENT].split("-")
    (span,) = [s for s in spans.get_finished_spans() if s.name == "admission.admit"]
    assert version == "00"
    assert (trace_id, span_id) == (
        format(span.context.trace_id, "032x"),
        format(span.context.span_id, "016x"),
    )
    assert span.attributes is not None
    assert span.attributes["k8s.namespace.name"] == "ml"
    assert span.attributes["k8s.pod.name"] == "trainer-7d9f8b6c5d-*"
    assert span.attributes["tandem.gpus"] == 4


async def test_pod_without_tandem_resources_passes_untouched(
    endpoint: tuple[str, ssl.SSLContext], spans: InMemorySpanExporter
) -> None:
    pod = deployment_pod(gpu=None, rdma=None)
    spans.clear()
    status, body = await post(endpoint, review(pod, uid="rev-2"))
    assert status == 200
    assert body["response"] == {"uid": "rev-2", "allowed": True}
    assert spans.get_finished_spans() == ()


async def test_existing_gates_annotations_and_stale_assignment(endpoint: tuple[str, ssl.SSLContext]) -> None:
    pod = deployment_pod(
        gpu="2",
        rdma="1",
        annotations={
            names.SCOPE: "numa",
            names.ASSIGNMENT: '{"node":"old-node"}',
            "example.com/owner": "team-a",
        },
        schedulingGates=[{"name": "example.com/quota"}],
    )
    _, body = await post(endpoint, review(pod))
    resp = body["response"]
    assert resp["allowed"] is True
    patched = apply_patch(pod, resp)
    ann = patched["metadata"]["annotations"]
    assert ann[names.SCOPE] == "numa"  # the author's choice is kept
    assert ann[names.PAIRING] == "shared"  # 2 GPUs, 1 NIC
    assert ann["example.com/owner"] == "team-a"
    assert names.ASSIGNMENT not in ann
    assert any(names.ASSIGNMENT in w for w in resp["warnings"])
    assert patched["spec"]["schedulingGates"] == [{"name": "example.com/quota"}, {"name": names.GATE}]
    ops = json.loads(base64.b64decode(resp["patch"]))
    assert {"op": "add", "path": "/metadata/annotations/tandem.io~1pairing", "value": "shared"} in ops
    validate(patched)


async def test_sidecar_init_container_adds_and_network_annotations_are_accepted(
    endpoint: tuple[str, ssl.SSLContext],
) -> None:
    pod = deployment_pod(
        gpu="1",
        rdma="1",
        annotations={
            names.NETWORK_IFNAME_PREFIX: "ib",
            names.NETWORK_MTU: "4096",
            names.NETWORK_ADDRESSES: "10.10.0.5/24, fd00::5/64",
        },
        initContainers=[
            {
                "name": "nccl-proxy",
                "image": "busybox",
                "restartPolicy": "Always",
                "resources": {"limits": {"tandem.io/gpu": "1", "tandem.io/rdma": "1"}},
            }
        ],
    )
    _, body = await post(endpoint, review(pod))
    assert body["response"]["allowed"] is True, body
    patched = apply_patch(pod, body["response"])
    assert patched["metadata"]["annotations"][names.PAIRING] == "per-gpu"
    validate(patched)


DENY_CASES: list[tuple[str, dict[str, Any], str]] = [
    (
        "unknown device class",
        deployment_pod(annotations={names.DEVICE_CLASS: "a100-roce"}),
        "unknown device class 'a100-roce' (known: default, h100-ib)",
    ),
    (
        "unknown scope",
        deployment_pod(annotations={names.SCOPE: "rack"}),
        "tandem.io/scope: 'rack' is not one of pcie-switch, pcie-root, numa, socket, node",
    ),
    ("fractional count", deployment_pod(gpu="1.5"), "'1.5' is not a whole number"),
    ("milli count", deployment_pod(gpu="500m", rdma=None), "'500m' is not a whole number"),
    ("word count", deployment_pod(rdma="four"), "limits[tandem.io/rdma]: 'four' is not a whole number"),
    ("negative count", deployment_pod(gpu="-2"), "'-2' is negative"),
    ("too many", deployment_pod(gpu="65", rdma=None), "65 is more than the 64 devices"),
    (
        "requests differ from limits",
        deployment_pod(requests={"tandem.io/gpu": "2"}),
        "requests[tandem.io/gpu]=2 differs from limits[tandem.io/gpu]=4",
    ),
    ("nodeName set", deployment_pod(nodeName="gpu-node-7"), "spec.nodeName is already set to 'gpu-node-7'"),
    (
        "init container asks more than the pod",
        deployment_pod(
            gpu="2",
            rdma="2",
            initContainers=[
                {"name": "warmup", "image": "busybox", "resources": {"limits": {"tandem.io/gpu": "8"}}}
            ],
        ),
        "init container 'warmup' asks for 8 tandem.io/gpu but the pod's containers ask for 2 in total",
    ),
    (
        "per-gpu pairing with fewer NICs",
        deployment_pod(gpu="4", rdma="2", annotations={names.PAIRING: "per-gpu"}),
        "needs as many tandem.io/rdma as tandem.io/gpu (asked 2 and 4)",
    ),
    (
        "network annotation without NICs",
        deployment_pod(gpu="2", rdma=None, annotations={names.NETWORK_MTU: "9000"}),
        "shape RDMA netdevs, but the pod asks for no tandem.io/rdma",
    ),
    (
        "bad address",
        deployment_pod(annotations={names.NETWORK_ADDRESSES: "10.0.0.300/24"}),
        "'10.0.0.300/24' is not an address with a prefix length",
    ),
]


@pytest.mark.parametrize(("pod", "expected"), [c[1:] for c in DENY_CASES], ids=[c[0] for c in DENY_CASES])
async def test_invalid_requests_are_denied_with_a_message_for_the_author(
    endpoint: tuple[str, ssl.SSLContext], pod: dict[str, Any], expected: str
) -> None:
    status, body = await post(endpoint, review(pod, uid="rev-deny"))
    assert status == 200
    resp = body["response"]
    assert resp["uid"] == "rev-deny"
    assert resp["allowed"] is False
    assert "patch" not in resp
    assert resp["status"]["code"] == 403
    assert resp["status"]["message"].startswith("tandem: pod trainer-7d9f8b6c5d-*: ")
    assert expected in resp["status"]["message"]


async def test_unreadable_pod_object_is_denied_naming_the_field(endpoint: tuple[str, ssl.SSLContext]) -> None:
    pod = deployment_pod()
    pod["spec"]["containers"][0]["resources"] = "lots"
    _, body = await post(endpoint, review(pod))
    resp = body["response"]
    assert resp["allowed"] is False and resp["status"]["code"] == 400
    assert "$.spec.containers[0].resources" in resp["status"]["message"]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"{not json", "body is not JSON"),
        (b"[1, 2]", "Expected `object`, got `array`"),
        (
            json.dumps({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}).encode(),
            "v1beta1",
        ),
        (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}).encode(), "no request"),
        (
            json.dumps(
                {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}
            ).encode(),
            "request has no uid",
        ),
    ],
    ids=["not-json", "not-object", "wrong-version", "no-request", "no-uid"],
)
async def test_malformed_body_is_a_400_with_the_reason(
    endpoint: tuple[str, ssl.SSLContext], raw: bytes, expected: str
) -> None:
    status, body = await post(endpoint, None, raw=raw)
    assert status == 400
    assert expected in body["error"]


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def with_request(**fields: Any) -> bytes:
    doc = review(deployment_pod())
    doc["request"].update(fields)
    return json.dumps(doc).encode()


HOSTILE = [
    ("kind-as-string", with_request(kind="Pod"), "Expected `object | null`, got `str` - at `$.request.kind`"),
    ("uid-not-string", with_request(uid=7), "Expected `str`, got `int` - at `$.request.uid`"),
    ("deep-list", nested(100_000), "JSON nests 100000 levels deep; the limit is 64"),
    (
        "deep-in-pod",  # review > request > object > spec > containers > [0] > resources > limits
        json.dumps(review(deployment_pod())).encode().replace(b'"cpu": "8"', b'"cpu": ' + nested(5_000)),
        "JSON nests 5008 levels deep",
    ),
    ("not-utf8", b"\xff\xfe{}", "body is not JSON"),
]


@pytest.mark.parametrize(("raw", "expected"), [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
async def test_hostile_bodies_get_400_with_the_reason_never_500(
    endpoint: tuple[str, ssl.SSLContext], raw: bytes, expected: str
) -> None:
    """Issue 9 finding 10: the first four were 500s (AttributeError, RecursionError)."""
    status, body = await post(endpoint, None, raw=raw)
    assert status == 400
    assert expected in body["error"]


async def test_brackets_inside_strings_do_not_count_towards_the_depth(
    endpoint: tuple[str, ssl.SSLContext],
) -> None:
    pod = deployment_pod(annotations={names.SCOPE: "[{" * 200 + '\\"' + "[" * 200})
    status, body = await post(endpoint, review(pod, uid="rev-brackets"))
    assert status == 200
    resp = body["response"]
    assert resp["uid"] == "rev-brackets" and resp["allowed"] is False
    assert "is not one of" in resp["status"]["message"]  # judged as a pod, not refused as too deep


async def test_body_over_the_size_limit_is_refused_before_it_is_read(
    endpoint: tuple[str, ssl.SSLContext],
) -> None:
    status, body = await post(endpoint, None, raw=b" " * (MAX_BODY + 1))
    assert status == 413
    assert body["error"] == f"tandem: body is {MAX_BODY + 1} bytes; the limit is {MAX_BODY}"


async def test_update_and_other_kinds_are_allowed_untouched(endpoint: tuple[str, ssl.SSLContext]) -> None:
    _, body = await post(endpoint, review(deployment_pod(nodeName="n1"), operation="UPDATE"))
    assert body["response"] == {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "allowed": True}


async def test_health_endpoint_over_tls(endpoint: tuple[str, ssl.SSLContext]) -> None:
    url, ctx = endpoint
    async with aiohttp.ClientSession() as session, session.get(f"{url}/healthz", ssl=ctx) as resp:
        assert resp.status == 200 and await resp.text() == "ok"


async def test_untrusted_client_cannot_talk_plain_http(endpoint: tuple[str, ssl.SSLContext]) -> None:
    url, _ = endpoint
    with pytest.raises(aiohttp.ClientError):
        async with aiohttp.ClientSession() as session:
            await session.post(url.replace("https", "http") + "/mutate", data=b"{}")


def test_certificate_reload_picks_up_rotated_files(tmp_path: Path) -> None:
    cert, key = write_self_signed(tmp_path)
    reloader = CertReloader(cert_file=str(cert), key_file=str(key))
    assert reloader.reload() is False  # unchanged

    write_self_signed(tmp_path)
    st = cert.stat()
    os.utime(cert, (st.st_atime, st.st_mtime + 5))
    assert reloader.reload() is True
