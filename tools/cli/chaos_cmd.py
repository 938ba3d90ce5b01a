"""``tandem chaos``: kill components of a replicated system under load, check invariants after
each round, print one JSON line.

The runner is :mod:`tools.chaos` (what it starts, kills and checks: there and in
``docs/reliability.md``). Progress goes to stderr; stdout gets a short summary and the JSON
line, or only the JSON line with ``--json``.

Ctrl-C (or SIGTERM) stops the run: the fleet and the services get SIGTERM, SIGKILL after a
grace period, and the servers are stopped; a second Ctrl-C kills them at once. Exit code 0
when no invariant was violated, 1 when one was, 2 when the run could not be done (one line on
stderr), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from tools.cli.errors import CliError

if TYPE_CHECKING:  # the runner is imported when the command runs: `tandem --help` stays fast
    from tools.chaos import ChaosConfig

# tools.chaos.victims.COMPONENTS, spelled here so that registering the command imports nothing.
COMPONENTS = ("allocator", "inventory", "fleet", "nats")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "chaos",
        help="SIGKILL components under load, check invariants from KV after each round (one JSON line)",
        description=(
            "Start a 3-server NATS cluster, inventory and allocator processes and a simulated "
            "fleet; each round, kill one of them (or a NATS server) under a request/release load, "
            "start it again and check the invariants on KV. Prints one JSON line."
        ),
    )
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--rounds", type=int, help="run this many rounds")
    length.add_argument("--duration", type=float, metavar="SECONDS", help="start rounds for this long")
    p.add_argument(
        "--seed", type=int, default=1, help="seed of the kill schedule and the requests (default 1)"
    )
    p.add_argument("--nodes", type=int, default=24, help="simulated nodes (default 24)")
    p.add_argument("--replicas", type=int, default=2, help="allocator processes (default 2)")
    p.add_argument("--round-requests", type=int, default=120, help="requests per round (default 120)")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second (default 20)")
    p.add_argument("--util", type=float, default=0.7, help="share of fleet GPUs kept held (default 0.7)")
    p.add_argument(
        "--down",
        default="0.5,4",
        metavar="MIN,MAX",
        help="seconds a victim stays down, drawn in this range (default 0.5,4)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=75.0,
        metavar="SECONDS",
        help="longest wait for the system to settle before a verdict (default 75; > the 30 s claim timeout)",
    )
    p.add_argument(
        "--kill",
        default=",".join(COMPONENTS),
        metavar="LIST",
        help=f"components that may be killed (default {','.join(COMPONENTS)})",
    )
    p.add_argument("--log-dir", help="write the children's logs and configs here (kept)")
    p.add_argument("--keep-logs", action="store_true", help="keep the run directory after a clean run")
    p.add_argument("--json", action="store_true", help="print only the JSON line on stdout")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=_run)


def _config(args: argparse.Namespace) -> ChaosConfig:
    from tools.chaos import ChaosConfig
    from tools.loadtest.errors import LoadtestError

    try:
        low, high = (float(x) for x in args.down.split(","))
    except ValueError as exc:
        raise LoadtestError(f"--down must be MIN,MAX in seconds, got {args.down!r}") from exc
    return ChaosConfig(
        rounds=args.rounds,
        duration_s=args.duration,
        seed=args.seed,
        nodes=args.nodes,
        replicas=args.replicas,
        round_requests=args.round_requests,
        rate=args.rate,
        util=args.util,
        down_s=(low, high),
        settle_s=args.settle,
        components=tuple(c.strip() for c in args.kill.split(",") if c.strip()),
        log_dir=args.log_dir,
        keep_logs=args.keep_logs,
    )


def _run(args: argparse.Namespace) -> int:
    from services.runtime.errors import SettingsError
    from services.runtime.process.lifecycle import run_loop
    from services.runtime.settings import load_settings
    from tools.chaos import ChaosRunner, summary, to_json_line
    from tools.cli.interrupt import until_interrupted
    from tools.loadtest.errors import LoadtestError

    try:
        cfg = _config(args)
        cfg.check()
        settings = load_settings("chaos")
    except (LoadtestError, SettingsError) as exc:
        raise CliError(str(exc)) from exc

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"chaos: {line}", file=sys.stderr, flush=True)

    runner = ChaosRunner(cfg, settings, progress=progress)
    try:
        report = run_loop(until_interrupted(runner.run(), runner))
    except LoadtestError as exc:
        raise CliError(str(exc)) from exc
    finally:
        runner.kill_now()  # no-op unless the loop died before the teardown finished
    if report is None:
        print("tandem: chaos interrupted; services, fleet and servers stopped", file=sys.stderr)
        return 130
    if not args.json:
        print(summary(report))
    print(to_json_line(report), flush=True)
    return 0 if report.violations == 0 else 1
