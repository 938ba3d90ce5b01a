"""Codecs, built once: msgpack on the wire, JSON for humans (CLI, annotations, files).

One decoder per stream decodes the tagged union of what that stream carries; a message that
fails to decode raises :class:`msgspec.DecodeError` / :class:`msgspec.ValidationError` with the
path of the bad field, which the services forward to the dead-letter subject.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    AllocatorHeartbeat,
    Applied,
    Assignment,
    ClaimRecord,
    Cleaned,
    DeadLetter,
    DeviceCommand,
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

NodeEvent = NodeInventory | HealthEvent | Heartbeat | Applied | Cleaned
AllocEvent = AllocationRequest | JobRequest | Assignment | AllocationFailed | Release | Freed | PreemptionPlan
AnyMessage = NodeEvent | AllocEvent | DeadLetter | DeviceCommand | InventoryQuery | InventoryReply

_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()

NODE_EVENT = msgspec.msgpack.Decoder(NodeEvent)
ALLOC_EVENT = msgspec.msgpack.Decoder(AllocEvent)
ANY_MESSAGE = msgspec.msgpack.Decoder(AnyMessage)
DEAD_LETTER = msgspec.msgpack.Decoder(DeadLetter)
COMMAND = msgspec.msgpack.Decoder(DeviceCommand)
QUERY = msgspec.msgpack.Decoder(InventoryQuery)
REPLY = msgspec.msgpack.Decoder(InventoryReply)
NODE_RECORD = msgspec.msgpack.Decoder(NodeRecord)
NODE_ALLOCS = msgspec.msgpack.Decoder(NodeAllocations)
REQUEST_RECORD = msgspec.msgpack.Decoder(RequestRecord)
JOB_RECORD = msgspec.msgpack.Decoder(JobRecord)
NODE_LABELS = msgspec.msgpack.Decoder(NodeLabels)
CLAIM_RECORD = msgspec.msgpack.Decoder(ClaimRecord)
ALLOCATOR_HEARTBEAT = msgspec.msgpack.Decoder(AllocatorHeartbeat)

DecodeErrors = (msgspec.DecodeError, msgspec.ValidationError)


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
