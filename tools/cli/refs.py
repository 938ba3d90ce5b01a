"""Names a command is given: ``NAMESPACE/NAME`` of a pod, a claim or a job, and request ids.

Checked before connecting, with Kubernetes' own rules (a namespace is a DNS label, a pod, claim
or job name a DNS subdomain), so a typo is one line and exit 2 rather than a request the bridge
could never have made. ``--pod``, ``--claim`` and ``--job`` take the same form; the error names
the flag that was given.
"""

from __future__ import annotations

import re

from schemas.messages import PodRef
from tools.cli.errors import CliError

# schemas.messages.RequestId: a pod's or claim's id, or a job's pod ``JOB/INDEX``.
REQUEST_ID = re.compile(r"^[A-Za-z0-9_=.-]{1,200}(/[0-9]{1,4})?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
WHAT = {"--pod": "pod", "--claim": "DeviceClaim", "--job": "job"}


def parse_ref(text: str, *, flag: str = "--pod") -> PodRef:
    """``NAMESPACE/NAME`` as given to ``flag`` (``--pod``, ``--claim``, ``--job``)."""
    namespace, sep, name = text.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise CliError(f"{flag} {text!r} is not NAMESPACE/NAME", hint=f"e.g. {flag} team-a/trainer-0")
    if len(namespace) > 63 or not DNS_LABEL.match(namespace):
        raise CliError(
            f"{flag} {text!r}: namespace {namespace!r} is not a Kubernetes namespace name",
            hint="lowercase letters, digits and '-', starting and ending with a letter or digit, at most 63",
        )
    if len(name) > 253 or not DNS_SUBDOMAIN.match(name):
        raise CliError(
            f"{flag} {text!r}: {name!r} is not a Kubernetes {WHAT.get(flag, 'object')} name",
            hint="lowercase letters, digits, '-' and '.', starting and ending with a letter or digit",
        )
    return PodRef(namespace=namespace, name=name)


def parse_pod(text: str) -> PodRef:
    return parse_ref(text, flag="--pod")


def check_request_id(rid: str) -> str:
    if not REQUEST_ID.match(rid):
        raise CliError(
            f"{rid!r} is not a request id",
            hint="ids are letters, digits and _=.- such as <pod uid>.1 (a job's pod: JOB/INDEX); "
            "`tandem requests` lists them",
        )
    return rid
