"""``tandem schema export DIR``: JSON Schema for every wire message and KV record."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("schema", help="wire schema tools")
    ssub = p.add_subparsers(dest="schema_command", required=True)
    e = ssub.add_parser("export", help="write one JSON Schema file per message type")
    e.add_argument("directory", type=Path, help="where to write the .json files (created if missing)")
    e.set_defaults(func=_export, light=True)


def _export(args: argparse.Namespace) -> int:
    from schemas.export import export

    for path in export(args.directory):
        print(path)
    return 0
