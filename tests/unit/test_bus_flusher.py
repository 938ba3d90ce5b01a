"""The coalescing flusher, the ping loop, the reconnect and the header parser override private
methods of nats-py's client and the ack inbox reads two private attributes: these checks fail
when an upgrade of nats-py moves what they rely on, instead of the client silently breaking (or
parsing headers differently)."""

from __future__ import annotations

import inspect

from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from services.runtime.nats.connection import _CoalescingClient


def test_the_attributes_the_flusher_uses_still_exist() -> None:
    client = Client()
    for name in (
        "_flush_queue",
        "_pending",
        "_pending_data_size",
        "_transport",
        "_error_cb",
        "_process_op_err",
        "is_connected",
        "is_connecting",
    ):
        assert hasattr(client, name), name


def test_the_override_is_the_library_loop_plus_one_yield() -> None:
    library = inspect.getsource(Client._flusher)
    ours = inspect.getsource(_CoalescingClient._flusher)
    # The library still writes the pending list the same way the override does ...
    for line in ("self._transport.writelines(self._pending[:])", "self._pending_data_size = 0"):
        assert line in library and line in ours
    # ... and the only behaviour the override adds is the yield before writing.
    assert "await asyncio.sleep(0)" in ours and "await asyncio.sleep(0)" not in library


def test_the_ping_loop_override_is_the_library_loop_plus_messages_as_answers() -> None:
    library = inspect.getsource(Client._ping_interval)
    ours = inspect.getsource(_CoalescingClient._ping_interval)
    for line in (
        'await asyncio.sleep(self.options["ping_interval"])',
        "self._pings_outstanding += 1",
        'if self._pings_outstanding > self.options["max_outstanding_pings"]:',
        "await self._send_ping()",
    ):
        assert line in library and line in ours, line
    # What the override adds reads the counter the library keeps for every message.
    assert 'self.stats["in_msgs"] += 1' in inspect.getsource(Client._process_msg)
    assert 'self.stats["in_msgs"]' in ours and "self.stats" not in library
    assert "self._pings_outstanding = 0" in inspect.getsource(Client._process_pong)


def test_the_reconnect_still_closes_the_transport_the_override_aborts() -> None:
    # nats-py's TcpTransport keeps the stream writers the abort reaches (TLS over TCP, and TCP).
    from nats.aio.transport import TcpTransport

    transport = TcpTransport()
    assert hasattr(transport, "_io_writer") and hasattr(transport, "_bare_io_writer")
    library = inspect.getsource(Client._attempt_reconnect)
    assert "self._transport.close()" in library and "await self._transport.wait_closed()" in library


def test_the_attributes_the_ack_inbox_uses_still_exist() -> None:
    # services/runtime/nats/puback.py: its reply subjects live under the client's inbox prefix
    # (the user's own, where permissions name one) and a NUID names its subscription.
    client = Client()
    assert isinstance(client._inbox_prefix, bytearray)
    assert isinstance(client._nuid.next(), bytearray)


def test_the_library_parses_header_blocks_through_the_overridden_method() -> None:
    # nats-py calls it on the instance, so the override is the parser every message meets.
    assert "self._parse_header_lines(" in inspect.getsource(Client._process_headers)


# Header blocks as they come and as they could come: real names and values, names with
# whitespace or non-ASCII bytes, lines without a colon, empty lines, stray separators.
_HEADER_PARTS = st.sampled_from(
    [
        b"Nats-Msg-Id",
        b"Nats-Expected-Last-Subject-Sequence",
        b"KV-Operation",
        b"traceparent",
        b"DEL",
        b"123",
        b":",
        b": ",
        b" ",
        b"\t",
        b"\x0b",
        b"\x1c",
        b"\x7f",
        b"\xc3\xa9",
        b"\xff",
        b"\r\n",
        b"\r",
        b"\n",
        b"a b",
        b"",
    ]
)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.lists(_HEADER_PARTS, max_size=6).map(b"".join), max_size=8).map(b"\r\n".join))
def test_the_header_parser_gives_the_library_result(raw: bytes) -> None:
    assert _CoalescingClient._parse_header_lines(raw) == Client._parse_header_lines(raw)


def test_the_header_parser_on_the_blocks_a_kv_watch_delivers() -> None:
    raw = (
        b"Nats-Stream: KV_tandem-allocs\r\nNats-Subject: $KV.tandem-allocs.node-1\r\n"
        b"Nats-Sequence: 42\r\nNats-Last-Sequence: 41\r\nNats-Msg-Id: x:node-1:41:\r\n"
        b"Nats-Expected-Last-Subject-Sequence: 41\r\nbad name: dropped\r\n\xc3\xa9: dropped\r\n\r\n"
    )
    parsed = _CoalescingClient._parse_header_lines(raw)
    assert parsed == Client._parse_header_lines(raw)
    assert parsed["Nats-Sequence"] == "42" and "bad name" not in parsed and len(parsed) == 6
