"""``tandem plan``: declared here, run by :mod:`tools.cli.plan` (imported only when the
command runs, so ``tandem --help`` does not load the allocator core)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="what-if placement of a request trace on a simulated cluster",
        description="Replay alloc/free requests against topology files with the real allocator core.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--cluster", type=Path, metavar="FILE", help="YAML/JSON list of {topology, count, prefix}"
    )
    src.add_argument("--nodes", type=Path, nargs="+", metavar="FILE", help="individual topology files")
    p.add_argument("--requests", required=True, metavar="FILE", help="JSON lines of alloc/free ('-': stdin)")
    p.add_argument("--summary", action="store_true", help="append a summary line")
    p.add_argument("--policy", choices=("binpack", "spread"), default="binpack", help="node policy")
    p.add_argument("--classes", type=Path, metavar="FILE", help="YAML/JSON mapping of device classes")
    p.add_argument(
        "--fabric-tiers",
        metavar="T1,T2,...",
        help="fabric tiers finest first, node labels tandem.io/fabric-<tier> (default leaf,spine)",
    )
    p.add_argument(
        "--jobs",
        choices=("gang", "gang-no-fabric", "per-pod"),
        default="gang",
        help="how job lines are placed: whole jobs (default) or a baseline",
    )
    p.add_argument("-o", "--output", type=Path, metavar="FILE", help="write here instead of stdout")
    p.set_defaults(func=_run, light=True)


def _run(args: argparse.Namespace) -> int:
    from tools.cli import plan

    return plan.run(args)
