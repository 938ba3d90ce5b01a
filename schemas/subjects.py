"""Every NATS subject, stream, consumer and KV bucket name. Services never spell one out.

Subject tree (``<node>`` is a node token, see :func:`node_token`)::

    tandem.node.<node>.inventory | health | applied | cleaned   stream NODE_STREAM
    tandem.node.<node>.heartbeat                                core NATS (loss is harmless)
    tandem.node.<node>.command                                  core NATS request/reply
    tandem.alloc.request                                        stream ALLOC_STREAM
    tandem.alloc.job                                            stream ALLOC_STREAM
    tandem.alloc.assigned.<node>                                stream ALLOC_STREAM
    tandem.alloc.failed | tandem.alloc.freed                    stream ALLOC_STREAM
    tandem.alloc.release.<node>  (``_unplaced`` when unknown)   stream ALLOC_STREAM
    tandem.alloc.preempt                                        stream ALLOC_STREAM
    tandem.dlq.<service>                                        stream DLQ_STREAM
    tandem.query.inventory                                      core NATS request/reply
    tandem.allocator.heartbeat                                  core NATS (replica membership)
    tandem.allocs.<node name>                                   core NATS, republished by the
                                                                server from KV ``tandem-allocs``

A node's allocation record (KV ``tandem-allocs``, key = node name) is the node's desired state
and the allocator's commit: every committed write is republished by the server (stream
RePublish) on ``tandem.allocs.<node name>`` with the header ``Nats-Sequence`` = the record's
revision, so one publish is both the commit and the event, and a node agent follows its record
with a plain subscription instead of a durable consumer per node (a stream holds at most a
few thousand consumers; a fleet has more nodes). Only stored writes are republished, so a
compare-and-set that lost its race is never seen as truth.

A release goes to the node's own subject, so a node agent reads only its own assignments and
releases (the NATS permission model in DESIGN.md "Security"); the allocator reads them all.
"""

from __future__ import annotations

ROOT = "tandem"

NODE_STREAM = "TANDEM_NODE"
ALLOC_STREAM = "TANDEM_ALLOC"
DLQ_STREAM = "TANDEM_DLQ"

KV_NODES = "tandem-nodes"
KV_ALLOCS = "tandem-allocs"
KV_REQUESTS = "tandem-requests"
KV_JOBS = "tandem-jobs"
KV_NODE_LABELS = "tandem-node-labels"
# DeviceClaims as the pod bridge sees them (phase, devices, pods using them); read by the CLI.
KV_CLAIMS = "tandem-claims"

ALLOC_REQUEST = f"{ROOT}.alloc.request"
ALLOC_JOB = f"{ROOT}.alloc.job"
ALLOC_FAILED = f"{ROOT}.alloc.failed"
ALLOC_FREED = f"{ROOT}.alloc.freed"
ALLOC_ASSIGNED_ALL = f"{ROOT}.alloc.assigned.*"
ALLOC_RELEASE_ALL = f"{ROOT}.alloc.release.*"
# Preemption plans: the allocator's intent to evict allocations for a request of higher
# priority; the pod bridge evicts their pods (services/allocator/evictionplans.py).
ALLOC_PREEMPT = f"{ROOT}.alloc.preempt"
UNPLACED = "_unplaced"
QUERY_INVENTORY = f"{ROOT}.query.inventory"
ALLOCATOR_HEARTBEAT = f"{ROOT}.allocator.heartbeat"
# A request one allocator replica hands to the replica whose shard holds the node it would
# take (core NATS request/reply, answered with ForwardReply; services/allocator/placer.py).
ALLOCATOR_FORWARD_PREFIX = f"{ROOT}.allocator.forward"
ALLOCATOR_FORWARD_ALL = f"{ALLOCATOR_FORWARD_PREFIX}.*"
ALLOCS_REPUBLISH_PREFIX = f"{ROOT}.allocs"
NODE_ALLOCS_ALL = f"{ALLOCS_REPUBLISH_PREFIX}.>"

NODE_EVENTS_ALL = f"{ROOT}.node.*.*"
NODE_INVENTORY_ALL = f"{ROOT}.node.*.inventory"
NODE_HEALTH_ALL = f"{ROOT}.node.*.health"
NODE_APPLIED_ALL = f"{ROOT}.node.*.applied"
NODE_CLEANED_ALL = f"{ROOT}.node.*.cleaned"
# What each durable consumer of TANDEM_NODE reads: the inventory the node's hardware and
# health, the allocator the cleanups that free devices (neither wades through the other's).
# ``applied`` is an event for observers (bridge, CLI, load harness), not a record change.
INVENTORY_NODE_FILTERS = [NODE_INVENTORY_ALL, NODE_HEALTH_ALL]
ALLOCATOR_NODE_FILTERS = [NODE_CLEANED_ALL]
NODE_HEARTBEAT_ALL = f"{ROOT}.node.*.heartbeat"
DLQ_ALL = f"{ROOT}.dlq.*"

