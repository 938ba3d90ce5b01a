"""The CLI's parser: constants spelled out for speed agree with the schemas, every option says
what it is (with its unit), and building the parser loads no heavy library."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import get_args, get_type_hints

from schemas.messages import RequestRecord
from schemas.topology import SCOPES
from tools.cli import stack_cmd
from tools.cli.main import build_parser


def test_constants_spelled_out_for_speed_agree_with_the_schemas() -> None:
    assert tuple(SCOPES) == stack_cmd.SCOPES
    record_states = set(get_args(get_type_hints(RequestRecord)["state"]))
    # Every state a record can hold can be asked for with --state ("deciding" is what a claim
    # not yet committed shows as), and nothing else: "applied" is never written (the node
    # agent's Applied event lands in no record), so offering it would filter for nothing.
    assert record_states <= set(stack_cmd.STATES)
    assert set(stack_cmd.STATES) - record_states == set()


def _parsers(
    parser: argparse.ArgumentParser, path: str = "tandem"
) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _parsers(sub, f"{path} {name}")
    return found


def test_every_option_and_argument_has_help() -> None:
    missing = []
    parsers = _parsers(build_parser())
    assert len(parsers) > 20
    for path, parser in parsers:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
                continue
            if not action.help:
                missing.append(f"{path}: {'/'.join(action.option_strings) or action.dest}")
    assert missing == []


def test_options_that_take_time_say_seconds() -> None:
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if action.dest in ("timeout", "interval", "watch", "give_up", "drain", "idle", "event_interval"):
                if action.nargs == 0:
                    continue  # a flag (status --watch), not an amount
                assert "second" in (action.help or ""), f"{path} {action.option_strings}"


def test_help_imports_no_heavy_library() -> None:
    code = (
        "import sys\n"
        "from tools.cli.main import build_parser\n"
        "build_parser()\n"
        "heavy = [m for m in ('nats', 'msgspec', 'structlog', 'opentelemetry', 'kubernetes_asyncio',"
        " 'aiohttp', 'yaml', 'asyncio') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_chaos_components_spelled_in_the_cli_are_the_runners() -> None:
    from tools.chaos.victims import COMPONENTS
    from tools.cli.chaos_cmd import COMPONENTS as SPELLED

    assert SPELLED == COMPONENTS
