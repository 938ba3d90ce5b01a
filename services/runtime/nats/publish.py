"""JetStream publishes that ride out a stream leader election, and the errors that mean one.

Fail-over: when the server leading a replicated stream dies, the stream has no leader for a
few seconds (4-7 s measured here) and a JetStream publish fails with "no responders" or times
out (the request went to the dead server). :func:`publish_acked` retries such a publish with
the *same* ``Nats-Msg-Id`` until its ``retry_for`` (the bus's
:attr:`~services.runtime.nats.bus.Bus.publish_retry_for`) runs out: a retry of a publish that
did land is dropped by the stream's duplicate window, so retrying never duplicates. A publish
without an id gets a random one for the duration of its retries for the same reason.

The publish itself and its acknowledgement go through :class:`~services.runtime.nats.puback.AckInbox`;
the trace context is put on the headers by the caller (:meth:`Bus.publish
<services.runtime.nats.bus.Bus.publish>`).
"""

from __future__ import annotations

import asyncio

import nats
from nats.js import api
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

from services.runtime.nats.puback import AckInbox, MsgIds
from services.runtime.observe.logging import get_logger

log = get_logger(__name__)

# One publish attempt: a stream acks in milliseconds, so a request that sat this long went to a
# server that died (or to a stream without a leader) and is retried rather than waited on.
PUBLISH_ATTEMPT_TIMEOUT_S = 2.0
# What a stream leader election may take before a publish gives up (well above the 4-7 s
# measured); far below the duplicate window, so every retry is still deduplicated.
PUBLISH_RETRY_S = 30.0
# "No stream answered" and "no answer in time": the transient faces of a leader election.
TRANSIENT_PUBLISH_ERRORS = (NoStreamResponseError, ServiceUnavailableError, nats.errors.TimeoutError)
# The same seen from a handler's KV calls, which also make plain requests (direct gets).
TRANSIENT_NATS_ERRORS = (*TRANSIENT_PUBLISH_ERRORS, nats.errors.NoRespondersError)


def cancelling() -> bool:
    """Whether the current task is being cancelled (a retry loop then stops retrying)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def publish_acked(
    acks: AckInbox, msg_ids: MsgIds, subject: str, data: bytes, headers: dict[str, str], *, retry_for: float
) -> api.PubAck:
    """Publish ``data`` and wait for the stream's ack, retrying a transient failure (the module
    docstring) for ``retry_for`` seconds; ``headers`` gets a ``Nats-Msg-Id`` when it has none."""
    # Retries must be deduplicable: a timed-out attempt may have been stored.
    headers.setdefault("Nats-Msg-Id", msg_ids.new("retry-"))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_for
    delay = 0.1
    attempt = 1
    while True:
        try:
            return await acks.publish(subject, data, headers=headers, timeout=PUBLISH_ATTEMPT_TIMEOUT_S)
        except TRANSIENT_PUBLISH_ERRORS as exc:
            if cancelling():
                raise asyncio.CancelledError from exc
            if loop.time() + delay > deadline:
                log.warning("publish_gave_up", subject=subject, attempts=attempt, error=repr(exc))
                raise
            log.info("publish_retry", subject=subject, attempt=attempt, error=repr(exc))
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)
        attempt += 1
