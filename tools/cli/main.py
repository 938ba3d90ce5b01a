"""``tandem`` entry point. Each command module exposes ``register(subparsers)``; a command's
handler returns the process exit code.

Fast and quiet by construction:

* Command modules import only the standard library at the top; each handler imports what it
  needs when it runs, so ``tandem --help`` and a usage error cost no more than argparse, and a
  command loads only its own dependencies (``bench/cli_startup.py`` measures it).
* Every failure is one line on stderr, ``tandem: <what went wrong> (<what to do>)``, and an
  exit code: 2 for bad usage or input, 1 for a command that did not succeed
  (:mod:`tools.cli.errors`), 130 for Ctrl-C. A closed output pipe (``tandem status |
  head``) ends the command quietly with 141, as a process killed by SIGPIPE would. An
  unexpected error is still one line (exit 1); ``tandem --debug`` shows its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

from tools.cli import (
    admission_cmd,
    chaos_cmd,
    demo_cmd,
    gpu_cmd,
    loadtest_cmd,
    nats_cmd,
    plan_cmd,
    schema_cmd,
    stack_cmd,
    topology_cmd,
)
from tools.cli.errors import FAILURE, USAGE, CliError, describe, one_line

# Command modules, in help order. Each adds its own subcommands.
MODULES: list[ModuleType] = [
    stack_cmd,
    demo_cmd,
    schema_cmd,
    topology_cmd,
    gpu_cmd,
    admission_cmd,
    plan_cmd,
    nats_cmd,
    loadtest_cmd,
    chaos_cmd,
]
BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for `yes | head`

EPILOG = """exit codes: 0 success, 1 the command did not succeed, 2 bad usage or input, 130 interrupted.
Commands that talk to a running system take --nats URL (default: $TANDEM_NATS_URL, else
nats://127.0.0.1:4222)."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (``tandem: ... (see `tandem X --help`)``, exit 2)."""

    def error(self, message: str) -> NoReturn:
        print(f"tandem: {one_line(message)} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(USAGE)


class _Version(argparse.Action):
    """``--version``: reads the installed distribution's metadata only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, *_: object, **__: object) -> NoReturn:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"tandem {version('tandem')}")
        except PackageNotFoundError:
            print("tandem (not installed: version unknown)")
        sys.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="tandem",
        description="Joint GPU + RDMA NIC allocation",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_Version)
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an unexpected error (for bug reports)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for module in MODULES:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "light", False):
        # Commands that run service code: the libraries' logs go to stderr, errors only
        # (commands that run services, such as `up` and `demo`, set their own level).
        # `light` commands load no code that logs, and skip structlog's import (a large part
        # of a light command's start-up: docs/benchmarks.md, "Measurements behind the code").
        from services.runtime.observe.logging import setup_logging

        setup_logging(level="error", json=False)
    try:
        code: int = args.func(args)
    except CliError as exc:
        return _fail(str(exc), exc.code)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _broken_pipe()
    except Exception as exc:
        known = describe(exc, nats_url=getattr(args, "nats", None) or "")
        if known is not None:
            return _fail(str(known), known.code)
        if args.debug:
            raise
        return _fail(
            f"unexpected error: {type(exc).__name__}: {one_line(str(exc))}",
            FAILURE,
            hint="a bug in Tandem; `tandem --debug ...` shows the traceback for a report",
        )
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return _broken_pipe()
    return code


def _fail(message: str, code: int, *, hint: str = "") -> int:
    # One line, whatever a library put in the message (YAML errors span several).
    print(f"tandem: {one_line(message)}" + (f" ({hint})" if hint else ""), file=sys.stderr)
    return code


def _broken_pipe() -> int:
    # The reader went away: say nothing, and keep Python from complaining about the buffered
    # output it can no longer flush at exit (the Python docs' recipe for SIGPIPE).
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
