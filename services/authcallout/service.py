"""Per-component and per-node NATS identities from Kubernetes, through NATS auth callout.

Every Tandem component connects to NATS with the token of its own Kubernetes service account
(a projected token with the audience ``tandem-nats``, rotated by the kubelet) and nothing else:
no password, no key, no per-node Secret. The NATS server hands each connection attempt to this
service (``$SYS.REQ.USER.AUTH``, signed by the server); the service asks the API server who the
token is (TokenReview) and answers with a user JWT, signed by the callout's issuer key, that
carries exactly the permissions of that role from :mod:`schemas.permissions`:

* ``system:serviceaccount:<namespace>:<sa>`` names the component by the service-account map
  (``auth_identities``, e.g. ``tandem-allocator`` → ``allocator``); any other account, or a
  token the API server does not accept, is refused with the reason;
* a node agent's token is bound to its pod, and the API server says which node that pod runs
  on (``authentication.kubernetes.io/node-name`` in the review's ``extra``, Kubernetes 1.30+;
  older servers name the pod, whose ``spec.nodeName`` is then read). So a node agent gets the
  permissions of *its* node and no other: the subject it publishes on is authenticated by the
  cluster, which is what :mod:`schemas.routing` relies on.

The user JWT expires with the token (at most ``auth_user_ttl``): the server then drops the
connection and the client reconnects with the kubelet's fresh token, which is reviewed again.
A token the API server accepted is remembered for ``auth_review_cache_s`` (60 s by default,
never past the token's own expiry), by its SHA-256 rather than itself: when a NATS server goes
away, every client that was on it reconnects to the others at once, with the token it already
had — at 10,000 nodes a third of them, each a TokenReview the API server would otherwise answer
in the same second. Kubernetes' own webhook token authenticator keeps its reviews (2 minutes
by default) for the same reason; the price is the same too: a token revoked (its pod deleted)
still connects for up to that long. Refusals are never remembered.

Why auth callout rather than JWT accounts with a per-node user minted into a Secret: a
DaemonSet cannot mount a different Secret on each node, and any agent able to read a Secret by
name could read another node's; a token bound to the pod and its node needs nothing stored.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import nkeys
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from prometheus_client import Counter

from schemas import permissions
from services.authcallout import natsjwt
from services.kube.client import KubeApi
from services.kube.errors import KubeError
from services.runtime.observe.logging import get_logger

log = get_logger(__name__)

AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
SA_PREFIX = "system:serviceaccount:"

DECISIONS = Counter(
    "tandem_auth_decisions_total", "NATS connections decided by the auth callout", ["outcome"]
)
REVIEWS = Counter(
    "tandem_auth_reviews_total",
    "Tokens the auth callout identified: reviewed by the API server, or remembered from a review",
    ["source"],
)
# Tokens remembered at most (the oldest go first): a fleet's node agents and the components.
REVIEW_CACHE_MAX = 100_000


class Denied(Exception):
    """The connection is refused; the message is what the server logs for it."""


@dataclass(frozen=True)
class Identity:
    role: str
    node: str | None = None

    @property
    def user(self) -> str:
        return permissions.user_name(self.role, self.node)


class Reviewer:
    """Who a service-account token is, according to the API server."""

    def __init__(
        self,
        kube: KubeApi,
        *,
        namespace: str,
        identities: Mapping[str, str],
        audiences: list[str],
        remember_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.identities = dict(identities)  # service account → role
        self.audiences = audiences
        self.remember_s = remember_s
        self.clock = clock
        # SHA-256 of an accepted token → (until when, on self.clock; who it is); oldest first
        self._known: dict[bytes, tuple[float, Identity]] = {}
        for source in ("api", "remembered"):
            REVIEWS.labels(source)

    async def identify(self, token: str) -> Identity:
        if not token:
            raise Denied("no token: connect with the service account token (nats_token_file)")
        key = hashlib.sha256(token.encode()).digest()
        known = self._known.get(key)
        if known is not None:
            if known[0] > self.clock():
                REVIEWS.labels("remembered").inc()
                return known[1]
            del self._known[key]
        identity = await self._review(token)
        REVIEWS.labels("api").inc()
        self._remember(key, identity, token)
        return identity

    def _remember(self, key: bytes, identity: Identity, token: str) -> None:
        if self.remember_s <= 0:
            return
        until = self.clock() + self.remember_s
        expires = token_expiry(token)
        if expires is not None:  # never past the token's own expiry (a wall-clock time)
            until = min(until, self.clock() + expires - time.time())
        if until <= self.clock():
            return
        while len(self._known) >= REVIEW_CACHE_MAX:
            del self._known[next(iter(self._known))]
        self._known[key] = (until, identity)

    async def _review(self, token: str) -> Identity:
        try:
            review = await self.kube.review_token(token, audiences=self.audiences)
        except KubeError as exc:
            raise Denied(f"token review failed: {exc}") from exc
        status = review.get("status") or {}
        if not status.get("authenticated"):
            raise Denied(f"token not accepted: {status.get('error') or 'not authenticated'}")
        # "authenticated" alone is not enough: an authenticator that ignores audiences answers
        # for a token of any audience (a token meant for the API server, or for another
        # service). The API server lists the audiences the token is valid for; one must be ours.
        granted = set(status.get("audiences") or [])
        if not granted & set(self.audiences):
            raise Denied(
                f"token not issued for audience {', '.join(self.audiences)} "
                f"(valid for: {', '.join(sorted(granted)) or 'no audience named'})"
            )
        user = status.get("user") or {}
        username = str(user.get("username", ""))
        prefix = f"{SA_PREFIX}{self.namespace}:"
        if not username.startswith(prefix):
            raise Denied(f"{username!r} is not a service account of namespace {self.namespace!r}")
        account = username[len(prefix) :]
        role = self.identities.get(account)
        if role is None:
            raise Denied(f"service account {account!r} has no Tandem role")
        if role != "nodeagent":
            return Identity(role)
        return Identity(role, await self._node_of(user.get("extra") or {}))

    async def _node_of(self, extra: Mapping[str, Any]) -> str:
        nodes = extra.get(NODE_NAME_EXTRA) or []
        if len(nodes) == 1 and nodes[0]:
            return str(nodes[0])
        pods = extra.get(POD_NAME_EXTRA) or []
        if len(pods) != 1:
            raise Denied("a node agent's token must be bound to its pod (a projected token)")
        try:
            pod = await self.kube.get_pod(self.namespace, str(pods[0]))
        except KubeError as exc:
            raise Denied(f"cannot read the node agent's pod {pods[0]!r}: {exc}") from exc
        node = (pod.get("spec") or {}).get("nodeName")
        if not node:
            raise Denied(f"the node agent's pod {pods[0]!r} is not on a node yet")
        return str(node)


def token_expiry(token: str) -> float | None:
    """The ``exp`` of a JWT token (read after the API server accepted it; not verified here)."""
    try:
        body = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (IndexError, ValueError, binascii.Error):
        return None
    exp = claims.get("exp") if isinstance(claims, dict) else None
    return float(exp) if isinstance(exp, int | float) else None


class AuthCallout:
    def __init__(
        self,
        nc: NATS,
        *,
        issuer: nkeys.KeyPair,
        account: str,
        reviewer: Reviewer,
        user_ttl: float = 3600.0,
    ) -> None:
        self.nc = nc
        self.issuer = issuer
        self.account = account
        self.reviewer = reviewer
        self.user_ttl = user_ttl
        self._sub: Any = None

    async def start(self) -> None:
        # A queue group: several replicas answer the server's requests between them.
        self._sub = await self.nc.subscribe(AUTH_SUBJECT, queue="tandem-auth", cb=self._on_request)
        log.info("auth_callout_started", account=self.account)

    async def stop(self) -> None:
        try:
            if self._sub is not None:
                # A connection closed already (for good, or by an outage) took the
                # subscription with it; nats-py raises for it, and the stop goes on.
                with contextlib.suppress(NatsError):
                    await self._sub.unsubscribe()
        finally:
            await self.reviewer.kube.close()

    async def _on_request(self, msg: Msg) -> None:
        try:
            request = natsjwt.decode(msg.data.decode(errors="replace"))
            nats = request.get("nats") or {}
            if nats.get("type") != natsjwt.REQUEST_TYPE:
                raise natsjwt.JwtError(f"not an authorization request: {nats.get('type')!r}")
            user_nkey = str(nats["user_nkey"])
            server_id = str(nats["server_id"]["id"])
        except (natsjwt.JwtError, KeyError, TypeError) as exc:
            # Not from a server (only servers publish here): nothing to answer with.
            log.warning("auth_request_invalid", error=str(exc))
            DECISIONS.labels("invalid").inc()
            return
        token = str((nats.get("connect_opts") or {}).get("auth_token") or "")
        try:
            identity = await self.reviewer.identify(token)
            answer = natsjwt.response_claims(
                user_nkey=user_nkey, server_id=server_id, user_jwt=self._user_jwt(identity, user_nkey, token)
            )
            DECISIONS.labels("allowed").inc()
            log.info("auth_allowed", user=identity.user)
        except Denied as exc:
            answer = natsjwt.response_claims(user_nkey=user_nkey, server_id=server_id, error=str(exc))
            DECISIONS.labels("denied").inc()
            log.warning("auth_denied", reason=str(exc))
        await msg.respond(natsjwt.encode(answer, self.issuer).encode())

    def _user_jwt(self, identity: Identity, user_nkey: str, token: str) -> str:
        perms = permissions.for_role(identity.role, node=identity.node)
        expires = token_expiry(token)
        ttl = self.user_ttl if expires is None else max(1.0, min(self.user_ttl, expires - time.time()))
        claims = natsjwt.user_claims(
            user_nkey=user_nkey,
            name=identity.user,
            account=self.account,
            publish=list(perms.publish),
            subscribe=list(perms.subscribe),
            allow_responses=perms.allow_responses,
            expires_in=ttl,
        )
        return natsjwt.encode(claims, self.issuer)
