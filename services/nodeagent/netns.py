"""VF netdev hand-off: move an assigned VF into the pod's network namespace and back.

This is what sriov-cni does on ADD/DEL, done by the node agent so that it happens exactly for
the devices the allocator assigned, with the same lock and state file as the rest of the
agent. pyroute2's async API (:class:`pyroute2.AsyncIPRoute`) does the netlink work; a socket
inside the pod namespace is opened from a namespace *file descriptor* the agent opened itself,
so a namespace that vanished fails loudly instead of being silently re-created (pyroute2's
default ``O_CREAT``) or confused with the host's.

**How the applier finds the pod's namespace.** A :class:`NetnsResolver` maps an assignment to
a namespace file. Two are provided:

* :class:`NamedNetnsResolver` — ``/var/run/netns/<name>`` from a template over the pod
  (``{uid}``, ``{namespace}``, ``{name}``); what ``ip netns add`` creates, used by the tests
  and by runtimes that pin sandboxes there (CRI-O pins them under ``/var/run/netns``).
* :class:`PodCgroupResolver` — finds a process of the pod by its cgroup path (kubelet puts
  every pod's processes under ``.../pod<uid>/...``; the systemd driver writes the UID with
  ``_`` for ``-``) and uses ``/proc/<pid>/ns/net``. Works with any runtime; needs the host's
  ``/proc`` (``hostPID``).

Assignments reach the node before the pod's sandbox exists (the allocator decides before
kubelet starts the pod), so resolving waits up to ``wait`` seconds and then raises
:class:`NetnsNotReady` (an :class:`ApplyError`); the service answers it with a redelivery of
the assignment (``Retry``), not a failed ``Applied``.

**Apply** (per VF, under the VF's lock): record the original name/MAC/MTU/up-state in the
state file *before* touching the device; set it down; move it into the pod namespace; rename
it to the requested ``ifname``; set MTU, MAC, addresses; bring it up; record ``applied``.
Each step checks the current state first, so a repeated apply (message redelivered, agent
restarted mid-way) converges instead of failing.

**Cleanup** finds the VF in the pod namespace (by ifindex, then name) and moves it home; when
the pod namespace is already gone the kernel has returned a physical VF to the host
namespace by itself (under its pod name, or ``devN``), so it is looked up there by PCI
address, then by ifindex + name/MAC. It is then renamed back and its MAC, MTU and up-state
restored, and *verified* by reading it back. Anything that does not match is returned as a
problem (``"<device>: ..."``) — never silently passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol

from pyroute2 import AsyncIPRoute
from pyroute2.netlink.exceptions import NetlinkError

from schemas.messages import AssignedNic, Assignment
from services.nodeagent.backends.base import ApplyError
from services.nodeagent.reconcile import Action, reconcile
from services.nodeagent.state import AgentState, NicState, Record, StateFile
from services.runtime.observe.logging import get_logger

__all__ = [
    "NamedNetnsResolver",
    "NetnsNotReady",
    "NetnsResolver",
    "PodCgroupResolver",
    "VfApplier",
    "pod_cgroup_matches",
]

log = get_logger(__name__)

ENODEV = 19
EEXIST = 17


class NetnsNotReady(ApplyError):
    """The pod's network namespace does not exist (yet); retry later."""


class NetnsResolver(Protocol):
    async def resolve(self, assignment: Assignment) -> str:
        """Path of the pod's network namespace file; raise :class:`NetnsNotReady` if none."""
        ...


async def _wait_for(check: Callable[[], str | None], *, wait: float, interval: float) -> str | None:
    deadline = asyncio.get_running_loop().time() + wait
    while True:
        found = await asyncio.to_thread(check)
        if found is not None or asyncio.get_running_loop().time() >= deadline:
            return found
        await asyncio.sleep(interval)


