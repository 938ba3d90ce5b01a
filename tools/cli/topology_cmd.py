"""``tandem topology``: import ``nvidia-smi topo -m`` output, list/show/validate topology files.

Thin I/O shell over :mod:`services.topology` (which is pure): it reads the files, prints, and
turns :class:`~services.topology.TopologyFileError` into :class:`CliError` (one line, exit 2).

- ``import --nvidia-smi FILE [--name N] [--gpu-model M] [--sockets N] [--strict] [-o OUT]
  [--format yaml|json]`` writes a topology file (stdout without ``-o``); notes about guesses
  and any pairs the tree cannot reproduce go to stderr; ``--strict`` makes the latter fatal.
- ``list`` prints the built-in topologies.
- ``show NAME|FILE [-o tree|json|yaml]`` draws the tree (or prints the topology as data).
- ``validate FILE`` loads and checks a file and prints a one-line summary.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from tools.cli.errors import CliError

# services.topology is imported by each handler: `tandem --help` must not load it.


def register(sub: Any) -> None:
    p = sub.add_parser("topology", help="node topology files: import, list, show, validate")
    tsub = p.add_subparsers(dest="topology_command", required=True, metavar="SUBCOMMAND")

    imp = tsub.add_parser("import", help="convert `nvidia-smi topo -m` output into a topology file")
    imp.add_argument(
        "--nvidia-smi",
        dest="nvidia_smi",
        type=Path,
        required=True,
        metavar="FILE",
        help="the output of `nvidia-smi topo -m`, saved as text",
    )
    imp.add_argument("--name", help="node name (default: derived from the file name)")
    imp.add_argument("--gpu-model", dest="gpu_model", default="unknown", help="GPU model string")
    imp.add_argument(
        "--sockets",
        type=int,
        default=None,
        help="spread the NUMA nodes over N sockets (default: one per NUMA node)",
    )
    imp.add_argument("--strict", action="store_true", help="fail if the tree cannot reproduce every relation")
    imp.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    imp.add_argument(
        "--format", choices=["yaml", "json"], default=None, help="default: from -o suffix, else yaml"
    )
    imp.set_defaults(func=_import, light=True)

    lst = tsub.add_parser("list", help="list the built-in topologies")
    lst.set_defaults(func=_list, light=True)

    show = tsub.add_parser(
        "show",
        help="draw a topology (built-in name, file, or with --live a node of the running system)",
    )
    show.add_argument(
        "source",
        metavar="NAME|FILE|NODE",
        help="a built-in topology name or a topology file; with --live, a node",
    )
    show.add_argument(
        "-o",
        "--output",
        "--format",
        choices=["tree", "json", "yaml", "dot", "svg"],
        default="tree",
        help="a drawn tree (default), the topology as JSON or YAML, or a picture: Graphviz DOT "
        "(`dot -Tpng`) or SVG (drawn by tandem itself)",
    )
    show.add_argument(
        "--live",
        action="store_true",
        help="the node's tree as the running system sees it now: each device free, held by which "
        "pod, unhealthy (with the reason) or cordoned",
    )
    show.add_argument(
        "--nats",
        default=None,
        metavar="URL",
        help="with --live: NATS server URL (default: $TANDEM_NATS_URL, else nats://127.0.0.1:4222)",
    )
    show.set_defaults(func=_show, light=True)

    val = tsub.add_parser("validate", help="check a topology file")
    val.add_argument("source", metavar="FILE", help="a topology file (YAML or JSON)")
    val.set_defaults(func=_validate, light=True)


def _default_name(path: Path) -> str:
    """A valid device-name-shaped node name from a file name (``p4d.txt`` → ``p4d``)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", path.stem).strip("-.") or "node"
    return name[:64]


def _import(args: argparse.Namespace) -> int:
    from services.topology import TopologyFileError, dump_topology, import_nvidia_smi, summary

    path: Path = args.nvidia_smi
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        raise CliError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if args.sockets is not None and args.sockets < 1:
        raise CliError("--sockets must be at least 1")
    try:
        result = import_nvidia_smi(
            text,
            name=args.name or _default_name(path),
            gpu_model=args.gpu_model,
            sockets=args.sockets,
            source=path,
        )
    except TopologyFileError as exc:  # not a matrix, or a --name the model rejects
        raise CliError(str(exc)) from exc
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    for mismatch in result.mismatches:
        print(f"warning: {path}: {mismatch}", file=sys.stderr)
    if result.mismatches and args.strict:
        raise CliError(
            f"{path}: {len(result.mismatches)} relation(s) cannot be represented by a tree (--strict)"
        )

    fmt = args.format
    if fmt is None:
        fmt = "json" if args.output is not None and args.output.suffix.lower() == ".json" else "yaml"
    text_out = dump_topology(result.topology, fmt=fmt)
    if args.output is None:
        sys.stdout.write(text_out)
    else:
        try:
            args.output.write_text(text_out)
        except OSError as exc:
            raise CliError(f"{args.output}: cannot write: {exc.strerror or exc}") from exc
        print(f"wrote {args.output}: {summary(result.topology)}", file=sys.stderr)
    return 0


def _list(args: argparse.Namespace) -> int:
    from services.topology import builtin_names, load_topology

    rows = []
    for name in builtin_names():
        topo = load_topology(name)
        desc = topo.description if len(topo.description) <= 90 else topo.description[:89] + "…"
        rows.append((name, str(len(topo.gpus())), str(len(topo.nics())), desc))
    header = ("NAME", "GPUS", "NICS", "DESCRIPTION")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3])
    return 0


def _load(source: str) -> Any:
    from services.topology import TopologyFileError, load_topology

    try:
        return load_topology(source)
    except TopologyFileError as exc:
        raise CliError(str(exc)) from exc
    except UnicodeDecodeError:
        raise CliError(f"{source}: not UTF-8 text", hint="give a topology YAML or JSON file") from None


def _show(args: argparse.Namespace) -> int:
    if args.live:
        import asyncio

        from tools.cli.devices import topology_live
        from tools.cli.session import with_client

        return asyncio.run(with_client(args, topology_live))
    from services.topology.picture import render_as

    sys.stdout.write(render_as(_load(args.source), args.output))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from services.topology import summary

    topo = _load(args.source)
    print(f"{args.source}: ok: {topo.name}: {summary(topo)}")
    return 0
