"""Which request a command names: an id, ``--pod``, ``--claim`` or ``--job``.

``release`` and ``explain`` take exactly one of them (:func:`check_target`, before
connecting); :func:`target` finds a pod's or a claim's request record by name, and
:func:`job_target` a whole job's record, which has a path of its own since a job has several
allocations. ``live`` picks the one still live (what a release means) rather than the newest
(what explain shows).
"""

from __future__ import annotations

import argparse
import sys

from schemas.messages import JobRecord, RequestRecord
from services.client import TandemClient
from tools.cli import workloads
from tools.cli.errors import CliError, CliFailure
from tools.cli.refs import check_request_id, parse_pod, parse_ref
from tools.cli.workloads import LIVE

TARGET_FLAGS = ("pod", "claim", "job")


def check_target(args: argparse.Namespace) -> None:
    """Exactly one of an id, ``--pod``, ``--claim``, ``--job``, each well formed."""
    given = [f"--{f}" for f in TARGET_FLAGS if getattr(args, f, None) is not None]
    if args.request_id is not None:
        given.insert(0, "an id")
    if len(given) > 1:
        both = "both" if len(given) == 2 else "all"
        raise CliError(f"give one of an id, --pod, --claim or --job, not {both} ({' and '.join(given)})")
    if not given:
        raise CliError(
            "name the request: an ID, --pod NAMESPACE/NAME, --claim NAMESPACE/NAME or --job NAMESPACE/NAME",
            hint="`tandem requests` lists them",
        )
    if args.request_id is not None:
        check_request_id(args.request_id)
    for flag in TARGET_FLAGS:
        if getattr(args, flag, None) is not None:
            parse_ref(getattr(args, flag), flag=f"--{flag}")


async def target(
    client: TandemClient, args: argparse.Namespace, *, live: bool
) -> tuple[str, RequestRecord | None]:
    """The request a command names (its id, ``--pod`` or ``--claim``), and its record when
    there is one. ``live``: the one still live (release), else the newest."""
    check_target(args)
    if args.request_id is not None:
        rid = args.request_id
        return rid, await client.request_record(rid)
    if getattr(args, "claim", None) is not None:
        ref = parse_ref(args.claim, flag="--claim")
        what, hint = f"claim {ref.namespace}/{ref.name}", "`tandem status` lists the claims"
        records = workloads.claims_named(await client.request_records(), ref)
    else:
        ref = parse_pod(args.pod)
        what, hint = f"pod {ref.namespace}/{ref.name}", f"`tandem requests -n {ref.namespace}` lists them"
        records = [r for r in await client.requests_of_pod(ref) if r.request.claim is None]
    if not records:
        raise CliFailure(f"no request of {what} is known", hint=hint)
    alive = [r for r in records if r.state in LIVE]
    if live and len(alive) > 1:
        ids = ", ".join(r.request.request_id for r in alive)
        raise CliError(f"{what} has {len(alive)} live requests: {ids}", hint="name one by its id")
    chosen = (alive or records)[0] if live else records[0]
    if not live and len(alive) > 1:
        others = ", ".join(r.request.request_id for r in alive if r is not chosen)
        print(
            f"note: {what} has {len(alive)} live requests; the newest is shown, the others: {others}",
            file=sys.stderr,
        )
    return chosen.request.request_id, chosen


async def job_target(client: TandemClient, args: argparse.Namespace, *, live: bool) -> JobRecord | None:
    """The whole job a command names (``--job``, or an id that is a job's), or None when it
    names a request. ``live``: with ``--job``, the one still waiting or holding."""
    check_target(args)
    if getattr(args, "job", None) is None:
        return await client.job_record(args.request_id) if args.request_id is not None else None
    ref = parse_ref(args.job, flag="--job")
    records = workloads.jobs_named(await client.job_records(), ref)
    if not records:
        raise CliFailure(
            f"no job {ref.namespace}/{ref.name} is known", hint="`tandem requests` lists the jobs"
        )
    alive = [r for r in records if r.state in workloads.JOB_LIVE]
    return (alive or records)[0] if live else records[0]
