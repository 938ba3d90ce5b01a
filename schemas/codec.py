"""Codecs, built once: msgpack on the wire, JSON for humans (CLI, annotations, files).

One decoder per stream decodes the tagged union of what that stream carries; a message that
fails to decode raises :class:`msgspec.DecodeError` / :class:`msgspec.ValidationError` with the
path of the bad field, which the services forward to the dead-letter subject.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import msgspec

from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    AllocatorHeartbeat,
    AllocRecord,
    Applied,
    Assignment,
    ClaimRecord,
    Cleaned,
    DeadLetter,
    DeviceCommand,
    ForwardReply,
    Freed,
    HealthEvent,
    Heartbeat,
    InventoryQuery,
    InventoryReply,
    JobRecord,
    JobRequest,
    NodeAllocations,
    NodeInventory,
    NodeLabels,
    NodeRecord,
    PreemptionPlan,
    Release,
    RequestRecord,
)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

NodeEvent = NodeInventory | HealthEvent | Heartbeat | Applied | Cleaned
AllocEvent = AllocationRequest | JobRequest | Assignment | AllocationFailed | Release | Freed | PreemptionPlan
AnyMessage = (
    NodeEvent | AllocEvent | DeadLetter | DeviceCommand | InventoryQuery | InventoryReply | ForwardReply
)

_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()

NODE_EVENT = msgspec.msgpack.Decoder(NodeEvent)
ALLOC_EVENT = msgspec.msgpack.Decoder(AllocEvent)
ANY_MESSAGE = msgspec.msgpack.Decoder(AnyMessage)
DEAD_LETTER = msgspec.msgpack.Decoder(DeadLetter)
COMMAND = msgspec.msgpack.Decoder(DeviceCommand)
QUERY = msgspec.msgpack.Decoder(InventoryQuery)
REPLY = msgspec.msgpack.Decoder(InventoryReply)
FORWARD_REPLY = msgspec.msgpack.Decoder(ForwardReply)
NODE_RECORD = msgspec.msgpack.Decoder(NodeRecord)
NODE_ALLOCS = msgspec.msgpack.Decoder(NodeAllocations)
REQUEST_RECORD = msgspec.msgpack.Decoder(RequestRecord)
JOB_RECORD = msgspec.msgpack.Decoder(JobRecord)
NODE_LABELS = msgspec.msgpack.Decoder(NodeLabels)
CLAIM_RECORD = msgspec.msgpack.Decoder(ClaimRecord)
ALLOCATOR_HEARTBEAT = msgspec.msgpack.Decoder(AllocatorHeartbeat)

DecodeErrors = (msgspec.DecodeError, msgspec.ValidationError)


class RecordDecoder(Protocol[T_co]):
    """What decodes a KV record: a msgspec decoder, or :class:`NodeAllocsDecoder`."""

    def decode(self, data: bytes, /) -> T_co: ...


class _AllocsFrame(msgspec.Struct):
    """A node allocation record with each allocation left undecoded (NodeAllocations' shape)."""

    node: str
    allocations: dict[str, msgspec.Raw] = {}


_ALLOCS_FRAME = msgspec.msgpack.Decoder(_AllocsFrame)
_ALLOC_RECORD = msgspec.msgpack.Decoder(AllocRecord)


class NodeAllocsDecoder:
    """Decodes node allocation records as :data:`NODE_ALLOCS` does, for a reader that sees
    every write of many records (a watch, a follower of every node).

    One write changes one allocation of a node's record and carries the others unchanged, and
    decoding the whole record again was most of what such a reader spent on it. So the
    decoder remembers, per node, each allocation's bytes and decoded :class:`AllocRecord`,
    and decodes only the allocations whose bytes changed; the others are the very objects of
    the last record (which lets a reader compare by identity). Errors are those of
    :data:`NODE_ALLOCS`, with the same paths. Memory: the last record's bytes of each
    node that holds something.
    """

    def __init__(self) -> None:
        self._last: dict[str, dict[str, tuple[msgspec.Raw, AllocRecord]]] = {}

    def decode(self, data: bytes) -> NodeAllocations:
        frame = _ALLOCS_FRAME.decode(data)
        before = self._last.get(frame.node, {})
        seen: dict[str, tuple[msgspec.Raw, AllocRecord]] = {}
        allocations: dict[str, AllocRecord] = {}
        for rid, raw in frame.allocations.items():
            known = before.get(rid)
            if known is not None and known[0] == raw:
                rec = known[1]
            else:
                try:
                    rec = _ALLOC_RECORD.decode(raw)
                except msgspec.ValidationError as exc:
                    raise msgspec.ValidationError(_nested(str(exc), "$.allocations[...]")) from None
            allocations[rid] = rec
            seen[rid] = (raw, rec)
        if seen:
            self._last[frame.node] = seen
        else:
            self._last.pop(frame.node, None)  # nothing held: nothing to remember
        return NodeAllocations(node=frame.node, allocations=allocations)


def _nested(message: str, at: str) -> str:
    """A validation error of an inner value, with the path it has in the outer one."""
    head, sep, path = message.partition(" - at `$")
    return f"{head} - at `{at}{path}" if sep else f"{head} - at `{at}`"


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def to_json(obj: Any) -> bytes:
    return _json_encoder.encode(obj)


def from_json(data: bytes | str, type: type[T]) -> T:
    return msgspec.json.decode(data, type=type)


def to_builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj)


def validated(obj: T) -> T:
    """``obj`` checked against its type's constraints (``Struct(...)`` does not check
    ``Meta`` bounds such as ``gpus >= 0``; decoding does). Raises ``msgspec.ValidationError``
    naming the field."""
    return msgspec.convert(msgspec.to_builtins(obj), type(obj))
