"""The last value of every key of a KV bucket, read once and complete.

nats-py's KV watcher ends a bucket's initial values at the first delivery that says nothing is
pending, and while keys are being rewritten the server can say so early, before the last
key's value: a reader that stops there misses keys (``tandem device list box-1`` once found no
box-1 right after ``tandem status`` had listed it). :func:`last_raw_values` reads on to the
stream's last sequence as it was before it started. It serves the CLI (``services.client``),
the services' resyncs (:func:`services.runtime.kv.watch.read_bucket`) and the load and chaos
harnesses' checks.

Kept free of heavy imports (nats-py is imported when a read runs): the CLI imports it, and its
start-up time is measured (``docs/benchmarks.md``, "CLI start-up").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from schemas import subjects

if TYPE_CHECKING:
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

# How long a read waits for the server between two entries.
SNAPSHOT_TIMEOUT_S = 5.0
# How long it waits for entries the server still owes after saying it had none.
SNAPSHOT_GRACE_S = 0.5


async def last_raw_values(js: JetStreamContext, kv: KeyValue, bucket: str) -> dict[str, bytes]:
    """The current value of every key of ``bucket`` (``kv``), as stored; deleted keys left out.

    One ordered consumer delivers the last value of each key; the read goes on past nats-py's
    end of the initial values until it has seen the stream's last sequence as it was before
    the watch (every key's last value is at or before it, or was rewritten after it), waiting
    at most ``SNAPSHOT_GRACE_S`` past that end (the message there may be gone: expired)."""
    import nats.errors

    last = (await js.stream_info(subjects.kv_stream(bucket))).state.last_seq
    watcher = await kv.watchall()
    out: dict[str, bytes] = {}
    seen = 0  # the highest stream sequence delivered
    ended = False  # nats-py said the initial values are over
    try:
        while not (ended and seen >= last):
            try:
                entry: Any = await watcher.updates(  # type: ignore[no-untyped-call]
                    timeout=SNAPSHOT_GRACE_S if ended else SNAPSHOT_TIMEOUT_S
                )
            except nats.errors.TimeoutError:
                if ended:
                    break
                raise
            if entry is None:
                ended = True
                continue
            seen = max(seen, entry.revision or 0)
            if entry.operation is None and entry.value:
                out[entry.key] = entry.value
            else:
                out.pop(entry.key, None)
        return out
    finally:
        await watcher.stop()  # type: ignore[no-untyped-call]
