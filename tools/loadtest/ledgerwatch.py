"""``python -m tools.loadtest.ledgerwatch``: feeds the ledger every write of a run.

:class:`~tools.loadtest.ledger.Ledger` judges; this module reads. Three ordered consumers,
each delivery handed to the ledger from the subscription's callback (as
:func:`services.runtime.kv.watch.watch_raw` does, without nats-py's watcher and its queue):

* the stream of KV ``tandem-allocs`` (``KV_tandem-allocs``, subject ``$KV.tandem-allocs.>``)
  and that of KV ``tandem-requests``: the last revision of every key as it stands when the
  reader starts (the *baseline*), then every revision written after, in stream order — the
  buckets' own streams, not snapshots and not the server's republish (a core subscription,
  which drops what it cannot deliver). Node records are decoded with
  :class:`~schemas.codec.NodeAllocsDecoder`, which decodes only the allocations a write
  changed and hands back the unchanged ones as the very objects of the revision before, so
  the ledger looks only at what changed;
* ``tandem.alloc.freed`` in ``TANDEM_ALLOC``, from the moment the reader starts: every
  ``Freed`` the allocators publish.

A node-record revision that the reader never got is seen as a hole in the stream sequences:
the bucket stream holds one stream for every key, so consecutive deliveries of a reader that
keeps up are consecutive sequences, and a skipped one was removed before it was read (a key
keeps 5 revisions). It is told to the ledger (``revisions_missed``), which then judges
nothing that the hole could hide. To keep up, this process runs at normal priority — unlike
the snapshot checker (:mod:`tools.loadtest.checker`), which can read whenever the CPU is
idle because it only wants the latest values. Its CPU is counted in ``cpu_s.harness``.

Protocol with the harness, one JSON line or command a line: once the three consumers exist
it prints ``{"event": "ready"}``; for ``finish`` on stdin it reads on until each source has
delivered what its stream held at that moment (bounded by ``FINISH_TIMEOUT_S``) and answers
:class:`LedgerAnswer` (its ``counts.error`` set, and the counts as far as read, when it could
not catch up). It exits when stdin closes. Logs go to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from schemas import codec, subjects
from schemas.messages import Freed
from services.runtime.kv.watch import WATCH_INACTIVE_THRESHOLD_S, kv_change
from services.runtime.nats.bus import Bus
from services.runtime.nats.jsack import position
from services.runtime.observe.logging import get_logger
from services.runtime.settings import Settings
from tools.loadtest.child import child_main
from tools.loadtest.ledger import Ledger, LedgerCounts

log = get_logger(__name__)

FINISH_COMMAND = b"finish"
READY_EVENT = "ready"
FINISH_TIMEOUT_S = 60.0
CATCH_UP_POLL_S = 0.05
# An ordered consumer whose heartbeats stop for two of these is made again from where it was
# (nats-py): with its default heartbeat, a consumer lost with a NATS server stalled the reader
# long enough that a key written a few times a second had lost revisions by then (a bucket keeps
# 5; docs/benchmarks.md, "Measurements behind the code").
IDLE_HEARTBEAT_S = 0.5
# The subscriptions must never drop a delivery for being slow (a dropped one is a hole).
PENDING_MSGS = 4_000_000
PENDING_BYTES = 1024 * 1024 * 1024


class LedgerIncomplete(Exception):
    """The reader could not read its streams to the end (a stream gone, a server that does
    not answer, a delivery the ledger failed on)."""


class LedgerAnswer(msgspec.Struct, frozen=True):
    """The answer to ``finish``: the counts, and a few lines describing the first faults."""

    counts: LedgerCounts
    examples: list[str] = []


class _Source:
    """One consumer: where its stream stood when it started, and how far it has read."""

    def __init__(self, name: str, *, stream: str, subject: str, replays: bool) -> None:
        self.name = name
        self.stream = stream
        self.subject = subject
        self.replays = replays  # delivers the stream's state at start (LAST_PER_SUBJECT), not NEW
        self.start_seq = 0  # the stream's last sequence just before the consumer was made
        self.seen = 0  # the highest stream sequence handled
        self.sub: Any = None

    def caught_up(self, target: int) -> bool:
        done = self.seen if self.replays else max(self.seen, self.start_seq)
        return done >= target


class LedgerWatch:
    """Feeds :attr:`ledger` from the three streams (see the module) until :meth:`stop`."""

    def __init__(self, js: JetStreamContext, *, ledger: Ledger | None = None) -> None:
        self.js = js
        self.ledger = ledger if ledger is not None else Ledger()
        self.failure: str | None = None  # a delivery the ledger could not take: nothing after it counts
        self._allocs_decoder = codec.NodeAllocsDecoder()
        self._allocs = _Source(
            "node records",
            stream=subjects.kv_stream(subjects.KV_ALLOCS),
            subject=subjects.kv_subject(subjects.KV_ALLOCS),
            replays=True,
        )
        self._requests = _Source(
            "request records",
            stream=subjects.kv_stream(subjects.KV_REQUESTS),
            subject=subjects.kv_subject(subjects.KV_REQUESTS),
            replays=True,
        )
        self._freed = _Source(
            "Freed events", stream=subjects.ALLOC_STREAM, subject=subjects.ALLOC_FREED, replays=False
        )
        self._allocs_prefix = subjects.kv_subject(subjects.KV_ALLOCS, "")
        self._requests_prefix = subjects.kv_subject(subjects.KV_REQUESTS, "")

    @property
    def sources(self) -> list[_Source]:
        return [self._allocs, self._requests, self._freed]

    async def start(self) -> None:
        """Make the three consumers; from here on no write of the run escapes the ledger."""
        handlers: list[tuple[_Source, Callable[[Msg, int], None], api.DeliverPolicy]] = [
            (self._allocs, self._on_allocs, api.DeliverPolicy.LAST_PER_SUBJECT),
            (self._requests, self._on_request, api.DeliverPolicy.LAST_PER_SUBJECT),
            (self._freed, self._on_freed, api.DeliverPolicy.NEW),
        ]
        for source, handler, policy in handlers:
            source.start_seq = (await self.js.stream_info(source.stream)).state.last_seq
            source.sub = await self.js.subscribe(
                source.subject,
                stream=source.stream,
                cb=self._guarded(source, handler),
                ordered_consumer=True,
                idle_heartbeat=IDLE_HEARTBEAT_S,
                deliver_policy=policy,
                inactive_threshold=WATCH_INACTIVE_THRESHOLD_S,
                pending_msgs_limit=PENDING_MSGS,
                pending_bytes_limit=PENDING_BYTES,
            )

    async def stop(self) -> None:
        for source in self.sources:
            if source.sub is not None:
                with contextlib.suppress(Exception):
                    await source.sub.unsubscribe()
                source.sub = None

    async def finish(self, *, timeout: float = FINISH_TIMEOUT_S) -> LedgerCounts:
        """Read on until every source has delivered what its stream holds now; the counts.
        Raises :class:`LedgerIncomplete` when that does not happen within ``timeout``."""
        targets = [(source, await self._target(source)) for source in self.sources]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self.failure is not None:
                raise LedgerIncomplete(self.failure)
            behind = [f"{s.name} at {s.seen} of {target}" for s, target in targets if not s.caught_up(target)]
            if not behind:
                return self.ledger.counts()
            if loop.time() > deadline:
                raise LedgerIncomplete(f"not read to the end in {timeout:g}s: {', '.join(behind)}")
            await asyncio.sleep(CATCH_UP_POLL_S)

    async def _target(self, source: _Source) -> int:
        """The sequence ``source`` has to reach: its stream's last (a bucket: every key's
        latest revision is at or before it), or the last ``Freed`` stored."""
        if source.replays:
            return int((await self.js.stream_info(source.stream)).state.last_seq)
        try:
            return int((await self.js.get_last_msg(source.stream, source.subject)).seq or 0)
        except NotFoundError:
            return 0

    # -- deliveries (from the subscriptions' callbacks) ------------------------------------------

    def _guarded(self, source: _Source, handler: Callable[[Msg, int], None]) -> Callable[[Msg], Any]:
        """The callback: ``handler`` for each delivery not handled yet. nats-py hands what a
        callback raises to the connection's error callback and goes on, so a failure is kept
        here, and ``finish`` answers it instead of counts that silently left a write out."""

        async def deliver(msg: Msg) -> None:
            if self.failure is not None:
                return
            try:
                seq = position(msg.reply).stream_seq
                if seq <= source.seen and seq > source.start_seq:
                    return  # delivered again (a consumer recreated after a reconnect)
                handler(msg, seq)
                source.seen = max(source.seen, seq)
            except Exception as exc:  # a bug or a foreign message: say so rather than miscount
                self.failure = f"{source.name}: {exc!r}"
                log.error("ledger_delivery_failed", source=source.name, error=repr(exc))

        return deliver

    def _on_allocs(self, msg: Msg, seq: int) -> None:
        source = self._allocs
        if seq > source.start_seq:
            skipped = seq - max(source.seen, source.start_seq) - 1
            if skipped > 0:
                self.ledger.missed(skipped, before=seq)
        change = kv_change(msg, self._allocs_prefix)
        if change is None:
            return
        node, data = change
        if data is None:
            self.ledger.node_record(node, None, seq=seq)
            return
        try:
            record = self._allocs_decoder.decode(data)
        except codec.DecodeErrors as exc:
            log.error("ledger_record_undecodable", node=node, revision=seq, error=str(exc))
            self.ledger.missed(1, before=seq + 1)
            return
        self.ledger.node_record(node, record, seq=seq)

    def _on_request(self, msg: Msg, seq: int) -> None:
        change = kv_change(msg, self._requests_prefix)
        if change is None:
            return
        key, data = change
        baseline = seq <= self._requests.start_seq
        if data is None:
            self.ledger.request_record(key, None, seq=seq, baseline=baseline)
            return
        try:
            record = codec.REQUEST_RECORD.decode(data)
        except codec.DecodeErrors as exc:
            log.error("ledger_request_undecodable", key=key, revision=seq, error=str(exc))
            return
        self.ledger.request_record(key, record, seq=seq, baseline=baseline)

    def _on_freed(self, msg: Msg, _seq: int) -> None:
        try:
            event = codec.ALLOC_EVENT.decode(msg.data)
        except codec.DecodeErrors as exc:
            log.error("ledger_freed_undecodable", error=str(exc))
            return
        if isinstance(event, Freed):
            self.ledger.freed(event)


# -- the process ------------------------------------------------------------------------------


def _say(obj: object) -> None:
    sys.stdout.buffer.write(msgspec.json.encode(obj) + b"\n")
    sys.stdout.flush()


async def serve(settings: Settings, commands: asyncio.StreamReader) -> None:
    """Follow the streams and answer every ``finish`` line on ``commands`` until it closes."""
    bus = await Bus.open(settings, provision_streams=False)
    watch = LedgerWatch(bus.js)
    try:
        await watch.start()
        _say({"event": READY_EVENT})
        while line := await commands.readline():
            if line.strip() != FINISH_COMMAND:
                print(f"loadtest-ledger: unknown command {line[:80]!r}", file=sys.stderr)
                continue
            try:
                counts = await watch.finish()
            except (LedgerIncomplete, nats.errors.Error, OSError) as exc:
                counts = msgspec.structs.replace(watch.ledger.counts(), error=f"incomplete: {exc}")
            _say(LedgerAnswer(counts=counts, examples=watch.ledger.end_examples()))
    finally:
        await watch.stop()
        await bus.close()


def main(argv: Sequence[str] | None = None) -> int:
    return child_main("ledgerwatch", "loadtest-ledger", serve, argv)


if __name__ == "__main__":
    sys.exit(main())
