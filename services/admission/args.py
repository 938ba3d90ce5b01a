"""The admission process's command-line options, apart from :mod:`.app` so that ``tandem
--help`` can list them without importing the Kubernetes client (tools/cli/main.py)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="settings file (YAML/JSON); default $TANDEM_CONFIG")
    p.add_argument("--no-webhook", dest="webhook", action="store_false", help="do not serve the webhook")
    p.add_argument("--no-bridge", dest="bridge", action="store_false", help="do not run the pod bridge")
    p.add_argument("--listen", default="0.0.0.0", help="webhook listen address (default 0.0.0.0)")
    p.add_argument(
        "--port", type=int, default=8443, metavar="PORT", help="webhook HTTPS TCP port (default 8443)"
    )
    p.add_argument("--tls-cert", default="/etc/tandem/tls/tls.crt", help="webhook certificate (PEM)")
    p.add_argument("--tls-key", default="/etc/tandem/tls/tls.key", help="webhook private key (PEM)")
    p.add_argument("--leader-elect", action="store_true", help="run the bridge only while holding the Lease")
    p.add_argument("--lease-namespace", default="default", help="namespace of the bridge's Lease")
    p.add_argument("--lease-name", default="tandem-bridge", help="name of the bridge's Lease")
    p.add_argument("--kubeconfig", help="kubeconfig when not running in a pod")
    p.add_argument(
        "--event-interval",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="min seconds between Event updates (default 30)",
    )
