"""The client's snapshot of a KV bucket when the server ends the initial values early.

The server's "nothing pending" can come before the last key's value while keys are being
rewritten (seen as `tandem device list box-1` finding no box-1 right after `tandem status`
listed it). That race cannot be forced on a real server, so this drives the snapshot through a
fake watcher at nats-py's boundary (the entries and the end marker as ``KeyWatcher.updates``
hands them over); the real-server path is covered by the CLI end-to-end tests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import nats.errors
import pytest

from schemas import codec
from schemas.messages import AllocatorHeartbeat
from services.client import TandemClient
from services.runtime.kv import read as kvread

ENTRY = SimpleNamespace  # key, value, revision, operation: what nats-py's KeyValue.Entry has


@dataclass
class FakeWatcher:
    updates_left: list[Any]
    stopped: bool = False

    async def updates(self, timeout: float) -> Any:
        if not self.updates_left:
            raise nats.errors.TimeoutError
        return self.updates_left.pop(0)

    async def stop(self) -> None:
        self.stopped = True


@dataclass
class FakeBucket:
    watcher: FakeWatcher

    async def watchall(self, **_: Any) -> FakeWatcher:
        return self.watcher


@dataclass
class FakeConnection:
    bucket: FakeBucket
    last_seq: int
    asked: list[str] = field(default_factory=list)

    @property
    def js(self) -> Any:
        async def stream_info(name: str) -> Any:
            self.asked.append(name)
            return SimpleNamespace(state=SimpleNamespace(last_seq=self.last_seq))

        return SimpleNamespace(stream_info=stream_info)

    async def kv(self, bucket: str) -> FakeBucket:
        return self.bucket


def record(name: str) -> bytes:
    # Any record type will do: the snapshot only decodes values with the decoder it is given.
    return codec.encode(AllocatorHeartbeat(instance=name))


def snapshot_of(updates: list[Any], *, last_seq: int) -> tuple[dict[str, Any], FakeConnection]:
    conn = FakeConnection(FakeBucket(FakeWatcher(updates)), last_seq=last_seq)
    client = TandemClient(conn)  # type: ignore[arg-type]
    got = asyncio.run(client._snapshot("tandem-nodes", codec.ALLOCATOR_HEARTBEAT))
    assert conn.bucket.watcher.stopped
    return got, conn


def test_an_early_end_marker_does_not_cut_the_snapshot_short() -> None:
    got, conn = snapshot_of(
        [
            ENTRY(key="box-0", value=record("box-0"), revision=5, operation=None),
            None,  # the server said nothing was pending ...
            ENTRY(key="box-1", value=record("box-1"), revision=6, operation=None),  # ... it was
        ],
        last_seq=6,
    )
    assert sorted(got) == ["box-0", "box-1"]
    assert conn.asked == ["KV_tandem-nodes"]


def test_deletes_count_towards_the_last_sequence_and_leave_the_key_out() -> None:
    got, _ = snapshot_of(
        [
            ENTRY(key="box-0", value=record("box-0"), revision=4, operation=None),
            ENTRY(key="box-1", value=b"", revision=7, operation="DEL"),
            None,
        ],
        last_seq=7,
    )
    assert sorted(got) == ["box-0"]


def test_a_last_message_that_is_gone_costs_only_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    # The message at the stream's last sequence expired: nothing will ever reach it, and the
    # snapshot returns what it has once the grace has passed (the fake answers at once).
    monkeypatch.setattr(kvread, "SNAPSHOT_GRACE_S", 0.01)
    got, _ = snapshot_of(
        [ENTRY(key="box-0", value=record("box-0"), revision=3, operation=None), None], last_seq=9
    )
    assert sorted(got) == ["box-0"]


def test_no_end_marker_at_all_is_still_an_error() -> None:
    with pytest.raises(nats.errors.TimeoutError):
        snapshot_of([ENTRY(key="box-0", value=record("box-0"), revision=3, operation=None)], last_seq=3)
