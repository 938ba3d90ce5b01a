"""The core's one exception.

Exception tree (the core raises nothing else on bad input)::

    ValueError
     └── InvalidRequest      unknown device class, unknown scope, impossible pairing, empty request

A request that is valid but cannot be placed *now* is not an exception: ``Cluster.decide``
returns an :class:`~services.allocator.core.placement.Unschedulable` value with the reasons.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """The request can never be placed as written; the message names the field and the value."""
