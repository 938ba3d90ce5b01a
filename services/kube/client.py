"""The thin, project-owned Kubernetes wrapper the bridge and leader election talk to.

:class:`KubeApi` is the boundary: plain JSON dicts in and out, typed errors
(:class:`~.errors.NotFound`, :class:`~.errors.Conflict`, :class:`~.errors.KubeError`), and only
the calls Tandem needs. Unit tests fake this Protocol; :class:`KubeClient` implements it with
kubernetes-asyncio and is exercised against an API emulator in the integration tests.

Writes are JSON merge patches (RFC 7386) carrying ``metadata.resourceVersion`` where a lost
update would matter: the API server turns that into an optimistic-lock precondition (409 on a
stale version), which is what the bridge and the lease rely on.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp
import msgspec
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException

from services.kube.errors import Conflict, KubeError, NotFound
from services.kube.resources import (
    CLAIM_GROUP,
    CLAIM_PLURAL,
    CLAIM_VERSION,
    RESOURCE_CLAIM_TEMPLATES,
    RESOURCE_CLAIMS,
    RESOURCE_SLICES,
)

MERGE_PATCH = "application/merge-patch+json"
Obj = dict[str, Any]


class KubeApi(Protocol):
    async def list_pods(self, *, label_selector: str) -> tuple[list[Obj], str]:
        """All pods (every namespace) matching the selector, and the list's resourceVersion."""
        ...

    def watch_pods(
        self, *, label_selector: str, resource_version: str, timeout_s: int
    ) -> AsyncIterator[tuple[str, Obj]]:
        """``(type, pod)`` events after ``resource_version`` until the server ends the watch."""
        ...

    async def get_pod(self, namespace: str, name: str) -> Obj: ...

    async def list_nodes(self) -> tuple[list[Obj], str]: ...

    def watch_nodes(self, *, resource_version: str, timeout_s: int) -> AsyncIterator[tuple[str, Obj]]: ...

    async def patch_pod(self, namespace: str, name: str, patch: Obj) -> Obj: ...

    async def evict_pod(self, namespace: str, name: str, *, uid: str) -> Obj:
        """Evict through the Eviction API (``policy/v1``), which respects PodDisruptionBudgets:
        429 when one forbids it now, 409 when the pod's uid is not ``uid`` any more."""
        ...

    async def create_event(self, namespace: str, body: Obj) -> Obj: ...

    async def get_event(self, namespace: str, name: str) -> Obj: ...

    async def patch_event(self, namespace: str, name: str, patch: Obj) -> Obj: ...

    async def get_lease(self, namespace: str, name: str) -> Obj: ...

    async def list_claims(self) -> tuple[list[Obj], str]:
        """All ``DeviceClaim``\\ s (every namespace) and the list's resourceVersion."""
        ...

    def watch_claims(self, *, resource_version: str, timeout_s: int) -> AsyncIterator[tuple[str, Obj]]:
        """``(type, claim)`` events after ``resource_version`` until the server ends the watch."""
        ...

    async def patch_claim_status(self, namespace: str, name: str, patch: Obj) -> Obj:
        """Merge patch of a claim's ``status`` subresource."""
        ...

    async def patch_claim(self, namespace: str, name: str, patch: Obj) -> Obj:
        """Merge patch of a claim (its finalizers)."""
        ...

    async def create_lease(self, namespace: str, body: Obj) -> Obj: ...

    async def patch_lease(self, namespace: str, name: str, patch: Obj) -> Obj: ...

    async def review_token(self, token: str, *, audiences: list[str]) -> Obj: ...

    async def close(self) -> None: ...


def _error(status: int, reason: str, body: str | bytes | None) -> KubeError:
    message = reason
    if body:
        try:
            doc = json.loads(body)
            message = doc.get("message") or reason
            # The why of a refusal, e.g. which PodDisruptionBudget forbids an eviction.
            causes = [c.get("message") for c in (doc.get("details") or {}).get("causes") or []]
            if any(causes):
                message = f"{message} ({'; '.join(c for c in causes if c)})"
        except (ValueError, AttributeError):
            pass
    text = f"Kubernetes API {status}: {message}"
    if status == 404:
        return NotFound(text, status=status, reason=reason)
    if status == 409:
        return Conflict(text, status=status, reason=reason)
    return KubeError(text, status=status, reason=reason)


