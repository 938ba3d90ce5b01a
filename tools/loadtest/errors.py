"""The load harness's one error type."""

from __future__ import annotations


class LoadtestError(Exception):
    """A run that cannot go on: a process that failed to start or died, a stage that timed
    out, bad input. The message is one line (the CLI prints ``tandem: <message>``) and names
    the log file to read when a child process is at fault."""
