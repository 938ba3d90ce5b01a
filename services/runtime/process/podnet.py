"""A network namespace joined to this machine by a veth pair: a pod's network, played here.

Two users: the control plane of ``make cluster-test`` (a workload that the API server must
reach runs inside one, :mod:`tests.cluster.controlplane`), and the load harness, which runs each
of its three NATS servers in one of their own when a run cuts a server off the network
(``tandem loadtest --partition-server-at``, :mod:`tools.loadtest.faults`).

Each :class:`PodNetwork` is a ``/30`` of a private ``/16`` that its user names (one per user,
so they never take each other's addresses): ``host_ip`` on this machine's end of the pair,
``pod_ip`` inside, and a default route inside through the host end. Pods reach each other
through this machine, which needs IPv4 forwarding (:func:`forwarding_on`); a new machine that no
container engine ever set up has it off and drops those packets.

:meth:`PodNetwork.cut` takes the pod's end of the pair down: every packet to and from the pod
is dropped without a word (no reset, no unreachable: the host end has no carrier, and the pod
has no route), as a switch port failing or a partition would, so connections through it hang
until their own keepalives give up. :meth:`PodNetwork.heal` brings it back, and TCP's
retransmissions carry on where they stopped.

Needs root (``ip netns add``); every command is ``ip`` from iproute2.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


class PodNetworkError(RuntimeError):
    """A namespace or link could not be made; the message has ``ip``'s own words."""


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, check=check, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        raise PodNetworkError(f"{' '.join(cmd)}: {exc.stderr.strip() or exc}") from exc


def forwarding_on() -> str:
    """Turn IPv4 forwarding on; returns what it was (for :func:`forwarding_back`)."""
    before = IP_FORWARD.read_text().strip()
    if before != "1":
        IP_FORWARD.write_text("1\n")
    return before


def forwarding_back(before: str) -> None:
    """Put IPv4 forwarding back as :func:`forwarding_on` found it."""
    if before not in ("", "1"):
        IP_FORWARD.write_text(f"{before}\n")


def free_subnet(second: int) -> tuple[int, int]:
    """A /30 of ``10.<second>.0.0/16`` that no address of this machine is in.

    Drawn at random so that concurrent runs rarely race for one, and checked against the
    addresses in use so that the host end of a run killed before its clean-up (its veth and
    route stay) never shadows a new pod's: that collision cut a pod off from NATS once."""
    used = set(re.findall(rf"inet 10\.{second}\.(\d+)\.(\d+)/", sh("ip", "-4", "-o", "addr", "show").stdout))
    taken = {(int(a), int(b) & ~3) for a, b in used}
    draw = random.SystemRandom()
    for _ in range(1000):
        subnet = draw.randrange(256), draw.randrange(0, 252, 4)
        if subnet not in taken:
            return subnet
    raise PodNetworkError(f"no free /30 in 10.{second}.0.0/16 ({len(taken)} in use: stale networks?)")


@dataclass
class PodNetwork:
    """A network namespace with a veth pair: ``host_ip`` on this machine, ``pod_ip`` inside."""

    netns: str
    host_if: str
    pod_if: str
    host_ip: str
    pod_ip: str

    @classmethod
    def create(cls, *, second: int, prefix: str) -> PodNetwork:
        """A new namespace in ``10.<second>.0.0/16``; ``prefix`` (two letters) starts the names
        of the namespace and both links, so a stale one says whose it was."""
        tag = os.urandom(3).hex()
        third, fourth = free_subnet(second)
        net = cls(
            netns=f"{prefix}l{tag}",
            host_if=f"{prefix}h{tag}",
            pod_if=f"{prefix}p{tag}",
            host_ip=f"10.{second}.{third}.{fourth + 1}",
            pod_ip=f"10.{second}.{third}.{fourth + 2}",
        )
        sh("ip", "netns", "add", net.netns)
        try:
            sh("ip", "link", "add", net.host_if, "type", "veth", "peer", "name", net.pod_if)
            sh("ip", "link", "set", net.pod_if, "netns", net.netns)
            sh("ip", "addr", "add", f"{net.host_ip}/30", "dev", net.host_if)
            sh("ip", "link", "set", net.host_if, "up")
            sh("ip", "-n", net.netns, "addr", "add", f"{net.pod_ip}/30", "dev", net.pod_if)
            sh("ip", "-n", net.netns, "link", "set", "lo", "up")
            net.heal()
        except PodNetworkError:
            net.delete()
            raise
        return net

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside the pod network."""
        return ["ip", "netns", "exec", self.netns, *cmd]

    def cut(self) -> None:
        """Off the network: the pod's end down (its route goes with it), nothing in or out."""
        sh("ip", "-n", self.netns, "link", "set", self.pod_if, "down")

    def heal(self) -> None:
        """Back on the network: the pod's end up and everything else routed via the host end."""
        sh("ip", "-n", self.netns, "link", "set", self.pod_if, "up")
        sh("ip", "-n", self.netns, "route", "replace", "default", "via", self.host_ip)

    def delete(self) -> None:
        sh("ip", "link", "del", self.host_if, check=False)  # takes its peer along
        sh("ip", "netns", "del", self.netns, check=False)
