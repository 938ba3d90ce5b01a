"""Where a JetStream delivery sits, read straight from its reply subject.

A message handed over by a JetStream consumer carries its position in the reply (ack)
subject: ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>``,
or, in the newer form, with a domain and an account hash in front (and a random token
behind). nats-py's ``Msg.metadata`` parses all of it into frozen dataclasses and a datetime,
a few per cent of the allocator's CPU under load, where every consumed message and every
watched KV change needs only its stream sequence, delivery count or pending count.
:func:`position` reads those three, several times faster (docs/benchmarks.md,
"Measurements behind the code").
"""

from __future__ import annotations

from typing import NamedTuple

from nats.errors import NotJSMessageError

# $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<time>.<pending>
_V1_TOKENS = 9
# $JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<time>.<pending>[.<random>]
_V2_MIN_TOKENS = 11


class Position(NamedTuple):
    stream_seq: int  # the message's sequence in its stream (a KV key's revision)
    delivered: int  # how many times the consumer has delivered it (1: first time)
    pending: int  # messages of the consumer's stream still behind this one


def position(reply: str | None) -> Position:
    """The position a JetStream delivery's ``reply`` subject states; raises
    ``NotJSMessageError`` (as ``Msg.metadata`` does) when it is no JetStream ack subject."""
    tokens = reply.split(".") if reply else []
    if len(tokens) >= _V1_TOKENS and tokens[0] == "$JS" and tokens[1] == "ACK":
        try:
            if len(tokens) == _V1_TOKENS:
                return Position(int(tokens[5]), int(tokens[4]), int(tokens[8]))
            if len(tokens) >= _V2_MIN_TOKENS:
                return Position(int(tokens[7]), int(tokens[6]), int(tokens[10]))
        except ValueError:
            pass
    raise NotJSMessageError