def _watch_event(line: bytes) -> tuple[str, Obj] | None:
    """One line of a watch stream: ``(type, object)``; ``None`` for a bookmark or a blank
    line. The server's ERROR event (410 Gone: the version is too old) and an unreadable line
    are raised as a :class:`KubeError`."""
    if not line.strip():
        return None
    try:
        event = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise KubeError(f"unreadable watch event: {exc}", status=0, reason="") from None
    obj = event.get("object") if isinstance(event, dict) else None
    kind = event.get("type") if isinstance(event, dict) else None
    if not isinstance(obj, dict) or not isinstance(kind, str):
        raise KubeError("a watch event without a type and an object", status=0, reason="")
    if kind == "ERROR":
        code = obj.get("code")
        status = code if isinstance(code, int) else 0
        raise _error(status, str(obj.get("reason") or ""), msgspec.json.encode(obj))
    if kind == "BOOKMARK":
        return None
    return kind, obj


def eviction_body(namespace: str, name: str, *, uid: str) -> Obj:
    """A ``policy/v1`` Eviction of one pod, only if it is still the pod with ``uid`` (a pod
    recreated under the same name is not the victim)."""
    body: Obj = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": namespace},
    }
    if uid:
        body["deleteOptions"] = {"preconditions": {"uid": uid}}
    return body


def _environment_once(api_client: client.ApiClient) -> None:
    """The proxy for the API server read from the environment once, as client-go reads it,
    rather than at every request.

    kubernetes-asyncio's session trusts the environment, and aiohttp then looks up the proxy
    variables and reads ``~/.netrc`` on a worker thread for every request: a quarter of the
    auth callout's CPU per connection it decided (py-spy, a 3,000-node reconnect of
    ``tandem loadtest``). The proxy (``HTTPS_PROXY``/``NO_PROXY``...) is taken here, when the
    client is made; ``.netrc`` never applied (every request carries its own credentials)."""
    rest = api_client.rest_client
    if rest.proxy is None:
        url = urllib.parse.urlsplit(api_client.configuration.host)
        proxies = urllib.request.getproxies_environment()
        if url.hostname and url.scheme in proxies and not urllib.request.proxy_bypass_environment(url.netloc):
            rest.proxy = proxies[url.scheme]
    rest.pool_manager._trust_env = False


