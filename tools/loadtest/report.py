"""The result of a run: one JSON line with the keys of issue 8, then a few more (pure).

Keys, in order (``docs/benchmarks.md`` explains how to read them): ``nodes``, ``replicas``,
``requests``, ``rate`` (null: open loop), ``assigned``, ``unschedulable``,
``decisions_per_s``, ``submit_to_assigned_ms`` and ``submit_to_applied_ms`` (``p50``,
``p99``, ``max``), ``lost``, ``double_held``, ``jetstream_ceiling`` (``publish_per_s``,
``pull_ack_per_s``), ``rss_mb`` (``allocator`` — the largest replica —, ``inventory``,
``nats``, ``fleet``; peak resident set), ``ready_s``; then ``double_placed``, ``released``,
``freed``, ``rejected``, ``cancelled``, ``recovered``, ``util_target``, ``util_peak``, ``util_mean``,
``load_s``, ``arrival_wait_s``, ``drained``, ``snapshots``, ``ledger`` (the invariants at
every write: :class:`~tools.loadtest.ledger.LedgerCounts`), ``wall_s``, ``cpu_s`` and
``idle_cpu_pct`` (per process: ``allocator`` — replicas summed —, ``inventory``, ``nats`` —
servers summed —, ``fleet``, ``harness``, and in the production profile ``callout`` and
``prometheus``); then ``profile`` (``production`` or ``dev``), ``nats_servers``,
``stream_replicas``, ``security`` (TLS, auth, and whether the servers refused a plain and an
unauthenticated connection), ``scrape`` (Prometheus's targets: up, scrapes), and
``cpu_ms_per_decision`` (per process, and ``_total``), ``longest_stall_s`` and, with
``--kill-server-at``, ``nats_kill`` (with ``--partition-server-at``, ``nats_partition``),
``nodes_lost``; last
``by_replica`` (each allocator replica's latency and counters,
:mod:`tools.loadtest.replicastats`). A figure that was not measured is ``null``. ``shares`` and
``shares_assigned``, ``overcommitted`` and ``cleanup_fail_share`` sit among them as the
:class:`Report` lists them.
"""

from __future__ import annotations

import itertools
import math

import msgspec

from tools.loadtest.ledger import LedgerCounts


class Percentiles(msgspec.Struct):
    p50: float | None = None
    p99: float | None = None
    max: float | None = None


class CeilingFigures(msgspec.Struct):
    publish_per_s: float | None = None
    pull_ack_per_s: float | None = None


class RssFigures(msgspec.Struct):
    allocator: float | None = None
    inventory: float | None = None
    nats: float | None = None
    fleet: float | None = None
    callout: float | None = None  # production profile
    prometheus: float | None = None  # production profile


class CpuFigures(msgspec.Struct):
    """Per process; ``allocator`` sums the replicas, ``nats`` the servers, ``harness`` is this
    process with its checker and ledger (:mod:`tools.loadtest.meter`); ``callout`` and
    ``prometheus`` run in the production profile only."""

    allocator: float | None = None
    inventory: float | None = None
    nats: float | None = None
    fleet: float | None = None
    harness: float | None = None
    callout: float | None = None
    prometheus: float | None = None


class Security(msgspec.Struct):
    """How the clients connected (``tls``, ``auth``: ``callout`` or ``none``) and what the
    servers did, before the load, with connections that must not get in (production profile:
    both refused; null when not tried)."""

    tls: bool = False
    auth: str = "none"
    plain_refused: bool | None = None  # nats:// without TLS
    no_token_refused: bool | None = None  # TLS without a token


class FaultFigures(msgspec.Struct):
    """The NATS server killed (``--kill-server-at``) or cut off the network
    (``--partition-server-at``) during the load, and brought back (tools.loadtest.faults)."""

    server: str = ""  # its name, and why it was chosen
    at_s: float | None = None  # when, from the start of the services
    down_s: float = 0.0  # how long it stayed down (killed) or cut off
    back_s: float | None = None  # started again or reconnected → healthy (caught up); null: never


