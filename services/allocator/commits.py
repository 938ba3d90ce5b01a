"""The allocator's writes, as pure mutations of the records they change.

A node's allocation record (``NodeAllocations``, KV ``tandem-allocs``) is the unit of
atomicity and the single source of truth for what a node has handed out: it is written with
compare-and-set by :class:`~services.runtime.kv.records.RecordStore`, which folds every mutation
queued for one node into one write (group commit) and re-applies them to the fresh record
when another replica wrote first. So each mutation here must decide from the record it is
given, never from the allocator's view: :func:`add_allocation` refuses (``Conflict``) when a
device it wants is held in the fresh record, or when a GPU it takes a share of has no room
left for it there (:class:`ShareRoom`) — that is what keeps two replicas from ever handing
out one device, or more of a GPU than it has: each decides on its own view, and two shares
decided on one stale view must not both land on a GPU that fits one.

The request records' writes (the *claim* among them) are :mod:`.requestbook`'s; the two
errors both kinds of write raise are here: :class:`AlreadyDone` and :class:`DifferentRequest`.
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec

from schemas.messages import AllocRecord, Assignment, NodeAllocations
from services.runtime.kv.records import Conflict, Mutation
from services.runtime.nats.bus import Refuse

AllocState = Literal["assigned", "releasing"]


class AlreadyDone(Exception):
    """The request has an outcome already (placed, freed, cancelled or rejected)."""


class DifferentRequest(Refuse):
    """A request id already used for a different request: the request id is the key of
    everything about a request, so the second one is refused rather than taking its place."""


# -- node allocation records -------------------------------------------------------------------


class ShareRoom(msgspec.Struct, frozen=True):
    """What the shared GPUs of a node can hold, as the allocator core counts it
    (``core.shares.fit_mask``): each GPU's memory, 100 % of compute, and at most
    ``max_shares`` shares (the request's device class)."""

    memory_mib: dict[str, int]  # GPU device id -> its memory
    max_shares: int


def _clash(base: NodeAllocations, assignment: Assignment) -> set[str]:
    """Devices of ``assignment`` another allocation of ``base`` holds: any device held whole
    by either side, and a GPU shared in another mode (HAMi-core and MPS limit a GPU's shares in
    different ways; the node agent runs one per GPU). Two shares of one mode on one GPU do not
    clash here; whether the GPU has room for one more is :func:`_no_room`'s question."""
    mine = set(assignment.device_ids())
    my_shares = assignment.shares()
    whole: set[str] = set()
    shared: set[str] = set()
    for other in base.allocations.values():
        theirs = other.assignment.shares()
        same_mode = other.assignment.sharing == assignment.sharing
        for dev in other.assignment.device_ids():
            (shared if dev in theirs and same_mode else whole).add(dev)
    return (mine & whole) | ((mine - set(my_shares)) & shared)


def _no_room(base: NodeAllocations, assignment: Assignment, room: ShareRoom) -> list[str]:
    """The shares of ``assignment`` that the GPUs of ``base`` have no room left for: memory,
    compute or share count over what :class:`ShareRoom` says, counting every share ``base``
    holds on the GPU (as ``core.shares.fit_mask`` decides)."""
    mine = assignment.shares()
    used: dict[str, list[int]] = {dev: [0, 0, 0] for dev in mine}
    for other in base.allocations.values():
        for dev, (mem, cores) in other.assignment.shares().items():
            u = used.get(dev)
            if u is not None:
                u[0] += mem
                u[1] += cores
                u[2] += 1
    out = []
    for dev, (mem, cores) in mine.items():
        u = used[dev]
        if u[2] >= room.max_shares:
            out.append(f"{dev} holds {u[2]} shares already (at most {room.max_shares})")
        elif u[0] + mem > room.memory_mib.get(dev, 0):
            out.append(f"{dev} has {room.memory_mib.get(dev, 0) - u[0]} MiB left, not {mem}")
        elif u[1] + cores > 100:
            out.append(f"{dev} has {100 - u[1]} % compute left, not {cores}")
    return out


def add_allocation(
    node: str, request_id: str, rec: AllocRecord, *, share_room: ShareRoom | None = None
) -> Mutation[NodeAllocations]:
    """Add ``rec`` to the node's record; ``share_room`` is required when it holds shares."""

    def mutate(current: NodeAllocations | None) -> NodeAllocations | None:
        base = current if current is not None else NodeAllocations(node=node)
        if request_id in base.allocations:
            raise Conflict(f"{request_id} is already held on {node}")
        clash = _clash(base, rec.assignment)
        if clash:
            raise Conflict(f"{node}: {', '.join(sorted(clash))} held by another allocation")
        if rec.assignment.shares():
            if share_room is None:
                raise ValueError(f"{request_id}: an allocation of shares needs the GPUs' room")
            full = _no_room(base, rec.assignment, share_room)
            if full:
                raise Conflict(f"{node}: {'; '.join(full)}")
        allocations = dict(base.allocations)
        allocations[request_id] = rec
        return NodeAllocations(node=node, allocations=allocations)

    return mutate


def set_state(request_id: str, state: AllocState, *, only_from: frozenset[str]) -> Mutation[NodeAllocations]:
    """Move one allocation to ``state`` when it is in one of ``only_from`` (else no change)."""

    def mutate(current: NodeAllocations | None) -> NodeAllocations | None:
        rec = current.allocations.get(request_id) if current is not None else None
        if current is None or rec is None or rec.state not in only_from:
            return None
        allocations = dict(current.allocations)
        allocations[request_id] = msgspec.structs.replace(rec, state=state, updated_at=time.time())
        return msgspec.structs.replace(current, allocations=allocations)

    return mutate


def drop_allocation(request_id: str, *, only_from: frozenset[str] | None = None) -> Mutation[NodeAllocations]:
    """Remove one allocation (when in one of ``only_from``, if given)."""

    def mutate(current: NodeAllocations | None) -> NodeAllocations | None:
        rec = current.allocations.get(request_id) if current is not None else None
        if current is None or rec is None or (only_from is not None and rec.state not in only_from):
            return None
        rest = {k: v for k, v in current.allocations.items() if k != request_id}
        return msgspec.structs.replace(current, allocations=rest)

    return mutate
