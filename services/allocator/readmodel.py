"""The allocator's read model: KV state mirrored into the pure core.

* ``tandem-nodes`` (hardware, health, ready/lost; written by the inventory) → the core's nodes:
  a node that is not ``ready`` gets no new allocation, its holds stay;
* ``tandem-node-labels`` (the Node objects' fabric labels, mirrored by the pod bridge) → added
  to the node's labels;
* ``tandem-allocs`` (what every node has handed out; written by allocators) → the core's
  holds and :attr:`ReadModel.placed` (request id → node). These records come from the
  allocator's own writes (:class:`~services.runtime.kv.records.RecordStore` calls
  :meth:`ReadModel.on_allocs` as each commit lands), from other replicas' writes through a
  watch, and from re-reads after a lost compare-and-set;
* *tentative* holds: devices chosen by a decision whose commit is still in flight. Decisions
  are taken one at a time on the event loop while many commits are in flight, so the next
  decision must already see those devices as used; a tentative hold turns into the record's
  hold when the commit lands, and is dropped when it fails;
* *reservations*: devices kept for a preempting request while its victims are evicted
  (:meth:`ReadModel.reserve_for`, :mod:`.preemption`), lent to that request alone for its own
  decisions (:meth:`ReadModel.lend`, :meth:`ReadModel.keep`).

Who writes it: the record watches (and the allocator's own commits, which land through the
same path), the replica heartbeats (the shards), and the placement pipeline
(:mod:`.placer`: tentative holds, reservations lent and kept, a node whose record is full).

Decisions never read NATS. :attr:`ReadModel.capacity` is set whenever capacity may have grown
(a node joined or recovered, a device recovered, an allocation was dropped) so the placement
loop retries pending requests then, not on every change.

Every node carries one label of the allocator's own besides its own ones: its name under
``kubernetes.io/hostname`` (as kubelet sets it, for pinned pods). It is registered in the core
with its *shard* (a hash of the name modulo the number of live replicas, :func:`shard_of`),
which lets each replica try its own share of the nodes first (services.allocator.replicas).

With several replicas, the holds of another shard's nodes are applied to the core lazily:
each replica sees every write of the others, and applying them (the core's index updates)
was the larger part of what a second replica cost (docs/benchmarks.md). A decision inside the
replica's own shard never looks at another shard's nodes, so their latest records wait in
``_deferred`` until something does look — a decision outside the shard, a pinned request,
preemption, a job, the metrics, a change of shards: each calls :meth:`ReadModel.catch_up`
first. Everything else about the records (``placed``, prepared job pods, the capacity event)
is kept at once, and a node with a decision of this replica in flight (tentative holds, a
reservation) is always applied at once.

Nodes the core does not count are still named in a refusal (:meth:`ReadModel.explain`): a
lost node is removed from the core, so "3 nodes: labels do not match the node selector" would
send the author of a pod pinned to the lost node to check a selector that is right. So is a
node whose allocation record is *full* (:meth:`ReadModel.close_full`: a commit there failed
with :class:`~services.runtime.kv.records.RecordTooLarge`): no request can be recorded on it until
an allocation leaves it, so decisions skip it — one tenant's many small shares must not make
other tenants' requests fail while other nodes have room — and a request only it can take
waits, saying so. Nodes with devices out of service are counted by the core; the refusal
names them too, with their devices.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import replace

from schemas.messages import AllocRecord, NodeAllocations, NodeLabels, NodeRecord
from services.allocator.core import Cluster, Unschedulable

HOSTNAME_LABEL = "kubernetes.io/hostname"
# How many nodes one clause of a refusal names before it says "and N more".
NAMED_MAX = 5


def reservation_key(request_id: str) -> str:
    """The hold key of a preemptor's reserved devices: ``:`` never occurs in a request id."""
    return f"preempt:{request_id}"


def shard_of(node: str, shards: int) -> str:
    """Which allocator replica decides on the node first (see ReadModel.set_shards)."""
    return str(zlib.crc32(node.encode()) % shards)