class ReplicaFigures(msgspec.Struct, kw_only=True):
    """One allocator replica's part of the run (``by_replica``, tools.loadtest.replicastats)."""

    assigned: int = 0  # first answers that were its Assignment
    submit_to_assigned_ms: Percentiles = msgspec.field(default_factory=Percentiles)
    counters: dict[str, float] = msgspec.field(default_factory=dict)  # from its /metrics


class Target(msgspec.Struct):
    """One scrape target as Prometheus saw it at the end of the load."""

    up: bool = False
    scrapes: int = 0  # samples of ``up`` it stored for the target: one per scrape
    last_error: str = ""


class ScrapeFigures(msgspec.Struct):
    """The Prometheus that scraped every component during the run (production profile)."""

    interval_s: float | None = None
    targets: dict[str, Target] = msgspec.field(default_factory=dict)
    error: str | None = None  # set when Prometheus could not be asked


class Report(msgspec.Struct, kw_only=True):
    nodes: int
    replicas: int
    requests: int
    rate: float | None
    assigned: int
    unschedulable: int
    decisions_per_s: float | None
    submit_to_assigned_ms: Percentiles
    submit_to_applied_ms: Percentiles
    lost: int
    double_held: int
    jetstream_ceiling: CeilingFigures
    rss_mb: RssFigures
    ready_s: float | None
    # beyond the keys
    double_placed: int = 0  # requests held on two nodes (KV records, or assigned twice)
    overcommitted: int = 0  # GPUs whose shares take more than the GPU has (KV records)
    shares: float = 0.0  # the share of requests that ask a share of a GPU (--shares)
    cleanup_fail_share: float = 0.0  # releases whose first cleanup the fleet failed (--cleanup-fail-share)
    shares_assigned: int = 0  # of those, assigned
    released: int = 0
    freed: int = 0
    rejected: int = 0  # AllocationFailed(retrying=False): never to be placed
    cancelled: int = 0  # pending longer than --give-up: released unplaced by the harness
    recovered: int = 0  # outcomes read from KV because their event was missed (a reconnect)
    util_target: float = 0.0
    util_peak: float = 0.0  # largest share of fleet GPUs held by observed assignments
    util_mean: float | None = None  # held share at each arrival after the fill, averaged
    load_s: float = 0.0  # first submit → last submit
    arrival_wait_s: float = 0.0  # time arrivals waited for room in the fleet (driver gates)
    drained: bool = True  # every request answered and every release freed before the deadline
    snapshots: int = 0  # KV snapshots checked for double_held / double_placed
    ledger: LedgerCounts = msgspec.field(default_factory=LedgerCounts)  # every write checked (ledger.py)
    wall_s: float = 0.0  # services started → end of the drain
    cpu_s: CpuFigures = msgspec.field(default_factory=CpuFigures)  # CPU seconds in wall_s
    idle_cpu_pct: CpuFigures = msgspec.field(default_factory=CpuFigures)  # % of one core, idle
    # The profile (tools.loadtest.production): "production" as the chart installs NATS, or "dev".
    profile: str = "dev"
    nats_servers: int = 1
    stream_replicas: int = 1
    security: Security = msgspec.field(default_factory=Security)
    scrape: ScrapeFigures = msgspec.field(default_factory=ScrapeFigures)
    # CPU of the load and the drain (start-up excluded) / decisions, in ms
    cpu_ms_per_decision: CpuFigures = msgspec.field(default_factory=CpuFigures)
    cpu_ms_per_decision_total: float | None = None  # every process together
    longest_stall_s: float | None = None  # the longest time without a first answer, during the load
    longest_stall_from_s: float | None = None  # when it began, from the first submit
    nats_kill: FaultFigures | None = None  # --kill-server-at: the server killed and brought back
    nats_partition: FaultFigures | None = None  # --partition-server-at: the server cut off and back
    # Times the inventory took a node for lost (no heartbeat for node_lost_after) during the
    # run, start-up included; null: not read. Beyond a fault's own nodes, a fleet too starved
    # of CPU to heartbeat in time: the run measures that machine, not the allocator.
    nodes_lost: int | None = None
    # Per allocator replica: the latency of what it decided, its counters (replicastats)
    by_replica: dict[str, ReplicaFigures] = msgspec.field(default_factory=dict)


