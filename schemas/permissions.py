"""Least-privilege NATS permissions per Tandem component, derived from the subject contract.

Every component gets an allow-list (nothing outside it): the application subjects it
publishes or subscribes to (from :mod:`schemas.subjects`) plus exactly the JetStream API
subjects that nats-py sends for what the component does. Those were read from nats-py 2.x and
checked against a real nats-server (``tests/integration/test_permissions.py`` runs the whole
flow with these permissions and fails on any "Permissions Violation"):

==================================  =========================================================
what the component does             subjects it needs
==================================  =========================================================
JetStream publish (waits for ack)   publish ``<subject>``; the ack comes to its inbox
``js.key_value(bucket)``            ``$JS.API.STREAM.INFO.KV_<bucket>``
KV get (bucket with allow_direct)   ``$JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>`` —
                                    the key is in the subject, so a read can be limited to
                                    one key; the classic ``$JS.API.STREAM.MSG.GET.KV_<bucket>``
                                    carries the key in the body and is given to trusted
                                    readers only (buckets made before direct gets were on)
KV put/create/update                publish ``$KV.<bucket>.<key>``
KV keys()/watch (ordered consumer)  ``$JS.API.CONSUMER.CREATE.KV_<bucket>`` (ephemeral),
                                    ``$JS.API.CONSUMER.INFO.KV_<bucket>.*``, flow-control
                                    replies to ``$JS.FC.KV_<bucket>.>``
durable pull consumer               ``$JS.API.CONSUMER.INFO.<stream>.<durable>``,
                                    ``$JS.API.CONSUMER.CREATE.<stream>.<durable>.<filter>``
                                    (the server checks that the filter in the subject is the
                                    one in the config, so a node agent cannot make its own
                                    durable read another node's subject),
                                    ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>``, acks to
                                    ``$JS.ACK.<stream>.<durable>.>``
provisioning (Bus.open default)     ``$JS.API.STREAM.INFO|CREATE|UPDATE.<stream>`` for the
                                    Tandem streams and the KV streams
replies to its own requests         subscribe ``_INBOX_<user>.>`` (:func:`inbox_prefix`)
answering requests (core NATS)      ``allow_responses`` (publish to the reply subject of a
                                    request it received, once)
==================================  =========================================================

The legacy ``$JS.API.CONSUMER.DURABLE.CREATE.<stream>.<durable>`` is never granted: its
filter is in the body, so it would let a node agent point its own durable at another node's
assignments; nats-py uses it only against servers older than 2.9.

Who provisions: the allocator, inventory and admission services call ``Bus.open`` with
provisioning on (any of them may start first), so they may create and update the streams and
buckets; the node agent and the CLI never provision. Nothing here imports service code: the
module is as much a part of the contract as the subjects it is made from.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from schemas import subjects

JS_API = "$JS.API"  # nats-py's default API prefix (no JetStream domain)

ROLES = ("allocator", "inventory", "admission", "nodeagent", "cli")
PROVISIONERS = frozenset({"allocator", "inventory", "admission"})
KV_BUCKETS = (
    subjects.KV_NODES,
    subjects.KV_ALLOCS,
    subjects.KV_REQUESTS,
    subjects.KV_JOBS,
    subjects.KV_NODE_LABELS,
    subjects.KV_CLAIMS,
)


class PermissionsError(ValueError):
    """A role or node name that permissions cannot be made for."""


@dataclass(frozen=True)
class Permissions:
    """One NATS user's permissions: allow-lists (and deny-lists) for publish and subscribe."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    allow_responses: bool = False

    def as_config(self) -> dict[str, object]:
        """The ``permissions`` map of a nats-server ``authorization.users`` entry."""
        pub: dict[str, object] = {"allow": list(self.publish)}
        sub: dict[str, object] = {"allow": list(self.subscribe)}
        if self.publish_deny:
            pub["deny"] = list(self.publish_deny)
        if self.subscribe_deny:
            sub["deny"] = list(self.subscribe_deny)
        out: dict[str, object] = {"publish": pub, "subscribe": sub}
        if self.allow_responses:
            out["allow_responses"] = True
        return out


@dataclass(frozen=True)
class User:
    """A nats-server user: name, password and the permissions of its role."""

    name: str
    password: str = field(repr=False)  # never in a log line or a traceback
    permissions: Permissions = field(repr=False)


def inbox_prefix(user: str) -> str:
    """The inbox prefix of a user's connection (``Bus`` sets it from the user in ``nats_url``).

    Replies to a client's requests (JetStream acks and API answers, direct gets, the messages
    a pull consumer delivers) go to its inbox. With nats-py's shared ``_INBOX`` every user
    would need ``_INBOX.>``, and a node agent could read another node's deliveries there; with
    one prefix per user, each may subscribe to its own inbox only.
    """
    return f"_INBOX_{user}"


kv_stream = subjects.kv_stream
kv_subject = subjects.kv_subject


def user_name(role: str, node: str | None = None) -> str:
    """The NATS user of a role; node agents get one user per node."""
    if role == "nodeagent":
        if not node:
            raise PermissionsError("the nodeagent role needs its node name")
        return f"nodeagent-{subjects.node_token(node)}"
    return role


