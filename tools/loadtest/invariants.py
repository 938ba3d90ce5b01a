"""The safety invariants, read from the system's own truth: KV ``tandem-allocs``.

A snapshot reads every node's allocation record (one ordered consumer delivering the last value
of every key — one pass, not a get per key — read on past an early "nothing pending" from the
server: :func:`services.runtime.kv.read.last_raw_values`) and checks what no harness bookkeeping can vouch
for:

* ``double_held``: a device of a node listed by two allocations of that node's record — except
  a GPU that every one of them holds as a *share* (several shares of a GPU are the point);
* ``overcommitted``: a GPU whose shares take more than it has: memory over the GPU's (when
  ``gpu_memory`` knows it), compute over 100 %, or more shares than ``max_shares``;
* ``double_placed``: one request id held on two nodes.

Each record is read whole, so a double-held device inside it is never an artefact of the
snapshot not being atomic across keys. Across keys it is not atomic, but a request never moves
between nodes (it is freed and gone, never re-placed under the same id), so a request seen on
two nodes was really held twice.

In the middle of a load run the checks are made by a process of its own
(:mod:`tools.loadtest.checker`), which reads the bucket at a pace and sends back what it
found (:class:`Found`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
from nats.js import JetStreamContext

from schemas import codec, subjects
from schemas.messages import NodeAllocations
from services.runtime.kv.read import last_raw_values
from tools.loadtest import mix

T = TypeVar("T")

# What the harness writes to the checker for one snapshot.
CHECKER_COMMAND = b"snapshot"


@dataclass
class Violations:
    """Everything found so far; sets, so repeated snapshots do not count one fault twice."""

    double_held: set[tuple[str, str]] = field(default_factory=set)  # (node, device)
    overcommitted: set[tuple[str, str]] = field(default_factory=set)  # (node, GPU)
    double_placed: set[str] = field(default_factory=set)  # request ids
    undecodable: set[str] = field(default_factory=set)  # node keys
    snapshots: int = 0

    def add(self, found: Found) -> None:
        """Fold in what a snapshot taken elsewhere found (:mod:`tools.loadtest.checker`)."""
        self.double_held.update((node, device) for node, device in found.double_held)
        self.overcommitted.update((node, device) for node, device in found.overcommitted)
        self.double_placed.update(found.double_placed)
        self.undecodable.update(found.undecodable)
        self.snapshots += found.snapshots


class Found(msgspec.Struct, frozen=True):
    """:class:`Violations` as the checker process sends them."""

    double_held: list[tuple[str, str]]
    double_placed: list[str]
    undecodable: list[str]
    snapshots: int
    error: str | None = None  # why there is no check this time (the records could not be read)
    overcommitted: list[tuple[str, str]] = []

    @classmethod
    def of(cls, found: Violations) -> Found:
        return cls(
            double_held=sorted(found.double_held),
            double_placed=sorted(found.double_placed),
            undecodable=sorted(found.undecodable),
            snapshots=found.snapshots,
            overcommitted=sorted(found.overcommitted),
        )


async def snapshot(js: JetStreamContext) -> dict[str, NodeAllocations | None]:
    """The current record of every node (None: undecodable)."""
    return await last_values(js, subjects.KV_ALLOCS, codec.NODE_ALLOCS)


async def last_values(
    js: JetStreamContext, bucket: str, decoder: msgspec.msgpack.Decoder[T]
) -> dict[str, T | None]:
    """The current value of every key of ``bucket``, decoded (None: undecodable); one ordered
    consumer delivering the last value of each key, not a get per key, and not cut short by
    the server's early "nothing pending" (:mod:`services.runtime.kv.read`)."""
    return decode_all(await last_raw_values(js, await js.key_value(bucket), bucket), decoder)


def decode_all(raw: dict[str, bytes], decoder: msgspec.msgpack.Decoder[T]) -> dict[str, T | None]:
    """Every value of ``raw`` decoded (None: undecodable)."""
    records: dict[str, T | None] = {}
    for key, data in raw.items():
        try:
            records[key] = decoder.decode(data)
        except codec.DecodeErrors:
            records[key] = None
    return records


@dataclass(frozen=True)
class ShareLimits:
    """What a GPU's shares may take: its memory (None: unknown, not checked) and a count."""

    gpu_memory: Callable[[str, str], int | None]  # (node, GPU device id) -> MiB
    max_shares: int


# The harness's fleet and share class (tools/loadtest/mix.py).
LOADTEST_SHARES = ShareLimits(
    gpu_memory=mix.gpu_memory, max_shares=mix.SHARED_DEVICE_CLASS.max_shares_per_gpu
)


def check(
    records: dict[str, NodeAllocations | None], found: Violations, *, shares: ShareLimits | None = None
) -> dict[str, str]:
    """Add what ``records`` violates to ``found``; return request id → node for every holding.
    ``shares``: what a GPU's shares may take (without it, only compute over 100 % counts)."""
    found.snapshots += 1
    placed: dict[str, str] = {}
    for key, record in records.items():
        if record is None:
            found.undecodable.add(key)
            continue
        whole: Counter[str] = Counter()
        shared: dict[str, list[int]] = {}  # GPU -> [memory MiB, compute %, shares]
        for rid, rec in record.allocations.items():
            its_shares = rec.assignment.shares()
            for device in set(rec.assignment.device_ids()):
                if device in its_shares:
                    use = shared.setdefault(device, [0, 0, 0])
                    use[0] += its_shares[device][0]
                    use[1] += its_shares[device][1]
                    use[2] += 1
                else:
                    whole[device] += 1
            if rid in placed and placed[rid] != key:
                found.double_placed.add(rid)
            placed[rid] = key
        found.double_held.update((key, d) for d, n in whole.items() if n > 1 or (n and d in shared))
        for device, (memory, cores, count) in shared.items():
            size = shares.gpu_memory(key, device) if shares is not None else None
            too_many = shares is not None and count > shares.max_shares
            if cores > 100 or (size is not None and memory > size) or too_many:
                found.overcommitted.add((key, device))
    return placed
