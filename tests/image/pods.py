"""A rendered pod template, run under podman the way kubelet would run it.

This is the small part of kubelet the image test needs, written out so that what the chart
renders is what runs: the container's command and args, its env (``$(VAR)`` references and
``fieldRef`` values resolved as kubelet resolves them), its volumes (ConfigMap and Secret
volumes filled from the rendered objects, with their ``items``; projected volumes of those and
of service-account tokens; emptyDir, hostPath), the pod and container security context, host
namespaces, and the service-account token mount when the pod asks for one.

What differs from a cluster, on purpose:

* Every container runs with ``--network host`` (no pod network here), so a port in the pod
  spec is a port on this machine; two replicas of one Deployment would collide, which is why
  the test renders each pod with its own free ports.
* Several simulated nodes share this one machine, so each node's writable hostPath directories
  (state, device-plugin, netns, CDI) live under that node's own directory; ``/sys`` and ``/dev``
  are the machine's own.
* Resource requests/limits and probes' timing are not enforced; the test runs the probes itself.

A spec this module cannot honour raises :class:`UnsupportedSpec` naming the field, so a chart
change that needs more of kubelet fails loudly instead of running something else.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Directories a node's kernel provides; shared by every simulated node on this machine.
KERNEL_PATHS = ("/sys", "/dev")
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
PROPAGATION = {"HostToContainer": "rslave", "Bidirectional": "rshared", "None": "rprivate"}


class UnsupportedSpec(ValueError):
    """The rendered pod uses something this kubelet stand-in does not implement."""


@dataclass(frozen=True)
class ApiAccess:
    """What kubelet gives a pod with ``automountServiceAccountToken: true``."""

    host: str
    port: int
    token: str
    ca_pem: bytes


# A projected service-account token for (pod, audience): what kubelet asks the API server for.
TokenIssuer = Callable[["Pod", str], str]


@dataclass
class Pod:
    """One pod of a rendered workload, placed on a (simulated) node."""

    name: str
    namespace: str
    node: str
    workload: dict[str, Any]
    objects: list[dict[str, Any]]  # the whole render: ConfigMaps and Secrets come from here
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def spec(self) -> dict[str, Any]:
        return dict(self.workload["spec"]["template"]["spec"])

    @property
    def container(self) -> dict[str, Any]:
        containers = self.spec["containers"]
        if len(containers) != 1 or self.spec.get("initContainers"):
            raise UnsupportedSpec(f"{self.name}: one container and no initContainers expected")
        return dict(containers[0])

    def port(self, name_or_number: str | int) -> int:
        if isinstance(name_or_number, int):
            return name_or_number
        for p in self.container.get("ports", []):
            if p["name"] == name_or_number:
                return int(p["containerPort"])
        raise UnsupportedSpec(f"{self.name}: no container port named {name_or_number!r}")

    def env(self) -> dict[str, str]:
        """The container's environment as kubelet builds it (in order, references expanded)."""
        out: dict[str, str] = {}
        for item in self.container.get("env", []):
            if "value" in item:
                out[item["name"]] = expand(item["value"], out)
            elif "valueFrom" in item:
                out[item["name"]] = self._value_from(item["name"], item["valueFrom"])
            else:
                out[item["name"]] = ""
        if self.container.get("envFrom"):
            raise UnsupportedSpec(f"{self.name}: envFrom")
        return out

    def _value_from(self, name: str, source: dict[str, Any]) -> str:
        ref = source.get("fieldRef", {}).get("fieldPath")
        values = {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "spec.nodeName": self.node,
            "status.podIP": "127.0.0.1",
            "status.hostIP": "127.0.0.1",
        }
        if ref not in values:
            raise UnsupportedSpec(f"{self.name}: env {name}: valueFrom {json.dumps(source)}")
        return values[ref]

    def user(self, image_user: str) -> tuple[str, str]:
        """The uid:gid the container runs as; refuses root when runAsNonRoot says so (as kubelet)."""
        pod_sc = self.spec.get("securityContext") or {}
        sc = {**pod_sc, **(self.container.get("securityContext") or {})}
        img_uid, _, img_gid = image_user.partition(":")
        uid = str(sc.get("runAsUser", img_uid or "0"))
        gid = str(sc.get("runAsGroup", img_gid or "0"))
        if not uid.isdigit():
            raise UnsupportedSpec(f"{self.name}: image user {image_user!r} is not numeric")
        if sc.get("runAsNonRoot") and uid == "0":
            raise UnsupportedSpec(f"{self.name}: runAsNonRoot but the container would run as root")
        return uid, gid


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined names expand, ``$$`` escapes, the rest stays."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, value)


