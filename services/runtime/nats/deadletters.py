"""What a service refuses, and where it goes: the checks every message passes before its
handler sees it, the dead letters that record a refusal, and the budget that bounds them.

:func:`check` refuses, in order and each before any work the next would cost, a message over
the size limit, one that does not decode, and one whose kind or node does not fit the subject
it arrived on (:func:`schemas.routing.refusal`). :class:`DeadLetters` turns a refusal into a
:class:`~schemas.messages.DeadLetter` for ``tandem.dlq.<service>`` (the reason, the subject,
the first bytes and the digest of the payload) within a per-source budget (:class:`_Budget`,
keyed by :func:`routing_source`): a flood from one sender costs a counter increment per message
beyond it, so it can neither fill the dead-letter stream nor slow what other senders wait for.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from prometheus_client import Counter

from schemas import codec, limits, routing, subjects
from schemas.messages import DeadLetter
from services.runtime.observe.logging import get_logger

log = get_logger(__name__)

# Dead letters stored per source (a node, or a subject without one): a burst, then this many
# per second. A flood from one sender costs a counter increment per message beyond it, so it
# can neither fill the DLQ stream nor slow what other senders are waiting for.
DEAD_LETTER_BURST = 20
DEAD_LETTER_PER_S = 1.0
# Sources remembered by the dead-letter budget (oldest forgotten first).
DEAD_LETTER_SOURCES = 10_000

DEAD_LETTERS = Counter(
    "tandem_dead_letters_total", "Messages refused and stored on the dead-letter subject", ["service", "why"]
)
DEAD_LETTERS_DROPPED = Counter(
    "tandem_dead_letters_dropped_total",
    "Refused messages not stored because their source exceeded its dead-letter budget",
    ["service"],
)
DEAD_LETTER_REASONS = ("oversized", "undecodable", "mismatch", "refused", "retry_exhausted", "handler_failed")


def check(subject: str, data: bytes, decoder: msgspec.msgpack.Decoder[Any]) -> tuple[Any, str | None, str]:
    """(decoded body, None, "") or (None, why refused, which check refused it)."""
    if len(data) > limits.MAX_MESSAGE_BYTES:
        return None, f"{len(data)} bytes, over the limit of {limits.MAX_MESSAGE_BYTES}", "oversized"
    try:
        body = decoder.decode(data)
    except codec.DecodeErrors as exc:
        return None, str(exc), "undecodable"
    refused = routing.refusal(subject, body)
    if refused is not None:
        return None, refused, "mismatch"
    return body, None, ""


class DeadLetters:
    """One service's dead letters: every refusal counted (``tandem_dead_letters_total``), and
    a letter to store for those within their source's budget."""

    def __init__(self, service: str) -> None:
        self.service = service
        self._budget = _Budget(burst=DEAD_LETTER_BURST, per_s=DEAD_LETTER_PER_S, sources=DEAD_LETTER_SOURCES)
        # Shown from 0: increase() over a series born at 1 sees no increase.
        DEAD_LETTERS_DROPPED.labels(service)
        for why in DEAD_LETTER_REASONS:
            DEAD_LETTERS.labels(service, why)

    def letter(
        self, *, subject: str, data: bytes, error: str, headers: dict[str, str] | None, why: str
    ) -> DeadLetter | None:
        """The letter to store for a refused message, or None when its source is over budget
        (counted as dropped). Never all of the payload: a dead letter must stay far below the
        server's max payload, whatever arrived."""
        DEAD_LETTERS.labels(self.service, why).inc()
        if not self._budget.take(routing_source(subject)):
            DEAD_LETTERS_DROPPED.labels(self.service).inc()
            return None
        kept_headers = {k: v[:256] for k, v in list((headers or {}).items())[:32]}
        letter = DeadLetter(
            service=self.service,
            subject=subject[:512],
            error=error[: limits.TEXT],
            data=data[: limits.DEAD_LETTER_SAMPLE_BYTES],
            size=len(data),
            digest=limits.digest(data),
            headers=kept_headers,
        )
        log.warning("dead_letter", subject=subject, error=error[:500], size=len(data), why=why)
        return letter


def routing_source(subject: str) -> str:
    """Who a subject's messages come from, for the dead-letter budget: the node for a node's
    subjects (only that node may publish there), else the subject."""
    _, node = routing.expected(subject)
    return f"node:{node}" if node is not None and subject.startswith(f"{subjects.ROOT}.node.") else subject


class _Budget:
    """Token buckets per source: ``burst`` at once, then ``per_s`` per second; at most
    ``sources`` remembered (the least recently seen forgotten first)."""

    def __init__(self, *, burst: int, per_s: float, sources: int) -> None:
        self.burst = burst
        self.per_s = per_s
        self.sources = sources
        self._tokens: dict[str, tuple[float, float]] = {}  # source → (tokens, at)

    def take(self, source: str) -> bool:
        now = asyncio.get_running_loop().time()
        tokens, at = self._tokens.pop(source, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.per_s)
        ok = tokens >= 1.0
        self._tokens[source] = (tokens - 1.0 if ok else tokens, now)  # re-inserted: most recent
        if len(self._tokens) > self.sources:
            del self._tokens[next(iter(self._tokens))]
        return ok
