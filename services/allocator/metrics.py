"""Prometheus metrics of the allocator (served by ``services.runtime.observe.opsserver`` on ``/metrics``).

Counters and histograms are counted where things happen (:mod:`.service`); the gauges are
:class:`AllocatorState`, computed from the read model and the request book when Prometheus
scrapes, so a restarted allocator shows the truth from its first scrape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from schemas.messages import NodeAllocations, NodeRecord
from services.allocator.readmodel import ReadModel
from services.allocator.requestbook import RequestBook
from services.runtime.observe.metrics import DEVICE_STATES, RenderedFamily, device_states, label_value

DECISIONS = Counter("tandem_allocator_decisions_total", "Allocation decisions by outcome", ["outcome"])
DECISION_SECONDS = Histogram(
    "tandem_allocator_decision_seconds",
    "Time the core takes to decide one request",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1),
)
REQUEST_TO_ASSIGNMENT_SECONDS = Histogram(
    "tandem_allocator_request_to_assignment_seconds",
    "From the request's creation to its committed assignment (includes time spent pending)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30, 120, 600),
)
PENDING_AGE_AT_PLACEMENT_SECONDS = Histogram(
    "tandem_allocator_pending_age_at_placement_seconds",
    "Age of a request that had been pending (no capacity) when it was finally placed",
    buckets=(0.1, 0.5, 1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 14400),
)
PAIRS = Counter("tandem_allocator_pairs_total", "GPU/NIC pairs assigned, by alignment scope", ["scope"])
PREEMPTIONS = Counter(
    "tandem_allocator_preemptions_total", "Preemption plans made for requests of higher priority"
)
PREEMPTED = Counter(
    "tandem_allocator_preempted_allocations_total", "Allocations chosen to be evicted by a preemption plan"
)
COMMIT_CONFLICTS = Counter(
    "tandem_allocator_commit_conflicts_total", "Commits that lost the compare-and-set race and re-decided"
)
CLAIMS_BUSY = Counter(
    "tandem_allocator_claims_busy_total",
    "Claims that found the request in another live replica's hand (redelivered later)",
)
SHARD_FALLBACKS = Counter(
    "tandem_allocator_shard_fallbacks_total",
    "Decisions that found no room in this replica's shard and looked at every node",
)
FORWARDS = Counter(
    "tandem_allocator_forwards_total",
    "Requests handed to the replica whose shard holds the node this one would take, by what came "
    "of it: taken (placed, placed already, rejected or recorded pending there), no_room (its shard "
    "had no room: this replica decided on its own), gone (no responders: this replica placed it "
    "itself), unanswered (no answer in time or an error there: the message is delivered again)",
    ["outcome"],
)
for _outcome in ("taken", "no_room", "gone", "unanswered"):
    FORWARDS.labels(_outcome)
CATCH_UP_SECONDS = Counter(
    "tandem_allocator_catch_up_seconds_total",
    "Time spent applying other shards' node records before a decision that looks at them",
)
RECORD_FULL = Counter(
    "tandem_allocator_record_full_total",
    "Commits refused because the node's allocation record was full; the node is skipped until a release",
)
for _outcome in ("assigned", "unschedulable", "rejected"):
    DECISIONS.labels(_outcome)  # shown from 0: rate() over a fresh replica is 0, not absent

NODE_STATUSES = ("ready", "lost")


def node_device_states(record: NodeRecord, allocs: NodeAllocations | None) -> dict[tuple[str, str], int]:
    """``(kind, state) → count`` of one node's GPUs and NICs, from its inventory record and its
    allocations record (:func:`services.runtime.observe.metrics.device_states`)."""
    return device_states(record.topology, record.health, allocs)


class AllocatorView(Protocol):
    """What the gauges read of the allocator (:class:`services.allocator.service.Allocator`)."""

    @property
    def book(self) -> RequestBook: ...

    @property
    def model(self) -> ReadModel: ...

    @property
    def allocs(self) -> Mapping[str, tuple[NodeAllocations | None, int]]: ...


class AllocatorState(Collector):
    """The allocator's gauges, from its state at scrape time:

    * ``tandem_allocator_pending_requests`` and ``tandem_allocator_oldest_pending_seconds``;
    * ``tandem_allocator_nodes{status}``;
    * ``tandem_cluster_devices{kind,state}``: devices of ready nodes, ``total`` and by state
      (``free``, ``allocated``, ``unhealthy``, ``cordoned``), counted from the committed
      records: the sums of the per-node counts;
    * ``tandem_node_devices{node,kind,state}``: the same per node (ready and lost ones), while
      the allocator knows at most ``node_metrics_max`` nodes.

    A scrape runs on the allocator's event loop, between decisions, so its cost must not grow
    with the fleet: the read model gathers each node whose records changed
    (``ReadModel.follow_changes``); a scrape counts those nodes again and moves the cluster
    sums by the difference, and renders their per-node lines again; every other node's lines
    are the bytes rendered when it last changed (a :class:`RenderedFamily`, joined, not
    formatted). The node statuses come from the read model's count of lost nodes. Nothing
    here reads the core: with several replicas, the core holds other shards' records only
    when a decision looks at them (``ReadModel.catch_up``), and a scrape must not apply them.
    """

    def __init__(
        self,
        allocator: AllocatorView,
        *,
        clock: Callable[[], float] = time.time,
        node_metrics_max: int = 1000,
    ) -> None:
        self.allocator = allocator
        self.clock = clock
        self.node_metrics_max = node_metrics_max
        # node -> (its record, its allocations record, their counts)
        self._counts: dict[str, tuple[NodeRecord, NodeAllocations | None, dict[tuple[str, str], int]]] = {}
        self._lines: dict[str, bytes] = {}  # node -> its tandem_node_devices lines, once rendered
        # (kind, state) -> devices of ready nodes, the sum of the ready nodes' _counts
        self._cluster: dict[tuple[str, str], int] = {
            (kind, state): 0 for kind in ("gpu", "nic") for state in DEVICE_STATES
        }
        self._ready: set[str] = set()  # the nodes counted in _cluster
        self._changed = allocator.model.follow_changes()

    def _node_counts(
        self, name: str, record: NodeRecord, allocs: NodeAllocations | None
    ) -> dict[tuple[str, str], int]:
        known = self._counts.get(name)
        if known is not None and known[0] is record and known[1] is allocs:
            return known[2]
        counts = node_device_states(record, allocs)
        self._counts[name] = (record, allocs, counts)
        self._lines.pop(name, None)
        return counts

    def _count_changed(self) -> None:
        """Bring ``_counts`` and the cluster sums up to date for the nodes that changed."""
        a = self.allocator
        dirty = list(self._changed)
        self._changed.clear()
        for name in dirty:
            self._move(name, -1)
            record = a.model.nodes.get(name)
            if record is None:
                self._counts.pop(name, None)
                self._lines.pop(name, None)
                continue
            self._node_counts(name, record, a.allocs.get(name, (None, 0))[0])
            self._move(name, 1)

    def prime(self) -> None:
        """Count every node known now, as the first scrape would (0.3 s at 10,000 nodes): called
        as the allocator starts, once it has read its records, so that this is not a stall of
        decisions at the first scrape."""
        self._count_changed()

    def _move(self, name: str, sign: int) -> None:
        """Add (1) or take out (-1) a node's counts from the cluster sums, if it is ready."""
        if sign < 0:
            if name not in self._ready:
                return
            self._ready.discard(name)
            counts = self._counts[name][2]
        else:
            record, _, counts = self._counts[name]
            if record.status != "ready":
                return
            self._ready.add(name)
        for key, n in counts.items():
            self._cluster[key] += sign * n

    def _node_lines(self, name: str) -> bytes:
        lines = self._lines.get(name)
        if lines is None:
            node = label_value(name)
            lines = "".join(
                f'tandem_node_devices{{node="{node}",kind="{kind}",state="{state}"}} {float(n)}\n'
                for (kind, state), n in self._counts[name][2].items()
            ).encode()
            self._lines[name] = lines
        return lines

    def collect(self) -> Iterator[Metric]:
        a = self.allocator
        pending = list(a.book.pending.values())
        yield GaugeMetricFamily(
            "tandem_allocator_pending_requests", "Requests waiting for capacity", value=len(pending)
        )
        oldest = min((r.created_at for r in pending), default=None)
        yield GaugeMetricFamily(
            "tandem_allocator_oldest_pending_seconds",
            "Age of the oldest request waiting for capacity (0 when none waits)",
            value=max(0.0, self.clock() - oldest) if oldest is not None else 0.0,
        )
        nodes = GaugeMetricFamily(
            "tandem_allocator_nodes", "Nodes in the allocator's view by status", labels=["status"]
        )
        self._count_changed()
        known, lost = len(a.model.nodes), a.model.lost
        for status, n in zip(NODE_STATUSES, (known - lost, lost), strict=True):
            nodes.add_metric([status], n)
        yield nodes
        devices = GaugeMetricFamily(
            "tandem_cluster_devices",
            "Devices of ready nodes: total, free (no allocation holds it, healthy, not cordoned), "
            "allocated, unhealthy, cordoned",
            labels=["kind", "state"],
        )
        for kind in ("gpu", "nic"):
            devices.add_metric([kind, "total"], sum(self._cluster[kind, state] for state in DEVICE_STATES))
        for (kind, state), n in self._cluster.items():
            devices.add_metric([kind, state], n)
        yield devices
        per_node = b""
        if known <= self.node_metrics_max:
            per_node = b"".join([self._node_lines(name) for name in self._counts])
        yield RenderedFamily("tandem_node_devices", "Devices of each node by kind and state", per_node)