STREAM_SUBJECTS: dict[str, list[str]] = {
    NODE_STREAM: [
        f"{ROOT}.node.*.inventory",
        f"{ROOT}.node.*.health",
        f"{ROOT}.node.*.applied",
        f"{ROOT}.node.*.cleaned",
    ],
    ALLOC_STREAM: [f"{ROOT}.alloc.>"],
    DLQ_STREAM: [f"{ROOT}.dlq.>"],
}

# Durable consumer names, one per role; all replicas of a role share one durable.
CONSUMER_ALLOCATOR_REQUESTS = "allocator-requests"
CONSUMER_ALLOCATOR_JOBS = "allocator-jobs"
CONSUMER_ALLOCATOR_NODE = "allocator-node-events"
CONSUMER_ALLOCATOR_RELEASES = "allocator-releases"
CONSUMER_INVENTORY = "inventory-node-events"
CONSUMER_BRIDGE = "bridge-outcomes"
CONSUMER_BRIDGE_FAILED = "bridge-failures"
CONSUMER_BRIDGE_PREEMPT = "bridge-preemptions"
# Freed devices of DRA claims: the bridge then clears the claim's allocation and finalizer.
CONSUMER_BRIDGE_FREED = "bridge-freed"


def node_token(node: str) -> str:
    """A node name as one subject token. Kubernetes node names are DNS subdomains
    (``[a-z0-9.-]``), so mapping ``.`` to ``_`` is reversible and never collides."""
    return node.replace(".", "_")


def node_from_token(token: str) -> str:
    return token.replace("_", ".")


def allocator_forward(instance: str) -> str:
    """The subject on which the replica named ``instance`` takes requests handed to it (the
    name as one token: anything but letters, digits, ``-`` and ``_`` becomes ``_``)."""
    token = "".join(c if c.isascii() and (c.isalnum() or c in "-_") else "_" for c in instance)
    return f"{ALLOCATOR_FORWARD_PREFIX}.{token}"


def node_subject(node: str, event: str) -> str:
    return f"{ROOT}.node.{node_token(node)}.{event}"


def node_inventory(node: str) -> str:
    return node_subject(node, "inventory")


def node_health(node: str) -> str:
    return node_subject(node, "health")


def node_heartbeat(node: str) -> str:
    return node_subject(node, "heartbeat")


def node_applied(node: str) -> str:
    return node_subject(node, "applied")


def node_cleaned(node: str) -> str:
    return node_subject(node, "cleaned")


def node_command(node: str) -> str:
    return node_subject(node, "command")


def alloc_assigned(node: str) -> str:
    return f"{ROOT}.alloc.assigned.{node_token(node)}"


def alloc_release(node: str | None) -> str:
    return f"{ROOT}.alloc.release.{node_token(node) if node else UNPLACED}"


def node_allocs(node: str) -> str:
    """Where the server republishes every committed write of ``node``'s allocation record."""
    return f"{ALLOCS_REPUBLISH_PREFIX}.{kv_key(node)}"


def node_of_allocs(subject: str) -> str:
    """The node a :func:`node_allocs` subject is about (node names may contain dots)."""
    return subject[len(ALLOCS_REPUBLISH_PREFIX) + 1 :]


def kv_subject(bucket: str, key: str = ">") -> str:
    """The stream subject a KV write of ``key`` goes to (``$KV.<bucket>.<key>``)."""
    return f"$KV.{bucket}.{key}"


def kv_stream(bucket: str) -> str:
    """The stream behind a KV bucket (nats-py's ``KV_STREAM_TEMPLATE``)."""
    return f"KV_{bucket}"


def dlq(service: str) -> str:
    return f"{ROOT}.dlq.{service}"


def node_of(subject: str) -> str:
    """The node a ``tandem.node.<node>.*`` / ``tandem.alloc.*.<node>`` subject is about."""
    parts = subject.split(".")
    if len(parts) >= 4 and parts[1] == "node":
        return node_from_token(parts[2])
    return node_from_token(parts[-1])


def kv_key(name: str) -> str:
    """KV keys allow ``[-/_=.a-zA-Z0-9]``; node names and request ids already fit."""
    return name


def msg_id(*parts: object) -> str:
    """The ``Nats-Msg-Id`` for a publish: same logical event, same id, so JetStream dedups."""
    return ":".join(str(p) for p in parts)


def nodeagent_durable(node: str, what: str) -> str:
    """Durable consumer name of one node agent (durable names may not contain ``.``)."""
    return f"nodeagent-{node_token(node)}-{what}"
