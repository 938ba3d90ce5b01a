"""KV records held in memory, written with compare-and-set, one write in flight per key.

:class:`RecordStore` is the one compare-and-set helper of the services (the allocator's node
allocation records and request records, the inventory's node records). Each record is kept
with its revision; a change is a *mutation* (``current → new``, ``None`` = no change) handed
to :meth:`RecordStore.update`. Per key, one write is in flight at a time; mutations that
arrive meanwhile are folded into the next write (group commit), so a burst of decisions for
one node costs one publish, and writes to different keys run concurrently. A write is one
JetStream publish to ``$KV.<bucket>.<key>`` with ``Nats-Expected-Last-Subject-Sequence``
(what ``kv.update(..., last=revision)`` sends), so it lands only on the revision it was
computed from: when another writer got there first, the store reads the key again and applies
the waiting mutations to the fresh record. A mutation that no longer applies raises
(:class:`Conflict`, or an error of the caller's); only its caller sees the error, the others
in the group are written.

No read is needed on the hot path: the cache is filled by :meth:`RecordStore.observe` (a KV
watch, a resync) and by the store's own writes, and a key missing from a complete cache is
taken to be absent (``assume_absent``); a wrong guess costs one failed compare-and-set.
Records a caller no longer needs in memory (``retain`` says which) are dropped after their
write, so the cache stays as large as the live state.

Every record is bounded (:data:`schemas.limits.MAX_RECORD_BYTES`): a mutation that would grow
a record past it fails alone with :class:`RecordTooLarge`, so the caller can refuse what it
was asked (a request) instead of the whole group's write failing at the server. A record that
is finished can be given a lifetime (``ttl``): its write carries ``Nats-TTL`` and
``Nats-Rollup: sub`` (the key's earlier revisions are dropped with it, so when it expires the
key is gone rather than back at an older revision).

Writes ride out a NATS leader election like every publish (:meth:`Bus.publish`): the publish
carries a ``Nats-Msg-Id``, so a retried write that had landed is answered from the duplicate
window instead of failing its compare-and-set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from nats.js import api
from nats.js.errors import APIError, NotFoundError

from schemas import codec, limits, subjects
from services.runtime.nats.bus import Bus
from services.runtime.observe.logging import get_logger
from services.runtime.process.tasks import Supervisor

log = get_logger(__name__)
T = TypeVar("T")

Mutation = Callable[[T | None], T | None]
OnChange = Callable[[str, T | None, int], None]
# JetStream's "wrong last sequence" error codes (as nats-py's kv.update checks them).
WRONG_LAST_SEQUENCE = (10071, 10164)
# The header of a KV delete or purge marker (nats-py's ``KV_OP``).
KV_OPERATION = "KV-Operation"
# Lost compare-and-set races in a row before a write gives up (each one re-reads the key).
MAX_CAS_ATTEMPTS = 32


class Conflict(Exception):
    """A mutation cannot apply to the current record (e.g. its devices are held already)."""


class RecordStoreError(Exception):
    """A record kept losing its compare-and-set race."""


class RecordTooLarge(Conflict):
    """The mutation would grow the record past :data:`schemas.limits.MAX_RECORD_BYTES`."""


class _Pending(Generic[T]):
    __slots__ = ("assume_absent", "future", "mutate")

    def __init__(self, mutate: Mutation[T], future: asyncio.Future[T | None], assume_absent: bool) -> None:
        self.mutate = mutate
        self.future = future
        self.assume_absent = assume_absent


class RecordStore(Generic[T]):
    def __init__(
        self,
        bus: Bus,
        bucket: str,
        decoder: codec.RecordDecoder[T],
        *,
        on_change: OnChange[T] | None = None,
        retain: Callable[[T], bool] | None = None,
        ttl: Callable[[T], float | None] | None = None,
        max_bytes: int = limits.MAX_RECORD_BYTES,
    ) -> None:
        self.bus = bus
        self.bucket = bucket
        self.decoder = decoder
        self.on_change = on_change
        self.retain = retain
        self.ttl = ttl  # seconds a record lives once written (None: for ever)
        self.max_bytes = max_bytes
        self.cache: dict[str, tuple[T | None, int]] = {}  # key → (value or None = absent, revision)
        self._queues: dict[str, list[_Pending[T]]] = {}
        # The write in flight per key, as bytes and value: a watch often shows it before its
        # acknowledgement arrives, and then it need not be decoded.
        self._writing: dict[str, tuple[bytes, T]] = {}
        self._tasks = Supervisor(f"records:{bucket}")

    async def aclose(self) -> None:
        await self._tasks.aclose()

    # -- reading --------------------------------------------------------------------------

    def cached(self, key: str) -> tuple[T | None, int] | None:
        return self.cache.get(key)

    def observe(self, key: str, data: bytes | None, revision: int) -> bool:
        """A value seen elsewhere (a watch): keep it when newer than the cached one and tell
        ``on_change``. Own writes coming back through a watch are skipped without decoding.
        Returns whether it was newer."""
        known = self.cache.get(key)
        if known is not None and known[1] >= revision:
            return False
        value: T | None = None
        writing = self._writing.get(key)
        if data and writing is not None and writing[0] == data:
            # Our own write, seen before its acknowledgement: no need to decode it.
            value = writing[1]
        elif data:
            try:
                value = self.decoder.decode(data)
            except codec.DecodeErrors as exc:
                # Only Tandem's services may write here: a record that does not decode is a
                # writer's bug (or an old version's), kept on the dead-letter subject.
                error = f"record does not decode: {exc}"
                log.error("record_undecodable", bucket=self.bucket, key=key, error=error)
                self._tasks.spawn(
                    f"dead-letter:{key}", lambda: self._dead_letter(key, data, error), restart=False
                )
                return False
        self._set(key, value, revision)
        return True

    async def _dead_letter(self, key: str, data: bytes, error: str) -> None:
        subject = subjects.kv_subject(self.bucket, subjects.kv_key(key))
        await self.bus.dead_letter(subject=subject, data=data, error=error, why="undecodable_record")

    async def fetch(self, key: str) -> tuple[T | None, int]:
        """Read ``key`` from the bucket stream's *leader* and cache it.

        Not a direct get: the buckets allow direct gets (a node agent reads its own record
        that way), and with replicas every replica answers those, so one may return a record
        that is behind the last write by the replication lag — ``tandem chaos`` caught a
        follower that had just restarted answering an allocator's re-read with a record
        older than the one the node had already acted on (``docs/reliability.md``). A fetch
        is what a writer reads when its copy may be stale, and a mutation that finds nothing
        to do on what it read is checked by no compare-and-set, so the read must be the
        latest: ``STREAM.MSG.GET`` is answered by the leader only."""
        try:
            msg = await self.bus.js.get_last_msg(
                subjects.kv_stream(self.bucket), subjects.kv_subject(self.bucket, subjects.kv_key(key))
            )
        except NotFoundError:  # never written, or expired
            self._set(key, None, 0, force=True)
            return None, 0
        revision = msg.seq or 0
        deleted = (msg.headers or {}).get(KV_OPERATION) in ("DEL", "PURGE")
        value = None if deleted or not msg.data else self.decoder.decode(msg.data)
        self._set(key, value, revision, force=True)
        return value, revision

    def _set(self, key: str, value: T | None, revision: int, *, force: bool = False) -> None:
        known = self.cache.get(key)
        if not force and known is not None and known[1] >= revision:
            return
        if known is not None and known[1] == revision and known[0] is not None:
            return  # the same revision read again: nothing changed
        if value is not None and self.retain is not None and not self.retain(value):
            self.cache.pop(key, None)
        else:
            self.cache[key] = (value, revision)
        if self.on_change is not None:
            self.on_change(key, value, revision)

    # -- writing --------------------------------------------------------------------------

    async def update(self, key: str, mutate: Mutation[T], *, assume_absent: bool = False) -> T | None:
        """Apply ``mutate`` to the record and write it; returns the record as committed.

        ``assume_absent``: a key not in the cache is taken not to exist (a create), instead
        of being read first. Raises what ``mutate`` raised (e.g. :class:`Conflict`)."""
        return await self._enqueue(key, mutate, assume_absent=assume_absent)

    def submit(
        self, key: str, mutate: Mutation[T], *, assume_absent: bool = False
    ) -> asyncio.Future[T | None]:
        """:meth:`update` without waiting: the write is queued behind the key's earlier ones
        (so writes to one key keep their order); a failure is logged."""
        future = self._enqueue(key, mutate, assume_absent=assume_absent)
        future.add_done_callback(_log_failure)
        return future

    def _enqueue(self, key: str, mutate: Mutation[T], *, assume_absent: bool) -> asyncio.Future[T | None]:
        future: asyncio.Future[T | None] = asyncio.get_running_loop().create_future()
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = []
            self._tasks.spawn(f"write:{key}", lambda: self._writer(key, queue), restart=False)
        queue.append(_Pending(mutate, future, assume_absent))
        return future

    async def _writer(self, key: str, queue: list[_Pending[T]]) -> None:
        try:
            while queue:
                batch = list(queue)
                queue.clear()
                try:
                    await self._write(key, batch)
                except asyncio.CancelledError:
                    for p in batch:
                        if not p.future.done():
                            p.future.cancel()
                    raise
                except Exception as exc:
                    # The write may or may not have landed: the cached revision is no longer
                    # trusted, the next write reads the record first.
                    self.cache.pop(key, None)
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(exc)
        finally:
            self._queues.pop(key, None)
            for p in queue:
                if not p.future.done():
                    p.future.cancel()

    async def _write(self, key: str, batch: list[_Pending[T]]) -> None:
        known = self.cache.get(key)
        if known is None:
            if all(p.assume_absent for p in batch):
                known = (None, 0)
            else:
                known = await self.fetch(key)
        base, revision = known
        for _ in range(MAX_CAS_ATTEMPTS):
            value, data, outcomes = self._apply(key, base, batch, checked=False)
            if data is not None and len(data) > self.max_bytes:
                # Rare: find the mutations that pushed it over, encoding after each.
                value, data, outcomes = self._apply(key, base, batch, checked=True)
            if value is not base:
                assert value is not None and data is not None
                try:
                    revision = await self._publish(key, value, data, expected=revision)
                except _WrongRevision:
                    base, revision = await self.fetch(key)
                    continue
                self._set(key, value, revision)
            for p, error in outcomes:
                if p.future.done():
                    continue
                if error is not None:
                    p.future.set_exception(error)
                else:
                    p.future.set_result(value)
            return
        raise RecordStoreError(f"{self.bucket}/{key}: lost {MAX_CAS_ATTEMPTS} compare-and-set races")

    def _apply(
        self, key: str, base: T | None, batch: list[_Pending[T]], *, checked: bool
    ) -> tuple[T | None, bytes | None, list[tuple[_Pending[T], Exception | None]]]:
        """Fold ``batch`` into ``base``: the new value, its encoding (None when unchanged)
        and each mutation's outcome. ``checked``: refuse each mutation that would make the
        record larger than ``max_bytes`` (costs an encode per mutation)."""
        value = base
        data: bytes | None = None
        outcomes: list[tuple[_Pending[T], Exception | None]] = []
        for p in batch:
            try:
                new = p.mutate(value)
            except Exception as exc:  # this mutation's own refusal: only its caller sees it
                outcomes.append((p, exc))
                continue
            if new is not None and checked:
                encoded = codec.encode(new)
                if len(encoded) > self.max_bytes:
                    error = RecordTooLarge(
                        f"record {self.bucket}/{key} would be {len(encoded)} bytes, "
                        f"over the limit of {self.max_bytes}"
                    )
                    outcomes.append((p, error))
                    continue
                data = encoded
            if new is not None:
                value = new
            outcomes.append((p, None))
        if value is not base and data is None:
            data = codec.encode(value)
        return value, data, outcomes

    async def _publish(self, key: str, value: T, data: bytes, *, expected: int) -> int:
        headers = {
            api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(expected),
            # A retried write that landed is answered from the duplicate window.
            "Nats-Msg-Id": self.bus.msg_ids.new(f"{self.bucket}:{key}:{expected}:"),
        }
        ttl = self.ttl(value) if self.ttl is not None else None
        if ttl is not None:
            headers["Nats-TTL"] = f"{max(1, int(ttl))}s"
            headers[api.Header.ROLLUP] = "sub"
        subject = subjects.kv_subject(self.bucket, subjects.kv_key(key))
        self._writing[key] = (data, value)
        try:
            ack = await self.bus.publish_raw(subject, data, headers=headers)
        except APIError as exc:
            if exc.err_code in WRONG_LAST_SEQUENCE:
                raise _WrongRevision from exc
            raise
        finally:
            self._writing.pop(key, None)
        return ack.seq


class _WrongRevision(Exception):
    pass


def _log_failure(future: asyncio.Future[Any]) -> None:
    if future.cancelled():
        return
    exc = future.exception()
    if exc is not None:
        log.warning("record_write_failed", error=repr(exc))