def find_object(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for obj in objects:
        if obj.get("kind") == kind and obj["metadata"]["name"] == name:
            return obj
    raise UnsupportedSpec(f"the render has no {kind} {name!r}")


def _write_files(directory: Path, files: dict[str, bytes]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)
    for key, data in files.items():
        path = directory / key
        path.write_bytes(data)
        path.chmod(0o644)  # kubelet's defaultMode


def podman_run_args(
    pod: Pod,
    *,
    image_user: str,
    workdir: Path,
    container_name: str,
    labels: dict[str, str],
    api: ApiAccess | None = None,
    tokens: TokenIssuer | None = None,
) -> list[str]:
    """``podman run`` arguments (after ``podman run``) that start ``pod``'s container detached."""
    spec, c = pod.spec, pod.container
    pod_dir = workdir / pod.name
    node_root = workdir / "nodes" / pod.node
    args = ["--detach", "--name", container_name, "--network", "host", "--hostname", pod.name]
    for k, v in labels.items():
        args += ["--label", f"{k}={v}"]
    if spec.get("hostPID"):
        args += ["--pid", "host"]  # the service is not PID 1 there, so it needs no init
    else:
        args += ["--init"]  # a Python PID 1 would ignore SIGTERM's default action
    if spec.get("hostIPC"):
        args += ["--ipc", "host"]

    sc = c.get("securityContext") or {}
    pod_sc = spec.get("securityContext") or {}
    uid, gid = pod.user(image_user)
    args += ["--user", f"{uid}:{gid}"]
    if "fsGroup" in pod_sc:
        args += ["--group-add", str(pod_sc["fsGroup"])]
    if sc.get("privileged"):
        args += ["--privileged"]
    if sc.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--read-only-tmpfs=false"]
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    caps = sc.get("capabilities") or {}
    for cap in caps.get("drop", []):
        args += ["--cap-drop", cap]
    for cap in caps.get("add", []):
        args += ["--cap-add", cap]
    seccomp = {**(pod_sc.get("seccompProfile") or {}), **(sc.get("seccompProfile") or {})}
    if seccomp and seccomp.get("type") != "RuntimeDefault":
        raise UnsupportedSpec(f"{pod.name}: seccompProfile {seccomp}")

    env = pod.env()
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in c.get("volumeMounts", []):
        vol = volumes.get(mount["name"])
        if vol is None:
            raise UnsupportedSpec(f"{pod.name}: volumeMount {mount['name']!r} has no volume")
        source = _volume_source(pod, vol, pod_dir=pod_dir, node_root=node_root, tokens=tokens)
        opts = ["ro" if mount.get("readOnly") else "rw"]
        if mount.get("subPath"):
            raise UnsupportedSpec(f"{pod.name}: subPath on {mount['name']!r}")
        if "mountPropagation" in mount:
            opts.append(PROPAGATION[mount["mountPropagation"]])
        args += ["--volume", f"{source}:{mount['mountPath']}:{','.join(opts)}"]

    if spec.get("automountServiceAccountToken", True) and spec.get("serviceAccountName"):
        if api is None:
            raise UnsupportedSpec(f"{pod.name}: wants an API token but no API server was given")
        sa_dir = pod_dir / "serviceaccount"
        _write_files(
            sa_dir,
            {"token": api.token.encode(), "ca.crt": api.ca_pem, "namespace": pod.namespace.encode()},
        )
        args += ["--volume", f"{sa_dir}:{SERVICE_ACCOUNT_DIR}:ro"]
        env = {**env, "KUBERNETES_SERVICE_HOST": api.host, "KUBERNETES_SERVICE_PORT": str(api.port)}

    for k, v in env.items():
        args += ["--env", f"{k}={v}"]
    if c.get("workingDir"):
        args += ["--workdir", c["workingDir"]]
    image = c["image"]
    command, cargs = c.get("command"), c.get("args")
    if command:
        args += ["--entrypoint", json.dumps([expand(x, env) for x in command])]
    args.append(image)
    if cargs:
        args += [expand(x, env) for x in cargs]
    return args


def _volume_source(
    pod: Pod, vol: dict[str, Any], *, pod_dir: Path, node_root: Path, tokens: TokenIssuer | None = None
) -> Path:
    name = vol["name"]
    if "configMap" in vol or "secret" in vol or "projected" in vol:
        sources = vol["projected"]["sources"] if "projected" in vol else [vol]
        files: dict[str, bytes] = {}
        for source in sources:
            files |= _source_files(pod, name, source, tokens)
        _write_files(pod_dir / "volumes" / name, files)
        return pod_dir / "volumes" / name
    if "emptyDir" in vol:
        path = pod_dir / "volumes" / name
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o1777)  # kubelet makes emptyDir world-writable
        return path
    if "hostPath" in vol:
        host = vol["hostPath"]["path"]
        if host.startswith(KERNEL_PATHS):
            return Path(host)
        path = node_root / host.lstrip("/")
        kind = vol["hostPath"].get("type", "")
        if kind not in ("", "Directory", "DirectoryOrCreate"):
            raise UnsupportedSpec(f"{pod.name}: hostPath type {kind!r} on volume {name!r}")
        path.mkdir(parents=True, exist_ok=True)  # "Directory": it exists on a real node
        return path
    raise UnsupportedSpec(f"{pod.name}: volume {name!r} of kind {sorted(set(vol) - {'name'})}")


def _source_files(
    pod: Pod, volume: str, source: dict[str, Any], tokens: TokenIssuer | None
) -> dict[str, bytes]:
    """The files one volume source (a configMap, secret or serviceAccountToken) puts in a volume,
    by path; ``items`` pick and rename keys as kubelet does."""
    if "serviceAccountToken" in source:
        sat = source["serviceAccountToken"]
        if tokens is None:
            raise UnsupportedSpec(f"{pod.name}: volume {volume!r} wants a token but no issuer was given")
        return {sat["path"]: tokens(pod, sat.get("audience", "")).encode()}
    if "configMap" in source:
        ref = source["configMap"]
        obj = find_object(pod.objects, "ConfigMap", ref["name"])
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        data |= {k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}
    elif "secret" in source:
        ref = source["secret"]
        obj = find_object(pod.objects, "Secret", ref.get("secretName") or ref["name"])
        data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        data |= {k: v.encode() for k, v in (obj.get("stringData") or {}).items()}
    else:
        raise UnsupportedSpec(f"{pod.name}: volume {volume!r} source {sorted(source)}")
    items = ref.get("items")
    if not items:
        return data
    missing = [i["key"] for i in items if i["key"] not in data]
    if missing:
        raise UnsupportedSpec(f"{pod.name}: volume {volume!r}: no key {missing} in {ref}")
    return {i["path"]: data[i["key"]] for i in items}
