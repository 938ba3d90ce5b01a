"""Who dies in each round, and when (pure, seeded).

Components are dealt like cards: every cycle of rounds is a seeded shuffle of
:data:`COMPONENTS`, so any run of ``len(COMPONENTS)`` consecutive rounds kills each of them
once (four rounds already hit an allocator, the inventory, the fleet and a NATS server), and
the order still changes with the seed. Within a component the victim is drawn too: which
allocator replica; for NATS, most rounds (:data:`LEADER_SHARE`) the server that currently
leads something that matters — a KV bucket stream (``KV_tandem-allocs``,
``KV_tandem-requests``) or the JetStream meta group — else any server. A leader is looked up
when the kill happens (:mod:`tools.chaos.runner`), not when the round is planned.

When in the round the kill comes (a share of the load's length) and how long the victim stays
down are drawn from the same generator, so a seed replays the same schedule.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from schemas import subjects

COMPONENTS: tuple[str, ...] = ("allocator", "inventory", "fleet", "nats")
# Kill kinds of NATS servers: what the victim is chosen for.
NATS_ANY = "nats-any"
NATS_META_LEADER = "nats-meta-leader"
NATS_KV_ALLOCS_LEADER = "nats-kv-allocs-leader"
NATS_KV_REQUESTS_LEADER = "nats-kv-requests-leader"
NATS_LEADERS: tuple[str, ...] = (NATS_META_LEADER, NATS_KV_ALLOCS_LEADER, NATS_KV_REQUESTS_LEADER)
# The stream each leader kind is about (the meta group is no stream).
LEADER_STREAM = {
    NATS_KV_ALLOCS_LEADER: subjects.kv_stream(subjects.KV_ALLOCS),
    NATS_KV_REQUESTS_LEADER: subjects.kv_stream(subjects.KV_REQUESTS),
}
KINDS: tuple[str, ...] = ("allocator", "inventory", "fleet", NATS_ANY, *NATS_LEADERS)
LEADER_SHARE = 0.75


@dataclass(frozen=True, slots=True)
class Plan:
    """One round's kill: ``kind`` (one of :data:`KINDS`), ``index`` (the allocator replica,
    or the server for ``nats-any``; None otherwise), ``at`` (share of the load's length
    before the kill), ``down_s`` (seconds before the victim is started again)."""

    round: int
    kind: str
    index: int | None
    at: float
    down_s: float

    @property
    def component(self) -> str:
        return "nats" if self.kind.startswith("nats") else self.kind


class Schedule:
    def __init__(
        self,
        seed: int,
        *,
        replicas: int,
        servers: int,
        down_s: tuple[float, float] = (0.5, 4.0),
        components: tuple[str, ...] = COMPONENTS,
    ) -> None:
        unknown = set(components) - set(COMPONENTS)
        if unknown or not components:
            raise ValueError(f"components must be some of {', '.join(COMPONENTS)}, got {components}")
        self.rng = random.Random(seed)
        self.replicas = replicas
        self.servers = servers
        self.down_s = down_s
        self.components = components
        self._deck: list[str] = []
        self.rounds = 0

    def next(self) -> Plan:
        rng = self.rng
        if not self._deck:
            self._deck = list(self.components)
            rng.shuffle(self._deck)
        component = self._deck.pop()
        self.rounds += 1
        index: int | None = None
        kind = component
        if component == "allocator":
            index = rng.randrange(self.replicas)
        elif component == "nats":
            if rng.random() < LEADER_SHARE:
                kind = rng.choice(NATS_LEADERS)
            else:
                kind, index = NATS_ANY, rng.randrange(self.servers)
        at = rng.uniform(0.2, 0.6)
        down = round(rng.uniform(*self.down_s), 2)
        return Plan(round=self.rounds, kind=kind, index=index, at=at, down_s=down)
