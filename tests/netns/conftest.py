"""Real network namespaces and veth pairs standing in for pods and VF netdevs.

A veth end plays the VF: it is a real netdev with an ifindex, MAC and MTU that moves between
real namespaces exactly as a VF does. One difference matters and is tested both ways: when a
namespace dies, the kernel returns a *physical* VF to the host namespace but destroys a veth.
Every name is unique per test and everything is removed afterwards, also on failure.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from schemas.messages import AssignedNic, Assignment, PodRef

NOT_ROOT = os.geteuid() != 0


def sh(cmd: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, shell=True, check=check, capture_output=True, text=True)


@dataclass
class Vf:
    name: str  # host netdev name (the "VF")
    peer: str
    mac: str
    mtu: int


@dataclass
class Lab:
    tag: str
    tmp: Path
    namespaces: list[str]
    links: list[str]

    def netns(self, suffix: str = "") -> str:
        name = f"tp{self.tag}{suffix}"
        sh(f"ip netns add {name}")
        self.namespaces.append(name)
        return name

    def vf(self, suffix: str = "", *, mtu: int = 1500, up: bool = True) -> Vf:
        name, peer = f"tv{self.tag}{suffix}", f"tw{self.tag}{suffix}"
        mac = "02:00:" + ":".join(f"{b:02x}" for b in os.urandom(4))
        sh(f"ip link add {name} mtu {mtu} address {mac} type veth peer name {peer}")
        if up:
            sh(f"ip link set {name} up")
        self.links += [name, peer]
        return Vf(name=name, peer=peer, mac=mac, mtu=mtu)


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    if NOT_ROOT:
        pytest.skip("network namespace tests need root (ip netns add, moving links)")
    lab = Lab(tag=uuid.uuid4().hex[:6], tmp=tmp_path, namespaces=[], links=[])
    yield lab
    for ns in lab.namespaces:
        sh(f"ip netns del {ns}", check=False)
    for link in lab.links:
        sh(f"ip link del {link}", check=False)


def link_in(ns: str | None, name: str) -> dict[str, object] | None:
    """``ip -j link show`` of one device in a namespace (None: host), or None if absent."""
    import json

    prefix = f"ip -n {ns}" if ns else "ip"
    out = sh(f"{prefix} -j link show dev {name}", check=False)
    if out.returncode != 0:
        return None
    (info,) = json.loads(out.stdout)
    return info  # type: ignore[no-any-return]


def addrs_in(ns: str, name: str) -> list[str]:
    import json

    out = sh(f"ip -n {ns} -j addr show dev {name}")
    (info,) = json.loads(out.stdout)
    return [f"{a['local']}/{a['prefixlen']}" for a in info["addr_info"] if a["family"] == "inet"]


def assignment(rid: str, uid: str, nics: list[tuple[str, Vf, str]], *, mtu: int | None = 9000) -> Assignment:
    """(RDMA device name, vf, pod ifname) per NIC; MAC 02:aa:... chosen by the 'allocator'."""
    return Assignment(
        request_id=rid,
        pod=PodRef(namespace="ml", name=f"pod-{rid}", uid=uid),
        node="node-a",
        gpus=[],
        nics=[
            AssignedNic(
                name=dev,
                pf="mlx5_0",
                vf=i,
                netdev=vf.name,
                ifname=ifname,
                mtu=mtu,
                mac=f"02:aa:00:00:00:{i + 1:02x}",
                addresses=[f"10.77.{i}.2/24"],
            )
            for i, (dev, vf, ifname) in enumerate(nics)
        ],
    )