def percentiles(values: list[float]) -> Percentiles:
    """Nearest-rank p50 / p99 / max, in the unit given, rounded to 0.01."""
    if not values:
        return Percentiles()
    ordered = sorted(values)

    def rank(p: float) -> float:
        return round(ordered[max(0, math.ceil(p * len(ordered)) - 1)], 2)

    return Percentiles(p50=rank(0.50), p99=rank(0.99), max=round(ordered[-1], 2))


def longest_gap(times: list[float], *, start: float) -> tuple[float, float] | None:
    """The longest interval between ``start`` and the first of ``times`` or between two of
    them, and when it began (from ``start``), in seconds rounded to 1 ms (times before
    ``start`` do not count); None without times."""
    after = sorted(t for t in times if t >= start)
    if not after:
        return None
    gap, began = max((b - a, a) for a, b in itertools.pairwise([start, *after]))
    return round(gap, 3), round(began - start, 3)


def to_json_line(report: Report) -> str:
    return msgspec.json.encode(report).decode()


def _ms(p: Percentiles) -> str:
    if p.p50 is None:
        return "n/a"
    return f"p50 {p.p50:g} ms, p99 {p.p99:g} ms, max {p.max:g} ms"


def _num(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:g}{unit}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _cpu(c: CpuFigures, unit: str) -> str:
    parts = [("allocator", c.allocator), ("inventory", c.inventory), ("nats", c.nats)]
    parts += [("fleet", c.fleet), ("harness", c.harness)]
    extra = (("callout", c.callout), ("prometheus", c.prometheus))
    parts += [(name, v) for name, v in extra if v is not None]
    return ", ".join(f"{name} {_num(v, unit)}" for name, v in parts)


def _profile(r: Report) -> str:
    sec = r.security
    how = f"{'TLS' if sec.tls else 'plain'}, auth {sec.auth}"
    if sec.plain_refused is not None:
        how += (
            f" (plain connection {'refused' if sec.plain_refused else 'ACCEPTED'}, "
            f"no token {'refused' if sec.no_token_refused else 'ACCEPTED'})"
        )
    line = f"  profile {r.profile}: {r.nats_servers} nats-server(s), streams R{r.stream_replicas}, {how}"
    sc = r.scrape
    if sc.interval_s is not None:
        if sc.error is not None:
            line += f"; Prometheus NOT read ({sc.error})"
        else:
            seen = ", ".join(f"{n} {t.scrapes}{'' if t.up else ' DOWN'}" for n, t in sc.targets.items())
            line += f"; Prometheus every {sc.interval_s:g} s, scrapes: {seen}"
    if r.nats_kill is not None:
        k = r.nats_kill
        line += (
            f"\n  killed nats-server {k.server} at {_num(k.at_s, ' s')} for {k.down_s:g} s, "
            f"healthy {_num(k.back_s, ' s')} after its restart"
        )
    if r.nats_partition is not None:
        k = r.nats_partition
        line += (
            f"\n  cut nats-server {k.server} off the network at {_num(k.at_s, ' s')} for {k.down_s:g} s, "
            f"healthy {_num(k.back_s, ' s')} after it was back"
        )
    if r.nodes_lost:
        line += f"\n  nodes taken for lost (no heartbeat in time) {r.nodes_lost} times"
    if r.longest_stall_s is not None:
        line += (
            f"\n  longest time without a decision: {r.longest_stall_s:g} s, "
            f"from {_num(r.longest_stall_from_s, ' s')} after the first submit"
        )
    return line


