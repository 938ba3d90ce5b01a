"""The result of a chaos run: one JSON line (pure).

Keys, in order: ``rounds``, ``seed``, ``kills`` (kill kind → how many, kinds of
:data:`tools.chaos.victims.KINDS`), ``requests`` (submitted), ``invariant_checks`` (verdicts
given: two per round — under load and after the drain — and a final one over the whole
buckets), ``records_checked`` (records read by those verdicts' snapshots, every poll counted),
``violations`` (distinct (check, subject) pairs; 0 is a clean run), ``violation_details`` (the
first :data:`MAX_DETAILS`, with the round and phase that found them), ``duration_s``, then
``nodes``, ``replicas``, ``nats_servers``, ``settle_s_max`` (the longest a verdict waited for the
system to settle) and ``round_log`` (one entry a round: what was killed, for how long, how
long it took to come back and to settle).
"""

from __future__ import annotations

import msgspec

MAX_DETAILS = 20


class Violation(msgspec.Struct, kw_only=True):
    round: int  # 0: the final check
    phase: str  # "load", "drained", "final"
    check: str
    subject: str
    detail: str


class RoundLog(msgspec.Struct, kw_only=True):
    round: int
    planned: str  # the kind the schedule drew
    kind: str  # the kind really killed ("" when nothing was)
    victim: str  # process or server name
    pid: int | None = None
    down_s: float
    back_s: float | None = None  # restart → ready (healthy, for a NATS server)
    requests: int
    placed: int = 0  # requests the harness saw assigned (a load that really ran)
    settle_s: float  # both verdicts' waits together
    violations: int


class ChaosReport(msgspec.Struct, kw_only=True):
    rounds: int
    seed: int
    kills: dict[str, int]
    requests: int
    invariant_checks: int
    records_checked: int
    violations: int
    violation_details: list[Violation]
    duration_s: float
    nodes: int
    replicas: int
    nats_servers: int
    settle_s_max: float
    round_log: list[RoundLog]


def to_json_line(report: ChaosReport) -> str:
    return msgspec.json.encode(report).decode()


def summary(report: ChaosReport) -> str:
    kills = ", ".join(f"{kind} {n}" for kind, n in sorted(report.kills.items())) or "none"
    lines = [
        f"chaos: {report.rounds} rounds in {report.duration_s:.0f} s (seed {report.seed}), "
        f"{report.nodes} nodes, {report.replicas} allocators, {report.nats_servers} NATS servers",
        f"  kills: {kills}",
        f"  requests: {report.requests}; invariant checks: {report.invariant_checks} "
        f"({report.records_checked} records read); longest settle {report.settle_s_max:.1f} s",
        f"  violations: {report.violations}",
    ]
    lines += [
        f"    round {v.round} ({v.phase}): {v.check} {v.subject}: {v.detail}"
        for v in report.violation_details
    ]
    return "\n".join(lines)
