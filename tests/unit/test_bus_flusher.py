"""The coalescing flusher overrides a private method of nats-py's client and the ack inbox reads
two private attributes: these checks fail when an upgrade of nats-py moves what they rely on,
instead of the client silently breaking."""

from __future__ import annotations

import inspect

from nats.aio.client import Client

from services.runtime.bus import _CoalescingClient


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


def test_the_attributes_the_ack_inbox_uses_still_exist() -> None:
    # services/runtime/puback.py: its reply subjects live under the client's inbox prefix
    # (the user's own, where permissions name one) and a NUID names its subscription.
    client = Client()
    assert isinstance(client._inbox_prefix, bytearray)
    assert isinstance(client._nuid.next(), bytearray)