class NamedNetnsResolver:
    """``<directory>/<template>`` — e.g. ``/var/run/netns/{uid}`` — waiting up to ``wait`` s."""

    def __init__(
        self, directory: str | Path = "/var/run/netns", *, template: str = "{uid}", wait: float = 0.0
    ) -> None:
        self.directory = Path(directory)
        self.template = template
        self.wait = wait

    def path_for(self, assignment: Assignment) -> Path:
        pod = assignment.pod
        return self.directory / self.template.format(uid=pod.uid, namespace=pod.namespace, name=pod.name)

    async def resolve(self, assignment: Assignment) -> str:
        path = self.path_for(assignment)
        found = await _wait_for(lambda: str(path) if path.exists() else None, wait=self.wait, interval=0.1)
        if found is None:
            raise NetnsNotReady(
                f"pod {assignment.pod.namespace}/{assignment.pod.name}: "
                f"network namespace {path} does not exist"
            )
        return found


def pod_cgroup_matches(cgroup_text: str, uid: str) -> bool:
    """Whether a ``/proc/<pid>/cgroup`` content places the process in pod ``uid`` (cgroupfs
    driver: ``pod<uid>``; systemd driver: ``pod<uid with _>.slice``)."""
    if not uid:
        return False
    forms = (f"pod{uid}", f"pod{uid.replace('-', '_')}")
    return any(
        re.search(rf"[/-]{re.escape(f)}(\.slice)?(/|$)", line)
        for f in forms
        for line in cgroup_text.splitlines()
    )


class PodCgroupResolver:
    """The pod's namespace via any of its processes: ``/proc/<pid>/ns/net``."""

    def __init__(self, proc: str | Path = "/proc", *, wait: float = 0.0) -> None:
        self.proc = Path(proc)
        self.wait = wait

    def _scan(self, uid: str) -> str | None:
        for entry in self.proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                text = (entry / "cgroup").read_text()
            except OSError:
                continue  # the process exited while scanning
            if pod_cgroup_matches(text, uid):
                return str(entry / "ns" / "net")
        return None

    async def resolve(self, assignment: Assignment) -> str:
        uid = assignment.pod.uid
        found = await _wait_for(lambda: self._scan(uid), wait=self.wait, interval=0.2)
        if found is None:
            raise NetnsNotReady(
                f"pod {assignment.pod.namespace}/{assignment.pod.name}: "
                f"no process of pod {uid} in {self.proc}"
            )
        return found


# ---------------------------------------------------------------------------------------------
# netlink helpers


async def _msgs(result: Any) -> list[Any]:
    """pyroute2's async calls return either a list or an async iterator; make it a list."""
    got = await result
    if isinstance(got, (list, tuple)):
        return list(got)
    return [m async for m in got]


def _attrs(msg: Any) -> dict[str, Any]:
    return {
        "index": int(msg["index"]),
        "name": msg.get("IFLA_IFNAME"),
        "mac": (msg.get("IFLA_ADDRESS") or "").lower(),
        "mtu": int(msg.get("IFLA_MTU") or 0),
        "up": bool(int(msg["flags"]) & 1),
    }


async def _link(ipr: AsyncIPRoute, **match: Any) -> dict[str, Any] | None:
    try:
        found = await _msgs(ipr.link("get", **match))
    except NetlinkError as exc:
        if exc.code == ENODEV:
            return None
        raise
    return _attrs(found[0]) if found else None


@contextlib.asynccontextmanager
async def _ns(path: str | None) -> AsyncIterator[AsyncIPRoute]:
    """An RTNL socket in the namespace at ``path`` (None: the agent's own, the host's)."""
    if path is None:
        async with AsyncIPRoute() as ipr:
            yield ipr
        return
    fd = await asyncio.to_thread(os.open, path, os.O_RDONLY)
    try:
        async with AsyncIPRoute(netns=fd, flags=0) as ipr:
            yield ipr
    finally:
        os.close(fd)


