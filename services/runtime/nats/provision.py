"""Stream and KV provisioning: every stream and bucket Tandem uses, created or brought up to
date, idempotently, by each service that starts (unless its NATS user may not: the node agent).

The names and subjects come from :mod:`schemas.subjects`; the bounds that keep one sender's
flood from costing anyone else (the dead-letter stream's size, a node subject's message count)
are the constants here. A replicated stream that cannot be placed yet (a peer of the cluster
down), or a JetStream API that answers "temporarily unavailable" (a cluster still electing its
meta leader, or just routing a new account's API to it), is waited for
(:func:`while_forming`); an API call that timed out is simply made again.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError, ServiceUnavailableError

from schemas import limits, subjects
from services.runtime.observe.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")

KV_BUCKETS = (
    subjects.KV_NODES,
    subjects.KV_ALLOCS,
    subjects.KV_REQUESTS,
    subjects.KV_JOBS,
    subjects.KV_NODE_LABELS,
    subjects.KV_CLAIMS,
)
DUPLICATE_WINDOW_S = 120.0
# JetStream's "no suitable peers for placement" (a replicated stream while a peer is down), and
# its 503 "temporarily unavailable" (no meta leader yet, or a new account's API not yet routed
# to it: seen right after three servers report healthy on a loaded machine): provisioning
# waits, PLACEMENT_WAITS x PLACEMENT_WAIT_S at most.
NO_PLACEMENT = 10005
PLACEMENT_WAITS = 30
PLACEMENT_WAIT_S = 0.5
# The dead-letter stream keeps at most this much (oldest dropped first).
DLQ_MAX_BYTES = 256 * 1024 * 1024
# Messages kept per node-event subject (oldest dropped first): a flood on one node's subject
# can only push out that node's own messages, never another node's.
NODE_SUBJECT_MAX_MSGS = 10_000


async def provision(js: JetStreamContext, *, replicas: int = 1, attempts: int = 3) -> None:
    """Create or update every stream and KV bucket; safe to run from every service at start.

    Every step is idempotent, so a JetStream API call that times out (a loaded server can take
    longer than the client's 5 s to create a file-backed stream) is simply tried again. So is a
    replicated stream or bucket that cannot be placed yet because a peer of the cluster is not
    up (err_code 10005: a cluster still forming, or a server restarting), or JetStream answers
    503 (its meta leader not elected yet), for a while longer: :func:`while_forming`."""
    attempt = 1
    while True:
        try:
            await while_forming(lambda: _provision_once(js, replicas=replicas), what="provision")
            return
        except nats.errors.TimeoutError:
            if attempt == attempts:
                raise
            log.warning("provision_retry", attempt=attempt)
            attempt += 1


def _forming(exc: APIError) -> bool:
    """Whether ``exc`` is what a cluster still forming (or a peer restarting) answers."""
    return isinstance(exc, ServiceUnavailableError) or exc.err_code == NO_PLACEMENT


async def while_forming(call: Callable[[], Awaitable[T]], *, what: str) -> T:
    """``await call()``, made again while JetStream answers that the cluster is still forming
    (:func:`_forming`), PLACEMENT_WAITS times at most; ``call`` must be safe to repeat. Any
    other error, or the last of those, is raised."""
    waits = 0
    while True:
        try:
            return await call()
        except APIError as exc:
            if not _forming(exc) or waits >= PLACEMENT_WAITS:
                raise
            waits += 1
            log.warning("jetstream_forming_wait", what=what, error=exc.description, code=exc.code, wait=waits)
            await asyncio.sleep(PLACEMENT_WAIT_S)


async def _provision_once(js: JetStreamContext, *, replicas: int) -> None:
    for name, subjects_ in subjects.STREAM_SUBJECTS.items():
        cfg = api.StreamConfig(
            name=name,
            subjects=subjects_,
            duplicate_window=DUPLICATE_WINDOW_S,
            num_replicas=replicas,
            max_age=7 * 24 * 3600.0,
            max_msg_size=limits.MAX_MESSAGE_BYTES,
            **_stream_limits(name),
        )
        try:
            await js.stream_info(name)
            await js.update_stream(cfg)
        except NotFoundError:
            await js.add_stream(cfg)
    # Buckets allow direct gets: a direct get names the key in its subject
    # ($JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>), so NATS permissions can let a node
    # agent read its own allocation record and no other (schemas.permissions).
    for bucket in KV_BUCKETS:
        republish = _republish(bucket)
        try:
            kv = await js.key_value(bucket)
        except BucketNotFoundError:
            cfg_kv = api.KeyValueConfig(
                bucket=bucket,
                history=5,
                replicas=replicas,
                direct=True,
                republish=republish,
                max_value_size=limits.MAX_RECORD_BYTES,
            )
            await js.create_key_value(cfg_kv)
            continue
        info = await js.stream_info(subjects.kv_stream(bucket))
        current = info.config.republish
        wants_republish = republish is not None and (
            current is None or (current.src, current.dest) != (republish.src, republish.dest)
        )
        cfg = info.config
        if (
            not kv._direct
            or wants_republish
            or not cfg.allow_msg_ttl
            or cfg.max_msg_size != limits.MAX_RECORD_BYTES
        ):  # a bucket made by an older version
            await js.update_stream(
                dataclasses.replace(
                    cfg,
                    allow_direct=True,
                    republish=republish or current,
                    allow_msg_ttl=True,
                    max_msg_size=limits.MAX_RECORD_BYTES,
                )
            )


def _stream_limits(stream: str) -> dict[str, Any]:
    """Bounds that keep one sender's flood from costing anyone else (module constants)."""
    if stream == subjects.DLQ_STREAM:
        return {"max_bytes": DLQ_MAX_BYTES, "discard": api.DiscardPolicy.OLD}
    if stream == subjects.NODE_STREAM:
        return {"max_msgs_per_subject": NODE_SUBJECT_MAX_MSGS, "discard": api.DiscardPolicy.OLD}
    return {}


def _republish(bucket: str) -> api.RePublish | None:
    """Node allocation records are republished on ``tandem.allocs.<node>`` (schemas.subjects)."""
    if bucket != subjects.KV_ALLOCS:
        return None
    return api.RePublish(src=subjects.kv_subject(bucket), dest=subjects.NODE_ALLOCS_ALL, headers_only=False)
