"""A delivery's position read from its reply subject agrees with nats-py's own parser, in both
forms the server sends; anything else is refused with nats-py's NotJSMessageError."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError

from services.runtime.nats.jsack import Position, position

V1 = "$JS.ACK.KV_tandem-allocs.Xx1Yy2.3.4711.88.1764633600123456789.12"
V2 = "$JS.ACK._.ACC7HASH.KV_tandem-allocs.Xx1Yy2.3.4711.88.1764633600123456789.12.r4nd0m"
V2_NO_RANDOM = V2.rsplit(".", 1)[0]
V2_DOMAIN = "$JS.ACK.hub.ACC7HASH.ALLOC.allocator.1.99.98.1764633600123456789.0.tok"


@pytest.mark.parametrize("reply", [V1, V2, V2_NO_RANDOM, V2_DOMAIN])
def test_the_position_is_what_nats_py_reads(reply: str) -> None:
    meta = Msg.Metadata._from_reply(reply)
    assert position(reply) == Position(
        stream_seq=meta.sequence.stream, delivered=meta.num_delivered, pending=meta.num_pending
    )


def test_the_v1_fields_by_name() -> None:
    assert position(V1) == Position(stream_seq=4711, delivered=3, pending=12)


@pytest.mark.parametrize(
    "reply",
    [
        None,
        "",
        "_INBOX.abc.def",
        "$JS.ACK.too.short",
        "$JS.ACK.a.b.c.d.e.f.g.h",  # ten tokens: neither form
        "$JS.API.KV_x.c.3.4711.88.1764633600123456789.12",  # not an ack subject
        "$JS.ACK.KV_x.c.three.4711.88.1764633600123456789.12",  # a count that is no number
    ],
)
def test_anything_else_is_not_a_jetstream_message(reply: str | None) -> None:
    with pytest.raises(NotJSMessageError):
        position(reply)
