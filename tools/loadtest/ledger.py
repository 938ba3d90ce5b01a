"""The ledger: the safety invariants judged at every write, not on snapshots (pure).

The KV snapshots of :mod:`tools.loadtest.invariants` read each record's latest value a few
times a run: a device held twice for a few milliseconds between two snapshots, or an
allocation that silently left its node's record (what a broken compare-and-set would do), is
invisible to them. The ledger is fed *every* revision of every node allocation record (KV
``tandem-allocs``) and every request record (KV ``tandem-requests``), read from the buckets'
own streams in stream order, and every ``Freed`` the allocator publishes; from them it keeps
an account of each allocation's life — assigned (or prepared, for a job pod), releasing,
dropped — and counts:

* ``double_held``: a device of a node listed by two allocations of *any revision* of that
  node's record (shares of one GPU excepted, as in the snapshots: :class:`DeviceHolds`);
  ``(node, device)`` pairs, each counted once;
* ``double_placed``: a request held by two node records at the same point of the stream. One
  bucket is one stream, so its revisions are totally ordered and "at the same time" is exact
  here, where a snapshot read over seconds can only approximate it;
* ``vanished``: a request whose allocation left its node's record without having been
  ``releasing`` there (the only legal ways out are a drop after a verified cleanup and the
  roll-back of a job pod still ``prepared``), or — at the end — a request whose record says
  ``assigned`` to a node whose record does not hold it: an assignment lost;
* ``freed_unknown``: a release reported as freed that the node records never showed: a
  ``Freed`` (or a request record ``freed``) naming a node on which the ledger never saw the
  allocation ``releasing``, or a cancel (``Freed`` without a node, record ``cancelled``) of a
  request that some node record held — the allocator took a placed request for an unplaced
  one, which is what a release of a vanished allocation becomes.

Also counted, for the reader: ``assignments``, ``releases``, ``frees`` (allocations dropped
after ``releasing``), ``freed_events``, ``cleanups_unverified`` (requests whose record went
``releasing``: the allocator heard a ``Cleaned(ok=False)`` and kept the devices) and
``revisions_seen``.

What it cannot see, it says: ``revisions_missed`` counts node-record revisions the stream no
longer had when they were read (a bucket keeps 5 revisions of a key: a reader more than 5
writes of one key behind loses some) or that did not decode. A hole can hide a double hold
and can make a legal release look like a vanish, so a request last seen before a hole is not
judged vanished or unknown-freed (it is not counted clean either: ``revisions_missed`` > 0
says the ledger could not vouch for everything). Request-record revisions are not counted
missing: a finished record is written with a rollup that removes its key's older revisions,
and the ledger needs only their latest state.

Revisions at or before the stream's last sequence when the reader started (``baseline``) are
the state it starts from: their holds are checked, but finished request records among them
(of an earlier run on the same server) are not judged.

:class:`Ledger` is fed by :mod:`tools.loadtest.ledgerwatch` (the NATS side) and by tests
with crafted sequences; :class:`DeviceHolds` is also the simulated fleet's check before it
applies an assignment (:mod:`tools.loadtest.fleet`).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from schemas.messages import AllocRecord, Assignment, Freed, NodeAllocations, RequestRecord

__all__ = ["DeviceHolds", "Ledger", "LedgerCounts"]

# States in which an allocation is the pod's (assigned to it, or being released).
HELD_STATES = frozenset({"assigned", "releasing"})
# How many examples of each violation the ledger keeps for the harness's progress lines.
EXAMPLES = 10


class LedgerCounts(msgspec.Struct, kw_only=True):
    """The ledger's figures: the ``ledger`` object of ``tandem loadtest``'s JSON line (the
    module says what each means). ``overlap_at_apply`` and ``cleanup_failures_injected`` come
    from the simulated fleet, not from the records: assignments it refused because they
    overlapped devices it had applied, and cleanups it failed on purpose before succeeding."""

    revisions_seen: int = 0
    revisions_missed: int = 0
    assignments: int = 0
    releases: int = 0
    frees: int = 0
    freed_events: int = 0
    cleanups_unverified: int = 0
    double_held: int = 0
    double_placed: int = 0
    vanished: int = 0
    freed_unknown: int = 0
    overlap_at_apply: int = 0
    cleanup_failures_injected: int = 0
    error: str | None = None  # why there are no counts (the ledger could not be read)

    def violations(self) -> int:
        """How many faults the ledger and the fleet found (0: the invariants held)."""
        faults = self.double_held + self.double_placed + self.vanished + self.freed_unknown
        return faults + self.overlap_at_apply


class DeviceHolds:
    """Which allocations hold each device of one node, and what a new one clashes with: a
    device held by two allocations, unless both hold it as a share of a GPU (how many shares
    fit is :func:`tools.loadtest.invariants.check`'s question, not this one's). The same
    rule as the snapshots' ``double_held``; MIG instances are devices of their own (as there)."""

    __slots__ = ("_by_device", "_of")

    def __init__(self) -> None:
        self._by_device: dict[str, dict[str, bool]] = {}  # device -> {request id: as a share}
        self._of: dict[str, list[str]] = {}  # request id -> its devices

    def clashes(self, request_id: str, assignment: Assignment) -> list[tuple[str, str]]:
        """``(device, other request id)`` for each device ``assignment`` would share with
        another allocation, nothing added."""
        return self._clashes(request_id, _devices(assignment))

    def add(self, request_id: str, assignment: Assignment) -> list[tuple[str, str]]:
        """Hold ``assignment``'s devices for ``request_id`` (replacing what it held); returns
        the clashes, as :meth:`clashes` — the devices are held all the same, since a record
        that lists them does hold them."""
        self.remove(request_id)
        devices = _devices(assignment)
        found = self._clashes(request_id, devices)
        by_device = self._by_device
        for device, as_share in devices.items():
            holders = by_device.get(device)
            if holders is None:
                by_device[device] = {request_id: as_share}
            else:
                holders[request_id] = as_share
        self._of[request_id] = list(devices)
        return found

    def _clashes(self, request_id: str, devices: dict[str, bool]) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        by_device = self._by_device
        for device, as_share in devices.items():
            holders = by_device.get(device)
            if holders:
                out.extend(
                    (device, other)
                    for other, other_share in holders.items()
                    if other != request_id and not (as_share and other_share)
                )
        return out

    def remove(self, request_id: str) -> None:
        for device in self._of.pop(request_id, ()):
            holders = self._by_device.get(device)
            if holders is not None:
                holders.pop(request_id, None)
                if not holders:
                    del self._by_device[device]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._of


