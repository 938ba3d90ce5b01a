"""``tandem`` entry point. Each command module exposes ``register(subparsers)``; a command's
handler returns the process exit code. Errors a user can fix print one line, not a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from services.cli import (
    admission_cmd,
    chaos_cmd,
    demo,
    gpu_cmd,
    loadtest_cmd,
    nats_cmd,
    plan_cmd,
    schema_cmd,
    stack_cmd,
    topology_cmd,
)
from services.cli.errors import CliError
from services.runtime.logging import setup_logging

# Command modules, in help order. Each adds its own subcommands.
MODULES: list[ModuleType] = [
    stack_cmd,
    demo,
    schema_cmd,
    topology_cmd,
    gpu_cmd,
    admission_cmd,
    plan_cmd,
    nats_cmd,
    loadtest_cmd,
    chaos_cmd,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Joint GPU + RDMA NIC allocation")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in MODULES:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Command output goes to stdout; the libraries' logs go to stderr, errors only
    # (commands that run services, such as `up` and `demo`, set their own level).
    setup_logging(level="error", json=False)
    try:
        code: int = args.func(args)
    except CliError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
