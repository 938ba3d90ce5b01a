"""The node agent's local state file: what it has applied, so a restarted agent can finish or
undo half-done work (DESIGN.md "Node side", issue "Crash recovery").

One JSON document (msgspec, human-readable for an operator) under ``state_dir``. Every change
is written atomically — temp file in the same directory, ``fsync``, ``rename`` over the old
file, ``fsync`` of the directory — so after a crash (SIGKILL, power loss) the file is either the
old or the new version, never a torn one. The applier writes an *intent* before each step that
changes the machine (``phase="applying"`` with the VF's original name/MAC/MTU recorded before it
is moved) and the outcome after it, which is what makes recovery possible: the file always
knows at least as much as the kernel's state can surprise it with.

``owners`` maps a device id (the VF's RDMA name) to the request that holds it: a cleanup for a
request that no longer owns a device never touches it (the "delete racing a new pod" bug of
CNI plugins), and an apply never takes a device another request still holds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

import msgspec

from schemas.messages import Assignment
from services.nodeagent.backends.base import BackendError

__all__ = ["AgentState", "NicState", "Record", "StateError", "StateFile"]

Phase = Literal["applying", "applied", "cleaning"]


class StateError(BackendError):
    """The state file cannot be read or written; the message names the path."""


class NicState(msgspec.Struct, kw_only=True):
    """One VF netdev handed to a pod, with what it looked like before (restored on cleanup)."""

    device: str
    host_name: str
    ifname: str
    netns: str
    ifindex: int
    orig_mac: str
    orig_mtu: int
    orig_up: bool = False
    pci_bus_id: str | None = None
    phase: Phase = "applying"


class Record(msgspec.Struct, kw_only=True):
    assignment: Assignment
    phase: Phase = "applying"
    netns: str = ""
    nics: dict[str, NicState] = {}
    updated_at: float = 0.0


class AgentState(msgspec.Struct, kw_only=True):
    version: int = 1
    records: dict[str, Record] = {}
    owners: dict[str, str] = {}
    released: dict[str, float] = {}
    """Request ids already cleaned up (with when), so a late or redelivered assignment for a
    released pod is refused instead of moving a VF into a dead pod. Bounded, oldest dropped."""

    def remember_released(self, request_id: str, *, now: float, keep: int = 1000) -> None:
        self.released[request_id] = now
        if len(self.released) > keep:
            for rid, _ in sorted(self.released.items(), key=lambda kv: kv[1])[: len(self.released) - keep]:
                del self.released[rid]


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AgentState)


class StateFile:
    """Load and atomically save :class:`AgentState` at ``path`` (blocking; call in a thread)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self) -> AgentState:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return AgentState()
        except OSError as exc:
            raise StateError(f"{self.path}: cannot read state file: {exc.strerror}") from exc
        try:
            return _decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise StateError(
                f"{self.path}: state file is not valid ({exc}); move it aside to start clean, "
                "after checking no VF is left in a pod namespace"
            ) from exc

    def save(self, state: AgentState) -> None:
        for rec in state.records.values():
            rec.updated_at = rec.updated_at or time.time()
        data = msgspec.json.format(_encoder.encode(state), indent=1)
        directory = self.path.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / f".{self.path.name}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)  # make the rename itself durable
            finally:
                os.close(dfd)
        except OSError as exc:
            raise StateError(f"{self.path}: cannot write state file: {exc.strerror}") from exc
