"""Builders shared by the admission and bridge tests (no tests here): TLS pair, realistic pods."""

from __future__ import annotations

import asyncio
import copy
import datetime
import ipaddress
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def write_self_signed(directory: Path, *, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A certificate for ``host`` (IP SAN) and ``localhost``, valid one day; returns cert, key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem-admission-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address(host)), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def deployment_pod(
    *,
    gpu: Any = "4",
    rdma: Any = "4",
    annotations: dict[str, str] | None = None,
    requests: dict[str, Any] | None = None,
    **spec_extra: Any,
) -> dict[str, Any]:
    """A pod as a ReplicaSet creates it: generateName, owner reference, no name, no uid."""
    limits: dict[str, Any] = {"cpu": "8", "memory": "64Gi"}
    if gpu is not None:
        limits["tandem.io/gpu"] = gpu
    if rdma is not None:
        limits["tandem.io/rdma"] = rdma
    resources: dict[str, Any] = {"limits": limits}
    if requests is not None:
        resources["requests"] = requests
    meta: dict[str, Any] = {
        "generateName": "trainer-7d9f8b6c5d-",
        "namespace": "ml",
        "labels": {"app": "trainer", "pod-template-hash": "7d9f8b6c5d"},
        "ownerReferences": [
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "name": "trainer-7d9f8b6c5d",
                "uid": "0b1f4a52-8f0e-4a57-9d1b-2f4f7d1c9e10",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }
    if annotations is not None:
        meta["annotations"] = annotations
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "trainer",
                "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                "command": ["torchrun", "train.py"],
                "resources": resources,
            }
        ],
        "restartPolicy": "Always",
        "schedulerName": "default-scheduler",
        "terminationGracePeriodSeconds": 30,
    }
    spec.update(spec_extra)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def review(
    obj: Any, *, uid: str = "705ab4f5-6393-11e8-b7cc-42010a800002", operation: str = "CREATE"
) -> dict[str, Any]:
    """An AdmissionReview v1 request as kube-apiserver sends it for a pod create."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    namespace = meta.get("namespace") if isinstance(meta, dict) else None
    namespace = namespace if isinstance(namespace, str) else "default"
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "",
            "namespace": namespace,
            "operation": operation,
            "userInfo": {
                "username": "system:serviceaccount:kube-system:replicaset-controller",
                "uid": "c9a4c1b8-57c8-4d3c-9b1e-3f1f2a4b5c6d",
                "groups": ["system:serviceaccounts", "system:authenticated"],
            },
            "object": copy.deepcopy(obj),
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


async def _silent_watch() -> Any:
    """A watch on which nothing happens until it is cancelled (the stream never ends by itself)."""
    await asyncio.Event().wait()
    yield  # pragma: no cover


class FakeKube:
    """In-memory stand-in for :class:`services.kube.client.KubeApi` (the project's wrapper).

    Objects are JSON dicts keyed by (kind, namespace, name); every write bumps a resourceVersion,
    and a merge patch that carries ``metadata.resourceVersion`` fails with Conflict when stale,
    as the API server's optimistic lock does. ``fail_writes`` makes every write a 500.
    """

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.version = 0
        self.fail_writes = False
        self.calls: list[tuple[str, str, str]] = []
        self.after_get: list[Any] = []
        """One-shot coroutines run after the next get (another writer acting in between)."""

    def _bump(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        return copy.deepcopy(obj)

    def _get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        from services.kube.errors import NotFound

        self.calls.append(("get", kind, name))
        try:
            return copy.deepcopy(self.objects[(kind, namespace, name)])
        except KeyError:
            raise NotFound(f"{kind} {namespace}/{name} not found", status=404) from None

    def _create(self, kind: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        from services.kube.errors import Conflict, KubeError

        self.calls.append(("create", kind, body["metadata"]["name"]))
        if self.fail_writes:
            raise KubeError("injected failure", status=500)
        key = (kind, namespace, body["metadata"]["name"])
        if key in self.objects:
            raise Conflict("exists", status=409)
        self.objects[key] = copy.deepcopy(body)
        return self._bump(self.objects[key])

    def _patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        from services.kube.errors import Conflict, KubeError, NotFound

        self.calls.append(("patch", kind, name))
        if self.fail_writes:
            raise KubeError("injected failure", status=500)
        key = (kind, namespace, name)
        if key not in self.objects:
            raise NotFound("gone", status=404)
        want = (patch.get("metadata") or {}).get("resourceVersion")
        if want is not None and want != self.objects[key]["metadata"].get("resourceVersion"):
            raise Conflict("the object has been modified", status=409)
        self.objects[key] = merge_patch(self.objects[key], patch)
        return self._bump(self.objects[key])

    async def _hooks(self) -> None:
        hooks, self.after_get = self.after_get, []
        for hook in hooks:
            await hook()

    async def list_pods(self, *, label_selector: str) -> tuple[list[dict[str, Any]], str]:
        key, _, value = label_selector.partition("=")
        pods = [copy.deepcopy(o) for (k, _, _), o in self.objects.items() if k == "pod"]
        return [p for p in pods if p["metadata"].get("labels", {}).get(key) == value], str(self.version)

    def watch_pods(self, *, label_selector: str, resource_version: str, timeout_s: int) -> Any:
        return _silent_watch()

    async def list_nodes(self) -> tuple[list[dict[str, Any]], str]:
        return [copy.deepcopy(o) for (k, _, _), o in self.objects.items() if k == "node"], str(self.version)

    def watch_nodes(self, *, resource_version: str, timeout_s: int) -> Any:
        return _silent_watch()

    async def list_claims(self) -> tuple[list[dict[str, Any]], str]:
        claims = [copy.deepcopy(o) for (k, _, _), o in self.objects.items() if k == "deviceclaim"]
        return claims, str(self.version)

    def watch_claims(self, *, resource_version: str, timeout_s: int) -> Any:
        return _silent_watch()

    async def patch_claim_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._patch("deviceclaim", namespace, name, patch)

    async def patch_claim(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._patch("deviceclaim", namespace, name, patch)

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        pod = self._get("pod", namespace, name)
        await self._hooks()
        return pod

    async def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._patch("pod", namespace, name, patch)

    async def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._create("event", namespace, body)

    async def get_event(self, namespace: str, name: str) -> dict[str, Any]:
        return self._get("event", namespace, name)

    async def patch_event(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._patch("event", namespace, name, patch)

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any]:
        lease = self._get("lease", namespace, name)
        await self._hooks()
        return lease

    async def create_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._create("lease", namespace, body)

    async def patch_lease(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._patch("lease", namespace, name, patch)

    async def close(self) -> None:
        return None


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out
