"""Which message may arrive on which subject: the subject, not the body, says who sent it.

NATS permissions (:mod:`schemas.permissions`) let a node agent publish only on its own
``tandem.node.<node>.*`` subjects, and let the CLI and admission publish requests and
releases but no assignment. So the subject a message arrived on is the authenticated part of
it; its body is whatever the sender chose to write. :func:`refusal` compares the two before
any handler acts: the kind must be the one the subject carries, and a node named in the body
must be the node the subject names. ``Bus.consume`` dead-letters a mismatch with the reason,
so a node agent cannot speak for another node by writing its name into a message, and a
release published on an assignment subject is never applied.
"""

from __future__ import annotations

from schemas import subjects
from schemas.messages import (
    AllocationFailed,
    AllocationRequest,
    Applied,
    Assignment,
    Cleaned,
    DeadLetter,
    DeviceCommand,
    Freed,
    HealthEvent,
    Heartbeat,
    InventoryQuery,
    JobRequest,
    NodeInventory,
    PreemptionPlan,
    Release,
)

# tandem.node.<node>.<event> → the one kind that event subject carries.
_NODE_EVENT_KINDS: dict[str, type] = {
    "inventory": NodeInventory,
    "health": HealthEvent,
    "heartbeat": Heartbeat,
    "applied": Applied,
    "cleaned": Cleaned,
    "command": DeviceCommand,
}
# tandem.alloc.<what>[.<node>] → the one kind it carries, and whether a node token follows.
_ALLOC_KINDS: dict[str, tuple[type, bool]] = {
    "request": (AllocationRequest, False),
    "job": (JobRequest, False),
    "failed": (AllocationFailed, False),
    "freed": (Freed, False),
    "assigned": (Assignment, True),
    "release": (Release, True),
    "preempt": (PreemptionPlan, False),
}


def expected(subject: str) -> tuple[type | None, str | None]:
    """The kind ``subject`` carries and the node it names (None where it names none). A kind
    of None: not a Tandem message subject at all."""
    parts = subject.split(".")
    if len(parts) < 3 or parts[0] != subjects.ROOT:
        return None, None
    if parts[1] == "node" and len(parts) == 4:
        return _NODE_EVENT_KINDS.get(parts[3]), subjects.node_from_token(parts[2])
    if parts[1] == "alloc":
        kind, has_node = _ALLOC_KINDS.get(parts[2], (None, False))
        if kind is None or len(parts) != (4 if has_node else 3):
            return None, None
        if not has_node or parts[3] == subjects.UNPLACED:
            return kind, None
        return kind, subjects.node_from_token(parts[3])
    if parts[1] == "dlq" and len(parts) == 3:
        return DeadLetter, None
    if subject == subjects.QUERY_INVENTORY:
        return InventoryQuery, None
    if len(parts) == 4 and subject.startswith(f"{subjects.ALLOCATOR_FORWARD_PREFIX}."):
        return AllocationRequest, None
    return None, None


def refusal(subject: str, message: object) -> str | None:
    """Why ``message`` must not be acted on when it arrived on ``subject``; None when it may."""
    kind, node = expected(subject)
    if kind is None:
        return f"subject {subject!r} carries no Tandem message"
    if type(message) is not kind:
        tag = getattr(type(message), "__struct_config__", None)
        got = tag.tag if tag is not None else type(message).__name__
        return f"a {got!r} message on {subject!r}, which carries only {kind.__struct_config__.tag!r}"  # type: ignore[attr-defined]
    body_node = getattr(message, "node", None)
    if node is not None and body_node is not None and body_node != node:
        return f"the message names node {body_node!r} but arrived on {subject!r} (node {node!r})"
    if node is None and body_node is not None and isinstance(message, Release):
        where = subjects.alloc_release(body_node)
        return f"a release naming node {body_node!r} must be published on {where!r}"
    return None
