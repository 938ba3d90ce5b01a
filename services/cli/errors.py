"""The CLI's one error type."""


class CliError(Exception):
    """A user-facing failure: printed as ``tandem: <message>`` with exit code 2."""