class KubeClient:
    """:class:`KubeApi` over kubernetes-asyncio (responses read raw, as dicts)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        _environment_once(api_client)
        # Typed Any: the package's stubs omit ``_content_type``/``_preload_content`` and take
        # models where the runtime also accepts dicts, which is how this wrapper calls it.
        self.core: Any = client.CoreV1Api(api_client)
        self.coordination: Any = client.CoordinationV1Api(api_client)
        self.authentication: Any = client.AuthenticationV1Api(api_client)
        self.custom: Any = client.CustomObjectsApi(api_client)

    @classmethod
    async def connect(cls, *, kubeconfig: str | None = None) -> KubeClient:
        """In-cluster service account when running in a pod, else the kubeconfig."""
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except ConfigException:
            await config.load_kube_config(config_file=kubeconfig)
        return cls(client.ApiClient())

    @classmethod
    def for_host(cls, host: str) -> KubeClient:
        """A client for an API server URL without credentials (tests, ``kubectl proxy``)."""
        conf = client.Configuration(host=host)
        return cls(client.ApiClient(configuration=conf))

    async def close(self) -> None:
        await self.api_client.close()

    async def _json(self, call: Any) -> Obj:
        try:
            resp = await call
        except ApiException as exc:
            raise _error(exc.status or 0, exc.reason or "", exc.body) from None
        try:
            body = await resp.read()
            status = resp.status
        finally:
            resp.release()
        if not 200 <= status < 300:
            raise _error(status, resp.reason or "", body)
        data: Obj = msgspec.json.decode(body) if body else {}
        return data

    async def list_pods(self, *, label_selector: str) -> tuple[list[Obj], str]:
        doc = await self._json(
            self.core.list_pod_for_all_namespaces(label_selector=label_selector, _preload_content=False)
        )
        items: list[Obj] = doc.get("items") or []
        return items, str((doc.get("metadata") or {}).get("resourceVersion") or "")

    def watch_pods(
        self, *, label_selector: str, resource_version: str, timeout_s: int
    ) -> AsyncIterator[tuple[str, Obj]]:
        return self._watch(
            self.core.list_pod_for_all_namespaces,
            resource_version=resource_version,
            timeout_s=timeout_s,
            label_selector=label_selector,
        )

    async def _watch(
        self, list_call: Any, *args: Any, resource_version: str, timeout_s: int, **kwargs: Any
    ) -> AsyncIterator[tuple[str, Obj]]:
        """``(type, object)`` events of a list call's watch after ``resource_version``, until
        the server ends it (bookmarks skipped).

        The stream is read here, not through kubernetes-asyncio's ``Watch``, which decodes
        each event, encodes its object again and decodes that once more (its model round trip,
        even for plain dicts): that was the largest part of the bridge's CPU per pod. Here each
        event is decoded once; an unreadable one is a :class:`KubeError` (the caller lists
        again)."""
        kwargs["timeout_seconds"] = timeout_s
        if resource_version:
            kwargs["resource_version"] = resource_version
        try:
            resp = await list_call(*args, watch=True, _preload_content=False, **kwargs)
        except ApiException as exc:
            raise _error(exc.status or 0, exc.reason or "", exc.body) from None
        try:
            if not 200 <= resp.status < 300:
                raise _error(resp.status, resp.reason or "", await resp.read())
            # One event per line; the client's read buffer (2 MiB, kubernetes-asyncio's
            # setting: etcd refuses objects over 1.5 MiB) bounds a line.
            while line := await resp.content.readline():
                event = _watch_event(line)
                if event is not None:
                    yield event
        except aiohttp.ClientError as exc:
            raise KubeError(f"watch stream broken: {exc}", status=0, reason="") from None
        finally:
            resp.release()

    async def get_pod(self, namespace: str, name: str) -> Obj:
        return await self._json(self.core.read_namespaced_pod(name, namespace, _preload_content=False))

    async def list_nodes(self) -> tuple[list[Obj], str]:
        doc = await self._json(self.core.list_node(_preload_content=False))
        items: list[Obj] = doc.get("items") or []
        return items, str((doc.get("metadata") or {}).get("resourceVersion") or "")

    def watch_nodes(self, *, resource_version: str, timeout_s: int) -> AsyncIterator[tuple[str, Obj]]:
        return self._watch(self.core.list_node, resource_version=resource_version, timeout_s=timeout_s)

    async def patch_pod(self, namespace: str, name: str, patch: Obj) -> Obj:
        return await self._json(
            self.core.patch_namespaced_pod(
                name, namespace, patch, _content_type=MERGE_PATCH, _preload_content=False
            )
        )

    async def evict_pod(self, namespace: str, name: str, *, uid: str) -> Obj:
        body = eviction_body(namespace, name, uid=uid)
        return await self._json(
            self.core.create_namespaced_pod_eviction(name, namespace, body, _preload_content=False)
        )

    async def create_event(self, namespace: str, body: Obj) -> Obj:
        return await self._json(self.core.create_namespaced_event(namespace, body, _preload_content=False))

    async def get_event(self, namespace: str, name: str) -> Obj:
        return await self._json(self.core.read_namespaced_event(name, namespace, _preload_content=False))

    async def patch_event(self, namespace: str, name: str, patch: Obj) -> Obj:
        return await self._json(
            self.core.patch_namespaced_event(
                name, namespace, patch, _content_type=MERGE_PATCH, _preload_content=False
            )
        )

    async def list_claims(self) -> tuple[list[Obj], str]:
        doc = await self._json(
            self.custom.list_cluster_custom_object(
                CLAIM_GROUP, CLAIM_VERSION, CLAIM_PLURAL, _preload_content=False
            )
        )
        items: list[Obj] = doc.get("items") or []
        return items, str((doc.get("metadata") or {}).get("resourceVersion") or "")

    def watch_claims(self, *, resource_version: str, timeout_s: int) -> AsyncIterator[tuple[str, Obj]]:
        return self._watch(
            self.custom.list_cluster_custom_object,
            CLAIM_GROUP,
            CLAIM_VERSION,
            CLAIM_PLURAL,
            resource_version=resource_version,
            timeout_s=timeout_s,
        )

    async def patch_claim_status(self, namespace: str, name: str, patch: Obj) -> Obj:
        return await self._patch_claim(
            self.custom.patch_namespaced_custom_object_status, namespace, name, patch
        )

    async def patch_claim(self, namespace: str, name: str, patch: Obj) -> Obj:
        return await self._patch_claim(self.custom.patch_namespaced_custom_object, namespace, name, patch)

    async def _patch_claim(self, call: Any, namespace: str, name: str, patch: Obj) -> Obj:
        """A merge patch of one DeviceClaim (``call``: the object's or its status's)."""
        return await self._json(
            call(
                CLAIM_GROUP,
                CLAIM_VERSION,
                namespace,
                CLAIM_PLURAL,
                name,
                patch,
                _content_type=MERGE_PATCH,
                _preload_content=False,
            )
        )

    async def get_lease(self, namespace: str, name: str) -> Obj:
        return await self._json(
            self.coordination.read_namespaced_lease(name, namespace, _preload_content=False)
        )

    async def create_lease(self, namespace: str, body: Obj) -> Obj:
        return await self._json(
            self.coordination.create_namespaced_lease(namespace, body, _preload_content=False)
        )

    async def patch_lease(self, namespace: str, name: str, patch: Obj) -> Obj:
        return await self._json(
            self.coordination.patch_namespaced_lease(
                name, namespace, patch, _content_type=MERGE_PATCH, _preload_content=False
            )
        )

    # ResourceSlices (resource.k8s.io/v1, cluster-scoped): the node agent's DRA pool
    # (services.nodeagent.dra.publisher.SliceApi).
    async def list_resource_slices(self, *, node: str, driver: str) -> list[Obj]:
        doc = await self._json(
            self.custom.list_cluster_custom_object(
                *RESOURCE_SLICES,
                field_selector=f"spec.nodeName={node},spec.driver={driver}",
                _preload_content=False,
            )
        )
        items: list[Obj] = doc.get("items") or []
        return items

    async def create_resource_slice(self, body: Obj) -> Obj:
        return await self._json(
            self.custom.create_cluster_custom_object(*RESOURCE_SLICES, body, _preload_content=False)
        )

    async def replace_resource_slice(self, name: str, body: Obj) -> Obj:
        return await self._json(
            self.custom.replace_cluster_custom_object(*RESOURCE_SLICES, name, body, _preload_content=False)
        )

    async def delete_resource_slice(self, name: str) -> None:
        await self._json(
            self.custom.delete_cluster_custom_object(*RESOURCE_SLICES, name, _preload_content=False)
        )

    # ResourceClaims (resource.k8s.io/v1): the node agent's DRA kubelet plugin reads the claim
    # it is asked to prepare (services.nodeagent.dra.plugin.ClaimReader).
    async def get_resource_claim(self, namespace: str, name: str) -> Obj:
        return await self._json(
            self.custom.get_namespaced_custom_object(
                *RESOURCE_CLAIMS[:2], namespace, RESOURCE_CLAIMS[2], name, _preload_content=False
            )
        )

    # ... and the DRA bridge's (services.admission.drabridge.ClaimApi): every claim listed and
    # watched, Tandem's finalizer put on, the allocation written to the status.
    async def list_resource_claims(self) -> tuple[list[Obj], str]:
        doc = await self._json(
            self.custom.list_cluster_custom_object(*RESOURCE_CLAIMS, _preload_content=False)
        )
        items: list[Obj] = doc.get("items") or []
        return items, str((doc.get("metadata") or {}).get("resourceVersion") or "")

    def watch_resource_claims(
        self, *, resource_version: str, timeout_s: int
    ) -> AsyncIterator[tuple[str, Obj]]:
        return self._watch(
            self.custom.list_cluster_custom_object,
            *RESOURCE_CLAIMS,
            resource_version=resource_version,
            timeout_s=timeout_s,
        )

    async def replace_resource_claim(self, namespace: str, name: str, body: Obj) -> Obj:
        """PUT of a whole claim as read with its metadata changed (a 409 when it changed since):
        the API server 1.36 refuses a merge patch of a claim's metadata as a change of its
        immutable spec, which an update carrying the spec as read is not."""
        group, version, plural = RESOURCE_CLAIMS
        return await self._json(
            self.custom.replace_namespaced_custom_object(
                group, version, namespace, plural, name, body, _preload_content=False
            )
        )

    async def patch_resource_claim_status(self, namespace: str, name: str, patch: Obj) -> Obj:
        group, version, plural = RESOURCE_CLAIMS
        return await self._json(
            self.custom.patch_namespaced_custom_object_status(
                group,
                version,
                namespace,
                plural,
                name,
                patch,
                _content_type=MERGE_PATCH,
                _preload_content=False,
            )
        )

    async def get_resource_claim_template(self, namespace: str, name: str) -> Obj:
        group, version, plural = RESOURCE_CLAIM_TEMPLATES
        return await self._json(
            self.custom.get_namespaced_custom_object(
                group, version, namespace, plural, name, _preload_content=False
            )
        )

    async def review_token(self, token: str, *, audiences: list[str]) -> Obj:
        """A TokenReview (authentication.k8s.io/v1): who the API server says ``token`` is."""
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": audiences},
        }
        return await self._json(self.authentication.create_token_review(body, _preload_content=False))

    # Secrets: only for the chart's install hook (``tandem nats-config --secret``), not part of
    # :class:`KubeApi` (no service reads or writes a Secret).
    async def get_secret(self, namespace: str, name: str) -> Obj:
        return await self._json(self.core.read_namespaced_secret(name, namespace, _preload_content=False))

    async def create_secret(self, namespace: str, body: Obj) -> Obj:
        return await self._json(self.core.create_namespaced_secret(namespace, body, _preload_content=False))

    async def patch_secret(self, namespace: str, name: str, patch: Obj) -> Obj:
        return await self._json(
            self.core.patch_namespaced_secret(
                name, namespace, patch, _content_type=MERGE_PATCH, _preload_content=False
            )
        )
