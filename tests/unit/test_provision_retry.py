"""Provisioning rides out a JetStream API timeout (seen once on a loaded CI machine)."""

from __future__ import annotations

from typing import Any

import nats
import pytest
from nats.js.errors import BucketNotFoundError, NotFoundError

from schemas import subjects
from services.runtime.nats.bus import KV_BUCKETS, provision


class SlowOnceJetStream:
    """The JetStream calls provision makes; the first stream creation times out."""

    def __init__(self, *, timeouts: int) -> None:
        self.timeouts = timeouts
        self.streams: set[str] = set()
        self.buckets: set[str] = set()

    async def stream_info(self, name: str) -> Any:
        if name not in self.streams:
            raise NotFoundError
        return object()

    async def update_stream(self, cfg: Any) -> None:
        return None

    async def add_stream(self, cfg: Any) -> None:
        if self.timeouts:
            self.timeouts -= 1
            raise nats.errors.TimeoutError
        self.streams.add(cfg.name)

    async def key_value(self, bucket: str) -> Any:
        if bucket not in self.buckets:
            raise BucketNotFoundError

        class Kv:
            _direct = True

        return Kv()

    async def create_key_value(self, cfg: Any) -> None:
        self.buckets.add(cfg.bucket)


async def test_a_timed_out_step_is_tried_again() -> None:
    js = SlowOnceJetStream(timeouts=1)
    await provision(js)  # type: ignore[arg-type]
    assert js.streams == set(subjects.STREAM_SUBJECTS) and js.buckets == set(KV_BUCKETS)


async def test_a_server_that_keeps_timing_out_still_fails() -> None:
    with pytest.raises(nats.errors.TimeoutError):
        await provision(SlowOnceJetStream(timeouts=10), attempts=3)  # type: ignore[arg-type]
