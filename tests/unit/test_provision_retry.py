"""Provisioning rides out a JetStream API timeout (seen once on a loaded CI machine), and the
503 "temporarily unavailable" a three-server cluster answered on CI right after all three
reported healthy (the load harness's first stream creation failed on it)."""

from __future__ import annotations

from typing import Any

import nats
import pytest
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError, ServiceUnavailableError

from schemas import subjects
from services.runtime.nats import provision as provision_module
from services.runtime.nats.bus import KV_BUCKETS, provision
from services.runtime.nats.provision import NO_PLACEMENT, PLACEMENT_WAITS, while_forming


class SlowOnceJetStream:
    """The JetStream calls provision makes; the first stream creation times out."""

    def __init__(self, *, timeouts: int = 0, unavailable: int = 0) -> None:
        self.timeouts = timeouts
        self.unavailable = unavailable
        self.streams: set[str] = set()
        self.buckets: set[str] = set()

    async def stream_info(self, name: str) -> Any:
        if name not in self.streams:
            raise NotFoundError
        return object()

    async def update_stream(self, cfg: Any) -> None:
        return None

    async def add_stream(self, cfg: Any) -> None:
        if self.unavailable:
            self.unavailable -= 1
            raise ServiceUnavailableError(code=503, description="JetStream system temporarily unavailable")
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


@pytest.fixture
def no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(provision_module, "PLACEMENT_WAIT_S", 0.0)


@pytest.mark.usefixtures("no_pause")
async def test_jetstream_temporarily_unavailable_is_waited_for() -> None:
    js = SlowOnceJetStream(unavailable=3)
    await provision(js)  # type: ignore[arg-type]
    assert js.unavailable == 0 and js.streams == set(subjects.STREAM_SUBJECTS)


@pytest.mark.usefixtures("no_pause")
async def test_while_forming_waits_for_placement_but_raises_anything_else_at_once() -> None:
    answers: list[BaseException | str] = [
        APIError(code=503, err_code=NO_PLACEMENT, description="no suitable peers for placement"),
        ServiceUnavailableError(code=503),
        "placed",
    ]
    calls = 0

    async def create() -> str:
        nonlocal calls
        calls += 1
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    assert await while_forming(create, what="test") == "placed" and calls == 3

    async def refused() -> None:
        raise APIError(code=400, err_code=10058, description="stream name already in use")

    with pytest.raises(APIError, match="already in use"):
        await while_forming(refused, what="test")


@pytest.mark.usefixtures("no_pause")
async def test_a_cluster_that_never_forms_still_fails() -> None:
    with pytest.raises(ServiceUnavailableError):
        await provision(SlowOnceJetStream(unavailable=PLACEMENT_WAITS + 1))  # type: ignore[arg-type]