def _exists(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    os.close(fd)
    return True


def _ifname(nic: AssignedNic, position: int) -> str:
    return nic.ifname or f"net{position}"


class VfApplier:
    """The real :class:`~services.nodeagent.backends.base.Applier` for VF netdevs.

    ``checkpoint`` is called with a step name after every durable step; tests use it to kill
    the process between steps. Call :meth:`load` (or :meth:`recover`) once before use.
    """

    def __init__(
        self,
        state: StateFile,
        *,
        resolver: NetnsResolver,
        sysfs_root: str | Path = "/sys",
        checkpoint: Callable[[str], None] | None = None,
        move_pfs: bool = False,
    ) -> None:
        self.state_file = state
        self.move_pfs = move_pfs
        self.resolver = resolver
        self.sysfs_root = Path(sysfs_root)
        self.checkpoint = checkpoint or (lambda step: None)
        self.state = AgentState()
        self._locks: dict[str, asyncio.Lock] = {}
        self._save_lock = asyncio.Lock()
        self._host_fd: int | None = None

    async def load(self) -> AgentState:
        self.state = await asyncio.to_thread(self.state_file.load)
        return self.state

    def _moves(self, nic: AssignedNic) -> bool:
        """VFs with a netdev move into the pod; a PF only when ``move_pfs`` (a PF's netdev is
        usually the host's own link, and RDMA on a shared PF needs no netdev in the pod)."""
        return bool(nic.netdev) and (nic.vf is not None or self.move_pfs)

    def _lock(self, device: str) -> asyncio.Lock:
        return self._locks.setdefault(device, asyncio.Lock())

    async def _save(self, step: str) -> None:
        async with self._save_lock:
            await asyncio.to_thread(self.state_file.save, self.state)
        self.checkpoint(step)

    def _host_ns_fd(self) -> int:
        # Opened once: the agent's own namespace is the host's (hostNetwork DaemonSet).
        if self._host_fd is None:
            self._host_fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        return self._host_fd

    def _netdev_by_pci(self, bus_id: str | None) -> str | None:
        if not bus_id:
            return None
        try:
            names = sorted(p.name for p in (self.sysfs_root / "bus/pci/devices" / bus_id / "net").iterdir())
        except OSError:
            return None
        return names[0] if names else None

    # -- apply -------------------------------------------------------------------------------

    async def apply(self, assignment: Assignment) -> None:
        nics = [(i, n) for i, n in enumerate(assignment.nics) if self._moves(n)]
        if not nics:
            return  # nothing to move: PFs / shared RDMA devices go through the device plugin only
        # One request at a time (its apply and its release can race: separate consumers, very
        # short-lived pods); one device at a time across requests (the device locks below).
        async with self._lock(f"request:{assignment.request_id}"):
            await self._apply(assignment, nics)

    async def _apply(self, assignment: Assignment, nics: list[tuple[int, AssignedNic]]) -> None:
        rid = assignment.request_id
        if rid in self.state.released:
            raise ApplyError(f"{rid}: already released and cleaned up on this node; not applying again")
        known = self.state.records.get(rid)
        if known is not None and known.phase == "cleaning":
            # Released and not verified clean: the record holds the VFs' original state, and a
            # redelivered assignment must not overwrite it or move the VFs again.
            raise ApplyError(f"{rid}: released; its cleanup has not completed, not applying again")
        for _, nic in nics:
            owner = self.state.owners.get(nic.name)
            if owner is not None and owner != rid:
                raise ApplyError(f"{nic.name}: still held by {owner} (its cleanup has not finished)")
        netns = await self.resolver.resolve(assignment)
        rec = self.state.records.get(rid)
        if rec is None:
            rec = Record(assignment=assignment, phase="applying", netns=netns)
            self.state.records[rid] = rec
        rec.netns = netns
        for position, nic in nics:
            async with self._lock(nic.name):
                owner = self.state.owners.get(nic.name)
                if owner is not None and owner != rid:
                    raise ApplyError(f"{nic.name}: still held by {owner} (its cleanup has not finished)")
                await self._apply_nic(rec, nic, _ifname(nic, position), netns)
        rec.phase = "applied"
        await self._save("applied")

    async def _apply_nic(self, rec: Record, nic: AssignedNic, ifname: str, netns: str) -> None:
        assert nic.netdev is not None
        rid = rec.assignment.request_id
        st = rec.nics.get(nic.name)
        if st is not None and st.phase == "applied" and await self._in_pod_ok(st, nic):
            return
        async with _ns(None) as host:
            link = await _link(host, ifname=nic.netdev)
            if link is None and st is not None:
                link = await _link(host, index=st.ifindex)
                if link is not None and link["name"] not in {st.host_name, st.ifname}:
                    link = None  # the ifindex was reused by an unrelated device
            if link is not None:
                if st is None:
                    st = NicState(
                        device=nic.name,
                        host_name=nic.netdev,
                        ifname=ifname,
                        netns=netns,
                        ifindex=link["index"],
                        orig_mac=link["mac"],
                        orig_mtu=link["mtu"],
                        orig_up=link["up"],
                        pci_bus_id=nic.pci_bus_id,
                    )
                    rec.nics[nic.name] = st
                    self.state.owners[nic.name] = rid
                    await self._save("recorded")  # intent is durable before the device moves
                if link["up"]:
                    await host.link("set", index=link["index"], state="down")
                ns_fd = await asyncio.to_thread(os.open, netns, os.O_RDONLY)
                try:
                    await host.link("set", index=link["index"], net_ns_fd=ns_fd)
                finally:
                    os.close(ns_fd)
                self.checkpoint("moved")
        if st is None:
            raise ApplyError(f"{nic.name}: netdev {nic.netdev} is not in the host namespace")
        async with _ns(netns) as pod:
            link = await _link(pod, index=st.ifindex) or await _link(pod, ifname=ifname)
            if link is None:
                raise ApplyError(f"{nic.name}: netdev {nic.netdev} is neither in the host nor in {netns}")
            st.ifindex = link["index"]
            changes: dict[str, Any] = {}
            if link["name"] != ifname:
                changes["ifname"] = ifname
            if nic.mtu and link["mtu"] != nic.mtu:
                changes["mtu"] = nic.mtu
            if nic.mac and link["mac"] != nic.mac.lower():
                changes["address"] = nic.mac.lower()
            if changes:
                if link["up"]:
                    await pod.link("set", index=link["index"], state="down")
                await pod.link("set", index=link["index"], **changes)
            for cidr in nic.addresses:
                iface = ipaddress.ip_interface(cidr)
                try:
                    await pod.addr(
                        "add", index=link["index"], address=str(iface.ip), prefixlen=iface.network.prefixlen
                    )
                except NetlinkError as exc:
                    if exc.code != EEXIST:
                        raise
            await pod.link("set", index=link["index"], state="up")
        st.phase = "applied"
        await self._save("configured")

    async def _in_pod_ok(self, st: NicState, nic: AssignedNic) -> bool:
        if not _exists(st.netns):
            return False
        async with _ns(st.netns) as pod:
            link = await _link(pod, index=st.ifindex)
        return (
            link is not None
            and link["name"] == st.ifname
            and (not nic.mtu or link["mtu"] == nic.mtu)
            and (not nic.mac or link["mac"] == nic.mac.lower())
        )

    # -- cleanup -----------------------------------------------------------------------------

    async def cleanup(self, assignment: Assignment) -> list[str]:
        async with self._lock(f"request:{assignment.request_id}"):
            return await self._cleanup(assignment)

    async def _cleanup(self, assignment: Assignment) -> list[str]:
        rid = assignment.request_id
        rec = self.state.records.get(rid)
        problems: list[str] = []
        if rec is not None:
            rec.phase = "cleaning"
            await self._save("cleaning")
        for nic in assignment.nics:
            if not self._moves(nic):
                continue
            async with self._lock(nic.name):
                owner = self.state.owners.get(nic.name)
                if owner is not None and owner != rid:
                    # A newer assignment holds this VF now: a stale delete must not touch it.
                    log.info("cleanup_skips_reassigned_device", device=nic.name, request_id=rid, owner=owner)
                    continue
                st = rec.nics.get(nic.name) if rec is not None else None
                if st is None:
                    problems += await self._verify_home(nic)
                    continue
                found = await self._cleanup_nic(st)
                problems += found
                if not found:
                    assert rec is not None
                    del rec.nics[nic.name]
                    self.state.owners.pop(nic.name, None)
                    await self._save("restored")
        if not problems and (rec is None or not rec.nics):
            self.state.records.pop(rid, None)
            self.state.remember_released(rid, now=time.time())
            await self._save("cleaned")
        return problems

    async def _verify_home(self, nic: AssignedNic) -> list[str]:
        """Nothing recorded (never applied here, or already cleaned): the VF must be at home."""
        assert nic.netdev is not None
        async with _ns(None) as host:
            if await _link(host, ifname=nic.netdev) is not None:
                return []
        return [f"{nic.name}: netdev {nic.netdev} is not in the host namespace and no apply is recorded"]

    async def _cleanup_nic(self, st: NicState) -> list[str]:
        pod_alive = _exists(st.netns)
        if pod_alive:
            async with _ns(st.netns) as pod:
                link = await _link(pod, index=st.ifindex) or await _link(pod, ifname=st.ifname)
                if link is not None:
                    await pod.link("set", index=link["index"], state="down")
                    await pod.link("set", index=link["index"], net_ns_fd=self._host_ns_fd())
                    self.checkpoint("returned")
        async with _ns(None) as host:
            link = await self._find_home(host, st)
            if link is None:
                where = "exists" if pod_alive else "is gone"
                return [
                    f"{st.device}: netdev {st.host_name} is not back in the host namespace "
                    f"(pod namespace {st.netns} {where}; not found by PCI address, ifindex or name)"
                ]
            changes: dict[str, Any] = {}
            if link["name"] != st.host_name:
                if await _link(host, ifname=st.host_name) is not None:
                    return [f"{st.device}: cannot restore name {st.host_name}: another device holds it"]
                changes["ifname"] = st.host_name
            if link["mac"] != st.orig_mac:
                changes["address"] = st.orig_mac
            if link["mtu"] != st.orig_mtu:
                changes["mtu"] = st.orig_mtu
            if changes:
                if link["up"]:
                    await host.link("set", index=link["index"], state="down")
                await host.link("set", index=link["index"], **changes)
            if st.orig_up:
                await host.link("set", index=link["index"], state="up")
            after = await _link(host, index=link["index"])
        problems: list[str] = []
        if after is None:
            return [f"{st.device}: netdev {st.host_name} vanished while being restored"]
        for what, want, got in (
            ("name", st.host_name, after["name"]),
            ("MAC", st.orig_mac, after["mac"]),
            ("MTU", st.orig_mtu, after["mtu"]),
        ):
            if want != got:
                problems.append(f"{st.device}: {what} is {got}, expected {want} after restore")
        return problems

    async def _find_home(self, host: AsyncIPRoute, st: NicState) -> dict[str, Any] | None:
        by_pci = await asyncio.to_thread(self._netdev_by_pci, st.pci_bus_id)
        if by_pci is not None:
            return await _link(host, ifname=by_pci)
        link = await _link(host, index=st.ifindex)
        if link is not None and (
            link["name"] in {st.host_name, st.ifname} or re.fullmatch(r"dev\d+", link["name"] or "")
        ):
            return link
        return await _link(host, ifname=st.host_name)

    # -- crash recovery ----------------------------------------------------------------------

    async def recover(self, *, allocated: set[str] | None) -> list[tuple[Action, list[str]]]:
        """Load the state file and finish or undo what a previous run left half-done.

        ``allocated``: request ids the allocator still holds on this node (``None``: unknown).
        Returns each action with the problems it met (an empty list: done and verified)."""
        await self.load()
        actions = reconcile(self.state, allocated=allocated, netns_exists=_exists)
        out: list[tuple[Action, list[str]]] = []
        for action in actions:
            rec = self.state.records[action.request_id]
            log.info("recover", request_id=action.request_id, action=action.action, reason=action.reason)
            if action.action == "apply":
                try:
                    await self.apply(rec.assignment)
                    out.append((action, []))
                except ApplyError as exc:
                    out.append((action, [str(exc)]))
            elif action.action == "cleanup":
                out.append((action, await self.cleanup(rec.assignment)))
            else:
                out.append((action, []))
        return out

    async def close(self) -> None:
        if self._host_fd is not None:
            os.close(self._host_fd)
            self._host_fd = None
