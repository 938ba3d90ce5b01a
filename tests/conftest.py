"""Shared fixtures: a real nats-server per test session (127.0.0.1, free port, JetStream).

Tests that need NATS take ``nats_url`` (and usually ``bus_factory``); each test gets fresh
streams and buckets via ``clean_jetstream`` so tests stay independent while the server start
cost is paid once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from nats.js.errors import NotFoundError

from schemas import subjects
from services.runtime.nats.bus import KV_BUCKETS, Bus
from services.runtime.process.embedded import EmbeddedNats
from services.runtime.settings import Settings, load_settings


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


def make_settings(nats_url: str, service: str, **overrides: Any) -> Settings:
    return load_settings(service, environ={}, nats_url=nats_url, log_json=True, **overrides)


@pytest.fixture
async def clean_jetstream(nats_url: str) -> AsyncIterator[None]:
    """Delete every Tandem stream and bucket before the test so it starts from nothing."""
    bus = await Bus.open(make_settings(nats_url, "test-cleaner"), provision_streams=False)
    for name in [*subjects.STREAM_SUBJECTS, *(f"KV_{b}" for b in KV_BUCKETS)]:
        with contextlib.suppress(NotFoundError):
            await bus.js.delete_stream(name)
    await bus.close()
    yield


BusFactory = Callable[..., Awaitable[Bus]]


@pytest.fixture
async def bus_factory(nats_url: str, clean_jetstream: None) -> AsyncIterator[BusFactory]:
    """Open provisioned buses (one per simulated service); all closed after the test."""
    opened: list[Bus] = []

    async def factory(service: str = "test", **overrides: Any) -> Bus:
        bus = await Bus.open(make_settings(nats_url, service, **overrides))
        opened.append(bus)
        return bus

    yield factory
    for bus in opened:
        await bus.close()
