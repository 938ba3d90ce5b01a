"""Metrics every service shares, and what one service's ``/metrics`` shows.

* :data:`RECONNECTS` (``tandem_nats_reconnects_total{service}``): counted by
  :func:`services.runtime.nats.connection.connect` each time nats-py reconnects;
* :data:`CONSUMER_PENDING` (``tandem_consumer_pending_messages{service,consumer}``): the
  messages a durable consumer has not been handed yet, from the server's consumer info,
  polled by :func:`services.runtime.nats.consumerlag.watch_consumers` (a lagging service shows
  here before it shows anywhere else);
* ``tandem_ready{service}``: 1 while the service would answer ``/readyz`` with 200, written by
  :class:`ServiceView` at scrape time (the alert "allocator without a ready replica" sums it).

Gauges that describe state (pending requests, devices, nodes) are computed from the
service's state when Prometheus scrapes (a :class:`prometheus_client.registry.Collector` per
service, e.g. :class:`services.allocator.metrics.AllocatorState`), never kept up by events,
so they are right from the first scrape after any restart.

A family of many series that a collector keeps rendered itself, changing only the lines of
what changed, is a :class:`RenderedFamily`: :func:`exposition` writes its text as it is instead
of formatting every sample again (prometheus_client's text formatting costs ~4 µs a series,
on the event loop of the service being scraped).

One process may run several services (``tandem up``): the counters are process-wide, so
:class:`ServiceView` shows one service its own families (by name prefix, or by the
``service`` label of the shared ones) plus the process-wide ones (``process_*``, loop lag),
and each service is served on its own port (:class:`services.runtime.observe.opsserver.OpsServer`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from schemas.messages import DeviceHealth, NodeAllocations
from schemas.topology import NodeTopology
from services.runtime.observe.logging import get_logger

log = get_logger(__name__)

# Every counter would also export a `<name>_created` series (its creation time) that no rule,
# alert or dashboard reads: twice the series per counter in every Prometheus.
disable_created_metrics()  # type: ignore[no-untyped-call]  # the package leaves it unannotated

RECONNECTS = Counter(
    "tandem_nats_reconnects_total", "NATS reconnects of the service's connection", ["service"]
)
CONSUMER_PENDING = Gauge(
    "tandem_consumer_pending_messages",
    "Messages a durable consumer has not been handed yet (consumer info num_pending, polled)",
    ["service", "consumer"],
)

# Families that belong to one service (shown only on its port), by name prefix.
SERVICE_PREFIXES: dict[str, tuple[str, ...]] = {
    "allocator": ("tandem_allocator_", "tandem_cluster_", "tandem_node_devices"),
    "inventory": ("tandem_inventory_",),
    "nodeagent": ("tandem_nodeagent_",),
    "admission": ("tandem_admission_", "tandem_bridge_"),
    "authcallout": ("tandem_authcallout_",),
}
_OWNED = tuple(p for prefixes in SERVICE_PREFIXES.values() for p in prefixes)


# Device states, per node and cluster-wide: held by an allocation, out of service (a failed
# device is "unhealthy" even when also cordoned), or free to allocate. The allocator counts
# them from the records it reads, each node agent from what it knows itself.
DEVICE_STATES = ("free", "allocated", "unhealthy", "cordoned")


def device_states(
    topology: NodeTopology, health: Mapping[str, DeviceHealth], allocs: NodeAllocations | None
) -> dict[tuple[str, str], int]:
    """``(kind, state) → count`` of one node's GPUs and NICs (physical functions; a NIC whose
    function or any of its VFs is held counts as allocated, and so does a GPU in MIG mode any
    of whose instances is held)."""
    used = allocs.used() if allocs is not None else set()
    counts = {(kind, state): 0 for kind in ("gpu", "nic") for state in DEVICE_STATES}
    devices: list[tuple[str, str, set[str]]] = [
        ("gpu", g.id, {g.id, *(d for d, _ in g.mig_ids())}) for g in topology.gpus()
    ]
    devices += [("nic", n.id, {n.id, *(vf.name for vf in n.vfs)}) for n in topology.nics()]
    for kind, device, names in devices:
        h = health.get(device)
        if h is not None and not h.healthy:
            state = "unhealthy"
        elif h is not None and h.cordoned:
            state = "cordoned"
        elif names & used:
            state = "allocated"
        else:
            state = "free"
        counts[kind, state] += 1
    return counts


class ServiceView(Collector):
    """One service's share of the process registry, its state collectors and ``tandem_ready``."""

    def __init__(
        self,
        service: str,
        *,
        ready: Callable[[], bool],
        source: CollectorRegistry = REGISTRY,
        collectors: Iterable[Collector] = (),
    ) -> None:
        self.service = service
        self.ready = ready
        self.source = source
        self.own = SERVICE_PREFIXES.get(service, ())
        self.collectors = list(collectors)

    def collect(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily(
            "tandem_ready", "1 while the service answers /readyz with 200", labels=["service"]
        )
        ready.add_metric([self.service], 1.0 if self.ready() else 0.0)
        yield ready
        for family in self.source.collect():
            if family.name.startswith(_OWNED) and not family.name.startswith(self.own):
                continue  # another service's
            family.samples = [
                s for s in family.samples if s.labels.get("service", self.service) == self.service
            ]
            yield family
        for collector in self.collectors:
            yield from collector.collect()


def service_registry(
    service: str, *, ready: Callable[[], bool], collectors: Iterable[Collector] = ()
) -> CollectorRegistry:
    """A registry that holds only :class:`ServiceView` of ``service``: what its port serves."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceView(service, ready=ready, collectors=collectors))
    return registry


class RenderedFamily(Metric):
    """A gauge family whose text exposition its collector renders itself: ``lines`` are its
    series in the text format (``name{labels} value``, one per line, each ending in a
    newline), typically joined from per-object blocks cached until the object changes."""

    def __init__(self, name: str, documentation: str, lines: bytes) -> None:
        super().__init__(name, documentation, "gauge")
        self.lines = lines

    def text(self) -> bytes:
        doc = self.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        return f"# HELP {self.name} {doc}\n# TYPE {self.name} gauge\n".encode() + self.lines


def label_value(value: str) -> str:
    """``value`` escaped for a label in the text format (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass
class _Families:
    """The already collected families, as ``generate_latest`` wants a registry."""

    families: list[Metric]

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def exposition(registry: CollectorRegistry) -> bytes:
    """The text exposition of ``registry``: :func:`prometheus_client.generate_latest`, with each
    :class:`RenderedFamily` written as its collector rendered it."""
    families = list(registry.collect())
    rendered = [f.text() for f in families if isinstance(f, RenderedFamily)]
    plain = [f for f in families if not isinstance(f, RenderedFamily)]
    return generate_latest(_Families(plain)) + b"".join(rendered)


_state: dict[str, Collector] = {}


def register_state(collector: Collector) -> None:
    """Register a service's state collector with the process registry (one service per
    process, as ``python -m services.<service>`` runs it); a second one of the same type
    replaces the first."""
    name = type(collector).__name__
    old = _state.pop(name, None)
    if old is not None:
        REGISTRY.unregister(old)
    REGISTRY.register(collector)
    _state[name] = collector
