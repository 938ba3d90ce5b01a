"""Each allocator replica's share of a run: the latency of the requests it decided, and what
its own counters say about the way there (``by_replica`` in the JSON line).

Two replicas share one durable consumer of requests, so a request goes to whichever replica's
pull the server hands it to, and a slow replica shows only in the tail of the run's latency.
Per replica, then:

* from the harness's own clock, over the requests whose first answer was an ``Assignment``
  made by that replica (``Assignment.allocator``; for an answer the harness missed and read
  from the request's record, the record's owner): how many (``assigned``), and
  ``submit_to_assigned_ms`` (p50 / p99 / max);
* from the replica's ``/metrics`` (read once, after the drain, on its ops port): decisions by
  outcome, commit conflicts (a node record's compare-and-set lost to another write), claims
  found in another replica's hand, decisions that fell back outside the replica's shard,
  redeliveries it asked for (``Retry``), and the time its decisions took on its event loop
  (``decide_ms_mean``, the core's decision alone; ``catch_up_s``, applying other shards'
  records before a decision that looks at them). Counters a replica does not export are
  absent, not 0.

:func:`by_replica` is pure; :func:`read_counters` asks the replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Mapping

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from tools.loadtest.driver import Req
from tools.loadtest.report import ReplicaFigures, percentiles

ASK_S = 5.0

# JSON name → (metric sample name, the labels it must have): counters summed over their samples.
COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "decisions_assigned": ("tandem_allocator_decisions_total", {"outcome": "assigned"}),
    "decisions_unschedulable": ("tandem_allocator_decisions_total", {"outcome": "unschedulable"}),
    "commit_conflicts": ("tandem_allocator_commit_conflicts_total", {}),
    "claims_busy": ("tandem_allocator_claims_busy_total", {}),
    "shard_fallbacks": ("tandem_allocator_shard_fallbacks_total", {}),
    "handed_over": ("tandem_allocator_forwards_total", {"outcome": "taken"}),
    "hand_over_no_room": ("tandem_allocator_forwards_total", {"outcome": "no_room"}),
    "hand_over_gone": ("tandem_allocator_forwards_total", {"outcome": "gone"}),
    "hand_over_unanswered": ("tandem_allocator_forwards_total", {"outcome": "unanswered"}),
    "redeliveries": ("tandem_redeliveries_total", {"why": "retry"}),
    "catch_up_s": ("tandem_allocator_catch_up_seconds_total", {}),
    # The inventory's (nodes_lost), read from its own page.
    "nodes_lost": ("tandem_inventory_node_transitions_total", {"to": "lost"}),
}
DECIDE_SUM = "tandem_allocator_decision_seconds_sum"
DECIDE_COUNT = "tandem_allocator_decision_seconds_count"


class Decided(msgspec.Struct, frozen=True):
    """A request whose first answer was an assignment: by whom, and how long it took."""

    allocator: str
    ms: float


def decided(reqs: Iterable[Req]) -> list[Decided]:
    """The requests of a run whose first answer was an assignment, with who made it."""
    return [
        Decided(r.allocator, (r.assigned - r.submitted) * 1000)
        for r in reqs
        if r.assigned is not None and r.first == r.assigned
    ]


def by_replica(
    decided: Iterable[Decided], counters: Mapping[str, Mapping[str, float]] | None = None
) -> dict[str, ReplicaFigures]:
    """Per replica (sorted by name): its assignments and their latency, with ``counters``
    (from :func:`read_counters`) beside them. A replica that assigned nothing but answered
    its counters is listed too."""
    ms: dict[str, list[float]] = {}
    for d in decided:
        ms.setdefault(d.allocator or "?", []).append(d.ms)
    names = sorted({*ms, *(counters or {})})
    return {
        name: ReplicaFigures(
            assigned=len(ms.get(name, [])),
            submit_to_assigned_ms=percentiles(ms.get(name, [])),
            counters=dict((counters or {}).get(name, {})),
        )
        for name in names
    }


async def nodes_lost(port: int) -> int | None:
    """How many times the inventory (its ops ``port``) took a node for lost, from its
    ``tandem_inventory_node_transitions_total{to="lost"}``; None when it does not answer."""
    page = (await read_counters({"inventory": port})).get("inventory")
    return None if page is None else int(page.get("nodes_lost", 0))


def parse_counters(text: str) -> dict[str, float]:
    """The :data:`COUNTERS` (and ``decide_ms_mean``) found in one ``/metrics`` page."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    out: dict[str, float] = {}
    for key, (name, labels) in COUNTERS.items():
        found = [v for lab, v in samples.get(name, []) if all(lab.get(k) == w for k, w in labels.items())]
        if found:
            out[key] = round(sum(found), 3)
    total = sum(v for _, v in samples.get(DECIDE_SUM, []))
    count = sum(v for _, v in samples.get(DECIDE_COUNT, []))
    if count > 0:
        out["decide_ms_mean"] = round(total / count * 1000, 4)
    return out


async def read_counters(ports: Mapping[str, int]) -> dict[str, dict[str, float]]:
    """Each replica's counters (``name → ops port``); a replica that does not answer is left
    out (the run is judged without its counters)."""
    out: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ASK_S)) as http:

        async def one(name: str, port: int) -> None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    if resp.status == 200:
                        out[name] = parse_counters(await resp.text())

        await asyncio.gather(*(one(n, p) for n, p in ports.items()))
    return out
