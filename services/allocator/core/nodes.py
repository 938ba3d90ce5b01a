"""A registered node as the core keeps it, and the small helpers every part of the core shares.

:class:`Node` is the registry's record (:class:`~services.allocator.core.cluster.Cluster`):
hardware (compiled :class:`~.model.Shape` plus the *hardware id*, which also names the
node's grouping labels and shard), labels, devices out of service, and the current group
mask (free slots, and share usage above them: :mod:`.shares`). The device-kind plugins
(:mod:`.plugins`) and the node order (:mod:`.scores`) read it; only the registry changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from schemas.topology import NodeTopology

from .model import Shape

__all__ = ["Hardware", "Node", "port_down", "slot_mask"]


@dataclass(slots=True)
class Node:
    name: str
    topology: NodeTopology
    shape: Shape
    hw: int
    labels: dict[str, str]
    # Tuples, not sets: strings-only tuples are untracked by the cycle collector, which keeps
    # full collections cheap on fleets of 10,000+ nodes.
    unavailable: tuple[str, ...]
    port_down: tuple[str, ...]
    mask: int = 0
    # Slots a device kind took out of every other kind's free mask for good (MIG-mode GPUs,
    # .plugins.mig), and the kinds' hooks told of the node's every refresh (.plugins.base).
    kind_block: int = 0
    refreshing: tuple[Callable[..., None], ...] = ()
    shard: str | None = None  # the allocator replica that looks here first (see .scores)

    @property
    def impaired(self) -> bool:
        """Has devices out of service (unhealthy, cordoned, port down)."""
        return bool(self.unavailable or self.port_down)


@dataclass(frozen=True, slots=True)
class Hardware:
    """What a hardware id stands for: the shape, the node's grouping labels, its shard."""

    shape: Shape
    labels: dict[str, str]
    shard: str | None


def slot_mask(slot_of: Mapping[str, int], devices: Iterable[str]) -> int:
    """The slot bits of ``devices`` (ids the shape does not know are left out)."""
    m = 0
    for dev in devices:
        s = slot_of.get(dev)
        if s is not None:
            m |= 1 << s
    return m


def port_down(topo: NodeTopology) -> tuple[str, ...]:
    """NICs whose port is down or still initialising (and their VFs) cannot be handed out."""
    out: list[str] = []
    for nic in topo.nics():
        if nic.port_state in ("down", "init"):
            out.append(nic.name)
            out.extend(vf.name for vf in nic.vfs)
    return tuple(out)
