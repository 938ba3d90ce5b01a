"""One chaos run: a replicated system under load, one SIGKILL a round, invariants after each.

Setup (the parts of :mod:`tools.loadtest`, reused):

1. **NATS**: a three-server JetStream cluster (:class:`EmbeddedNatsCluster`); every stream
   and bucket is created with ``stream_replicas: 3`` by the services.
2. **Services**: the inventory and ``replicas`` allocators, each its own
   ``python -m services.<name> --config FILE`` process (:class:`~tools.loadtest.procs.Children`)
   given all three server URLs, as the chart runs them; each must answer ``/readyz``.
3. **Fleet**: ``python -m tools.loadtest.fleet`` speaking for ``nodes`` simulated nodes;
   the run waits until the inventory has registered all of them.

Each round (:class:`~tools.chaos.victims.Schedule` picks the victim from the seed):

1. a :class:`~tools.loadtest.driver.LoadDriver` submits ``round_requests`` requests at
   ``rate`` per second, keeping the fleet at ``util`` with releases and giving up requests
   pending ``give_up_s`` (cancels), as ``tandem loadtest`` does;
2. part-way through, the victim is SIGKILLed — an allocator replica, the inventory, the fleet,
   or a NATS server (often the current leader of ``KV_tandem-allocs``, ``KV_tandem-requests``
   or the JetStream meta group) — stays down ``down_s`` and is started again (same name,
   config, instance and, for a server, store), and the run waits until it is ready again;
3. the load finishes; the driver waits for its answers (bounded); then the **verdict under
   load** (:mod:`tools.chaos.checker`): KV snapshots are taken until the system has
   settled or ``settle_s`` has passed (longer than the allocator's 30 s claim timeout plus
   ``ack_wait``), safety problems in any snapshot and settling problems in the last one are
   violations;
4. every request of the round still held or pending is released, the driver waits for the
   frees, and the **verdict after the drain**: also no allocation left in any node record and
   every request freed, cancelled or rejected.

At the end a last verdict reads the whole of both buckets (every request of the run, not
only those of one round). Teardown whatever happened: fleet, services, cluster; the run
directory (logs of every process, the killed ones kept as ``<name>.killed-r<round>.log``)
stays when the run failed, had violations, or ``keep_logs`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats

from services.runtime.errors import EmbeddedServerError
from services.runtime.nats.bus import Bus
from services.runtime.process.embedded import EmbeddedNatsCluster, free_ports
from services.runtime.process.tasks import Supervisor
from services.runtime.settings import Settings
from tools.chaos import checker
from tools.chaos.report import MAX_DETAILS, ChaosReport, RoundLog, Violation
from tools.chaos.victims import COMPONENTS, LEADER_STREAM, NATS_ANY, NATS_META_LEADER, Plan, Schedule
from tools.loadtest.driver import LoadDriver
from tools.loadtest.errors import LoadtestError
from tools.loadtest.events import FleetEvents
from tools.loadtest.mix import RequestStream, Workload, fleet_gpus, fleet_plan
from tools.loadtest.procs import Child, Children
from tools.loadtest.publisher import AsyncPublisher
from tools.loadtest.registration import auto_in_flight, wait_registered

Progress = Callable[[str], None]
SERVICE_READY_S = 90.0
FLEET_READY_S = 120.0
NATS_RESTART_S = 90.0
LEADER_LOOKUP_S = 15.0
CONNECT_S = 10.0
POLL_S = 0.5


@dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    rounds: int | None = None  # stop after this many rounds ...
    duration_s: float | None = None  # ... or start no round after this long
    seed: int = 1
    nodes: int = 24
    replicas: int = 2
    servers: int = 3
    round_requests: int = 120
    rate: float = 20.0
    util: float = 0.7
    give_up_s: float = 5.0
    down_s: tuple[float, float] = (0.5, 4.0)
    settle_s: float = 75.0
    # Shorter than the chart's 30 s so that a message a killed allocator held comes back
    # within a round; the code paths are the same.
    ack_wait: float = 10.0
    heartbeat_interval: float = 0.5
    node_lost_after: float = 3.0  # a fleet down longer than this has its nodes marked lost
    components: tuple[str, ...] = COMPONENTS
    log_dir: str | None = None
    keep_logs: bool = False

    def check(self) -> None:
        """Raise :class:`LoadtestError` for the first bad value (one line, names the flag)."""
        problems = [
            (
                (self.rounds is None) == (self.duration_s is None),
                "give exactly one of --rounds and --duration",
            ),
            (self.rounds is not None and self.rounds < 1, f"--rounds must be at least 1, got {self.rounds}"),
            (
                self.duration_s is not None and not self.duration_s > 0,
                f"--duration must be above 0, got {self.duration_s}",
            ),
            (self.nodes < 1, f"--nodes must be at least 1, got {self.nodes}"),
            (self.replicas < 1, f"--replicas must be at least 1, got {self.replicas}"),
            (self.round_requests < 1, f"--round-requests must be at least 1, got {self.round_requests}"),
            (not self.rate > 0, f"--rate must be above 0, got {self.rate}"),
            (not 0 < self.util <= 1, f"--util must be in (0, 1], got {self.util}"),
            (
                not 0 <= self.down_s[0] <= self.down_s[1],
                f"--down must be MIN,MAX with 0 <= MIN <= MAX, got {self.down_s}",
            ),
            (self.settle_s <= 0, f"--settle must be above 0, got {self.settle_s}"),
            (
                not set(self.components) <= set(COMPONENTS) or not self.components,
                f"--kill takes some of {', '.join(COMPONENTS)}",
            ),
        ]
        for bad, message in problems:
            if bad:
                raise LoadtestError(message)


@dataclass
class _Service:
    """How to start one process again: its role, module, config and environment."""

    name: str
    role: str
    module: str
    config: dict[str, object]
    env: dict[str, str]
    args: list[str]
    child: Child | None = None


class ChaosRunner:
    def __init__(self, cfg: ChaosConfig, settings: Settings, *, progress: Progress) -> None:
        self.cfg = cfg
        self.settings = settings
        self.progress = progress
        self.run_id = f"ch{uuid.uuid4().hex[:6]}"
        self.own_dir = cfg.log_dir is None
        self.run_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="tandem-chaos-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.children = Children(self.run_dir)
        self.tasks = Supervisor("chaos")
        self.cluster: EmbeddedNatsCluster | None = None
        self.bus: Bus | None = None
        self.publisher: AsyncPublisher | None = None
        self.plan = fleet_plan(cfg.nodes)
        self.names = [spec.name for spec in self.plan]
        self.gpus = fleet_gpus(self.plan)
        self.schedule = Schedule(
            cfg.seed, replicas=cfg.replicas, servers=cfg.servers, down_s=cfg.down_s, components=cfg.components
        )
        self.procs: dict[str, _Service] = {}
        self.fleet_events: FleetEvents | None = None
        self.violations: dict[tuple[str, str], Violation] = {}
        self.kills: Counter[str] = Counter()
        self.round_log: list[RoundLog] = []
        self.checks = 0
        self.records = 0
        self.requests = 0
        self.settle_max = 0.0
        self.failed = True

    # -- the run ----------------------------------------------------------------------------

    async def run(self) -> ChaosReport:
        try:
            report = await self._run()
            self.failed = report.violations > 0
            return report
        finally:
            await self._teardown()

    async def _run(self) -> ChaosReport:
        cfg = self.cfg
        t0 = time.monotonic()
        url = await self._start_cluster()
        self.bus = await self._connect(url)
        await self._start_services(url)
        await self._start_fleet()
        await wait_registered(
            self.bus.js,
            self.names,
            deadline=asyncio.get_running_loop().time() + FLEET_READY_S,
            alive=self.children.check,
            why=f"after {FLEET_READY_S:g}s (logs: {self.run_dir})",
        )
        self.progress(f"{cfg.nodes} nodes registered after {time.monotonic() - t0:.1f} s")
        publisher = self.publisher = AsyncPublisher(self.bus.acks, window=256)
        self.tasks.spawn("publish", publisher.run)
        began = time.monotonic()
        while self._more(began):
            await self._round(self.schedule.next())
        await self._final()
        return self._report(duration=time.monotonic() - t0)

    def _more(self, began: float) -> bool:
        if self.cfg.rounds is not None:
            return self.schedule.rounds < self.cfg.rounds
        assert self.cfg.duration_s is not None
        return time.monotonic() - began < self.cfg.duration_s

    async def _round(self, plan: Plan) -> None:
        cfg = self.cfg
        assert self.bus is not None and self.publisher is not None
        workload = Workload()
        driver = LoadDriver(
            self.bus.nc,
            self.publisher,
            stream=RequestStream(
                seed=cfg.seed * 100_003 + plan.round,
                run=f"{self.run_id}-r{plan.round:04d}",
                nodes=self.names,
                workload=workload,
            ),
            fleet_gpus=self.gpus,
            util=cfg.util,
            requests=cfg.round_requests,
            rate=cfg.rate,
            max_in_flight=auto_in_flight(self.gpus, workload),
            seed=cfg.seed + plan.round,
            give_up=cfg.give_up_s,
        )
        await driver.observe()
        found_before = len(self.violations)
        try:
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(driver.run(alive=self.children.check))
                    strike = group.create_task(
                        self._strike(plan, after=plan.at * cfg.round_requests / cfg.rate)
                    )
            except BaseExceptionGroup as group_error:  # the first failure, as one line
                raise group_error.exceptions[0] from None
            entry = strike.result()
            self.requests += len(driver.reqs)
            await driver.drain(timeout=cfg.settle_s, alive=self.children.check)
            settle = await self._verdict(plan.round, "load", driver.reqs.keys(), drained=False)
            driver.release_all()
            await driver.drain(timeout=cfg.settle_s, alive=self.children.check)
            settle += await self._verdict(plan.round, "drained", driver.reqs.keys(), drained=True)
        finally:
            await driver.close()
        entry.requests = len(driver.reqs)
        entry.placed = sum(1 for r in driver.reqs.values() if r.assigned is not None)
        entry.settle_s = round(settle, 2)
        entry.violations = len(self.violations) - found_before
        self.round_log.append(entry)
        self.progress(
            f"round {plan.round}: killed {entry.kind or 'nothing'} ({entry.victim}) for {entry.down_s:g} s, "
            f"back in {entry.back_s} s; {entry.requests} requests ({entry.placed} placed); "
            f"settled in {settle:.1f} s; "
            f"violations {entry.violations} (total {len(self.violations)})"
        )

    async def _final(self) -> None:
        """The whole buckets, once: every request of the run finished, every node empty."""
        assert self.bus is not None
        bus = self.bus
        await self._settle(0, "final", lambda: checker.read_all(bus.js), drained=True)

    # -- kills ------------------------------------------------------------------------------

    async def _strike(self, plan: Plan, *, after: float) -> RoundLog:
        await asyncio.sleep(after)
        entry = RoundLog(
            round=plan.round,
            planned=plan.kind,
            kind="",
            victim="",
            down_s=plan.down_s,
            requests=0,
            settle_s=0.0,
            violations=0,
        )
        if plan.component == "nats":
            await self._kill_server(plan, entry)
        else:
            await self._kill_process(plan, entry)
        if entry.kind:
            self.kills[entry.kind] += 1
        return entry

    async def _kill_process(self, plan: Plan, entry: RoundLog) -> None:
        name = f"allocator-{plan.index}" if plan.component == "allocator" else plan.component
        proc = self.procs[name]
        child = proc.child
        assert child is not None
        if not child.alive:
            raise child.died()
        child.stopping = True
        entry.pid = child.proc.pid
        with contextlib.suppress(ProcessLookupError):
            child.proc.send_signal(signal.SIGKILL)
        await child.proc.wait()
        entry.kind, entry.victim = plan.kind, name
        kept = child.log.with_name(f"{name}.killed-r{plan.round:04d}.log")
        with contextlib.suppress(OSError):
            child.log.rename(kept)
            child.log = kept
        await asyncio.sleep(plan.down_s)
        started = time.monotonic()
        await self._spawn(proc)
        entry.back_s = round(time.monotonic() - started, 2)

    async def _kill_server(self, plan: Plan, entry: RoundLog) -> None:
        cluster = self.cluster
        assert cluster is not None
        index, label = await self._server_for(plan)
        kind = plan.kind if index is not None else NATS_ANY
        if index is None:  # no leader could be found: any server will do (the log says so)
            index = plan.index if plan.index is not None else 0
            label = f"{cluster.server_names[index]} (no {plan.kind} found)"
        proc = cluster.members[index].proc
        entry.pid = proc.pid if proc is not None else None
        await asyncio.to_thread(cluster.kill, index)
        entry.kind, entry.victim = kind, label
        await asyncio.sleep(plan.down_s)
        started = time.monotonic()
        try:
            await asyncio.to_thread(cluster.restart, index, timeout=NATS_RESTART_S)
        except EmbeddedServerError as exc:
            raise LoadtestError(
                f"nats-server {cluster.server_names[index]} did not come back: {exc}"
            ) from exc
        entry.back_s = round(time.monotonic() - started, 2)

    async def _server_for(self, plan: Plan) -> tuple[int | None, str]:
        """The index of the server to kill for ``plan`` and how to name it."""
        cluster = self.cluster
        assert cluster is not None and self.bus is not None
        if plan.kind == NATS_ANY:
            assert plan.index is not None
            return plan.index, cluster.server_names[plan.index]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LEADER_LOOKUP_S
        while loop.time() < deadline:
            leader: str | None = None
            if plan.kind == NATS_META_LEADER:
                leader = await asyncio.to_thread(cluster.meta_leader)
                what = "the JetStream meta group"
            else:
                what = LEADER_STREAM[plan.kind]
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    info = (await self.bus.js.stream_info(what)).cluster
                    leader = info.leader if info is not None else None
            if leader and leader in cluster.server_names:
                return cluster.index_of(leader), f"{leader} (leader of {what})"
            await asyncio.sleep(POLL_S)
        return None, ""

    # -- verdicts ---------------------------------------------------------------------------

    async def _verdict(
        self, round_no: int, phase: str, request_ids: Iterable[str], *, drained: bool
    ) -> float:
        assert self.bus is not None and self.publisher is not None
        bus = self.bus
        if not await self.publisher.flush(timeout=self.cfg.settle_s):
            self.progress(f"warning: publishes still unacknowledged: {self.publisher.stats.last_error}")
        ids = list(request_ids)
        return await self._settle(round_no, phase, lambda: checker.read(bus.js, ids), drained=drained)

    async def _settle(
        self,
        round_no: int,
        phase: str,
        read: Callable[[], Awaitable[checker.KvState]],
        *,
        drained: bool,
    ) -> float:
        """Snapshots until nothing is left to settle or ``settle_s`` passed; returns the wait."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + self.cfg.settle_s
        pending: list[checker.Problem] = []
        last_error = ""
        while True:
            self.children.check()
            state: checker.KvState | None = None
            try:
                state = await asyncio.wait_for(read(), 30.0)
            except (nats.errors.Error, TimeoutError, OSError) as exc:  # an election: look again
                last_error = repr(exc)
            if state is not None:
                self.records += state.records
                for problem in checker.safety(state):
                    self._violation(round_no, phase, problem)
                pending = checker.settling(state, drained=drained)
                if not pending:
                    break
            if loop.time() > deadline:
                if state is None and not pending:
                    pending = [
                        checker.Problem(
                            "unreadable", "KV", f"no snapshot within {self.cfg.settle_s:g}s: {last_error}"
                        )
                    ]
                for problem in pending:
                    self._violation(round_no, phase, problem)
                break
            await asyncio.sleep(POLL_S)
        self.checks += 1
        took = loop.time() - began
        self.settle_max = max(self.settle_max, took)
        return took

    def _violation(self, round_no: int, phase: str, problem: checker.Problem) -> None:
        key = (problem.check, problem.subject)
        if key not in self.violations:
            self.violations[key] = Violation(
                round=round_no,
                phase=phase,
                check=problem.check,
                subject=problem.subject,
                detail=problem.detail,
            )
            self.progress(
                f"VIOLATION round {round_no} ({phase}): {problem.check} {problem.subject}: {problem.detail}"
            )

    # -- processes --------------------------------------------------------------------------

    async def _start_cluster(self) -> str:
        cluster = self.cluster = EmbeddedNatsCluster(
            size=self.cfg.servers, base_dir=str(self.run_dir / "nats")
        )
        try:
            await asyncio.to_thread(cluster.start)
        except EmbeddedServerError as exc:
            raise LoadtestError(f"embedded nats cluster: {str(exc).splitlines()[0]}") from exc
        self.progress(f"{self.cfg.servers} nats-servers at {cluster.url}")
        return cluster.url

    async def _connect(self, url: str) -> Bus:
        settings = msgspec.structs.replace(self.settings, nats_url=url, service="chaos")
        try:
            return await asyncio.wait_for(Bus.open(settings, provision_streams=False), CONNECT_S)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            raise LoadtestError(f"cannot reach NATS at {url}: {exc!r}") from exc

    def _base_config(self, url: str) -> dict[str, object]:
        return {
            "nats_url": url,
            "log_level": self.settings.log_level,
            "log_json": True,
            "heartbeat_interval": self.cfg.heartbeat_interval,
        }

    async def _start_services(self, url: str) -> None:
        s = self.settings
        cfg = self.cfg
        names = [("inventory", "inventory", "inventory-0")] + [
            ("allocator", f"allocator-{i}", f"allocator-{i}") for i in range(cfg.replicas)
        ]
        for (role, name, instance), port in zip(names, free_ports(len(names)), strict=True):
            config = {
                **self._base_config(url),
                "ops_port": port,
                "stream_replicas": cfg.servers,
                "node_policy": s.node_policy,
                "node_lost_after": cfg.node_lost_after,
                "ack_wait": cfg.ack_wait,
                "device_classes": s.device_classes,
            }
            env = {"TANDEM_INSTANCE": instance}
            self.procs[name] = _Service(name, role, f"services.{role}", config, env, [])
        # One at a time: the first provisions the streams, the others find them.
        for proc in self.procs.values():
            await self._spawn(proc)
        self.progress(f"inventory + {cfg.replicas} allocators ready")

    async def _start_fleet(self) -> None:
        assert self.cluster is not None
        args = ["--nodes", str(self.cfg.nodes)]
        self.procs["fleet"] = _Service(
            "fleet", "fleet", "tools.loadtest.fleet", self._base_config(self.cluster.url), {}, args
        )
        await self._spawn(self.procs["fleet"])

    async def _spawn(self, proc: _Service) -> None:
        """Start ``proc`` (again) and wait until it is ready."""
        fleet = proc.role == "fleet"
        child = proc.child = await self.children.spawn(
            proc.name,
            role=proc.role,
            module=proc.module,
            config=proc.config,
            args=proc.args,
            env=proc.env,
            stdout_pipe=fleet,
        )
        if not fleet:
            await self.children.wait_ready(child, timeout=SERVICE_READY_S)
            return
        events = self.fleet_events = FleetEvents(child)
        self.tasks.spawn(f"fleet-stdout-{child.proc.pid}", events.read, restart=False)
        loop = asyncio.get_running_loop()
        await events.wait("ready", deadline=loop.time() + FLEET_READY_S, alive=self.children.check)

    # -- result and teardown ----------------------------------------------------------------

    def _report(self, *, duration: float) -> ChaosReport:
        details = sorted(self.violations.values(), key=lambda v: (v.round or 10**9, v.check, v.subject))
        return ChaosReport(
            rounds=self.schedule.rounds,
            seed=self.cfg.seed,
            kills=dict(sorted(self.kills.items())),
            requests=self.requests,
            invariant_checks=self.checks,
            records_checked=self.records,
            violations=len(self.violations),
            violation_details=details[:MAX_DETAILS],
            duration_s=round(duration, 1),
            nodes=self.cfg.nodes,
            replicas=self.cfg.replicas,
            nats_servers=self.cfg.servers,
            settle_s_max=round(self.settle_max, 2),
            round_log=self.round_log,
        )

    async def _teardown(self) -> None:
        fleet = [c for c in self.children.children if c.role == "fleet"]
        services = [c for c in self.children.children if c.role != "fleet"]
        await self.children.stop(fleet, grace=10.0)
        await self.children.stop(services, grace=15.0)
        await self.tasks.aclose()
        if self.bus is not None:
            with contextlib.suppress(Exception):
                await self.bus.close()
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)
        if self.failed or self.cfg.keep_logs or not self.own_dir:
            self.progress(f"logs of the services, the fleet and the servers: {self.run_dir}")
        else:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def kill_now(self) -> None:
        """Last resort when the event loop is gone (a second Ctrl-C): SIGKILL everything."""
        self.children.kill_now()
        if self.cluster is not None:
            for i in range(len(self.cluster.members)):
                self.cluster.kill(i)


async def run_chaos(cfg: ChaosConfig, settings: Settings, *, progress: Progress) -> ChaosReport:
    cfg.check()
    return await ChaosRunner(cfg, settings, progress=progress).run()