def _devices(assignment: Assignment) -> dict[str, bool]:
    """An allocation's devices, each with whether it holds it as a share of a GPU."""
    shared = {f"gpu{g.index}" for g in assignment.gpus if g.shared}
    return {device: device in shared for device in assignment.device_ids()}


class Ledger:
    """Feed it every revision in stream order (:meth:`node_record`, :meth:`request_record`,
    :meth:`freed`, :meth:`missed`); :meth:`counts` judges what can only be judged at the end
    and may be called at any time (it changes nothing)."""

    def __init__(self) -> None:
        self._records: dict[str, Mapping[str, AllocRecord]] = {}  # node -> its allocations now
        self._holds: dict[str, DeviceHolds] = {}  # node -> its devices' holders now
        self._where: dict[str, str] = {}  # request id -> the node whose record holds it now
        self._seen_at: dict[str, int] = {}  # request id -> sequence of its last node-record change
        self._ever_held: set[str] = set()  # requests some node record held (assigned or later)
        self._released: set[tuple[str, str]] = set()  # (request id, node): seen releasing there
        self._assigned: dict[str, str] = {}  # request id -> node, while its record says assigned
        self._request_state: dict[str, str] = {}  # request id -> its record's state now
        self._unverified: set[str] = set()  # requests whose record went releasing
        self._reports: set[tuple[str, str | None]] = set()  # (request id, node or None): freed or cancelled
        self._double_held: set[tuple[str, str]] = set()
        self._double_placed: set[str] = set()
        self._vanished: set[str] = set()  # left their record without being released
        self._unjudged: set[str] = set()  # left their record across a hole: their release may be in it
        self._holes_after = -1  # sequence before which the last hole in the node stream ended
        self._tally = LedgerCounts()
        self.examples: list[str] = []

    # -- feeding ------------------------------------------------------------------------------

    def node_record(self, node: str, record: NodeAllocations | None, *, seq: int) -> None:
        """One revision of ``node``'s allocation record (None: deleted), at stream sequence
        ``seq``. Allocations unchanged since the last revision may be the very same objects
        (:class:`schemas.codec.NodeAllocsDecoder`); they are skipped."""
        self._tally.revisions_seen += 1
        before = self._records.get(node, {})
        now: Mapping[str, AllocRecord] = record.allocations if record is not None else {}
        holds = self._holds.get(node)
        if holds is None:
            holds = self._holds[node] = DeviceHolds()
        for rid, old in before.items():
            if rid not in now:
                holds.remove(rid)
                self._left(node, rid, old, seq=seq)
        for rid, rec in now.items():
            prior = before.get(rid)
            if prior is rec:
                continue
            self._changed(node, rid, prior, rec, seq=seq)
            # A state change is decoded as a new allocation with an equal assignment: its
            # devices are held already.
            same_devices = prior is not None and (
                prior.assignment is rec.assignment or prior.assignment == rec.assignment
            )
            if not same_devices:
                for device, other in holds.add(rid, rec.assignment):
                    if (node, device) not in self._double_held:
                        self._double_held.add((node, device))
                        self._example(f"{node}: {device} held by {other} and {rid} (revision {seq})")
        if now:
            self._records[node] = now
        else:
            self._records.pop(node, None)
            self._holds.pop(node, None)

    def request_record(
        self, request_id: str, record: RequestRecord | None, *, seq: int, baseline: bool
    ) -> None:
        """One revision of a request's record (None: deleted or expired)."""
        self._tally.revisions_seen += 1
        before = self._request_state.get(request_id)
        if record is None:
            self._request_state.pop(request_id, None)
            self._assigned.pop(request_id, None)
            return
        state = record.state
        self._request_state[request_id] = state
        if state == "assigned" and record.node:
            self._assigned[request_id] = record.node
        else:
            self._assigned.pop(request_id, None)
        if state == "releasing":
            self._unverified.add(request_id)
        if baseline or state == before:
            return
        if state == "freed":
            self._reports.add((request_id, record.node))
        elif state == "cancelled":
            self._reports.add((request_id, None))

    def freed(self, event: Freed) -> None:
        """A ``Freed`` the allocator published (node None: a cancel of an unplaced request)."""
        self._tally.freed_events += 1
        self._reports.add((event.request_id, event.node))

    def missed(self, count: int, *, before: int) -> None:
        """``count`` node-record revisions, the last of them just before sequence ``before``,
        were not read (gone from the stream, or undecodable)."""
        self._tally.revisions_missed += count
        self._holes_after = max(self._holes_after, before)

    # -- judging ------------------------------------------------------------------------------

    def counts(self) -> LedgerCounts:
        """Everything so far, with the checks that need the end: requests assigned in their
        record but held by no node, and freed reports the node records never showed."""
        lost_at_end = {rid for rid, _ in self._lost_at_end()}
        return msgspec.structs.replace(
            self._tally,
            cleanups_unverified=len(self._unverified),
            double_held=len(self._double_held),
            double_placed=len(self._double_placed),
            vanished=len(self._vanished | lost_at_end),
            freed_unknown=len({rid for rid, _ in self._unknown_frees()}),
        )

    def end_examples(self) -> list[str]:
        """:attr:`examples` and, within a bound, the faults only the end shows."""
        out = list(self.examples)
        for rid, node in self._lost_at_end():
            if rid not in self._vanished:
                out.append(f"{rid}: its record says assigned to {node}, whose record does not hold it")
        for rid, on in self._unknown_frees():
            if on is None:
                out.append(f"{rid}: cancelled (freed without a node) though a node record held it")
            else:
                out.append(f"{rid}: freed on {on}, never seen releasing there")
        return out[: 3 * EXAMPLES]

    def _lost_at_end(self) -> list[tuple[str, str]]:
        """Requests whose record says assigned to a node whose record does not hold them."""
        assigned = self._assigned.items()
        return sorted((rid, node) for rid, node in assigned if rid not in self._records.get(node, {}))

    def _unknown_frees(self) -> list[tuple[str, str | None]]:
        """Freed reports the node records never showed: freed on a node where the allocation
        was never releasing (unless a hole may hide it), or cancelled though a node held it."""
        return sorted(
            (
                (rid, node)
                for rid, node in self._reports
                if (node is None and rid in self._ever_held)
                or (node is not None and (rid, node) not in self._released and not self._in_hole(rid))
            ),
            key=lambda r: (r[0], r[1] or ""),
        )

    # -- one allocation's life ----------------------------------------------------------------

    def _changed(self, node: str, rid: str, old: AllocRecord | None, rec: AllocRecord, *, seq: int) -> None:
        self._seen_at[rid] = seq
        if old is None:
            elsewhere = self._where.get(rid)
            if elsewhere is not None and elsewhere != node and rid not in self._double_placed:
                self._double_placed.add(rid)
                self._example(f"{rid}: held on {elsewhere} and {node} (revision {seq})")
            self._where[rid] = node
        was = old.state if old is not None else None
        if rec.state == was:
            return
        if rec.state in HELD_STATES and was not in HELD_STATES:
            self._tally.assignments += 1
            self._ever_held.add(rid)
        if rec.state == "releasing":
            self._tally.releases += 1
            self._released.add((rid, node))

    def _left(self, node: str, rid: str, old: AllocRecord, *, seq: int) -> None:
        if self._where.get(rid) == node:
            del self._where[rid]
        if old.state == "releasing":
            self._tally.frees += 1
        elif old.state != "prepared" and self._in_hole(rid):
            self._unjudged.add(rid)  # its release may be among the revisions missed
        elif old.state != "prepared" and rid not in self._vanished:
            # Assigned or applied and gone: nobody released it (a job pod still prepared is
            # rolled back by design).
            self._vanished.add(rid)
            self._example(f"{rid}: left {node}'s record while {old.state}, never released (revision {seq})")
        self._seen_at[rid] = seq

    def _in_hole(self, rid: str) -> bool:
        """Whether revisions were missed since ``rid`` was last seen changing (or ever, for a
        request never seen in a node record), or it left a record across such a hole."""
        return rid in self._unjudged or self._holes_after > self._seen_at.get(rid, -1)

    def _example(self, line: str) -> None:
        if len(self.examples) < EXAMPLES:
            self.examples.append(line)
