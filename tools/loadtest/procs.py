"""Child processes of a run: started as the chart runs them, stopped whatever happens, measured.

Each service runs as ``python -m services.<name> --config <file>``: the config file holds the
keys the chart's ConfigMap holds (``nats_url``, ``ops_port``, ``log_level``...), so the child
loads its settings exactly as in a pod. The child's environment is the harness's minus every
``TANDEM_*`` variable (a ``TANDEM_NATS_URL`` left exported by ``tandem up`` would otherwise
override the file and send the child to another server) plus the per-child ones, e.g.
``TANDEM_INSTANCE`` — what the chart sets from the pod name.

Every child gets its own session (a Ctrl-C on the terminal reaches only the harness, which
then stops the children in order) and, on Linux, ``PR_SET_PDEATHSIG`` = SIGTERM, so even a
harness killed with SIGKILL takes its children with it. :meth:`Children.stop` sends SIGTERM
to all, waits ``grace`` seconds and SIGKILLs what is left; :meth:`Children.kill_now` is the
synchronous last resort for the CLI's ``finally``.

A child's stdout and stderr go to ``<run dir>/<name>.log`` (a pipe nobody reads would block
it); a child that dies during the run raises :class:`~tools.loadtest.errors.LoadtestError`
naming that file and quoting its last line. Peak RSS (``VmHWM``) and CPU time (``utime`` +
``stime``) come from ``/proc/<pid>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec

from tools.loadtest.errors import LoadtestError

_PR_SET_PDEATHSIG = 1
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def child_environment(overrides: Mapping[str, str]) -> dict[str, str]:
    """The harness's environment without ``TANDEM_*`` (see the module docstring), plus
    ``overrides``. Settings themselves are still read only by ``services.runtime.settings``,
    in the child."""
    inherited = dict(os.environ)  # noqa: TID251 (passed through to children, not read)
    env = {k: v for k, v in inherited.items() if not k.startswith("TANDEM_")}
    env.update(overrides)
    return env


def rss_mb(pid: int) -> float | None:
    """Peak resident set (``VmHWM``, else ``VmRSS``) of a live process, in MB."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    for key in ("VmHWM", "VmRSS"):
        if key in fields:
            kb = int(fields[key].split()[0])
            return round(kb / 1024, 1)
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a live process has used so far (``/proc/<pid>/stat``)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # after "pid (comm)": state is fields[0]
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / _CLOCK_TICKS


@dataclass
class Child:
    name: str
    role: str  # "allocator", "inventory", "fleet", "checker", "ledger", "callout", "prometheus"
    proc: asyncio.subprocess.Process
    log: Path
    ops_port: int | None = None
    stopping: bool = False
    peak_rss_mb: float | None = None
    cpu_s: float | None = None  # CPU used until the last sample

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def tail(self) -> str:
        """The last non-empty line the child wrote (its error, when it died)."""
        try:
            lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    def died(self) -> LoadtestError:
        why = self.tail() or "no output"
        return LoadtestError(f"{self.name} exited with code {self.proc.returncode}: {why} (log: {self.log})")

    def sample_rss(self) -> float | None:
        if self.alive:
            value = rss_mb(self.proc.pid)
            if value is not None:
                self.peak_rss_mb = max(self.peak_rss_mb or 0.0, value)
            self.cpu_s = cpu_seconds(self.proc.pid) or self.cpu_s
        return self.peak_rss_mb


@dataclass
class Children:
    run_dir: Path
    children: list[Child] = field(default_factory=list)

    async def spawn(
        self,
        name: str,
        *,
        role: str,
        module: str,
        config: dict[str, object],
        args: list[str] | None = None,
        env: Mapping[str, str] | None = None,
        stdout_pipe: bool = False,
        stdin_pipe: bool = False,
    ) -> Child:
        """``python -m <module> --config <run dir>/<name>.json [args]``; its stdout (and stdin)
        a pipe to this process when asked, else the log (and nothing)."""
        cfg = self.run_dir / f"{name}.json"
        cfg.write_bytes(msgspec.json.encode(config))
        port = config.get("ops_port")
        return await self.spawn_exec(
            name,
            role=role,
            argv=[sys.executable, "-m", module, "--config", str(cfg), *(args or [])],
            env=env,
            stdout_pipe=stdout_pipe,
            stdin_pipe=stdin_pipe,
            ops_port=port if isinstance(port, int) else None,
        )

    async def spawn_exec(
        self,
        name: str,
        *,
        role: str,
        argv: list[str],
        env: Mapping[str, str] | None = None,
        stdout_pipe: bool = False,
        stdin_pipe: bool = False,
        ops_port: int | None = None,
    ) -> Child:
        """Any program (``argv``), started, logged and stopped as the services are (a
        Prometheus, for one)."""
        log_path = self.run_dir / f"{name}.log"
        log = log_path.open("wb")
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin_pipe else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE if stdout_pipe else log,
                stderr=log,
                env=child_environment(env or {}),
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        except OSError as exc:
            raise LoadtestError(f"cannot start {name}: {exc}") from exc
        finally:
            log.close()
        child = Child(name, role, proc, log_path, ops_port=ops_port)
        self.children.append(child)
        return child

    def check(self) -> None:
        """Raise for the first child that exited while it should be running."""
        for child in self.children:
            if not child.alive and not child.stopping:
                raise child.died()

    def sample_rss(self) -> None:
        for child in self.children:
            child.sample_rss()

    async def wait_ready(self, child: Child, *, timeout: float) -> None:
        """Until the child's ``/readyz`` answers 200 (started and connected to NATS)."""
        assert child.ops_port is not None
        url = f"http://127.0.0.1:{child.ops_port}/readyz"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while True:
                if not child.alive:
                    raise child.died()
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(url) as resp:
                        if resp.status == 200:
                            return
                if loop.time() > deadline:
                    raise LoadtestError(
                        f"{child.name} not ready after {timeout:g}s"
                        f"{': ' + child.tail() if child.tail() else ''} (log: {child.log})"
                    )
                await asyncio.sleep(0.1)

    async def stop(self, children: list[Child] | None = None, *, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL whatever has not exited after ``grace`` seconds."""
        chosen = [c for c in (children or self.children) if c.alive]
        for child in chosen:
            child.stopping = True
            child.sample_rss()
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
        if not chosen:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(c.proc.wait() for c in chosen)), grace)
        for child in chosen:
            if child.alive:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
                await child.proc.wait()

    def kill_now(self) -> None:
        """Synchronous SIGKILL of every child still running (the CLI's last resort)."""
        for child in self.children:
            if child.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.proc.pid, signal.SIGKILL)
