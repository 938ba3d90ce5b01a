"""The mutating admission webhook: aiohttp over TLS, ``admission.k8s.io/v1`` AdmissionReview.

``POST /mutate`` takes an AdmissionReview, judges the pod with :func:`podrules.admit` and answers
with a JSONPatch (gate, managed label, class defaults, ``tandem.io/traceparent``) or a denial
whose message names what to fix. Pods that ask no Tandem resources are allowed untouched and
cost no span. For a Tandem pod the span ``admission.admit`` is started here (as a child of a
``tandem.io/traceparent`` the author may already have set) and its context is written to the
annotation, so the bridge, allocator and node agent all join this one trace.

A body that is not an AdmissionReview v1 request gets HTTP 400 with a one-line reason: without
a request uid there is nothing to answer. The body is hostile until checked, in this order:
its size (over :data:`MAX_BODY` → 413, before it is read to the end), its nesting depth (over
:data:`MAX_DEPTH` → 400, counted on the bytes by :func:`json_depth` before any parser
recurses), then msgspec decodes it into the typed :class:`AdmissionReview` — a field of the
wrong type (``request.kind`` as a string, say) is a 400 that names its path. The certificate
files are re-read when they change (cert-manager rotates them in place), without a restart.

The webhook publishes nothing: a pod being admitted may have no name or UID yet (generateName)
and its create can still fail; the bridge acts once the pod is persisted.

A pod with DRA ``spec.resourceClaims`` is judged by :func:`drapods.admit` on what the webhook can
read (with ``dra_claims``, a :class:`ClaimReader`): the ResourceClaims it names and the
ResourceClaimTemplates its claims will be made from, read before the pure verdict.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import ssl
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from aiohttp import web

from schemas.config import DeviceClass
from services.admission import drapods, metrics, names, podrules
from services.admission.errors import BodyTooLarge, InvalidPod, ReviewError
from services.kube.errors import KubeError, NotFound
from services.runtime.observe.logging import get_logger
from services.runtime.observe.tracing import context_from_traceparent, current_traceparent, tracer

log = get_logger(__name__)

API_VERSION = "admission.k8s.io/v1"
MAX_BODY = 8 * 1024 * 1024  # an AdmissionReview holds the object (etcd caps it at 1.5 MiB) and more
# Real pods nest ~20 levels deep in a review (managedFields' fieldsV1 are the deepest); Python's
# JSON parsers (json, msgspec) raise RecursionError near 1,000.
MAX_DEPTH = 64
MUTATE_PATH = "/mutate"
HEALTH_PATH = "/healthz"


class GroupVersionKind(msgspec.Struct, frozen=True):
    group: str = ""
    version: str = ""
    kind: str = ""


class AdmissionRequest(msgspec.Struct, frozen=True, rename="camel"):
    """The fields of an AdmissionReview v1 ``request`` the webhook reads (others are ignored)."""

    uid: str = ""
    kind: GroupVersionKind | None = None
    operation: str = ""
    sub_resource: str | None = None
    namespace: str | None = None
    object: Any = None  # the pod (podrules.read_pod checks it); any JSON for kinds we pass


class AdmissionReview(msgspec.Struct, frozen=True, rename="camel"):
    api_version: str = ""
    kind: str = ""
    request: AdmissionRequest | None = None


_REVIEW = msgspec.json.Decoder(AdmissionReview)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP = [0] * 256
for _c in b"[{":
    _STEP[_c] = 1
for _c in b"]}":
    _STEP[_c] = -1


def json_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in a JSON text, found without parsing it (no
    recursion, linear time): escaped backslashes and quotes are dropped, then whatever lies
    between the remaining quotes (the strings), and the brackets left are counted. For a text
    that is not JSON the answer bounds what a parser would reach before failing, which is all a
    limit needs. Linear in the body, which the webhook bounds before this runs."""
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[::2])
    brackets = outside.translate(None, _NOT_BRACKETS)
    return max(0, max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0))