# -- building blocks: each returns (publish, subscribe) subjects ------------------------------


def _stream_info(stream: str) -> list[str]:
    return [f"{JS_API}.STREAM.INFO.{stream}"]


def _provision() -> list[str]:
    streams = [*subjects.STREAM_SUBJECTS, *(kv_stream(b) for b in KV_BUCKETS)]
    return [f"{JS_API}.STREAM.{op}.{s}" for s in streams for op in ("INFO", "CREATE", "UPDATE")]


def _durable(stream: str, durable: str, filters: str | list[str]) -> list[str]:
    """A durable pull consumer as ``Bus.consume`` runs it (publish side). The server names
    one filter subject in the create subject; a consumer with several has none there."""
    create = f"{JS_API}.CONSUMER.CREATE.{stream}.{durable}"
    if isinstance(filters, str) or len(filters) == 1:
        create = f"{create}.{filters if isinstance(filters, str) else filters[0]}"
    return [
        f"{JS_API}.CONSUMER.INFO.{stream}.{durable}",
        create,
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
    ]


def _kv_reader(bucket: str, *, key: str | None = None) -> list[str]:
    """Read a bucket: every key (get, keys, watch) or, with ``key``, that one key (get)."""
    stream = kv_stream(bucket)
    if key is not None:
        return [*_stream_info(stream), f"{JS_API}.DIRECT.GET.{stream}.{kv_subject(bucket, key)}"]
    return [
        *_stream_info(stream),
        f"{JS_API}.DIRECT.GET.{stream}.{kv_subject(bucket)}",
        f"{JS_API}.STREAM.MSG.GET.{stream}",
        f"{JS_API}.CONSUMER.CREATE.{stream}",
        f"{JS_API}.CONSUMER.INFO.{stream}.*",
        f"$JS.FC.{stream}.>",
    ]


def _kv_writer(bucket: str) -> list[str]:
    return [*_kv_reader(bucket), kv_subject(bucket)]


def _inbox(user: str) -> str:
    return f"{inbox_prefix(user)}.>"


