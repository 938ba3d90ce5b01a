"""Three NATS servers in network namespaces of their own, one cut off and brought back.

What ``tandem loadtest --partition-server-at`` stands on (:class:`EmbeddedNatsCluster` with
``networks``, :class:`~services.runtime.process.podnet.PodNetwork`): a server cut off runs on
but nothing reaches it, so a client connected to it sees silence rather than a closed
connection; the other two keep a replicated stream writable (a new leader where the cut one
led); after the cut is healed the server is current again and nothing written meanwhile is
missing from it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import nats
import pytest
from nats.aio.msg import Msg
from nats.js.api import StreamConfig

from services.runtime.nats.connection import connect
from services.runtime.process.embedded import EmbeddedNatsCluster
from services.runtime.process.podnet import PodNetwork, forwarding_back, forwarding_on
from services.runtime.settings import Settings
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (ip netns add)"),
]

# The addresses of these tests' namespaces: 10.233.0.0/16, names starting "tn".
SECOND = 233


@pytest.fixture
def cluster(tmp_path: object) -> Iterator[EmbeddedNatsCluster]:
    before = forwarding_on()
    nets: list[PodNetwork] = []
    try:
        nets = [PodNetwork.create(second=SECOND, prefix="tn") for _ in range(3)]
        with EmbeddedNatsCluster(networks=nets) as c:
            yield c
    finally:
        for net in nets:
            net.delete()
        forwarding_back(before)


def test_servers_listen_on_their_own_namespaces_address(cluster: EmbeddedNatsCluster) -> None:
    hosts = [m.host for m in cluster.members]
    assert all(h.startswith(f"10.{SECOND}.") for h in hosts) and len(set(hosts)) == 3
    assert cluster.urls == [f"nats://{m.host}:{m.port}" for m in cluster.members]


async def test_a_partitioned_server_is_silent_and_the_others_go_on(cluster: EmbeddedNatsCluster) -> None:
    cut = 0
    others = [u for i, u in enumerate(cluster.urls) if i != cut]
    writer = await nats.connect(servers=others, max_reconnect_attempts=-1, allow_reconnect=True)
    lonely = await nats.connect(servers=[cluster.urls[cut]], allow_reconnect=False)
    try:
        js = writer.jetstream(timeout=10)
        await js.add_stream(StreamConfig(name="PART", subjects=["part.>"], num_replicas=3))
        await js.publish("part.before", b"0")

        cluster.partition(cut)
        # The cut server's client gets no answer (no error either: silence).
        with pytest.raises(nats.errors.TimeoutError):
            await lonely.request("anything", b"", timeout=1.0)
        assert lonely.is_connected
        # The other two still make a quorum: writes go on, after an election if needed.
        acks = [await _publish_when_led(js, f"part.during.{i}") for i in range(20)]
        assert [a.seq for a in acks] == list(range(2, 22))
        assert cluster.members[cut].alive

        cluster.rejoin(cut)
        await asyncio.to_thread(cluster.wait_healthy, [cut], timeout=60)
        # Current again: the cut server's own view of the stream has every message.
        jsl = lonely.jetstream(timeout=10)

        async def current() -> bool:
            try:
                return (await jsl.stream_info("PART")).state.messages == 21
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.APIError):
                return False  # still catching up

        await wait_until(current, timeout=20, poll=0.1, what="the rejoined server's copy of the stream")
        assert (await jsl.stream_info("PART")).state.last_seq == 21
    finally:
        await lonely.close()
        await writer.close()


async def test_a_client_on_the_cut_server_moves_to_another_within_its_pings(
    cluster: EmbeddedNatsCluster,
) -> None:
    """Tandem's connection (:func:`services.runtime.nats.connection.connect`) on the server that
    is cut off: its pings go unanswered, it takes the connection for dead and reconnects to one
    of the others (learnt from the cluster) while the cut lasts — also with publishes queued
    behind the stalled socket — and its subscription works there."""
    cut = 0
    settings = Settings(nats_url=cluster.urls[cut], nats_ping_interval=0.5, service="partition-test")
    nc = await connect(settings)
    peer = await nats.connect(servers=[u for i, u in enumerate(cluster.urls) if i != cut])
    try:
        assert nc.connected_url is not None and nc.connected_url.port == cluster.members[cut].port
        got: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_msg(msg: Msg) -> None:
            await got.put(msg.data)

        await nc.subscribe("part.echo", cb=on_msg)
        await nc.flush()
        cut_at = time.monotonic()
        cluster.partition(cut)
        # A busy client: its publishes pile up behind the stalled socket meanwhile.
        for _ in range(3000):
            await nc.publish("part.queued", b"x" * 512)

        def moved() -> bool:
            url = nc.connected_url
            return nc.is_connected and url is not None and url.port != cluster.members[cut].port

        await wait_until(moved, timeout=15, what="the client on another server")
        moved_after = time.monotonic() - cut_at
        assert nc.is_connected and moved_after < 10, moved_after
        await peer.publish("part.echo", b"after")
        assert await asyncio.wait_for(got.get(), 5) == b"after"
    finally:
        cluster.rejoin(cut)
        await peer.close()
        await nc.close()


async def _publish_when_led(js: nats.js.JetStreamContext, subject: str) -> nats.js.api.PubAck:
    """Publish once the stream has a leader the client can reach (an election may be on)."""
    acked: list[nats.js.api.PubAck] = []

    async def publish() -> bool:
        try:
            # The same id on every try: one that was stored but not acked is not stored twice.
            acked.append(await js.publish(subject, b"x", timeout=2, headers={"Nats-Msg-Id": subject}))
        except (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError, nats.js.errors.APIError):
            return False
        return True

    await wait_until(publish, timeout=30, poll=0.1, what=f"a quorum storing {subject}")
    return acked[0]
