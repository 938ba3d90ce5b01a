"""The CLI's errors and how every failure becomes one line.

Exceptions the CLI raises or meets::

    CliError              bad usage or input the user can fix: exit 2
     └── CliFailure       the command was right but did not succeed (system down, no such
                          request, a cleanup not verified, a timeout): exit 1

Both print ``tandem: <what went wrong> (<what to do>)``. :func:`describe` turns the library
errors a command can meet (NATS unreachable, no responder, no Tandem streams, an unreadable
file) into a :class:`CliFailure`; anything else is a bug and still ends in one line (exit 1),
with the traceback only under ``tandem --debug``.
"""

from __future__ import annotations

import sys

USAGE = 2
FAILURE = 1


class CliError(Exception):
    """A user-facing failure: printed as ``tandem: <message> (<hint>)``; exit code 2."""

    code = USAGE

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class CliFailure(CliError):
    """The command was well-formed but did not succeed: exit code 1."""

    code = FAILURE


def one_line(text: str) -> str:
    """``text`` on one line (server and library messages sometimes span several)."""
    return " ".join(str(text).split())


def describe(exc: BaseException, *, nats_url: str = "") -> CliError | None:
    """A :class:`CliError` for a library error a command can meet, else None (a bug).

    NATS errors are matched only when nats-py is loaded already (it raised them), so this
    costs no import."""
    where = f" at {nats_url}" if nats_url else ""
    if "nats" in sys.modules:
        import nats.errors
        import nats.js.errors

        if isinstance(exc, nats.js.errors.NotFoundError | nats.js.errors.NoStreamResponseError):
            return CliFailure(
                f"the NATS server{where} has no Tandem streams or buckets",
                hint="start Tandem's services there, e.g. `tandem up`, or point --nats elsewhere",
            )
        if isinstance(exc, nats.js.errors.ServiceUnavailableError):
            return CliFailure(
                f"JetStream{where} is not available", hint="run nats-server with JetStream enabled: -js"
            )
        if isinstance(exc, nats.errors.AuthorizationError):
            return CliFailure(
                f"NATS{where} refused the credentials", hint="check the user and password in --nats"
            )
        if isinstance(exc, nats.errors.NoRespondersError):
            return CliFailure("nobody answered on NATS", hint="is the service or node running?")
        if isinstance(exc, nats.errors.NoServersError | nats.errors.ConnectionClosedError):
            return CliFailure(
                f"cannot reach NATS{where}", hint="is `tandem up` running? set --nats or $TANDEM_NATS_URL"
            )
        if isinstance(exc, nats.errors.TimeoutError):
            return CliFailure(f"NATS{where} did not answer in time", hint="is the server overloaded or down?")
        if isinstance(exc, nats.js.errors.APIError):
            return CliFailure(f"JetStream refused: {one_line(str(exc))}", hint="check the server's log")
        if isinstance(exc, nats.errors.Error):
            return CliFailure(f"NATS error: {one_line(str(exc))}", hint="check the server and --nats")
    if isinstance(exc, UnicodeDecodeError):
        return CliError("the input is not UTF-8 text", hint="give a text file")
    if isinstance(exc, ConnectionRefusedError):
        return CliFailure(f"cannot reach NATS{where}: connection refused", hint="is `tandem up` running?")
    if isinstance(exc, OSError):
        return CliFailure(one_line(str(exc)), hint="check the path or the network")
    if isinstance(exc, TimeoutError):
        return CliFailure("timed out waiting for an answer", hint="is the system up and not overloaded?")
    return None
