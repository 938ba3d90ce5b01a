"""Where a running ``tandem up`` sends its traces, so that the CLI's spans join them unasked.

The CLI finds ``tandem up`` by its NATS URL alone, so ``tandem up`` leaves, while it runs and
exports, one small record per NATS port on this machine: ``up-<port>.json`` in
``<tmp>/tandem-<uid>`` (``<tmp>``: ``$TMPDIR`` or ``/tmp``), holding the OTLP endpoint and its
process id. A command that traces (submit, release) against a NATS URL on this machine reads
the record of that port, and exports there. What the user says still wins: an
``OTEL_EXPORTER_OTLP_ENDPOINT`` in the environment (empty: no export) or the settings file,
and ``OTEL_SDK_DISABLED=true`` (the SDK then makes no span at all). A record is believed only
when the user owns it and its writer still runs: one a killed ``tandem up`` left is ignored,
and replaced by the next ``tandem up`` on that port. :func:`choose_endpoint` and
:func:`record_name` decide; the functions below them read and write.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import tempfile
import urllib.parse
from collections.abc import Callable
from pathlib import Path

DEFAULT_NATS_PORT = 4222


def choose_endpoint(configured: str | None, *, published: Callable[[], str | None]) -> str | None:
    """The OTLP endpoint a command exports to, or None: the user's word first (``configured``,
    the settings' ``otlp_endpoint``: "" when the variable is set to nothing), else where the
    running ``tandem up`` exports (``published`` is asked only then)."""
    if configured is not None:
        return configured or None
    return published()


def record_name(nats_url: str) -> str | None:
    """The record's file name for a command pointed at ``nats_url``, or None when that is not
    one NATS server on this machine (``tandem up`` listens on 127.0.0.1 only)."""
    servers = [s.strip() for s in nats_url.split(",") if s.strip()]
    if len(servers) != 1:
        return None
    try:
        parts = urllib.parse.urlsplit(servers[0] if "://" in servers[0] else f"nats://{servers[0]}")
        port = parts.port or DEFAULT_NATS_PORT
    except ValueError:
        return None
    host = parts.hostname or ""
    if host != "localhost":
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return None
        except ValueError:
            return None
    return f"up-{port}.json"


def record_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"tandem-{os.getuid()}"


def publish(nats_url: str, otlp_endpoint: str | None) -> Path | None:
    """Record where ``tandem up`` at ``nats_url`` exports (``otlp_endpoint``; None: it does
    not, and an older record of that port goes). Returns the record's path, or None when there
    is none: nothing to say, or the directory cannot be written (the CLI then exports only
    when told to)."""
    name = record_name(nats_url)
    if name is None:
        return None
    folder = record_dir()
    path = folder / name
    if otlp_endpoint is None:
        withdraw(path)
        return None
    record = {"nats_url": nats_url, "otlp_endpoint": otlp_endpoint, "pid": os.getpid()}
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _ours(folder):
            return None
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.")  # whole or not at all: renamed
    except OSError:
        return None
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(record, out)
        os.replace(tmp, path)
    except OSError:
        withdraw(Path(tmp))
        return None
    return path


def withdraw(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


def published_endpoint(nats_url: str) -> str | None:
    """The OTLP endpoint the ``tandem up`` serving ``nats_url`` exports to, or None."""
    name = record_name(nats_url)
    if name is None:
        return None
    path = record_dir() / name
    try:
        if not (_ours(path.parent) and _ours(path)):
            return None
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    endpoint, pid = record.get("otlp_endpoint"), record.get("pid")
    if not isinstance(endpoint, str) or not endpoint or not isinstance(pid, int) or not _running(pid):
        return None
    return endpoint


def _ours(path: Path) -> bool:
    """Only the user's own files: another user could leave a record in a shared temp directory
    that sends this user's spans (request ids, pod names) to their collector."""
    return path.stat().st_uid == os.getuid()


def _running(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True
    except (OSError, OverflowError):  # ProcessLookupError: it has stopped
        return False
    return True