def violations(r: Report) -> int:
    """How many invariant violations the run found (0: they held): the snapshots', the
    harness's (``lost``) and the ledger's and fleet's (:meth:`LedgerCounts.violations`)."""
    return r.lost + r.double_held + r.double_placed + r.overcommitted + r.ledger.violations()


def _ledger(g: LedgerCounts) -> str:
    if g.error is not None:
        return f"  ledger INCOMPLETE ({g.error})"
    ok = "OK" if g.violations() == 0 else "VIOLATED"
    missed = f", {g.revisions_missed} MISSED" if g.revisions_missed else ""
    return (
        f"  ledger {ok} over {g.revisions_seen} revisions{missed}: double-held devices {g.double_held}, "
        f"requests on two nodes {g.double_placed}, vanished {g.vanished}, freed unknown {g.freed_unknown}, "
        f"overlaps refused at apply {g.overlap_at_apply}; cleanups failed on purpose "
        f"{g.cleanup_failures_injected} (the allocator saw {g.cleanups_unverified} unverified)"
    )


def _replicas(by: dict[str, ReplicaFigures]) -> str:
    def one(name: str, f: ReplicaFigures) -> str:
        c = f.counters
        seen = ", ".join(
            f"{label} {c[key]:g}"
            for key, label in (("commit_conflicts", "conflicts"), ("shard_fallbacks", "fallbacks"))
            if key in c
        )
        why = f" ({seen})" if seen else ""
        return f"{name} {f.assigned} assigned, {_ms(f.submit_to_assigned_ms)}{why}"

    return "  per replica: " + "; ".join(one(n, f) for n, f in by.items())


def summary(r: Report) -> str:
    """A few lines for a person; the JSON line follows it."""
    load = f"{r.rate:g}/s" if r.rate is not None else "open loop"
    rss = r.rss_mb
    ok = "OK" if violations(r) == 0 else "VIOLATED"
    lines = [
        f"{r.nodes} nodes, {r.replicas} allocator(s), {r.requests} requests ({load}), "
        f"ready after {_num(r.ready_s, ' s')}",
        f"  decided {_num(r.decisions_per_s, '/s')}: {r.assigned} assigned, {r.unschedulable} "
        f"unschedulable ({r.rejected} rejected, {r.cancelled} given up); {r.released} released, "
        f"{r.freed} freed; "
        f"fleet held {_pct(r.util_mean)} of its GPUs on average, {r.util_peak:.0%} at most "
        f"(target {r.util_target:.0%})",
        f"  submit→assigned {_ms(r.submit_to_assigned_ms)}",
        f"  submit→applied  {_ms(r.submit_to_applied_ms)}",
        f"  invariants {ok}: lost {r.lost}, double-held devices {r.double_held}, requests on two "
        f"nodes {r.double_placed}, overcommitted GPUs {r.overcommitted} ({r.snapshots} KV "
        f"snapshots){'' if r.drained else '; NOT drained'}",
        _ledger(r.ledger),
        f"  JetStream ceiling on this server: publish {_num(r.jetstream_ceiling.publish_per_s, '/s')}, "
        f"pull+ack {_num(r.jetstream_ceiling.pull_ack_per_s, '/s')}",
        f"  peak RSS MB: allocator {_num(rss.allocator)}, inventory {_num(rss.inventory)}, "
        f"nats {_num(rss.nats)}, fleet {_num(rss.fleet)}",
        f"  CPU s over {r.wall_s:g} s: {_cpu(r.cpu_s, '')}",
        f"  CPU ms per decision, {_num(r.cpu_ms_per_decision_total)} in all: "
        f"{_cpu(r.cpu_ms_per_decision, '')}",
        _profile(r),
    ]
    if len(r.by_replica) > 1:
        lines.append(_replicas(r.by_replica))
    if r.idle_cpu_pct.inventory is not None:
        lines.append(f"  idle (heartbeats only), % of one core: {_cpu(r.idle_cpu_pct, ' %')}")
    return "\n".join(lines)
