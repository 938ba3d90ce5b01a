"""Build the real control plane and Jaeger from their Go modules, pinned, and cache the binaries.

Nothing here downloads a prebuilt binary: each program is compiled with the machine's Go from
the module proxy's sources, at the versions that the small modules under ``tools/`` pin in their
``go.mod``/``go.sum`` (one module per upstream project, because each pins its own release of the
shared dependencies: kwok its own ``k8s.io/*`` client, Jaeger the OpenTelemetry Collector's).

Binaries are cached by the hash of their module's ``go.mod`` + ``go.sum``, the program and the Go
version, in ``.cache/cluster/`` under the checkout (ignored by git) unless
``TANDEM_CLUSTER_CACHE`` names another folder; a second run with the same pins builds nothing,
and on a fresh clone Go's own build cache (``GOCACHE``) turns a rebuild into little more than
the link.

Usage::

    python -m tests.cluster.build            # build what is missing, print one line per program
    python -m tests.cluster.build --json     # the same, then the paths as one JSON object
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOLS = HERE / "tools"
ROOT = HERE.parents[1]

KUBERNETES_VERSION = "v1.36.3"  # the tools/kube/go.mod require line; a test checks they agree
# What `kube-apiserver --version` and the /version endpoint report: k8s.io/kubernetes built
# outside its repository has no git metadata, and Helm reads the server's version.
_KUBE_LDFLAGS = " ".join(
    [
        f"-X k8s.io/component-base/version.gitVersion={KUBERNETES_VERSION}",
        "-X k8s.io/component-base/version.gitMajor=1",
        "-X k8s.io/component-base/version.gitMinor=" + KUBERNETES_VERSION.split(".")[1],
        "-X k8s.io/component-base/version.gitTreeState=clean",
        f"-X k8s.io/client-go/pkg/version.gitVersion={KUBERNETES_VERSION}",
    ]
)


@dataclass(frozen=True)
class Program:
    name: str  # the binary's file name
    module: str  # folder under tools/
    package: str  # Go import path of the main package
    ldflags: str = ""


PROGRAMS = (
    Program("kube-apiserver", "kube", "k8s.io/kubernetes/cmd/kube-apiserver", _KUBE_LDFLAGS),
    Program("kube-scheduler", "kube", "k8s.io/kubernetes/cmd/kube-scheduler", _KUBE_LDFLAGS),
    Program(
        "kube-controller-manager", "kube", "k8s.io/kubernetes/cmd/kube-controller-manager", _KUBE_LDFLAGS
    ),
    Program("etcd", "etcd", "go.etcd.io/etcd/server/v3"),
    Program("kwok", "kwok", "sigs.k8s.io/kwok/cmd/kwok"),
    Program("jaeger", "jaeger", "github.com/jaegertracing/jaeger/cmd/jaeger"),
)


class BuildError(RuntimeError):
    """A program could not be built; the message carries the end of Go's output."""


def cache_root() -> Path:
    configured = os.environ.get("TANDEM_CLUSTER_CACHE")
    return Path(configured) if configured else ROOT / ".cache" / "cluster"


def go_version(go: str) -> str:
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _key(program: Program, go: str) -> str:
    h = hashlib.sha256()
    for f in ("go.mod", "go.sum"):
        h.update((TOOLS / program.module / f).read_bytes())
    h.update(f"{program.package}\0{program.ldflags}\0{go_version(go)}".encode())
    return h.hexdigest()[:16]


def binary_path(program: Program, go: str = "go") -> Path:
    return cache_root() / f"{program.name}-{_key(program, go)}" / program.name


def find_go() -> str:
    go = shutil.which("go")
    if go is None:
        raise BuildError("the Go toolchain (`go`) is not on PATH; tests/cluster builds its programs with it")
    return go


def build(program: Program, *, go: str, log: bool = True) -> Path:
    """The cached binary of ``program``, building it first when the pins changed."""
    target = binary_path(program, go)
    if target.exists():
        if log:
            print(f"{program.name}: cached {target}", file=sys.stderr)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    cmd = [go, "build", "-trimpath", "-ldflags", f"-s -w {program.ldflags}".strip(), "-o", str(partial)]
    cmd.append(program.package)
    env = {**os.environ, "GOFLAGS": "-mod=readonly"}
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=TOOLS / program.module, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(
            f"go build {program.package} (tools/{program.module}) failed:\n{proc.stderr[-4000:]}"
        )
    partial.rename(target)  # only a complete binary ever has the final name
    if log:
        print(f"{program.name}: built in {time.monotonic() - started:.0f} s → {target}", file=sys.stderr)
    return target


def build_all(names: list[str] | None = None, *, log: bool = True) -> dict[str, Path]:
    go = find_go()
    chosen = [p for p in PROGRAMS if names is None or p.name in names]
    unknown = set(names or ()) - {p.name for p in PROGRAMS}
    if unknown:
        raise BuildError(f"unknown program(s) {sorted(unknown)}; known: {[p.name for p in PROGRAMS]}")
    return {p.name: build(p, go=go, log=log) for p in chosen}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.cluster.build", description=__doc__.splitlines()[0])
    p.add_argument("programs", nargs="*", help="only these (default: all)")
    p.add_argument("--json", action="store_true", help="print the binaries' paths as one JSON object")
    args = p.parse_args(argv)
    started = time.monotonic()
    try:
        paths = build_all(args.programs or None)
    except BuildError as exc:
        print(f"build: {exc}", file=sys.stderr)
        return 1
    print(f"cluster programs ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
    if args.json:
        print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