class ReadModel:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.nodes: dict[str, NodeRecord] = {}
        self.placed: dict[str, str] = {}  # request id → node, from the allocation records
        self.capacity = asyncio.Event()
        self.shards = 1
        self.shard: str | None = None  # this replica's shard while there are several
        # node of another shard → its latest allocation record, not applied to the core yet
        self._deferred: dict[str, NodeAllocations | None] = {}
        self._ids: dict[str, set[str]] = {}  # node → request ids its record holds
        # node → (job, epoch) of the job pods its record holds ``prepared`` (services.allocator.jobplacement)
        self.prepared: dict[str, set[tuple[str, int]]] = {}
        self._tentative: dict[str, dict[str, tuple[str, ...]]] = {}  # node → request → devices
        # node → request → the AllocRecord its hold was last taken from (see _sync_holds)
        self._applied: dict[str, dict[str, AllocRecord]] = {}
        # Labels the cluster keeps on the Node objects (fabric blocks), mirrored by the pod
        # bridge into KV tandem-node-labels: they join the topology's own labels.
        self.cluster_labels: dict[str, dict[str, str]] = {}
        # node → reservation key → devices: devices kept for a preempting request while its
        # victims are evicted (services/allocator/evictionplans.py); never preemptible.
        self._reserved: dict[str, dict[str, tuple[str, ...]]] = {}
        # preempting request id → (node, devices) of its reservation (see reserve_for)
        self.reservations: dict[str, tuple[str, list[str]]] = {}
        # node → why its allocation record has no room (see close_full); out of the core
        # until an allocation leaves that record.
        self.full: dict[str, str] = {}
        # Named in refusals, kept here so a refusal does not walk the fleet: lost nodes, and
        # ready nodes with devices out of service (unhealthy, cordoned).
        self._lost: set[str] = set()
        self._impaired: set[str] = set()
        # Sets handed out by follow_changes, each gathering the nodes whose records changed.
        self._followers: list[set[str]] = []

    # -- node records -----------------------------------------------------------------------

    @property
    def lost(self) -> int:
        """How many known nodes are not ready."""
        return len(self._lost)

    def follow_changes(self) -> set[str]:
        """A set that gathers the name of every node whose node or allocation record changes
        from now on, starting with every node known now; its reader empties it. The gauges
        (services/allocator/metrics.py) work on these nodes instead of walking the fleet."""
        changed = {*self.nodes, *self._ids}
        self._followers.append(changed)
        return changed

    def _changed(self, node: str) -> None:
        for follower in self._followers:
            follower.add(node)

    def on_node_record(self, node: str, record: NodeRecord | None) -> None:
        self._changed(node)
        before = self.nodes.get(node)
        if record is None:
            self.nodes.pop(node, None)
        else:
            self.nodes[node] = record
        if record is not None and record.status != "ready":
            self._lost.add(node)
        else:
            self._lost.discard(node)
        if record is not None and record.status == "ready" and record.unavailable():
            self._impaired.add(node)
        else:
            self._impaired.discard(node)
        if record is None or record.status != "ready":
            # A lost node gets no new allocations; its holds return with it.
            self.cluster.remove_node(node)
            return
        if (
            before is not None
            and before.status == record.status
            and before.topology == record.topology
            and before.unavailable() == record.unavailable()
        ):
            return  # a change the core does not see (heartbeat time, reasons)
        self._set_node(node, record)
        self.capacity.set()

    def _set_node(self, node: str, record: NodeRecord) -> None:
        if node in self.full:
            return  # out of the core until its record has room (see close_full)
        # Holds are kept per node name across set_node / remove_node (the core's contract).
        self.cluster.set_node(
            node,
            record.topology,
            labels=self._labels(node, record),
            unavailable=record.unavailable(),
            shard=shard_of(node, self.shards),
        )

    def _labels(self, node: str, record: NodeRecord) -> dict[str, str]:
        # Like kubelet, every node carries its own name as a label selectors can use.
        return {
            **record.topology.labels,
            **self.cluster_labels.get(node, {}),
            HOSTNAME_LABEL: node,
        }

    # -- nodes the core does not count ------------------------------------------------------

    def close_full(self, node: str, why: str) -> None:
        """A commit on ``node`` failed because its allocation record would grow past its size
        limit (``why``): take the node out of decisions until an allocation leaves the record
        (:meth:`on_allocs` puts it back), so requests that other nodes can take go there."""
        self.full[node] = why
        self.cluster.remove_node(node)

    def _reopen(self, node: str) -> None:
        if self.full.pop(node, None) is None:
            return
        record = self.nodes.get(node)
        if record is not None and record.status == "ready":
            self._set_node(node, record)

    def explain(self, selector: Mapping[str, str], why: Unschedulable) -> Unschedulable:
        """``why`` with the nodes the core did not count (lost, record full) and the nodes
        with devices out of service named, those of them that ``selector`` matches. Cheap:
        it looks only at those nodes. The text must not change while they do not (no ages),
        since a new reason is announced to the pod's owner."""
        absent: list[str] = []
        for node in sorted({*self.full, *self._lost}):
            record = self.nodes.get(node)
            if record is None or not self._selected(node, record, selector):
                continue
            if record.status != "ready":
                absent.append(f"{node} (lost: its node agent stopped reporting)")
            else:
                absent.append(f"{node} (its allocation record is full; waiting for releases on it)")
        impaired: list[str] = []
        for node in sorted(self._impaired):
            record = self.nodes.get(node)
            if record is None or node in self.full or not self._selected(node, record, selector):
                continue
            devices = ", ".join(
                f"{d} {'unhealthy' if not h.healthy else 'cordoned'}"
                for d, h in sorted(record.health.items())
                if not h.healthy or h.cordoned
            )
            impaired.append(f"{node} ({devices})")
        clauses = []
        if absent:
            clauses.append(f"not counted: {_named(absent)}")
        if impaired:
            clauses.append(f"devices out of service on {_named(impaired)}")
        if not clauses:
            return why
        return replace(why, reason="; ".join([why.reason, *clauses]))

    def _selected(self, node: str, record: NodeRecord, selector: Mapping[str, str]) -> bool:
        if not selector:
            return True
        labels = self._labels(node, record)
        return all(labels.get(k) == v for k, v in selector.items())

    def on_node_labels(self, node: str, record: NodeLabels | None) -> None:
        """The Node object's fabric labels changed (KV ``tandem-node-labels``)."""
        labels = dict(record.labels) if record is not None else {}
        if self.cluster_labels.get(node, {}) == labels:
            return
        if labels:
            self.cluster_labels[node] = labels
        else:
            self.cluster_labels.pop(node, None)
        known = self.nodes.get(node)
        if known is not None and known.status == "ready":
            self._set_node(node, known)
            self.capacity.set()  # a job waiting for a fabric block may fit now

    def set_shards(self, shards: int, shard: str | None = None) -> None:
        """Split the nodes into ``shards`` (the live replicas), ``shard`` being this replica's:
        registers every ready node with its new shard when their number changed."""
        if shards == self.shards and shard == self.shard:
            return
        self.catch_up()  # what was another shard's may be this one's now
        self.shard = shard if shards > 1 else None
        if shards == self.shards:
            return
        self.shards = shards
        for node, record in self.nodes.items():
            if record.status == "ready":
                self._set_node(node, record)

    # -- allocation records -----------------------------------------------------------------

    def on_allocs(self, node: str, record: NodeAllocations | None, _revision: int) -> None:
        self._changed(node)
        allocations = record.allocations if record is not None else {}
        old = self._ids.get(node, set())
        new = set(allocations)
        for rid in old - new:
            if self.placed.get(rid) == node:
                del self.placed[rid]
        for rid in new:
            self.placed[rid] = node
        self._ids[node] = new
        attempts = {(r.job, r.epoch) for r in allocations.values() if r.state == "prepared"}
        if attempts:
            self.prepared[node] = attempts
        else:
            self.prepared.pop(node, None)
        if self._elsewhere(node):
            self._deferred[node] = record
        else:
            self._deferred.pop(node, None)
            self._sync_holds(node, record)
        if old - new:
            self._reopen(node)  # a record that lost an allocation has room again
            self.capacity.set()

    def _elsewhere(self, node: str) -> bool:
        """Another replica's node, with nothing of this replica's own in flight on it."""
        return (
            self.shard is not None
            and node not in self._tentative
            and node not in self._reserved
            and shard_of(node, self.shards) != self.shard
        )

    def catch_up(self) -> None:
        """Apply the deferred records of other shards' nodes: call before anything reads the
        core beyond this replica's own shard."""
        if self._deferred:
            deferred, self._deferred = self._deferred, {}
            for node, record in deferred.items():
                self._sync_holds(node, record)

    def _catch_up_node(self, node: str) -> None:
        if node in self._deferred:
            self._sync_holds(node, self._deferred.pop(node))

    def _sync_holds(self, node: str, record: NodeAllocations | None) -> None:
        allocations = record.allocations if record is not None else {}
        tentative = self._tentative.get(node, {})
        reserved = self._reserved.get(node, {})
        for rid in [r for r in self.cluster.held(node) if r not in allocations and r not in tentative]:
            if rid not in reserved:
                self.cluster.release(node, rid)
        applied = self._applied.pop(node, {})
        for rid, rec in allocations.items():
            if applied.get(rid) is rec and rid not in tentative:
                # The very allocation held already: a write changes one allocation of a record
                # and carries the others as they were (commits keep their objects, and
                # codec.NodeAllocsDecoder the decoded ones), so only that one is held again.
                continue
            tentative.pop(rid, None)  # committed: the record's hold replaces it
            # A request of higher priority may evict a running allocation; one being released
            # is on its way out already, and a protected one (a claim) stays.
            self.cluster.hold(
                node,
                rid,
                rec.assignment.device_ids(),
                priority=rec.priority,
                # A job pod in the first phase of its commit is not an allocation yet.
                preemptible=rec.preemptible and rec.state not in ("releasing", "prepared"),
                shares=rec.assignment.shares(),
                sharing=rec.assignment.sharing,
            )
        if allocations:
            self._applied[node] = dict(allocations)
        if not tentative:
            self._tentative.pop(node, None)

    # -- decisions in flight ----------------------------------------------------------------

    def hold_tentative(
        self,
        node: str,
        request_id: str,
        devices: list[str],
        *,
        shares: dict[str, tuple[int, int]] | None = None,
        sharing: str = "",
    ) -> None:
        """``shares``: the GPUs held as shares (:meth:`Assignment.shares`), the rest whole;
        ``sharing``: their mode (the assignment's)."""
        self._catch_up_node(node)
        devs = tuple(devices)
        self._tentative.setdefault(node, {})[request_id] = devs
        self.cluster.hold(node, request_id, devs, shares=shares, sharing=sharing)

    def reserve(self, node: str, key: str, devices: list[str]) -> None:
        """Keep ``devices`` from every decision under ``key`` (not a request id) until
        :meth:`unreserve`: a preempting request's devices while its victims are evicted."""
        self._catch_up_node(node)
        devs = tuple(devices)
        self._reserved.setdefault(node, {})[key] = devs
        self.cluster.hold(node, key, devs)

    def unreserve(self, node: str, key: str) -> None:
        """Give a reservation back (no capacity event: the caller decides at once)."""
        reserved = self._reserved.get(node)
        if reserved is None or reserved.pop(key, None) is None:
            return
        if not reserved:
            del self._reserved[node]
        self.cluster.release(node, key)

    def reserve_for(self, request_id: str, node: str, devices: list[str]) -> None:
        """Keep ``devices`` on ``node`` for a preempting request while its victims are evicted
        (:mod:`.preemption`), instead of what was kept for it before."""
        self.unreserve_for(request_id)
        self.reserve(node, reservation_key(request_id), devices)
        self.reservations[request_id] = (node, list(devices))

    def unreserve_for(self, request_id: str) -> bool:
        """Give back what :meth:`reserve_for` kept for the request; False when nothing."""
        held = self.reservations.pop(request_id, None)
        if held is None:
            return False
        self.unreserve(held[0], reservation_key(request_id))
        return True

    def lend(self, request_id: str) -> None:
        """Give the request its own reserved devices for its next decision; :meth:`keep`
        right after it (no await in between: decisions are serial)."""
        held = self.reservations.get(request_id)
        if held is not None:
            self.unreserve(held[0], reservation_key(request_id))

    def keep(self, request_id: str, *, taken: bool) -> None:
        """After the decision :meth:`lend` prepared: the request took the devices (the
        reservation is over), or it still cannot be placed (they are reserved again)."""
        held = self.reservations.get(request_id)
        if held is None:
            return
        if taken:
            del self.reservations[request_id]
        else:
            self.reserve(held[0], reservation_key(request_id), held[1])

    def drop_tentative(self, node: str, request_id: str) -> None:
        """The commit failed: free the devices unless the record holds the request after all."""
        tentative = self._tentative.get(node)
        if tentative is None or tentative.pop(request_id, None) is None:
            return
        if not tentative:
            del self._tentative[node]
        if request_id not in self._ids.get(node, ()):
            self.cluster.release(node, request_id)
            self.capacity.set()


def _named(items: Iterable[str]) -> str:
    """At most :data:`NAMED_MAX` of ``items``, then how many more."""
    listed = list(items)
    more = len(listed) - NAMED_MAX
    return ", ".join(listed[:NAMED_MAX]) + (f" and {more} more" if more > 0 else "")
