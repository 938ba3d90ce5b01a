"""One index of nodes, grouped: the structure each indexed device kind keeps one of.

A :class:`GroupIndex` holds the nodes grouped by a key (hardware id, free mask), the log of
every membership change, and per group how many of its nodes have devices out of service.
Signature states (:mod:`~services.allocator.core.signatures`) are built from the groups
once and then replay the log from their cursor, so a decision costs the changes since the
last one of its kind, not a walk over the fleet. Positions in the log are absolute: the
change at position ``p`` is ``log[p - base]``; compaction drops a prefix and moves ``base``,
and a rebuild (:meth:`reset`) starts the log over from where it ended, so a cursor never
points into a different history.

Three device kinds keep one (:mod:`~services.allocator.core.plugins`): whole GPUs (keyed by
slot bits), shares (the full mask, slot and share bits) and stacking (the share groups that
have a shared GPU).
"""

from __future__ import annotations

__all__ = ["GroupIndex", "GroupKey"]

GroupKey = tuple[int, int]  # (hardware id, free mask)


class GroupIndex:
    __slots__ = ("base", "groups", "impaired", "log")

    def __init__(self) -> None:
        self.groups: dict[GroupKey, dict[str, None]] = {}
        self.log: list[tuple[GroupKey, int]] = []
        self.base = 0  # the absolute position of log[0]
        self.impaired: dict[GroupKey, int] = {}  # group -> its nodes with devices out of service

    @property
    def end(self) -> int:
        """The absolute position after the last change."""
        return self.base + len(self.log)

    def reset(self) -> None:
        """Forget every group; the log goes on from where it ended (a rebuild follows)."""
        self.groups.clear()
        self.impaired.clear()
        self.base += len(self.log)
        self.log.clear()

    def put(self, name: str, gkey: GroupKey, *, impaired: bool) -> None:
        """Add a node while rebuilding (not logged: states built after it read the groups)."""
        members = self.groups.get(gkey)
        if members is None:
            members = self.groups[gkey] = {}
        members[name] = None
        if impaired:
            self.count_impaired(gkey, 1)

    def move(self, name: str, old: GroupKey | None, new: GroupKey | None) -> bool:
        """Move node ``name`` from group ``old`` to ``new``, logging both changes; returns
        whether it was in ``old`` (so the caller's counts follow). Hot path."""
        removed = False
        groups, log = self.groups, self.log
        if old is not None:
            members = groups.get(old)
            if members is not None and name in members:
                del members[name]
                if not members:
                    del groups[old]
                log.append((old, -1))
                removed = True
        if new is not None:
            members = groups.get(new)
            if members is None:
                members = groups[new] = {}
            members[name] = None
            log.append((new, 1))
        return removed

    def count_impaired(self, gkey: GroupKey, delta: int) -> None:
        left = self.impaired.get(gkey, 0) + delta
        if left:
            self.impaired[gkey] = left
        else:
            del self.impaired[gkey]

    def trim(self, new_base: int) -> None:
        """Drop the changes before absolute position ``new_base`` (no cursor needs them)."""
        del self.log[: new_base - self.base]
        self.base = new_base
