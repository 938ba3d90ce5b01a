"""``tandem admission serve``: run the admission webhook and the pod bridge in the foreground."""

from __future__ import annotations

import argparse
from typing import Any

from services.admission.args import add_arguments
from tools.cli.errors import CliError


def register(sub: Any) -> None:
    p = sub.add_parser("admission", help="Kubernetes edge: admission webhook and pod bridge")
    asub = p.add_subparsers(dest="admission_command", required=True)
    s = asub.add_parser("serve", help="serve the webhook and run the pod bridge (--no-webhook/--no-bridge)")
    add_arguments(s)
    s.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from services.admission.app import run
    from services.runtime.errors import SettingsError

    try:
        return run(args)
    except SettingsError as exc:
        raise CliError(str(exc)) from None
    except FileNotFoundError as exc:
        raise CliError(f"webhook certificate: {exc}") from None
