"""``tandem demo``: declared here, run by :mod:`tools.cli.demo` (imported only when the
command runs, so ``tandem --help`` does not load the services)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    d = sub.add_parser("demo", help="scripted end-to-end demo on simulated nodes (make demo)")
    d.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    import asyncio

    from tools.cli.demo import run_demo

    return asyncio.run(run_demo(args))
