"""When a connection is taken for dead (``services.runtime.nats.connection``): pings every
``nats_ping_interval``, two unanswered and it is stale — but a message received since the last
ping counts as the server's answer, since the server's PONG waits behind what it still has to
send (a busy replica reading every write of the fleet). Silence is what a server cut off
sends; a flood is not silence."""

from __future__ import annotations

from typing import Any

import nats
from nats.aio.msg import Msg

from services.runtime.nats.connection import connect
from tests.conftest import make_settings
from tests.waiting import wait_until


async def test_messages_count_as_answers_and_silence_makes_the_connection_stale(nats_url: str) -> None:
    nc = await connect(make_settings(nats_url, "ping-test", nats_ping_interval=0.2))
    peer = await nats.connect(nats_url)

    async def unanswered(future: Any = None) -> None:
        """The ping never reaches the server, so no PONG ever comes back."""

    pings = got = 0

    async def answered_by_a_message(future: Any = None) -> None:
        """No PONG either, but a message from the server before the next ping is due."""
        nonlocal pings
        pings += 1
        await peer.publish("ping-test.flood", b"x")

    async def count(msg: Msg) -> None:
        nonlocal got
        got += 1

    try:
        await nc.subscribe("ping-test.flood", cb=count)
        await nc.flush()
        nc._send_ping = answered_by_a_message  # type: ignore[method-assign]
        # Ten pings answered by messages alone: alive.
        await wait_until(lambda: pings >= 10, timeout=10, what="ten pings answered by messages only")
        assert got >= 9 and nc.stats["reconnects"] == 0 and nc.is_connected
        # Neither message nor PONG: stale within a few intervals, and connected again.
        nc._send_ping = unanswered  # type: ignore[method-assign]
        stale = "the silent connection taken for dead"
        await wait_until(lambda: nc.stats["reconnects"] >= 1, timeout=5, what=stale)
    finally:
        await peer.close()
        await nc.close()
