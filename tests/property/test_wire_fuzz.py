"""Hypothesis fuzzing of everything that reads the wire: every decoder, the subject check and
the bus's pre-handler checks. Whatever bytes arrive, the only outcomes are a decoded, bounded
message or a refusal with a reason — never another exception (which would crash a consumer)."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import codec, limits, routing, subjects

DECODERS = [
    codec.NODE_EVENT,
    codec.ALLOC_EVENT,
    codec.ANY_MESSAGE,
    codec.DEAD_LETTER,
    codec.COMMAND,
    codec.QUERY,
    codec.REPLY,
    codec.NODE_RECORD,
    codec.NODE_ALLOCS,
    codec.REQUEST_RECORD,
    codec.ALLOCATOR_HEARTBEAT,
]
KINDS = [
    "node.inventory",
    "node.health",
    "node.heartbeat",
    "node.applied",
    "node.cleaned",
    "node.command",
    "alloc.request",
    "alloc.assigned",
    "alloc.failed",
    "alloc.release",
    "alloc.freed",
    "dlq",
    "query.inventory",
]
FIELDS = [
    "node",
    "request_id",
    "pod",
    "gpus",
    "rdma",
    "devices",
    "problems",
    "reason",
    "topology",
    "ok",
    "seq",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=300),
    st.text(alphabet="n", min_size=limits.TEXT - 10, max_size=limits.TEXT + 10),  # at the bound
    st.binary(max_size=64),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=30,
)
# Messages that look like Tandem's: a real kind, real field names, values of any type.
look_alikes = st.builds(
    lambda kind, fields: {"kind": kind, **fields},
    st.sampled_from(KINDS),
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=6),
)
node_names = st.sampled_from(["gpu-a", "gpu-b.example", "x"])
tandem_subjects = st.one_of(
    st.builds(subjects.node_inventory, node_names),
    st.builds(subjects.node_cleaned, node_names),
    st.builds(subjects.node_health, node_names),
    st.builds(subjects.alloc_release, st.one_of(st.none(), node_names)),
    st.builds(subjects.alloc_assigned, node_names),
    st.builds(subjects.allocator_forward, st.sampled_from(["allocator-0", "a.b"])),
    st.sampled_from(
        [subjects.ALLOC_REQUEST, subjects.ALLOC_FREED, subjects.QUERY_INVENTORY, "tandem", "x.y.z"]
    ),
    st.text(max_size=60),
)


def texts(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in (*texts(k), *texts(v))]
    if isinstance(value, list):
        return [t for v in value for t in texts(v)]
    return []


def decode_or_refuse(decoder: msgspec.msgpack.Decoder[object], data: bytes) -> object | None:
    try:
        return decoder.decode(data)
    except codec.DecodeErrors:
        return None


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=2048), subject=tandem_subjects)
def test_arbitrary_bytes_decode_or_are_refused(data: bytes, subject: str) -> None:
    for decoder in DECODERS:
        message = decode_or_refuse(decoder, data)
        if message is not None:
            refusal = routing.refusal(subject, message)
            assert refusal is None or isinstance(refusal, str)


@settings(max_examples=500, deadline=None)
@given(message=look_alikes, subject=tandem_subjects)
def test_look_alike_messages_decode_bounded_or_are_refused(message: dict[str, object], subject: str) -> None:
    data = msgspec.msgpack.encode(message)
    for decoder in (codec.NODE_EVENT, codec.ALLOC_EVENT, codec.ANY_MESSAGE):
        decoded = decode_or_refuse(decoder, data)
        if decoded is None:
            continue
        # What decodes is within its bounds: no text of an allocation message is longer
        # than the longest bound (node inventories carry the topology's own texts).
        if decoder is codec.ALLOC_EVENT:
            assert all(len(t) <= limits.TEXT for t in texts(msgspec.to_builtins(decoded)))
        refusal = routing.refusal(subject, decoded)
        kind, node = routing.expected(subject)
        if refusal is None:
            assert type(decoded) is kind
            if node is not None and getattr(decoded, "node", None) is not None:
                assert decoded.node == node  # type: ignore[attr-defined]


@settings(max_examples=200, deadline=None)
@given(subject=tandem_subjects)
def test_expected_never_raises_and_names_a_known_kind(subject: str) -> None:
    kind, node = routing.expected(subject)
    assert kind is None or kind.__struct_config__.tag in KINDS  # type: ignore[attr-defined]
    assert node is None or isinstance(node, str)