def _dedup(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


# -- roles ------------------------------------------------------------------------------------


def allocator() -> Permissions:
    a = subjects.ALLOC_STREAM
    pub = [
        subjects.ALLOC_ASSIGNED_ALL,
        subjects.ALLOC_FAILED,
        subjects.ALLOC_FREED,
        subjects.ALLOC_PREEMPT,
        subjects.ALLOCATOR_HEARTBEAT,
        subjects.ALLOCATOR_FORWARD_ALL,
        subjects.dlq("allocator"),
        *_provision(),
        *_durable(a, subjects.CONSUMER_ALLOCATOR_REQUESTS, subjects.ALLOC_REQUEST),
        *_durable(a, subjects.CONSUMER_ALLOCATOR_JOBS, subjects.ALLOC_JOB),
        *_durable(a, subjects.CONSUMER_ALLOCATOR_RELEASES, subjects.ALLOC_RELEASE_ALL),
        *_durable(subjects.NODE_STREAM, subjects.CONSUMER_ALLOCATOR_NODE, subjects.ALLOCATOR_NODE_FILTERS),
        *_kv_reader(subjects.KV_NODES),
        *_kv_writer(subjects.KV_ALLOCS),
        *_kv_writer(subjects.KV_REQUESTS),
        *_kv_writer(subjects.KV_JOBS),
        *_kv_reader(subjects.KV_NODE_LABELS),
    ]
    sub = [subjects.ALLOCATOR_HEARTBEAT, subjects.ALLOCATOR_FORWARD_ALL, _inbox("allocator")]
    # allow_responses: a replica answers the requests other replicas hand it.
    return Permissions(publish=_dedup(pub), subscribe=_dedup(sub), allow_responses=True)


def inventory() -> Permissions:
    pub = [
        subjects.dlq("inventory"),
        *_provision(),
        *_durable(subjects.NODE_STREAM, subjects.CONSUMER_INVENTORY, subjects.INVENTORY_NODE_FILTERS),
        *_kv_writer(subjects.KV_NODES),
    ]
    sub = [subjects.NODE_HEARTBEAT_ALL, subjects.QUERY_INVENTORY, _inbox("inventory")]
    return Permissions(publish=_dedup(pub), subscribe=_dedup(sub), allow_responses=True)


def admission() -> Permissions:
    a = subjects.ALLOC_STREAM
    pub = [
        subjects.ALLOC_REQUEST,
        subjects.ALLOC_JOB,
        subjects.ALLOC_RELEASE_ALL,
        subjects.dlq("admission"),
        *_provision(),
        *_durable(a, subjects.CONSUMER_BRIDGE, subjects.ALLOC_ASSIGNED_ALL),
        *_durable(a, subjects.CONSUMER_BRIDGE_FAILED, subjects.ALLOC_FAILED),
        *_durable(a, subjects.CONSUMER_BRIDGE_PREEMPT, subjects.ALLOC_PREEMPT),
        *_durable(a, subjects.CONSUMER_BRIDGE_FREED, subjects.ALLOC_FREED),
        *_kv_reader(subjects.KV_REQUESTS),
        *_kv_reader(subjects.KV_JOBS),
        *_kv_reader(subjects.KV_ALLOCS),
        *_kv_writer(subjects.KV_NODE_LABELS),
        *_kv_writer(subjects.KV_CLAIMS),
    ]
    return Permissions(publish=_dedup(pub), subscribe=(_inbox("admission"),))


def nodeagent(node: str) -> Permissions:
    """Only its own node: its own events, its own allocation record (read, and followed on
    its republish subject)."""
    if not node:
        raise PermissionsError("the nodeagent role needs its node name")
    pub = [
        subjects.node_inventory(node),
        subjects.node_health(node),
        subjects.node_applied(node),
        subjects.node_cleaned(node),
        subjects.node_heartbeat(node),
        subjects.dlq("nodeagent"),
        *_kv_reader(subjects.KV_ALLOCS, key=subjects.kv_key(node)),
    ]
    # Its allocation record comes as the server republishes it (no consumer of its own).
    sub = [subjects.node_command(node), subjects.node_allocs(node), _inbox(user_name("nodeagent", node))]
    return Permissions(publish=_dedup(pub), subscribe=_dedup(sub), allow_responses=True)


def cli() -> Permissions:
    """The operator's ``tandem`` CLI (TandemClient): submit, release, device commands, queries
    and reads of every record; it writes no record and provisions nothing."""
    pub = [
        subjects.ALLOC_REQUEST,
        subjects.ALLOC_JOB,
        subjects.ALLOC_RELEASE_ALL,
        subjects.node_command("*"),
        subjects.QUERY_INVENTORY,
        *(s for b in KV_BUCKETS for s in _kv_reader(b)),
    ]
    # Cleanup reports: `tandem release` waits for the node's verdict and prints it. Preemption
    # plans: `tandem submit --wait` follows the one made for its request.
    sub = [
        subjects.ALLOC_ASSIGNED_ALL,
        subjects.ALLOC_FAILED,
        subjects.ALLOC_FREED,
        subjects.ALLOC_PREEMPT,
        subjects.NODE_CLEANED_ALL,
        _inbox("cli"),
    ]
    return Permissions(publish=_dedup(pub), subscribe=_dedup(sub))


def for_role(role: str, *, node: str | None = None) -> Permissions:
    """Permissions of ``role`` (one of :data:`ROLES`); ``node`` is required for ``nodeagent``."""
    if role == "nodeagent":
        return nodeagent(node or "")
    builders = {"allocator": allocator, "inventory": inventory, "admission": admission, "cli": cli}
    if role not in builders:
        raise PermissionsError(f"unknown role {role!r}; known: {', '.join(ROLES)}")
    return builders[role]()


# -- nats-server configuration ----------------------------------------------------------------


def _value(v: object, indent: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)  # a quoted string: "$JS..." is not a variable reference
    if isinstance(v, list):
        inner = indent + "  "
        return "[\n" + "".join(f"{inner}{_value(x, inner)}\n" for x in v) + f"{indent}]"
    if isinstance(v, dict):
        inner = indent + "  "
        body = "".join(f"{inner}{k}: {_value(x, inner)}\n" for k, x in v.items())
        return "{\n" + body + f"{indent}}}"
    raise TypeError(f"cannot render {type(v).__name__} in a nats-server config")


def authorization_block(users: Sequence[User]) -> str:
    """An ``authorization { users = [...] }`` block for nats-server's config file."""
    entries = [
        {"user": u.name, "password": u.password, "permissions": u.permissions.as_config()} for u in users
    ]
    return f"authorization {{\n  users = {_value(entries, '  ')}\n}}\n"


def callout_block(
    *, issuer: str, auth_nkey: str, account: str = "TANDEM", trusted_nkeys: Sequence[str] = ()
) -> str:
    """The accounts and ``auth_callout`` blocks of a nats-server that hands every connection
    to Tandem's auth callout (``services.authcallout``): ``AUTH`` holds only the callout's own
    user, ``account`` (JetStream on) every Tandem component, ``SYS`` the system account.
    ``issuer`` is the public nkey whose signature the server accepts on the users it is given;
    ``auth_nkey`` the callout's own user, a public user nkey (the callout holds its seed). Both
    are public keys: the block holds no secret, so no password is stored in plain text.
    ``trusted_nkeys``: users of ``account`` with every permission who bypass the callout —
    the load harness's measuring connection (``tools.loadtest.production``); none in an
    install."""
    tandem: dict[str, object] = {"jetstream": "enabled"}
    if trusted_nkeys:
        tandem["users"] = [{"nkey": k} for k in trusted_nkeys]
    config: dict[str, object] = {
        "accounts": {"AUTH": {"users": [{"nkey": auth_nkey}]}, account: tandem, "SYS": {}},
        "system_account": "SYS",
        "authorization": {
            "auth_callout": {"issuer": issuer, "auth_users": [auth_nkey, *trusted_nkeys], "account": "AUTH"}
        },
    }
    return "".join(f"{k}: {_value(v, '')}\n" for k, v in config.items())
