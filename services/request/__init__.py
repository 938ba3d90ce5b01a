"""The one request resolver: what a user asked, with its device class's defaults applied and
every rule checked (:mod:`.resolve`). Pure: imports nothing but :mod:`schemas`."""

from services.request.resolve import (
    CLASS_DEFAULTED,
    WIRE_NAMES,
    Ask,
    Field,
    RequestError,
    Resolved,
    check,
    resolve,
)

__all__ = ["CLASS_DEFAULTED", "WIRE_NAMES", "Ask", "Field", "RequestError", "Resolved", "check", "resolve"]
