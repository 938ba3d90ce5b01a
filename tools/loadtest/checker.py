"""``python -m tools.loadtest.checker``: the invariant checks in the middle of a load run, in
a process of their own, read at a pace.

A check reads and decodes every node's record (one per node). Whatever it takes from the
system, the requests answered meanwhile pay for; p99 submit → assigned under ``tandem loadtest``
was measured with the checks in each place they could run (docs/benchmarks.md, "Measurements
behind the code"):

* on a thread of the harness (one ordered consumer, every record at once), through the GIL it
  still held up the handling of the answers the harness times;
* in a process of its own, the same read: every delivery in one burst takes the server and
  both cores at once;
* in a process of its own that follows the bucket from the start (a watch: every change sent
  once more, as it happens), the p50 moved too.

So this process reads at a pace instead (:func:`~services.runtime.kv.watch.read_paced`:
``PACE_BATCH`` records, then ``PACE_PAUSE_S`` to breathe), at the lowest CPU priority
(:func:`lower_priority`). It is started once, with the
fleet: started per check, its imports alone cost more CPU than the check.

Protocol, one line each way: the harness writes ``snapshot`` on stdin; the checker reads the
bucket, checks it (:func:`tools.loadtest.invariants.check`) and answers one JSON line on
stdout, :class:`~tools.loadtest.invariants.Found` — with ``error`` set, and nothing
checked, when the records could not be read (a NATS server died; the harness reports it and
goes on, one check fewer). It exits when stdin closes. Logs go to stderr.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence

import msgspec
import nats.errors

from schemas import codec, subjects
from services.runtime.kv.watch import read_paced
from services.runtime.nats.bus import Bus
from services.runtime.settings import Settings
from tools.loadtest import invariants
from tools.loadtest.child import child_main

AUTOGROUP = "/proc/self/autogroup"
PACE_BATCH = 250
PACE_PAUSE_S = 0.05
READ_ATTEMPTS_S = 20.0
READ_RETRY_S = 0.5


def autogroup_nice() -> int | None:
    """The nice value of this process's scheduling autogroup, or None where it has none of
    its own: a kernel without autogroups (no file), or a process still in the kernel's
    default group, whose file reads empty (a descendant of PID 1 that never started a session
    of its own, as a CI runner's may be)."""
    try:
        with open(AUTOGROUP) as f:
            fields = f.read().split()
    except OSError:
        return None
    return int(fields[-1]) if len(fields) == 3 and fields[1] == "nice" else None


def lower_priority() -> None:
    """The lowest CPU priority, so that the checks wait for idle CPU rather than take it from
    the system measured. ``nice`` alone does not do it on Linux: the harness starts every child
    in a session of its own, and with ``sched_autogroup_enabled`` (the default on most
    distributions, and on this machine) each session is a scheduling group of its own, which
    weighs as much as any other whatever the nice value of its tasks. The group's own nice
    value (``/proc/self/autogroup``) is what ranks it against the allocator's: with the process
    nice alone the checker still took a share of a core where answers came late, and the p99
    showed it (docs/benchmarks.md, "Measurements behind the code")."""
    os.nice(19)
    if os.getsid(0) != os.getpid():
        return  # not a session of its own (run by hand from a shell): leave the shell's group alone
    try:
        with open(AUTOGROUP, "w") as f:
            f.write("19")
    except OSError:
        pass  # no autogroups (another kernel, or not Linux): the nice value is what counts


async def serve(settings: Settings, commands: asyncio.StreamReader) -> None:
    """Answer every ``snapshot`` line on ``commands`` until it closes."""
    bus = await Bus.open(settings, provision_streams=False)
    try:
        while line := await commands.readline():
            if line.strip() != invariants.CHECKER_COMMAND:
                print(f"loadtest-checker: unknown command {line[:80]!r}", file=sys.stderr)
                continue
            try:
                raw = await _read(bus)
            except (nats.errors.Error, OSError) as exc:
                answer = invariants.Found([], [], [], snapshots=0, error=f"cannot read the records: {exc!r}")
            else:
                found = invariants.Violations()
                records = invariants.decode_all(raw, codec.NODE_ALLOCS)
                invariants.check(records, found, shares=invariants.LOADTEST_SHARES)
                answer = invariants.Found.of(found)
            sys.stdout.buffer.write(msgspec.json.encode(answer) + b"\n")
            sys.stdout.flush()
    finally:
        await bus.close()


async def _read(bus: Bus) -> dict[str, bytes]:
    """The records, read at a pace; a read that fails (a server died, a stream is electing its
    leader) is tried again for up to ``READ_ATTEMPTS_S``, as the services ride it out."""
    deadline = asyncio.get_running_loop().time() + READ_ATTEMPTS_S
    while True:
        try:
            return await read_paced(bus.js, subjects.KV_ALLOCS, batch=PACE_BATCH, pause=PACE_PAUSE_S)
        except (nats.errors.Error, OSError):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(READ_RETRY_S)


def main(argv: Sequence[str] | None = None) -> int:
    return child_main("checker", "loadtest-checker", serve, argv, before=lower_priority)


if __name__ == "__main__":
    sys.exit(main())