def parse_review(body: bytes) -> AdmissionRequest:
    """The ``request`` of an AdmissionReview v1 body; :class:`ReviewError` says what is wrong
    (:class:`BodyTooLarge` for a body over :data:`MAX_BODY`)."""
    if len(body) > MAX_BODY:
        raise BodyTooLarge(f"body is {len(body)} bytes; the limit is {MAX_BODY}")
    depth = json_depth(body)
    if depth > MAX_DEPTH:
        raise ReviewError(f"JSON nests {depth} levels deep; the limit is {MAX_DEPTH}")
    try:
        doc = _REVIEW.decode(body)
    except msgspec.ValidationError as exc:
        raise ReviewError(f"not an AdmissionReview: {exc}") from None
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: json_depth is a bound
        raise ReviewError(f"body is not JSON: {exc}") from None
    if doc.api_version != API_VERSION or doc.kind != "AdmissionReview":
        raise ReviewError(
            f"expected apiVersion {API_VERSION} kind AdmissionReview, got {doc.api_version!r} {doc.kind!r}"
        )
    if doc.request is None:
        raise ReviewError("AdmissionReview has no request object")
    if not doc.request.uid:
        raise ReviewError("AdmissionReview request has no uid")
    return doc.request


def review_response(uid: str, verdict: podrules.Verdict) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": verdict.allowed}
    if not verdict.allowed:
        response["status"] = {
            "code": verdict.code,
            "message": verdict.message,
            "reason": "Forbidden" if verdict.code == 403 else "BadRequest",
        }
    if verdict.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(verdict.patch).encode()).decode()
    if verdict.warnings:
        response["warnings"] = list(verdict.warnings)
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


class ClaimReader(Protocol):
    """What the webhook reads of a DRA pod's claims (:class:`services.kube.client.KubeClient`)."""

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...

    async def get_resource_claim_template(self, namespace: str, name: str) -> dict[str, Any]: ...


Specs = dict[tuple[str, str], dict[str, Any] | None]


class Webhook:
    """Admission decisions with tracing; holds the device classes and, for DRA pods, a reader
    of their claims and templates (without one, claims are not looked at)."""

    def __init__(self, *, device_classes: dict[str, DeviceClass], claims: ClaimReader | None = None) -> None:
        self.device_classes = device_classes
        self.claims = claims
        self._tracer = tracer("tandem.admission")

    async def claim_specs(self, request: AdmissionRequest) -> Specs:
        """The specs of the claims and templates a pod being created names (None: not found)."""
        out: Specs = {}
        if self.claims is None or request.operation != "CREATE" or not isinstance(request.object, dict):
            return out
        namespace = request.namespace or (request.object.get("metadata") or {}).get("namespace") or ""
        try:
            pod = podrules.read_pod(request.object)
        except InvalidPod:
            return out
        for ref in drapods.claim_refs(pod):
            key = ("claim", ref.claim) if ref.claim else ("template", ref.template or "")
            if not key[1] or key in out:
                continue
            try:
                if key[0] == "claim":
                    out[key] = drapods.spec_of(await self.claims.get_resource_claim(namespace, key[1]))
                else:
                    template = await self.claims.get_resource_claim_template(namespace, key[1])
                    out[key] = drapods.spec_of(drapods.spec_of(template))
            except NotFound:
                out[key] = None
            except KubeError as exc:
                # Unreadable now: judged as not there yet (gated; the bridge reads it later).
                log.warning("claim_unreadable", namespace=namespace, name=key[1], error=str(exc))
                out[key] = None
        return out

    def review(self, request: AdmissionRequest, *, specs: Specs | None = None) -> dict[str, Any]:
        uid = request.uid
        kind = request.kind.kind if request.kind is not None else None
        operation = request.operation
        obj = request.object
        if kind != "Pod" or operation != "CREATE" or request.sub_resource:
            return review_response(uid, podrules.Verdict(allowed=True))
        try:
            pod = podrules.read_pod(obj)
        except InvalidPod as exc:
            return review_response(uid, podrules.Verdict(allowed=False, code=400, message=f"tandem: {exc}"))
        dra = None
        if self.claims is not None and pod.spec.resourceClaims:
            # Whether its claims are Tandem's; judged again in the span, whose context it records.
            dra = drapods.admit(pod, specs=specs or {}, device_classes=self.device_classes, traceparent=None)
        if dra is None and not podrules.mentions_tandem(pod):
            return review_response(uid, podrules.Verdict(allowed=True))
        namespace = request.namespace or pod.metadata.namespace or ""
        parent = context_from_traceparent(pod.annotations.get(names.TRACEPARENT))
        with self._tracer.start_as_current_span("admission.admit", context=parent) as span:
            span.set_attribute("k8s.namespace.name", namespace)
            span.set_attribute("k8s.pod.name", pod.display_name)
            span.set_attribute("tandem.admission.uid", uid)
            if dra is not None:
                dra = drapods.admit(
                    pod,
                    specs=specs or {},
                    device_classes=self.device_classes,
                    traceparent=current_traceparent(),
                )
            verdict = (
                dra
                if dra is not None
                else podrules.admit(
                    obj,
                    operation=operation,
                    device_classes=self.device_classes,
                    traceparent=current_traceparent(),
                )
            )
            span.set_attribute("tandem.admission.allowed", verdict.allowed)
            if verdict.request is not None:
                span.set_attribute("tandem.gpus", verdict.request.gpus)
                span.set_attribute("tandem.rdma", verdict.request.rdma)
                span.set_attribute("tandem.device_class", verdict.request.device_class)
                span.set_attribute("tandem.scope", verdict.request.scope)
            if not verdict.allowed:
                span.set_attribute("tandem.admission.message", verdict.message)
        log.info(
            "admission",
            namespace=namespace,
            pod=pod.display_name,
            allowed=verdict.allowed,
            message=verdict.message or None,
        )
        return review_response(uid, verdict)

    def answer(self, body: bytes, *, specs: Specs | None = None) -> tuple[int, dict[str, Any]]:
        """HTTP status and JSON document for one request body (what ``POST /mutate`` returns):
        200 with the AdmissionReview response, or 400/413 with ``{"error": reason}``."""
        try:
            review = parse_review(body)
        except ReviewError as exc:
            log.warning("bad_admission_review", error=str(exc))
            metrics.REVIEWS.labels("bad_request").inc()
            return (413 if isinstance(exc, BodyTooLarge) else 400), {"error": f"tandem: {exc}"}
        doc = self.review(review, specs=specs)
        answer = doc["response"]
        outcome = "denied" if not answer["allowed"] else "mutated" if "patch" in answer else "ignored"
        metrics.REVIEWS.labels(outcome).inc()
        return 200, doc

    async def handle_mutate(self, request: web.Request) -> web.Response:
        length = request.content_length
        if length is not None and length > MAX_BODY:  # refused before it is read
            status, doc = 413, {"error": f"tandem: body is {length} bytes; the limit is {MAX_BODY}"}
            metrics.REVIEWS.labels("bad_request").inc()
        else:
            try:
                body = await request.read()  # chunked: aiohttp stops at client_max_size
            except web.HTTPRequestEntityTooLarge:
                status, doc = 413, {"error": f"tandem: body is over the limit of {MAX_BODY} bytes"}
                metrics.REVIEWS.labels("bad_request").inc()
            else:
                specs = None
                if self.claims is not None:
                    with contextlib.suppress(ReviewError):
                        specs = await self.claim_specs(parse_review(body))
                status, doc = self.answer(body, specs=specs)
        return web.json_response(doc, status=status)

    async def handle_health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post(MUTATE_PATH, self.handle_mutate)
        app.router.add_get(HEALTH_PATH, self.handle_health)
        return app


