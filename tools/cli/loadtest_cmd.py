"""``tandem loadtest``: run the whole system under load and print one JSON line of figures.

The harness is :mod:`tools.loadtest` (what it starts, measures and checks is documented
there and in ``docs/benchmarks.md``, "Running system (end to end)"). Progress goes to stderr;
stdout gets a short summary and the JSON line, or only the JSON line with ``--json``.

Ctrl-C (or SIGTERM) stops the run: the fleet and the services get SIGTERM, SIGKILL after a
grace period, and the servers it started are stopped; a second Ctrl-C kills them at once. Exit
code 0 when the invariants held (``lost``, ``double_held``, ``double_placed``, ``overcommitted``
and the ledger's faults — checked at every write — all 0), 1 when one did not, 2 when the
run could not be done (one line on stderr), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import TYPE_CHECKING, Any

from tools.cli.errors import CliError

if TYPE_CHECKING:  # imported when the command runs (tools/cli/main.py: fast --help)
    from tools.loadtest.config import LoadConfig


def register(sub: Any) -> None:
    p = sub.add_parser(
        "loadtest",
        help="the running system under load: decisions/s, latencies, invariants (one JSON line)",
        description=(
            "Start NATS (by default as the chart installs it), inventory and allocator processes "
            "and a simulated fleet, drive allocation requests through them and print one JSON "
            "line of figures."
        ),
    )
    _production_arguments(p)
    p.add_argument("--nats", metavar="URL", help="use this NATS server (default: start one or three)")
    p.add_argument(
        "--no-services",
        action="store_true",
        help="with --nats: inventory and allocators already run there; start only the fleet",
    )
    p.add_argument("--nodes", type=int, default=100, help="simulated nodes (default 100)")
    p.add_argument("--replicas", type=int, default=1, help="allocator processes (default 1)")
    p.add_argument("--requests", type=int, default=1000, help="requests to submit (default 1000)")
    p.add_argument("--rate", type=float, help="requests per second (default: open loop)")
    p.add_argument(
        "--max-in-flight",
        type=int,
        help="open loop: requests awaiting their first answer at most (default: 5%% of the fleet's GPUs)",
    )
    p.add_argument("--util", type=float, default=0.85, help="share of fleet GPUs kept held (default 0.85)")
    p.add_argument(
        "--give-up",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="cancel a request still pending after this many seconds, as a user would (0: never; default 5)",
    )
    p.add_argument("--pinned", type=float, default=0.0, help="share of requests pinned to one node")
    p.add_argument(
        "--shares",
        type=float,
        default=0.0,
        help="share of requests asking a share of one GPU instead of whole GPUs (default 0)",
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the request stream (default 1)")
    p.add_argument("--drain", type=float, default=60.0, help="seconds to wait for the last answers")
    p.add_argument(
        "--ceiling-msgs",
        type=int,
        default=20_000,
        help="messages for the JetStream ceiling measurement (0: skip it)",
    )
    p.add_argument("--apply-ms", type=float, default=0.0, help="simulated apply time per allocation")
    p.add_argument(
        "--cleanup-fail-share",
        type=float,
        default=0.02,
        metavar="F",
        help="share of releases whose first cleanup the fleet reports unverified, then retries "
        "(default 0.02)",
    )
    p.add_argument(
        "--idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before the load, measure CPU shares for this many seconds with heartbeats only (default: skip)",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        help="seconds for the fleet to register and the allocator to decide (default 60 + 0.02/node)",
    )
    p.add_argument("--log-dir", help="write the children's logs and configs here (kept)")
    p.add_argument("--keep-logs", action="store_true", help="keep the run directory after a good run")
    p.add_argument("--json", action="store_true", help="print only the JSON line on stdout")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=_run)


def _production_arguments(p: argparse.ArgumentParser) -> None:
    """The profile, and what only the production profile runs (Prometheus, a server killed or
    cut off)."""
    p.add_argument(
        "--profile",
        choices=("production", "dev"),
        help="production (default): NATS as the chart installs it — 3 JetStream servers, streams "
        "replicated on all, TLS, every component and node with its own identity through the auth "
        "callout — and a Prometheus scraping every component; dev: one plain embedded server "
        "(the default with --nats)",
    )
    p.add_argument(
        "--scrape-interval",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="production profile: Prometheus's scrape interval (default 30, the chart's)",
    )
    p.add_argument(
        "--kill-server-at",
        type=float,
        metavar="F",
        help="production profile: SIGKILL the NATS server leading the allocation bucket once this "
        "share of the requests is submitted, and start it again (default: no kill)",
    )
    p.add_argument(
        "--kill-down",
        type=float,
        default=3.0,
        metavar="SECONDS",
        help="with --kill-server-at: how long the server stays down (default 3)",
    )
    p.add_argument(
        "--partition-server-at",
        type=float,
        metavar="F",
        help="production profile, as root: run the NATS servers in network namespaces of their "
        "own and cut the one leading the allocation bucket off the network once this share of "
        "the requests is submitted, then put it back (default: no partition)",
    )
    p.add_argument(
        "--partition-for",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="with --partition-server-at: how long the server stays cut off (default 15)",
    )


def _config(args: argparse.Namespace) -> LoadConfig:
    from tools.loadtest.config import LoadConfig

    return LoadConfig(
        nodes=args.nodes,
        replicas=args.replicas,
        requests=args.requests,
        rate=args.rate,
        util=args.util,
        seed=args.seed,
        max_in_flight=args.max_in_flight,
        give_up_s=args.give_up,
        pinned=args.pinned,
        shares=args.shares,
        nats_url=args.nats,
        start_services=not args.no_services,
        drain_s=args.drain,
        ceiling_msgs=args.ceiling_msgs,
        apply_ms=args.apply_ms,
        cleanup_fail_share=args.cleanup_fail_share,
        idle_s=args.idle,
        start_timeout=args.start_timeout,
        profile=args.profile or ("dev" if args.nats else "production"),
        scrape_interval_s=args.scrape_interval,
        kill_server_at=args.kill_server_at,
        kill_down_s=args.kill_down,
        partition_server_at=args.partition_server_at,
        partition_s=args.partition_for,
        log_dir=args.log_dir,
        keep_logs=args.keep_logs,
    )


def _run(args: argparse.Namespace) -> int:
    from services.runtime.errors import SettingsError
    from services.runtime.process.lifecycle import GC_THRESHOLDS, run_loop
    from services.runtime.settings import load_settings
    from tools.cli.interrupt import until_interrupted
    from tools.loadtest.errors import LoadtestError
    from tools.loadtest.harness import Harness
    from tools.loadtest.report import summary, to_json_line, violations

    cfg = _config(args)
    try:
        cfg.check()
        settings = load_settings("loadtest")
    except (LoadtestError, SettingsError) as exc:
        raise CliError(str(exc)) from exc

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"loadtest: {line}", file=sys.stderr, flush=True)

    harness = Harness(cfg, settings, progress=progress)
    # The harness stamps every answer when its loop handles it, so a pause of its own is added
    # to the latency of each answer that arrives meanwhile. With Python's default thresholds
    # its full collections (every request's bookkeeping is kept to the end) showed in the p99
    # of a --rate 500 run; with the services' thresholds they are ten times rarer
    # (docs/benchmarks.md, "Measurements behind the code").
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        # uvloop, as the services run: the harness shares the cores
        report = run_loop(until_interrupted(harness.run(), harness))
    except LoadtestError as exc:
        raise CliError(str(exc)) from exc
    finally:
        harness.kill_now()  # no-op unless the loop died before the teardown finished
    if report is None:
        print("tandem: loadtest interrupted; services and fleet stopped", file=sys.stderr)
        return 130
    if not args.json:
        print(summary(report))
    print(to_json_line(report), flush=True)
    return 0 if violations(report) == 0 else 1
