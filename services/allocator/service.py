"""The allocator service: allocation requests in, committed placements out.

Decisions are serial and in memory; everything that waits on NATS runs many at a time. The
:class:`Allocator` wires the parts together, one module each, and feeds them its durable pull
consumers (each hands over up to ``concurrency`` messages at once):

* :mod:`.placer` is the placement of one request, one pipeline owned by one object —
  take → decide → reserve → claim → commit → announce — which holds what is in flight;
* :mod:`.readmodel` mirrors KV ``tandem-nodes`` and ``tandem-allocs`` into the pure core, with
  the devices of decisions whose commits are in flight held tentatively and those reserved for
  preemptors (written by the record watches and the placer, :mod:`.placer` says how);
* :mod:`.commits` holds the node records' writes as pure mutations;
  :class:`~services.runtime.kv.records.RecordStore` writes them with compare-and-set, one
  write in flight per record, the mutations that arrive meanwhile folded into the next one
  (group commit);
* :mod:`.requestbook` keeps the request records and their writes: claims, pending reasons
  (with a preemption's plan), outcomes;
* :mod:`.replicas` says which replicas are alive and which nodes this one decides on first;
* :mod:`.jobs` (with :mod:`.jobcommits`) places whole jobs: the two-phase commit across nodes;
* :mod:`.preemption` makes and records preemption plans, and keeps the devices of recorded
  plans reserved on every replica;
* :mod:`.frees` is the free path: releases, verified cleanups, devices back;
* :mod:`.retries` decides pending requests again when capacity may have grown.

The collaborators talk to the placer through its narrow interface (place a request, is it in
hand, wait until it is settled, hold a job pod's devices), never to this object, so none of
them calls back into the service that owns it.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from opentelemetry.context import Context

from schemas import codec, limits, subjects
from schemas.config import DeviceClass
from schemas.messages import AllocationRequest, ForwardReply, NodeAllocations, NodeRecord
from services.allocator.core import Cluster
from services.allocator.core.gang import DEFAULT_TIERS
from services.allocator.evictionplans import Preemptions
from services.allocator.frees import Frees
from services.allocator.jobplacement import Jobs
from services.allocator.placer import Placer
from services.allocator.readmodel import HOSTNAME_LABEL, ReadModel
from services.allocator.replicas import Replicas
from services.allocator.requestbook import RequestBook
from services.allocator.retries import PendingRetries
from services.runtime.kv.records import RecordStore
from services.runtime.kv.watch import watch_bucket, watch_raw
from services.runtime.nats.bus import Bus
from services.runtime.observe.logging import get_logger
from services.runtime.process.tasks import Service, Supervisor

__all__ = ["HOSTNAME_LABEL", "Allocator"]

log = get_logger(__name__)

# Messages handled at once per consumer: decisions stay serial (they never await), the
# commits, claims and publishes of that many requests are in flight together. Each request
# waits on a few round trips in a row, so what is in flight, not the CPU, bounded the
# allocator under load: at 256, tandem loadtest at 5,000 nodes left it idle a quarter of the
# time (docs/benchmarks.md, "Running system").
REQUEST_CONCURRENCY = 512
# Releases and cleanup reports, as wide as requests: a freed request waits on three writes in
# a row (its record, the node's record, Freed), and with fewer in flight than requests the
# free path fell behind under load (cleanup reports piled up, freed devices came back seconds
# late and arrivals were refused meanwhile).
EVENT_CONCURRENCY = REQUEST_CONCURRENCY
# Messages one pull asks for (topped up at half). Replicas share each consumer and the server
# hands a message to a waiting pull, so a replica whose pulls ask for many takes a long run of
# them into its own queue even while it falls behind, and the other waits idle (at 512, one of
# two replicas held most requests in flight). At 64 the deliveries interleave finely, and two
# replicas' tail latency dropped with one replica's unchanged (docs/benchmarks.md,
# "Measurements behind the code").
PULL_BATCH = 64

Watch = Callable[[asyncio.Event], Awaitable[None]]


class Allocator(Service):
    def __init__(
        self,
        bus: Bus,
        *,
        instance: str,
        node_policy: str = "binpack",
        device_classes: dict[str, DeviceClass] | None = None,
        retry_interval: float = 5.0,
        claim_timeout: float = 30.0,
        concurrency: int = REQUEST_CONCURRENCY,
        finished_request_ttl: float | None = None,
        fabric_tiers: Sequence[str] = DEFAULT_TIERS,
    ) -> None:
        self.bus = bus
        self.instance = instance
        self.model = ReadModel(Cluster(node_policy=node_policy, device_classes=device_classes))
        self.cluster = self.model.cluster
        self.concurrency = concurrency
        self.node_allocs: RecordStore[NodeAllocations] = RecordStore(
            bus, subjects.KV_ALLOCS, codec.NodeAllocsDecoder(), on_change=self.model.on_allocs
        )
        self.book = RequestBook(
            bus,
            instance=instance,
            claim_timeout=claim_timeout,
            placed=self.model.placed,
            finished_ttl=finished_request_ttl,
        )
        self.replicas = Replicas(bus, instance=instance, model=self.model)
        self.preemptions = Preemptions(
            bus,
            instance=instance,
            model=self.model,
            book=self.book,
            node_allocs=self.node_allocs,
        )
        self.placer = Placer(
            bus,
            instance=instance,
            model=self.model,
            book=self.book,
            node_allocs=self.node_allocs,
            replicas=self.replicas,
            preemptions=self.preemptions,
        )
        self.jobs = Jobs(
            bus,
            instance=instance,
            model=self.model,
            node_allocs=self.node_allocs,
            holds=self.placer,
            claim_timeout=claim_timeout,
            tiers=fabric_tiers,
        )
        self.frees = Frees(
            bus,
            model=self.model,
            node_allocs=self.node_allocs,
            book=self.book,
            jobs=self.jobs,
            placer=self.placer,
        )
        self.retries = PendingRetries(
            model=self.model,
            book=self.book,
            jobs=self.jobs,
            placer=self.placer,
            concurrency=concurrency,
            retry_interval=retry_interval,
        )
        self._frozen_at = 0  # nodes known at the last gc.freeze
        self._tasks = Supervisor("allocator")

    # -- the read model, as tests and the CLI see it ------------------------------------------

    @property
    def nodes(self) -> dict[str, NodeRecord]:
        return self.model.nodes

    @property
    def placed(self) -> dict[str, str]:
        return self.model.placed

    @property
    def allocs(self) -> dict[str, tuple[NodeAllocations | None, int]]:
        return self.node_allocs.cache

    @property
    def pending(self) -> dict[str, AllocationRequest]:
        return self.book.pending

    @property
    def claim_timeout(self) -> float:
        return self.book.claim_timeout

    @claim_timeout.setter
    def claim_timeout(self, seconds: float) -> None:
        self.book.claim_timeout = seconds
        self.jobs.claim_timeout = seconds

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        began = time.monotonic()
        for bucket, watch in self._watches():
            ready = asyncio.Event()
            self._tasks.spawn(f"watch-{bucket}", lambda w=watch, r=ready: w(r))  # type: ignore[misc]
            await asyncio.wait_for(ready.wait(), 60)
        # The decoded topologies of a large fleet are ~0.7 M long-lived objects; moving them out
        # of the collector's generations keeps full collections out of decision latency
        # (docs/benchmarks.md, "gc.freeze").
        gc.freeze()
        self._frozen_at = len(self.model.nodes)
        for stream, durable, filters, handler, concurrency in self._consumers():
            decoder = codec.NODE_EVENT if stream == subjects.NODE_STREAM else codec.ALLOC_EVENT
            self._tasks.spawn(
                durable,
                lambda st=stream, d=durable, f=filters, h=handler, c=concurrency, dec=decoder: (  # type: ignore[misc]
                    self.bus.consume(
                        stream=st,
                        durable=d,
                        filter_subject=f,
                        decoder=dec,
                        handler=h,
                        batch=PULL_BATCH,
                        concurrency=c,
                        # Every handler is idempotent: a lost ack costs a redelivery.
                        confirm_acks=False,
                    )
                ),
            )
        # Requests other replicas hand over (Placer.hand_over): listened to before this
        # replica's first heartbeat tells them it is alive.
        await self.bus.serve(
            subjects.allocator_forward(self.instance),
            decoder=codec.ALLOC_EVENT,
            handler=self.placer.on_forward,
            error_reply=lambda reason: ForwardReply(error=limits.clip(reason)),
            concurrent=True,
        )
        await self.replicas.start(self._tasks)
        # Job commits a crashed replica left half-done are settled before new decisions.
        await self.jobs.sweep()
        self._tasks.spawn("retry-pending", self.retries.run)
        self._tasks.spawn("refreeze", self._refreezing)
        log.info(
            "allocator_started",
            instance=self.instance,
            nodes=len(self.model.nodes),
            allocations=len(self.model.placed),
            pending=len(self.pending),
            seconds=round(time.monotonic() - began, 3),
        )

    def _watches(self) -> list[tuple[str, Watch]]:
        """The record watches, in the order they are started (each one ready before the next)."""
        js = self.bus.js
        return [
            # Cluster labels first, so that nodes are indexed with them from the start.
            (
                subjects.KV_NODE_LABELS,
                lambda r: watch_bucket(
                    js,
                    subjects.KV_NODE_LABELS,
                    codec.NODE_LABELS,
                    lambda k, v, _: self.model.on_node_labels(k, v),
                    ready=r,
                ),
            ),
            (
                subjects.KV_ALLOCS,
                lambda r: watch_raw(js, subjects.KV_ALLOCS, self.node_allocs.observe, ready=r),
            ),
            (
                subjects.KV_NODES,
                lambda r: watch_bucket(
                    js,
                    subjects.KV_NODES,
                    codec.NODE_RECORD,
                    lambda k, v, _: self.model.on_node_record(k, v),
                    ready=r,
                ),
            ),
            (
                subjects.KV_REQUESTS,
                lambda r: watch_raw(js, subjects.KV_REQUESTS, self.book.store.observe, ready=r),
            ),
            (subjects.KV_JOBS, lambda r: watch_raw(js, subjects.KV_JOBS, self.jobs.store.observe, ready=r)),
        ]

    def _consumers(self) -> list[tuple[str, str, str | list[str], Any, int]]:
        """(stream, durable, filter, handler, messages at once) of each durable consumer."""
        return [
            (
                subjects.ALLOC_STREAM,
                subjects.CONSUMER_ALLOCATOR_REQUESTS,
                subjects.ALLOC_REQUEST,
                self.placer.on_request,
                self.concurrency,
            ),
            (
                subjects.ALLOC_STREAM,
                subjects.CONSUMER_ALLOCATOR_JOBS,
                subjects.ALLOC_JOB,
                self.jobs.on_job,
                EVENT_CONCURRENCY,
            ),
            (
                subjects.ALLOC_STREAM,
                subjects.CONSUMER_ALLOCATOR_RELEASES,
                subjects.ALLOC_RELEASE_ALL,
                self.frees.on_release,
                EVENT_CONCURRENCY,
            ),
            (
                subjects.NODE_STREAM,
                subjects.CONSUMER_ALLOCATOR_NODE,
                subjects.ALLOCATOR_NODE_FILTERS,
                self.frees.on_node_report,
                EVENT_CONCURRENCY,
            ),
        ]

    async def stop(self) -> None:
        await self.replicas.stop()
        await self._tasks.aclose()
        await self.node_allocs.aclose()
        await self.book.aclose()
        await self.jobs.aclose()

    # -- requests ---------------------------------------------------------------------------

    async def handle_request(self, req: AllocationRequest, *, context: Context | None = None) -> str:
        """Place one request (:meth:`.Placer.place`): as its message when ``context`` is
        given, else as a retry of a pending request."""
        return await self.placer.place(req, origin="retry" if context is None else "message", context=context)

    async def retry_pending(self) -> int:
        """Decide every pending request again now (:mod:`.retries`)."""
        return await self.retries.retry_pending()

    async def _refreezing(self) -> None:
        """``gc.freeze`` again, looked at every ``retry_interval``, once the fleet grew by a
        tenth since the last time: nodes that joined after the start are long-lived objects
        too, and a full collection over them (long at 10,000 nodes) would otherwise land inside
        some decision."""
        while True:
            await asyncio.sleep(self.retries.retry_interval)
            nodes = len(self.model.nodes)
            if nodes > self._frozen_at * 1.1 + 10:
                gc.freeze()
                self._frozen_at = nodes