class CertReloader:
    """Keeps a server SSLContext's certificate in step with files rotated in place."""

    def __init__(self, *, cert_file: str, key_file: str) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._stamp: tuple[float, float] | None = None
        self.reload()

    def _mtimes(self) -> tuple[float, float]:
        return (os.stat(self.cert_file).st_mtime, os.stat(self.key_file).st_mtime)

    def reload(self) -> bool:
        """Load the pair if the files changed; new handshakes use it, open ones keep theirs."""
        stamp = self._mtimes()
        if stamp == self._stamp:
            return False
        self.context.load_cert_chain(self.cert_file, self.key_file)
        self._stamp = stamp
        return True

    async def watch(self, stop: asyncio.Event, *, interval: float = 30.0) -> None:
        while not stop.is_set():
            try:
                if await asyncio.to_thread(self.reload):
                    log.info("webhook_certificate_reloaded", cert=self.cert_file)
            except (OSError, ssl.SSLError) as exc:
                # A half-written rotation: keep serving the old pair, try again next round.
                log.warning("webhook_certificate_reload_failed", error=repr(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)


@dataclass(slots=True)
class RunningServer:
    runner: web.AppRunner
    port: int

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_server(
    webhook: Webhook, *, host: str, port: int, ssl_context: ssl.SSLContext | None
) -> RunningServer:
    """Start serving; ``port=0`` picks a free port (returned)."""
    runner = web.AppRunner(webhook.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host=host, port=port, ssl_context=ssl_context)
    await site.start()
    bound = port
    for address in runner.addresses:  # (host, port) of each listening socket
        bound = int(address[1])
    return RunningServer(runner=runner, port=bound)
