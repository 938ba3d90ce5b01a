"""The invariants, read from KV — the system's truth — never from the harness's bookkeeping.

A :class:`KvState` is every node's allocation record (``tandem-allocs``, one ordered pass,
:func:`tools.loadtest.invariants.snapshot`) and the request record (``tandem-requests``)
of each request asked about — or of every request in the bucket (:func:`read_all`). The
harness knows which requests it submitted (that is input, not bookkeeping of outcomes); what
became of them is read here.

Two kinds of problems:

* **safety** (:func:`safety`), a violation the moment one snapshot shows it: a device listed
  by two allocations of one node record (``double-held``), one request held on two nodes
  (``double-placed``), a record that does not decode (``undecodable``);
* **settling** (:func:`settling`), allowed while the system is still catching up after a kill
  and a violation only when it outlasts the quiesce deadline (longer than the allocator's
  30 s claim timeout): a submitted request with no record (``lost``); a record ``deciding``
  or ``releasing`` (``stuck-deciding``, ``stuck-releasing``); ``assigned`` to a node whose
  record does not hold it (``assigned-not-held``: a claim nobody committed); ``pending``
  without a reason (``pending-without-reason``) or while a node holds it; freed, cancelled or
  rejected while a node holds it (``finished-but-held``); a node holding a request whose
  record does not say so (``held-not-assigned``); an allocation ``releasing`` in a node record
  (``alloc-stuck-releasing``: the node never cleaned up or the allocator never freed). After
  a full drain (``drained=True``) also: any allocation left in a node record (``leaked``) and
  any request not freed, cancelled or rejected (``not-finished``).

Each problem is a :class:`Problem` (check, subject, detail); the runner keeps the distinct
(check, subject) pairs, so one fault seen in many snapshots counts once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from schemas import codec, subjects
from schemas.messages import NodeAllocations, RequestRecord
from services.runtime.kv.records import KV_OPERATION
from tools.loadtest import invariants

FINISHED = frozenset({"freed", "cancelled", "rejected"})
GET_CONCURRENCY = 32


@dataclass(frozen=True, slots=True)
class Problem:
    check: str
    subject: str  # a request id or a node
    detail: str


@dataclass
class KvState:
    allocs: dict[str, NodeAllocations | None]
    # request id → its record; None: the key does not exist; absent from ``undecodable``.
    requests: dict[str, RequestRecord | None]
    undecodable_requests: set[str] = field(default_factory=set)

    @property
    def records(self) -> int:
        return len(self.allocs) + len(self.requests)

    def holders(self) -> dict[str, list[str]]:
        """Request id → the nodes whose record holds it."""
        out: dict[str, list[str]] = {}
        for node, record in self.allocs.items():
            for rid in record.allocations if record is not None else ():
                out.setdefault(rid, []).append(node)
        return out


async def read(js: JetStreamContext, request_ids: Iterable[str]) -> KvState:
    """Every node record, and the record of each of ``request_ids`` — each read from the
    bucket stream's leader (``STREAM.MSG.GET``), never from a replica that may lag."""
    allocs = await invariants.snapshot(js)
    stream = subjects.kv_stream(subjects.KV_REQUESTS)
    state = KvState(allocs=allocs, requests={})
    gate = asyncio.Semaphore(GET_CONCURRENCY)

    async def get(rid: str) -> None:
        async with gate:
            try:
                msg = await js.get_last_msg(
                    stream, subjects.kv_subject(subjects.KV_REQUESTS, subjects.kv_key(rid))
                )
            except NotFoundError:
                state.requests[rid] = None
                return
        if (msg.headers or {}).get(KV_OPERATION) in ("DEL", "PURGE") or not msg.data:
            state.requests[rid] = None  # deleted: as lost as never written
            return
        try:
            state.requests[rid] = codec.REQUEST_RECORD.decode(msg.data)
        except codec.DecodeErrors:
            state.undecodable_requests.add(rid)

    await asyncio.gather(*(get(rid) for rid in request_ids))
    return state


async def read_all(js: JetStreamContext) -> KvState:
    """Every node record and every request record in the buckets (one ordered pass each)."""
    allocs = await invariants.snapshot(js)
    raw = await invariants.last_values(js, subjects.KV_REQUESTS, codec.REQUEST_RECORD)
    requests = {k: v for k, v in raw.items() if v is not None}
    return KvState(
        allocs=allocs, requests=dict(requests), undecodable_requests={k for k, v in raw.items() if v is None}
    )


def safety(state: KvState) -> list[Problem]:
    found = invariants.Violations()
    invariants.check(state.allocs, found)
    problems = [
        Problem("double-held", node, f"device {device} listed twice") for node, device in found.double_held
    ]
    holders = state.holders()
    problems += [
        Problem("double-placed", rid, f"held on {', '.join(sorted(holders.get(rid, [])))}")
        for rid in found.double_placed
    ]
    problems += [Problem("undecodable", node, "node allocation record") for node in found.undecodable]
    problems += [Problem("undecodable", rid, "request record") for rid in state.undecodable_requests]
    return problems


def settling(state: KvState, *, drained: bool) -> list[Problem]:
    problems: list[Problem] = []
    holders = state.holders()
    for rid, rec in state.requests.items():
        held = holders.get(rid, [])
        if rec is None:
            problems.append(Problem("lost", rid, "submitted, no request record"))
            continue
        where = f"held by {', '.join(held)}" if held else "held by no node"
        if rec.state == "deciding":
            problems.append(Problem("stuck-deciding", rid, f"owner {rec.owner!r}; {where}"))
        elif rec.state == "releasing":
            problems.append(Problem("stuck-releasing", rid, f"node {rec.node}: {rec.reason}; {where}"))
        elif rec.state == "assigned" and held != [rec.node]:
            problems.append(
                Problem("assigned-not-held", rid, f"record says {rec.node} (owner {rec.owner!r}); {where}")
            )
        elif rec.state == "pending":
            if not rec.reason:
                problems.append(Problem("pending-without-reason", rid, where))
            if held:
                problems.append(Problem("pending-but-held", rid, where))
        elif rec.state in FINISHED and held:
            problems.append(Problem("finished-but-held", rid, f"{rec.state}; {where}"))
        if drained and rec.state not in FINISHED:
            problems.append(
                Problem("not-finished", rid, f"{rec.state} after every request was released; {where}")
            )
    for node, record in state.allocs.items():
        if record is None:
            continue
        for rid, alloc in record.allocations.items():
            req = state.requests.get(rid)
            if rid in state.requests and (
                req is None or req.state not in ("assigned", "releasing") or req.node != node
            ):
                said = "no record" if req is None else f"{req.state} on {req.node}"
                problems.append(Problem("held-not-assigned", rid, f"{node} holds it; request record: {said}"))
            if alloc.state == "releasing":
                problems.append(Problem("alloc-stuck-releasing", rid, f"{node}: being released, not freed"))
            if drained:
                devices = ", ".join(alloc.assignment.device_ids())
                problems.append(Problem("leaked", rid, f"{node} still holds {devices} ({alloc.state})"))
    return problems
