"""The pins of tests/cluster's programs (tools/*/go.mod) agree with each other and with what
the build script stamps into the binaries: one Kubernetes release for every k8s.io module, and
etcd at the release that k8s.io/kubernetes itself pins."""

from __future__ import annotations

import re

from tests.cluster.build import KUBERNETES_VERSION, PROGRAMS, TOOLS


def go_mod(module: str) -> str:
    return (TOOLS / module / "go.mod").read_text()


def test_every_staging_module_is_replaced_by_the_same_release() -> None:
    text = go_mod("kube")
    assert f"k8s.io/kubernetes {KUBERNETES_VERSION}" in text
    minor = KUBERNETES_VERSION.removeprefix("v1.")
    replaced = re.findall(r"^\s+(k8s\.io/\S+) => k8s\.io/\S+ (v\S+)$", text, re.M)
    assert len(replaced) > 25  # every staging module k8s.io/kubernetes names as v0.0.0
    assert {v for _, v in replaced} == {f"v0.{minor}"}


def test_etcd_is_the_release_kubernetes_pins() -> None:
    client = re.search(r"go\.etcd\.io/etcd/client/v3 (v[\d.]+)", go_mod("kube"))
    server = re.search(r"require go\.etcd\.io/etcd/server/v3 (v[\d.]+)", go_mod("etcd"))
    assert client and server and client.group(1) == server.group(1)


def test_every_program_has_its_module() -> None:
    for program in PROGRAMS:
        assert (TOOLS / program.module / "go.sum").exists(), program
