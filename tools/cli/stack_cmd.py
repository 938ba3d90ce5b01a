"""``tandem up | submit | release | status | requests | get | explain | dlq | device``: run and
drive a Tandem system.

``tandem up`` starts an embedded nats-server on 127.0.0.1 (port 4222 when free, else any)
plus inventory, allocator and simulated node agents, and runs until Ctrl-C
(:mod:`tools.cli.up`). The other commands talk to any Tandem system through NATS
(``--nats`` or ``TANDEM_NATS_URL``; :mod:`tools.cli.session` runs each, the modules named
below hold them).

This module only declares the commands (standard library only, so ``tandem --help`` stays
fast); each handler imports its implementation when it runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Coroutine
from typing import Any

# The request states `tandem requests` shows (schemas.messages.RequestRecord); "cancelled" is a
# request released before it was placed. (No "applied": nothing writes it; the node agent's
# Applied event is not recorded in any record a command reads.)
STATES = ("pending", "deciding", "assigned", "releasing", "freed", "cancelled", "rejected")
# schemas.topology.SCOPES, spelled out so that building the parser imports no msgspec
# (tests/unit/test_cli_parser.py checks that the two agree).
SCOPES = ("pcie-switch", "pcie-root", "numa", "socket", "node")
READ_FORMATS = ("table", "json", "yaml")


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def count(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def port(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1-65535, got {value}")
    return value


def port_or_any(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1-65535 (0: any free one), got {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def _nats_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nats",
        default=None,
        metavar="URL",
        help="NATS server URL, comma-separated for a cluster (default: $TANDEM_NATS_URL, "
        "else nats://127.0.0.1:4222)",
    )


def _output_arg(p: argparse.ArgumentParser, formats: tuple[str, ...] = READ_FORMATS) -> None:
    p.add_argument(
        "-o",
        "--output",
        choices=formats,
        default="table",
        help=f"output format: {', '.join(formats)} (default: table)",
    )


def _policy_arg(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    p.add_argument(flag, choices=["required", "preferred"], help=help)


def _target_args(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument(
        "request_id",
        nargs="?",
        metavar="ID",
        help=f"the request or job to {verb} (`tandem requests` lists them); or --pod, --claim, --job",
    )
    p.add_argument(
        "--pod", metavar="NAMESPACE/NAME", help=f"{verb} the request of this pod instead of naming its id"
    )
    p.add_argument(
        "--claim",
        metavar="NAMESPACE/NAME",
        help=f"{verb} this DeviceClaim's request (a reservation is a claim: `submit --claim`)",
    )
    p.add_argument("--job", metavar="NAMESPACE/NAME", help=f"{verb} this whole job (`submit --job`)")


def _on_system(module: str, name: str, *, check: str | None = None) -> Callable[[argparse.Namespace], int]:
    """A handler that runs ``tools.cli.<module>.<name>(client, args)`` against the system
    (:func:`tools.cli.session.with_client`), after ``tools.cli.<check>(args)`` (``MODULE.NAME``):
    input that is wrong whatever the system says is refused before connecting. The modules are
    imported only when the command runs."""

    def handler(args: argparse.Namespace) -> int:
        from importlib import import_module

        from tools.cli.session import with_client

        checked = None
        if check is not None:
            where, _, fn = check.rpartition(".")
            checked = getattr(import_module(f"tools.cli.{where}"), fn)
        command = getattr(import_module(f"tools.cli.{module}"), name)
        return _run(with_client(args, command, check=checked))

    return handler


def _run(coro: Coroutine[Any, Any, int]) -> int:
    import asyncio

    return asyncio.run(coro)


def _up(args: argparse.Namespace) -> int:
    from tools.cli.up import run_up

    return run_up(args)


def _requests_args(p: argparse.ArgumentParser) -> None:
    _nats_arg(p)
    p.add_argument(
        "--state",
        action="append",
        choices=STATES,
        default=[],
        help="only requests in this state (repeatable)",
    )
    p.add_argument("--node", metavar="NODE", help="only requests placed on this node")
    p.add_argument("--namespace", "-n", metavar="NAMESPACE", help="only requests of pods in this namespace")
    _output_arg(p, ("table", "wide", "json", "yaml"))
    p.set_defaults(func=_on_system("request_rows", "requests"), light=True)


def register(sub: Any) -> None:
    """The commands, in help order."""
    for add in (_add_up, _add_submit, _add_release, _add_status):
        add(sub)
    for add in (_add_requests, _add_explain, _add_dlq, _add_device):
        add(sub)


def _add_up(sub: Any) -> None:
    up = sub.add_parser("up", help="run NATS + all services + simulated nodes until Ctrl-C")
    up.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="TOPOLOGY[:COUNT[:PREFIX]]",
        help="simulated nodes: a built-in topology name (`tandem topology list`) or a topology "
        "file, how many (default 1) and the node name prefix; repeatable; default: a mixed fleet",
    )
    up.add_argument(
        "--port",
        type=port_or_any,
        default=4222,
        help="NATS TCP port on 127.0.0.1 (default 4222; 0: any free one, printed at start); a taken "
        "port is refused, since commands pointed at it would reach whatever holds it",
    )
    up.add_argument(
        "--allocators", type=positive_int, default=1, help="allocator replicas to run (default 1)"
    )
    up.add_argument(
        "--ops-port",
        type=port_or_any,
        default=9470,
        help="first port of /metrics, /healthz and /readyz, one port per service in the order "
        "inventory, allocator-0.., nodeagents (default 9470; 0: any free ones; a taken one: any "
        "free one); printed at start",
    )
    up.add_argument(
        "--config",
        metavar="FILE",
        help="settings file, YAML or JSON (default: $TANDEM_CONFIG); its device_classes replace "
        "the ones served by default: default, shared and shared-mps of docs/sharing.md",
    )
    up.add_argument(
        "--jaeger",
        nargs="?",
        const="",
        default=None,
        metavar="BINARY",
        help="also start a Jaeger all-in-one (in memory) on 127.0.0.1, send every service's traces "
        "to it, and the spans of `tandem submit`/`release` to this system (no variable to set), and "
        "print its UI address; BINARY: the jaeger program (default: the one `make jaeger` "
        "built in this checkout, else `jaeger` on PATH)",
    )
    up.set_defaults(func=_up)


def _add_submit(sub: Any) -> None:
    s = sub.add_parser(
        "submit",
        help="request GPUs/NICs for a pod, a DeviceClaim (a reservation) or a whole job; say what happened",
        description="Request GPUs and RDMA NICs for a pod (--pod), for a DeviceClaim that holds them "
        "until released (--claim; with --expires-after/--expires-at it is a reservation), or for a "
        "whole job of --pods identical pods placed together or not at all (--job). Prints "
        "`assigned: ...`, `pending: <why>` or `rejected: <why>`; a request that no node of the "
        "cluster could ever hold is reported as such. Exit code 0 only when assigned.",
    )
    _nats_arg(s)
    what = s.add_mutually_exclusive_group()
    what.add_argument(
        "--pod", default=None, metavar="NAMESPACE/NAME", help="the pod (default: default/pod-<random>)"
    )
    what.add_argument(
        "--claim",
        metavar="NAMESPACE/NAME",
        help="a DeviceClaim instead of a pod: its devices are held until it is released "
        "(docs/sharing.md; for `tandem up`: in a cluster, a claim is a DeviceClaim object)",
    )
    what.add_argument(
        "--job",
        metavar="NAMESPACE/NAME",
        help="a whole job instead of a pod: --pods pods, each asking --gpus/--rdma, placed all or none",
    )
    _submit_asks(s)
    _submit_job_and_claim(s)
    s.add_argument(
        "--new",
        action="store_true",
        help="submit even when the --pod, --claim or --job already has a live request (default: "
        "refused, naming it; one pod, one request, as in Kubernetes)",
    )
    s.add_argument(
        "--wait",
        action="store_true",
        help="while pending, keep waiting and show progress until assigned (Ctrl-C stops waiting; "
        "the request stays pending)",
    )
    s.add_argument(
        "--timeout",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="seconds to wait for the allocator's first answer (default 10), or with --wait "
        "for the assignment (default: no limit)",
    )
    _output_arg(s, READ_FORMATS)
    s.set_defaults(func=_on_system("submit", "submit", check="submit.check_submit"), light=True)


def _submit_asks(s: argparse.ArgumentParser) -> None:
    """What each pod asks: the fields of a request (services.request checks them together)."""
    s.add_argument("--gpus", type=count, required=True, help="number of GPUs (0-64)")
    s.add_argument("--rdma", type=count, default=0, help="number of RDMA NICs (0-64; default 0)")
    s.add_argument("--scope", choices=SCOPES, help="alignment scope of GPU/NIC pairs (default: the class's)")
    _policy_arg(s, "--policy", "whether the scope is a must or a wish (default: the class's)")
    s.add_argument(
        "--pairing",
        choices=["per-gpu", "shared"],
        help="one NIC per GPU, or NICs shared (default: per-gpu when --rdma equals --gpus)",
    )
    s.add_argument(
        "--device-class", default="default", metavar="NAME", help="device class (default: default)"
    )
    s.add_argument(
        "--priority", type=int, default=0, help="higher is retried first while pending (default 0)"
    )
    s.add_argument(
        "--preemption",
        choices=["never", "lower-priority"],
        help="may it evict allocations of lower priority when nothing else makes room "
        "(default: the class's, never)",
    )
    s.add_argument(
        "--gpu-memory-mib",
        type=int,
        metavar="MIB",
        help="a share of each GPU instead of whole GPUs: this much memory (the class must allow "
        "sharing; docs/sharing.md)",
    )
    s.add_argument(
        "--gpu-cores-percent",
        type=int,
        metavar="PERCENT",
        help="a share of each GPU instead of whole GPUs: this much of its compute (1-100)",
    )
    s.add_argument(
        "--mig-profile",
        metavar="PROFILE",
        help="--gpus MIG instances of this profile (e.g. 1g.10gb) instead of whole GPUs",
    )
    s.add_argument("--mtu", type=int, metavar="BYTES", help="MTU of the pod's RDMA netdevs (576-9216)")


def _submit_job_and_claim(s: argparse.ArgumentParser) -> None:
    """The flags of a whole job (--job) and of a claim (--claim); workloads.check_flags refuses
    one given with the other kind."""
    s.add_argument("--pods", type=positive_int, metavar="N", help="with --job: how many pods (1-1024)")
    s.add_argument(
        "--fabric", metavar="TIER", help="with --job: keep the job within one block of this fabric tier"
    )
    _policy_arg(s, "--fabric-policy", "with --job: whether --fabric is a must or a wish (default: preferred)")
    _policy_arg(
        s, "--nvlink-domain", "with --job: all pods in one multi-node NVLink domain, as a must or a wish"
    )
    s.add_argument(
        "--shareable", action="store_true", help="with --claim: several pods may use the claim at once"
    )
    until = s.add_mutually_exclusive_group()
    until.add_argument(
        "--expires-after",
        metavar="DURATION",
        help="with --claim: a reservation, released this long after it is made if no pod uses it "
        "(90s, 30m, 2h, 1d, 1h30m)",
    )
    until.add_argument(
        "--expires-at",
        metavar="TIME",
        help="with --claim: a reservation, released at this RFC 3339 time (2026-12-02T06:00:00Z)",
    )


def _add_release(sub: Any) -> None:
    r = sub.add_parser(
        "release",
        help="release a request's devices and wait until cleanup is verified and they are free",
        description="Release a request (by id or --pod). Checks that it exists and finds its "
        "node; by default waits until the node verified the cleanup and the allocator freed the "
        "devices, printing each step.",
    )
    _nats_arg(r)
    _target_args(r, "release")
    r.add_argument(
        "--node",
        metavar="NODE",
        help="check that the request is on this node (an error if it is not; default: found)",
    )
    r.add_argument("--no-wait", dest="wait", action="store_false", help="return once the release is sent")
    r.add_argument(
        "--timeout",
        type=seconds,
        default=30.0,
        metavar="SECONDS",
        help="seconds to wait for the cleanup and the free (default 30)",
    )
    r.set_defaults(func=_on_system("release", "release", check="targets.check_target"), light=True)


def _add_status(sub: Any) -> None:
    st = sub.add_parser("status", help="nodes, devices and allocations as tables")
    _nats_arg(st)
    st.add_argument("--devices", action="store_true", help="also one row per device")
    st.add_argument("--watch", "-w", action="store_true", help="print again every --interval until Ctrl-C")
    st.add_argument(
        "--interval",
        type=seconds,
        default=2.0,
        metavar="SECONDS",
        help="seconds between two prints with --watch (default 2)",
    )
    _output_arg(st)
    st.set_defaults(func=_on_system("status", "status"), light=True)


def _add_requests(sub: Any) -> None:
    rq = sub.add_parser(
        "requests",
        help="every request: pod, state, node, devices, age, last reason",
        description="Every request known to the allocator, oldest first. States: " + ", ".join(STATES) + ".",
    )
    _requests_args(rq)

    g = sub.add_parser("get", help="kubectl-style alias: `tandem get requests`")
    gsub = g.add_subparsers(dest="get_what", required=True, metavar="WHAT")
    _requests_args(gsub.add_parser("requests", help="same as `tandem requests`"))


def _add_explain(sub: Any) -> None:
    e = sub.add_parser("explain", help="where a request stands and why (e.g. why a pod is pending)")
    _nats_arg(e)
    _target_args(e, "explain")
    _output_arg(e)
    e.set_defaults(func=_on_system("explain", "explain", check="targets.check_target"), light=True)


def _add_dlq(sub: Any) -> None:
    q = sub.add_parser("dlq", help="messages parked on the dead-letter subjects, with the error")
    _nats_arg(q)
    q.add_argument("--limit", type=positive_int, default=20, help="newest N messages (default 20)")
    _output_arg(q)
    q.set_defaults(func=_on_system("status", "dlq"), light=True)


def _add_device(sub: Any) -> None:
    d = sub.add_parser(
        "device",
        help="list devices, or fail / recover / cordon / uncordon one",
        description="`tandem device list [NODE]` shows every device and its state; "
        "`tandem device ACTION NODE DEVICE` sends a command to the node's agent.",
    )
    _nats_arg(d)
    d.add_argument("action", choices=["list", "fail", "recover", "cordon", "uncordon"], help="what to do")
    d.add_argument("node", nargs="?", metavar="NODE", help="the node (`tandem status` lists them)")
    d.add_argument("device", nargs="?", metavar="DEVICE", help="gpuN or an RDMA device name such as mlx5_0")
    d.add_argument("--reason", default="", help="why (kept with the device's health)")
    _output_arg(d)
    d.set_defaults(func=_on_system("devices", "device", check="devices.check_device"), light=True)
