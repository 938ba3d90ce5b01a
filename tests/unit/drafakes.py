"""The NATS side of the DRA bridge's unit tests: KV buckets in dicts and publishes in a list
(the bridge reads request and job records and publishes requests and releases; the Kubernetes
side of each test is its own ``FakeApi``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nats.js.errors import KeyNotFoundError


@dataclass
class Entry:
    value: bytes


@dataclass
class FakeKv:
    values: dict[str, bytes]

    async def get(self, key: str) -> Entry:
        if key not in self.values:
            raise KeyNotFoundError
        return Entry(self.values[key])


@dataclass
class FakeBus:
    buckets: dict[str, dict[str, bytes]] = field(default_factory=dict)
    published: list[tuple[str, Any]] = field(default_factory=list)

    async def kv(self, bucket: str) -> FakeKv:
        return FakeKv(self.buckets.setdefault(bucket, {}))

    async def publish(self, subject: str, message: Any, *, msg_id: str | None = None) -> None:
        self.published.append((subject, message))
