"""Run a pod of the real cluster as a local process: the part of kubelet that kwok cannot play.

The pod is a real object: made by the real controllers from the chart's workloads, bound by the
real scheduler, its service-account volume injected by the real admission plugin. This module
takes that object and starts its container the way kubelet would, on this machine:

* **command and env** as the spec says: ``$(VAR)`` references, ``fieldRef`` values (the pod's
  name, namespace, uid, node, host IP; ``status.podIP`` is the pod's real address here),
  ``configMapKeyRef``/``secretKeyRef`` read from the API, and ``KUBERNETES_SERVICE_HOST/PORT``
  (the API server's own address: no kube-proxy routes the ``kubernetes`` Service here).
  ``python`` and ``tandem`` are this checkout's, so its code runs.
* **volumes** filled from the API, each bound at its ``mountPath`` inside a private mount
  namespace (``unshare -m``): ConfigMaps and Secrets with their ``items``; projected volumes
  (the service-account token from the real TokenRequest API, bound to this pod with the
  audience and lifetime the spec asks, the ``kube-root-ca.crt`` CA, downward-API namespace);
  ``emptyDir``; ``hostPath`` under a directory of the node's own, since several nodes share
  this machine; a ``persistentVolumeClaim`` once bound (a directory per claim, kept across the
  pod's restarts). Paths the machine provides to every container here (``/sys``, ``/dev``,
  ``/tmp``, ``/var/run/netns``) are the machine's own.
* **names**: cluster DNS as a hosts file bound at ``/etc/hosts`` in every pod: a pod with
  ``hostname`` and ``subdomain`` (a StatefulSet's) is ``<hostname>.<subdomain>.<ns>.svc`` once
  it runs, as the cluster's DNS answers for a headless Service; a Service name is added with
  :meth:`LocalKubelet.resolve` (no kube-proxy gives it a virtual address here).
* **image entrypoints**: a container with ``args`` and no ``command`` runs its image's
  entrypoint (:data:`ENTRYPOINTS`: the NATS image's ``nats-server`` is the wheel's).
* **network**: a pod without ``hostNetwork`` gets a network namespace and veth pair of its own
  (:class:`~services.runtime.process.podnet.PodNetwork`), its address published for its Services
  by :func:`publish_endpoints`; a host-network pod binds its node's address.

What is not done: image pulls (the checkout is the image), resource limits, user and
capability changes of the security context, probes other than the readiness wait of
:meth:`RunningPod.wait_ready`. A spec that needs more raises :class:`UnsupportedSpec` naming
the field, so a chart change that needs more of kubelet fails loudly.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shlex
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.runtime.process.embedded import server_binary, terminate
from services.runtime.process.podnet import PodNetwork
from tests.cluster.controlplane import ControlPlane, pod_network
from tests.waiting import wait_until_sync

ROOT = Path(__file__).resolve().parents[2]
# Provided to every container on this machine as they are: the kernel's, and scratch space.
MACHINE_PATHS = ("/sys", "/dev", "/tmp", "/var/run/netns")
_VAR = re.compile(r"\$\((\w+)\)")
# The image's programs, as this checkout provides them.
PROGRAMS = {"python": sys.executable, "tandem": str(Path(sys.executable).parent / "tandem")}
# Entrypoints of the images the chart runs without a command, by repository.
ENTRYPOINTS = {"nats": server_binary}
HOSTS = "/etc/hosts"
EXIT_CODE = "tandem-tests.local/exit-code"  # read by kwok-stages.yaml's tandem-job-pod-done


class UnsupportedSpec(ValueError):
    """The pod uses something this kubelet stand-in does not implement."""


@dataclass
class RunningPod:
    pod: dict[str, Any]
    popen: subprocess.Popen[bytes]
    log: Path
    ip: str
    net: PodNetwork | None
    created_dirs: list[Path] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    def tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def port(self, name: str) -> int:
        for c in self.pod["spec"]["containers"]:
            for p in c.get("ports", []):
                if p.get("name") == name:
                    return int(p["containerPort"])
        raise KeyError(f"pod {self.name} has no port named {name!r}")

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the container's readiness probe (HTTP GET) answers 200, as kubelet probes:
        over HTTPS without checking the certificate."""
        (container,) = self.pod["spec"]["containers"][:1]
        probe = (container.get("readinessProbe") or {}).get("httpGet")
        if probe is None:
            raise UnsupportedSpec(f"pod {self.name}: readiness without an httpGet probe")
        port = probe["port"] if isinstance(probe["port"], int) else self.port(probe["port"])
        scheme = probe.get("scheme", "HTTP").lower()
        url = f"{scheme}://{self.ip}:{port}{probe.get('path', '/')}"
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx)
        )

        def ready() -> bool:
            if self.popen.poll() is not None:
                raise AssertionError(f"pod {self.name} exited with {self.popen.returncode}:\n{self.tail()}")
            with contextlib.suppress(urllib.error.URLError, OSError), opener.open(url, timeout=3) as resp:
                return bool(resp.status == 200)
            return False

        wait_until_sync(ready, timeout=timeout, what=f"pod {self.name} ready at {url}", details=self.tail)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, as kubelet stops a container; SIGKILL after ``timeout``. The exit code."""
        terminate(self.popen, timeout=timeout)
        if self.net is not None:
            self.net.delete()
            self.net = None
        for d in reversed(self.created_dirs):
            with contextlib.suppress(OSError):
                d.rmdir()  # only the empty mount points this run made
        return int(self.popen.returncode)


class LocalKubelet:
    def __init__(self, cp: ControlPlane, workdir: Path) -> None:
        self.cp = cp
        self.workdir = workdir
        self.running: list[RunningPod] = []
        # The cluster's DNS: name -> address, written to hosts_file, bound into every pod.
        self.names: dict[str, str] = {}
        self.hosts_file = workdir / "hosts"
        self._write_hosts()

    def resolve(self, name: str, ip: str) -> None:
        """Make ``name`` resolve to ``ip`` in every pod (a Service's DNS name, say)."""
        self.names[name] = ip
        self._write_hosts()

    def _write_hosts(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # The machine's own entries (localhost, its name), then the cluster's.
        lines = [Path(HOSTS).read_text().rstrip("\n"), *(f"{ip} {n}" for n, ip in sorted(self.names.items()))]
        # Rewritten in place: the running pods have this very file (inode) bound.
        with self.hosts_file.open("w") as out:
            out.write("\n".join(lines) + "\n")

    def get(self, path: str) -> Any:
        return self.cp.request("GET", path)

    def run(self, pod: dict[str, Any], *, env: dict[str, str] | None = None) -> RunningPod:
        """Start ``pod``'s one container; ``env`` adds variables (the test's, such as an OTLP
        endpoint, never the chart's)."""
        meta, spec = pod["metadata"], pod["spec"]
        if len(spec["containers"]) != 1 or spec.get("initContainers"):
            raise UnsupportedSpec(f"pod {meta['name']}: one container and no init containers")
        node = spec.get("nodeName")
        if not node:
            raise UnsupportedSpec(f"pod {meta['name']}: not bound to a node yet")
        (container,) = spec["containers"]
        pod_dir = self.workdir / "pods" / meta["uid"]
        pod_dir.mkdir(parents=True, exist_ok=True)
        host_ip = self._node_ip(node)
        net: PodNetwork | None = None
        if spec.get("hostNetwork"):
            ip = host_ip
        else:
            net = pod_network()
            ip = net.pod_ip
        try:
            values = self._env(pod, container, ip=ip, host_ip=host_ip)
            values.update(env or {})
            if spec.get("hostname") and spec.get("subdomain"):
                fqdn = f"{spec['hostname']}.{spec['subdomain']}.{meta['namespace']}.svc"
                self.names.update({fqdn: ip, f"{fqdn}.cluster.local": ip})
                self._write_hosts()
            mounts = [*self._mounts(pod, container, pod_dir, node=node), (str(self.hosts_file), HOSTS, True)]
            argv = [_expand(a, values) for a in [*container.get("command", []), *container.get("args", [])]]
            if not container.get("command"):
                image = container.get("image", "").rsplit("/", 1)[-1].split(":")[0]
                if image not in ENTRYPOINTS:
                    raise UnsupportedSpec(
                        f"pod {meta['name']}: no command, and image {image!r} has no entrypoint known here"
                    )
                argv.insert(0, ENTRYPOINTS[image]())
            if argv[0] in PROGRAMS:
                argv[0] = PROGRAMS[argv[0]]
            created = [Path(target) for _, target, _ in mounts if not Path(target).exists()]
            # A file (the hosts file) is bound over the file there; a directory needs its
            # mount point made first.
            script = "".join(
                ("" if Path(s).is_file() else f"mkdir -p {shlex.quote(t)} && ")
                + f"mount --bind {shlex.quote(s)} {shlex.quote(t)} && "
                + (f"mount -o remount,bind,ro {shlex.quote(t)} && " if ro else "")
                for s, t, ro in mounts
            )
            cmd = [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script + 'exec "$@"',
                "sh",
                *argv,
            ]
            if net is not None:
                cmd = net.wrap(cmd)
            log = pod_dir / "container.log"
            with log.open("wb") as out:
                popen = subprocess.Popen(
                    cmd, env=values, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
        except BaseException:
            if net is not None:
                net.delete()
            raise
        running = RunningPod(pod=pod, popen=popen, log=log, ip=ip, net=net, created_dirs=_parents(created))
        self.running.append(running)
        return running

    def run_to_completion(self, pod: dict[str, Any], *, timeout: float = 60.0) -> RunningPod:
        """Run a Job's pod until its container exits, then report the exit code on the pod, from
        which kwok sets its phase (Succeeded or Failed) and the Job controller takes over."""
        running = self.run(pod)
        try:
            running.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            running.stop()
            raise AssertionError(
                f"pod {running.name} still running after {timeout:.0f} s:\n{running.tail()}"
            ) from None
        meta = pod["metadata"]
        self.cp.request(
            "PATCH",
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
            {"metadata": {"annotations": {EXIT_CODE: str(running.popen.returncode)}}},
            content_type="application/merge-patch+json",
        )
        running.stop()
        return running

    def stop_all(self) -> None:
        for p in reversed(self.running):
            p.stop()
        self.running.clear()

    # --- pieces -----------------------------------------------------------------------------
    def _node_ip(self, node: str) -> str:
        for a in self.get(f"/api/v1/nodes/{node}").get("status", {}).get("addresses", []):
            if a["type"] == "InternalIP":
                return str(a["address"])
        return self.cp.host

    def _env(
        self, pod: dict[str, Any], container: dict[str, Any], *, ip: str, host_ip: str
    ) -> dict[str, str]:
        meta, ns = pod["metadata"], pod["metadata"]["namespace"]
        fields = {
            "metadata.name": meta["name"],
            "metadata.namespace": ns,
            "metadata.uid": meta["uid"],
            "spec.nodeName": pod["spec"]["nodeName"],
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
            "status.podIP": ip,
            "status.hostIP": host_ip,
        }
        values: dict[str, str] = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": "/tmp",
            "KUBERNETES_SERVICE_HOST": self.cp.host,
            "KUBERNETES_SERVICE_PORT": str(self.cp.api_port),
            "PYTHONUNBUFFERED": "1",
        }
        for src in container.get("envFrom", []):
            for kind, path in (("configMapRef", "configmaps"), ("secretRef", "secrets")):
                if kind in src:
                    data = self._data(ns, path, src[kind]["name"])
                    values.update({src.get("prefix", "") + k: v.decode() for k, v in data.items()})
        for item in container.get("env", []):
            if "value" in item:
                values[item["name"]] = _expand(item["value"], values)
                continue
            ref = item.get("valueFrom", {})
            if "fieldRef" in ref:
                path = ref["fieldRef"]["fieldPath"]
                if path not in fields:
                    raise UnsupportedSpec(f"env {item['name']}: fieldRef {path}")
                values[item["name"]] = fields[path]
            elif "configMapKeyRef" in ref or "secretKeyRef" in ref:
                kind = "configMapKeyRef" if "configMapKeyRef" in ref else "secretKeyRef"
                r = ref[kind]
                data = self._data(ns, "configmaps" if kind == "configMapKeyRef" else "secrets", r["name"])
                values[item["name"]] = data[r["key"]].decode()
            else:
                raise UnsupportedSpec(f"env {item['name']}: valueFrom {sorted(ref)}")
        return values

    def _data(self, ns: str, kind: str, name: str) -> dict[str, bytes]:
        obj = self.get(f"/api/v1/namespaces/{ns}/{kind}/{name}")
        if kind == "secrets":
            return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return out

    def _mounts(
        self, pod: dict[str, Any], container: dict[str, Any], pod_dir: Path, *, node: str
    ) -> list[tuple[str, str, bool]]:
        """``(source, mountPath, read-only)`` per mount; the machine's own paths left out."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        out: list[tuple[str, str, bool]] = []
        for m in container.get("volumeMounts", []):
            target = m["mountPath"]
            if m.get("subPath"):
                raise UnsupportedSpec(f"volumeMount {m['name']}: subPath")
            vol = volumes[m["name"]]
            if target in MACHINE_PATHS and ("emptyDir" in vol or "hostPath" in vol):
                continue
            src = pod_dir / "volumes" / m["name"]
            self._fill(pod, vol, src, node=node)
            out.append((str(src), target, bool(m.get("readOnly"))))
        return out

    def _fill(self, pod: dict[str, Any], vol: dict[str, Any], dest: Path, *, node: str) -> None:
        ns = pod["metadata"]["namespace"]
        if "emptyDir" in vol:
            dest.mkdir(parents=True, exist_ok=True)
        elif "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            pvc = self.get(f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{claim}")
            if pvc.get("status", {}).get("phase") != "Bound":
                raise UnsupportedSpec(f"volume {vol['name']}: claim {ns}/{claim} is not bound")
            # The claim's own directory: the data outlives the pod, as a volume's does.
            real = self.workdir / "claims" / ns / claim
            real.mkdir(parents=True, exist_ok=True)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not dest.exists():
                dest.symlink_to(real)
        elif "hostPath" in vol:
            # The node's own directory: several simulated nodes share this machine.
            real = self.workdir / "nodes" / node / vol["hostPath"]["path"].lstrip("/")
            real.mkdir(parents=True, exist_ok=True)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not dest.exists():
                dest.symlink_to(real)
        elif "configMap" in vol or "secret" in vol:
            kind = "configMap" if "configMap" in vol else "secret"
            src = vol[kind]
            name = src["name"] if kind == "configMap" else src["secretName"]
            data = self._data(ns, "configmaps" if kind == "configMap" else "secrets", name)
            _write_items(dest, data, src.get("items"))
        elif "projected" in vol:
            dest.mkdir(parents=True, exist_ok=True)
            for source in vol["projected"]["sources"]:
                if "serviceAccountToken" in source:
                    t = source["serviceAccountToken"]
                    token = self.cp.token(
                        ns,
                        pod["spec"].get("serviceAccountName", "default"),
                        audiences=[t["audience"]] if t.get("audience") else None,
                        pod=(pod["metadata"]["name"], pod["metadata"]["uid"]),
                        seconds=int(t.get("expirationSeconds", 3607)),
                    )
                    _write_items(dest, {t["path"]: token.encode()}, None)
                elif "configMap" in source or "secret" in source:
                    kind = "configMap" if "configMap" in source else "secret"
                    s = source[kind]
                    data = self._data(ns, "configmaps" if kind == "configMap" else "secrets", s["name"])
                    _write_items(dest, data, s.get("items"))
                elif "downwardAPI" in source:
                    for item in source["downwardAPI"]["items"]:
                        path = item["fieldRef"]["fieldPath"]
                        if path != "metadata.namespace":
                            raise UnsupportedSpec(f"downwardAPI {path}")
                        _write_items(dest, {item["path"]: ns.encode()}, None)
                else:
                    raise UnsupportedSpec(f"projected source {sorted(source)}")
        else:
            raise UnsupportedSpec(f"volume {vol['name']}: {sorted(k for k in vol if k != 'name')}")


def _write_items(dest: Path, data: dict[str, bytes], items: list[dict[str, Any]] | None) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    chosen = {i["key"]: i["path"] for i in items} if items else {k: k for k in data}
    for key, rel in chosen.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data[key])


def _expand(text: str, values: dict[str, str]) -> str:
    return _VAR.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def _parents(paths: list[Path]) -> list[Path]:
    """Every directory ``mkdir -p`` will make for ``paths``, outermost first."""
    made: list[Path] = []
    for p in paths:
        chain = []
        while not p.exists():
            chain.append(p)
            p = p.parent
        made += [c for c in reversed(chain) if c not in made]
    return made


def publish_endpoints(cp: ControlPlane, service: dict[str, Any], pods: list[RunningPod]) -> dict[str, Any]:
    """The EndpointSlice of ``service`` with the running pods' real addresses, as the
    endpoint-slice controller would write it for ready pods (that controller is off here)."""
    meta = service["metadata"]
    ports = []
    for sp in service["spec"]["ports"]:
        target = sp.get("targetPort", sp["port"])
        port = pods[0].port(target) if isinstance(target, str) else int(target)
        ports.append({"name": sp.get("name", ""), "port": port, "protocol": sp.get("protocol", "TCP")})
    body = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{meta['name']}-local",
            "namespace": meta["namespace"],
            "labels": {
                "kubernetes.io/service-name": meta["name"],
                "endpointslice.kubernetes.io/managed-by": "tandem-tests.local",
            },
        },
        "addressType": "IPv4",
        "ports": ports,
        "endpoints": [
            {
                "addresses": [p.ip],
                "conditions": {"ready": True},
                "nodeName": p.pod["spec"]["nodeName"],
                "targetRef": {
                    "kind": "Pod",
                    "name": p.name,
                    "namespace": meta["namespace"],
                    "uid": p.pod["metadata"]["uid"],
                },
            }
            for p in pods
        ],
    }
    path = f"/apis/discovery.k8s.io/v1/namespaces/{meta['namespace']}/endpointslices"
    try:
        return dict(cp.request("POST", path, body))
    except urllib.error.HTTPError as exc:
        if exc.code != 409:
            raise
        return dict(cp.request("PUT", f"{path}/{body['metadata']['name']}", body))


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1)[:4000]
