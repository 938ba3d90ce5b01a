"""Follow a node's allocation record: the node side of the commit protocol.

The allocator commits by writing the node's record (KV ``tandem-allocs``, key = node name) with
compare-and-set; the server republishes every *stored* write on ``tandem.allocs.<node>`` with
the record's revision in the ``Nats-Sequence`` header (schemas.subjects). The record is the
node's desired state, level-triggered like a Kubernetes object: an allocation in state
``assigned`` / ``applied`` is to be applied, ``releasing`` is to be cleaned up, one that
disappeared is freed. So a node needs no durable consumer of its own (a stream holds a few
thousand consumers at most; a fleet has more nodes): a plain subscription, plus a direct get
of the record at start, after every reconnect and every ``resync_interval``, in case a
republished message was missed (core NATS delivery is at-most-once). Following many nodes, the
periodic reads are spread over the interval (:func:`resync_slice`).

:class:`AllocationsFollower` hands each node's records to ``on_record`` in revision order,
skipping revisions older than one already handed over and coalescing a burst to its latest
record; calls for one node never overlap, different nodes run concurrently. A handler that
raises :class:`~services.runtime.nats.bus.Retry` (or fails) gets the node's record again after a
delay. It follows one
node (the node agent) or every node with one wildcard subscription (the load harness's
simulated fleet). :func:`node_actions` is the pure comparison of a record with what the node
has done so far.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection, Iterable
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError

from schemas import codec, subjects
from schemas.messages import AllocRecord, NodeAllocations
from services.runtime.nats.bus import TRANSIENT_NATS_ERRORS, Bus, Retry
from services.runtime.observe.logging import get_logger
from services.runtime.process.tasks import Supervisor

log = get_logger(__name__)

OnRecord = Callable[[str, NodeAllocations | None, int], Awaitable[None]]
# Direct gets of a resync in flight at once (a fleet resyncs thousands of nodes).
RESYNC_CONCURRENCY = 64
# How often the follower looks for a reconnect (after which it resyncs at once).
RECONNECT_CHECK_S = 1.0
# A record whose handling failed is read and handed over again after this long.
FAILED_RETRY_S = 2.0


class NodeActions(msgspec.Struct):
    """What a node has to do to match its record."""

    apply: list[AllocRecord]  # committed allocations it has not applied yet
    cleanup: list[AllocRecord]  # allocations being released it has not started cleaning
    gone: list[str]  # request ids it applied or cleaned that the record no longer holds


def node_actions(
    record: NodeAllocations | None, *, applied: Collection[str], cleaning: Collection[str]
) -> NodeActions:
    allocations = record.allocations if record is not None else {}
    apply = [
        rec
        for rid, rec in allocations.items()
        if rec.state == "assigned" and rid not in applied and rid not in cleaning
    ]
    cleanup = [rec for rid, rec in allocations.items() if rec.state == "releasing" and rid not in cleaning]
    gone = [rid for rid in {*applied, *cleaning} if rid not in allocations]
    return NodeActions(apply=apply, cleanup=cleanup, gone=sorted(gone))


class _NodeState:
    __slots__ = ("next", "revision", "running")

    def __init__(self) -> None:
        self.revision = -1  # last revision handed to on_record (-1: none yet)
        self.next: tuple[NodeAllocations | None, int] | None = None
        self.running = False


def resync_slice(nodes: list[str], *, tick: int, ticks: int) -> list[str]:
    """The nodes whose periodic read is due at check ``tick``: each node once every ``ticks``
    checks, a slice at each. N agents started at different moments spread their reads the same
    way; a fleet reading all its nodes at once (5,000 gets) was a burst that slowed every request
    around it (the p99 of ``tandem loadtest --rate 500``)."""
    return nodes[tick % ticks :: ticks]


class AllocationsFollower:
    def __init__(
        self,
        bus: Bus,
        *,
        on_record: OnRecord,
        node: str | None = None,
        nodes: Callable[[], Iterable[str]] | None = None,
        resync_interval: float = 30.0,
    ) -> None:
        if node is None and nodes is None:
            raise ValueError("AllocationsFollower: give the node to follow or nodes() to resync")
        self.bus = bus
        self.on_record = on_record
        self.node = node
        self._nodes = nodes if nodes is not None else (lambda: [node] if node else [])
        self.resync_interval = resync_interval
        self._state: dict[str, _NodeState] = {}
        # Decodes only the allocations a write changed (a fleet follows every node's writes).
        self._decoder = codec.NodeAllocsDecoder()
        self._sub: Any = None
        self._tasks = Supervisor(f"follow:{node or '*'}")

    async def start(self) -> None:
        subject = subjects.node_allocs(self.node) if self.node else subjects.NODE_ALLOCS_ALL
        self._sub = await self.bus.nc.subscribe(subject, cb=self._on_msg)
        await self.bus.nc.flush()  # subscribed before the first read: nothing falls in between
        await self.resync()
        self._tasks.spawn("resync", self._resync_loop)

    async def stop(self) -> None:
        await self._tasks.aclose()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def resync(self, nodes: Iterable[str] | None = None) -> None:
        """Read the current record of each node (default: all of ``nodes()``) directly."""
        kv = await self.bus.kv(subjects.KV_ALLOCS)
        gate = asyncio.Semaphore(RESYNC_CONCURRENCY)

        async def one(node: str) -> None:
            async with gate:
                try:
                    entry = await kv.get(subjects.kv_key(node))
                except KeyNotFoundError:  # never written, or deleted
                    self._offer(node, None, 0)
                    return
                except TRANSIENT_NATS_ERRORS as exc:
                    log.warning("resync_failed", node=node, error=repr(exc))
                    return
                try:
                    record = self._decoder.decode(entry.value or b"")
                except codec.DecodeErrors as exc:
                    log.error("allocs_record_undecodable", node=node, error=str(exc))
                    return
                self._offer(node, record, entry.revision or 0)

        await asyncio.gather(*(one(n) for n in list(nodes if nodes is not None else self._nodes())))

    async def _resync_loop(self) -> None:
        reconnects = self.bus.nc.stats["reconnects"]
        ticks = max(1, round(self.resync_interval / RECONNECT_CHECK_S))
        tick = 0
        while True:
            await asyncio.sleep(RECONNECT_CHECK_S)
            tick += 1
            now_reconnects = self.bus.nc.stats["reconnects"]
            if now_reconnects != reconnects:
                reconnects = now_reconnects
                await self.resync()
                continue
            due = resync_slice(list(self._nodes()), tick=tick, ticks=ticks)
            if due:
                await self.resync(due)

    async def _on_msg(self, msg: Msg) -> None:
        node = subjects.node_of_allocs(msg.subject)
        if self.node is not None and node != self.node:
            return
        headers = msg.headers or {}
        try:
            revision = int(headers.get("Nats-Sequence", ""))
        except ValueError:
            log.error("allocs_republish_without_sequence", subject=msg.subject)
            return
        if headers.get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
            self._offer(node, None, revision)
            return
        try:
            record = self._decoder.decode(msg.data)
        except codec.DecodeErrors as exc:
            log.error("allocs_record_undecodable", node=node, error=str(exc))
            return
        self._offer(node, record, revision)

    def _offer(self, node: str, record: NodeAllocations | None, revision: int) -> None:
        st = self._state.get(node)
        if st is None:
            st = self._state[node] = _NodeState()
        latest = st.next[1] if st.next is not None else st.revision
        if revision < latest or (revision == latest and revision > 0) or (revision == 0 and latest >= 0):
            return  # older than (or the same as) what this node has or is about to get
        st.next = (record, revision)
        if not st.running:
            st.running = True
            self._tasks.spawn(f"node:{node}", lambda: self._drain(node, st), restart=False)

    async def _drain(self, node: str, st: _NodeState) -> None:
        try:
            while st.next is not None:
                record, revision = st.next
                st.next = None
                st.revision = revision
                try:
                    await self.on_record(node, record, revision)
                except asyncio.CancelledError:
                    raise
                except Retry as exc:
                    # An expected wait (e.g. the pod's sandbox does not exist yet): read the
                    # record again after the delay and hand it over again.
                    log.info("on_record_retry", node=node, reason=str(exc), delay=exc.delay)
                    st.revision = -1
                    self._resync_later(node, exc.delay)
                except Exception as exc:
                    log.error(
                        "on_record_failed", node=node, revision=revision, error=repr(exc), exc_info=True
                    )
                    st.revision = -1
                    self._resync_later(node, FAILED_RETRY_S)
        finally:
            st.running = False

    def _resync_later(self, node: str, delay: float) -> None:
        async def later() -> None:
            await asyncio.sleep(delay)
            await self.resync([node])

        self._tasks.spawn(f"resync:{node}", later, restart=False)
