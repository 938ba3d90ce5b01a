"""One run of ``tandem loadtest``, start to finish.

1. **Server.** The ``production`` profile (the default): NATS as the chart installs it —
   three JetStream servers, TLS, every connection through the auth callout, which starts
   here too (:mod:`tools.loadtest.production`); the servers must refuse a plain and an
   unauthenticated connection (reported). The ``dev`` profile: one embedded ``nats-server``
   (JetStream, private store, 127.0.0.1, any free port, no TLS, no auth). With a URL given,
   that server as it is (``dev``).
2. **Ceiling.** The JetStream ceiling of that server (:mod:`tools.loadtest.ceiling`), while
   nothing else runs on it, on a stream replicated as the run's streams are.
3. **Services** (clock ``t0`` starts here): the inventory and ``replicas`` allocators, each its
   own ``python -m services.<name> --config FILE`` process with its own ``TANDEM_INSTANCE``
   (:mod:`tools.loadtest.procs`); each must answer ``/readyz`` on its ops port. In the
   production profile each connects with its own token, and a real Prometheus starts
   scraping every component's ``/metrics`` at the chart's interval (:mod:`tools.loadtest.scrape`).
4. **Fleet.** ``python -m tools.loadtest.fleet`` for all nodes
   (:mod:`tools.loadtest.fleet`; production: a connection and a token per node); it says
   ``ready`` once every inventory is stored. Then the
   harness waits until inventory has registered every node (keys of KV ``tandem-nodes``).
5. **Ready.** A probe request pinned to the last node registered: ``ready_s`` = ``t0`` → its
   assignment, i.e. until the allocator knows the whole fleet and decides. The probe is then
   released; it is not part of the figures. With ``idle_s``, the CPU share of every process
   is then measured over that long with heartbeats only (``idle_cpu_pct``).
6. **Load** (:mod:`tools.loadtest.driver`), with KV snapshots checking the invariants
   (:mod:`tools.loadtest.invariants`) at a quarter, half and three quarters of the
   requests, and the ledger (:mod:`tools.loadtest.ledger`, read by the process
   :mod:`tools.loadtest.ledgerwatch`, started before the fleet) judging every revision of
   every node and request record; then a **drain** until everything is answered and freed
   (bounded), the ledger's counts, a final snapshot, what Prometheus scraped, and peak RSS
   and CPU per decision of every process (:mod:`tools.loadtest.meter`).
7. **Teardown**, whatever happened: fleet first, then allocators and inventory (SIGTERM, then
   SIGKILL after a grace period), then the server. Logs of the children stay in the run
   directory when the run failed (the error names them) or ``keep_logs`` is set.

A stage that fails raises :class:`~tools.loadtest.errors.LoadtestError` with one line that
says which stage, what was seen and which log to read.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.js.errors import BucketNotFoundError

from schemas import subjects
from services.runtime.errors import EmbeddedServerError
from services.runtime.nats.bus import Bus
from services.runtime.process.embedded import EmbeddedNats, free_ports
from services.runtime.process.tasks import Supervisor
from services.runtime.settings import Settings
from tools.loadtest import ceiling, invariants, ledgerwatch, meter, replicastats
from tools.loadtest.config import LoadConfig
from tools.loadtest.driver import LoadDriver, Req
from tools.loadtest.errors import LoadtestError
from tools.loadtest.events import FleetEvents
from tools.loadtest.faults import FaultKind, ServerFault
from tools.loadtest.ledger import LedgerCounts
from tools.loadtest.mix import (
    SHARED_CLASS,
    SHARED_DEVICE_CLASS,
    RequestStream,
    Workload,
    fleet_gpus,
    fleet_plan,
    probe_request,
)
from tools.loadtest.procs import Child, Children
from tools.loadtest.production import Production
from tools.loadtest.publisher import AsyncPublisher
from tools.loadtest.registration import auto_in_flight, lost_requests, wait_registered
from tools.loadtest.report import CeilingFigures, CpuFigures, Report, Security, longest_gap, percentiles
from tools.loadtest.scrape import Scraper

__all__ = ["Harness", "LoadConfig", "run_loadtest"]

Progress = Callable[[str], None]
SERVICE_READY_S = 60.0
CONNECT_S = 5.0
PROGRESS_EVERY_S = 5.0
SNAPSHOT_TIMEOUT_S = 60.0  # for the checker's answer to one snapshot in the middle of the run
LEDGER_TIMEOUT_S = ledgerwatch.FINISH_TIMEOUT_S + 10.0  # for the ledger's answer at the end


class Harness:
    def __init__(self, cfg: LoadConfig, settings: Settings, *, progress: Progress) -> None:
        self.cfg = cfg
        self.settings = settings
        self.progress = progress
        self.run_id = f"lt{uuid.uuid4().hex[:8]}"
        self.own_dir = cfg.log_dir is None
        self.run_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="tandem-loadtest-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.children = Children(self.run_dir)
        self.tasks = Supervisor("loadtest")
        self.server: EmbeddedNats | None = None
        self.prod: Production | None = None  # the production profile's servers, keys and tokens
        self.scraper: Scraper | None = None
        self._scraping: asyncio.Task[None] | None = None  # until Prometheus scrapes every target
        self.security = Security()
        self.bus: Bus | None = None
        self.violations = invariants.Violations()
        self.checker: Child | None = None  # takes the snapshots during the load
        self.ledger: Child | None = None  # follows every write (tools.loadtest.ledgerwatch)
        self._checker_turn = asyncio.Lock()
        self._checks: list[asyncio.Task[None]] = []  # the mid-run checks, awaited before the final one
        self.plan = fleet_plan(cfg.nodes)
        self.names = [spec.name for spec in self.plan]
        self.failed = True
        self.fleet_events: FleetEvents | None = None
        self._cpu_t0: dict[str, float | None] = {}
        self._t0 = 0.0

    # -- the run ----------------------------------------------------------------------------

    async def run(self) -> Report:
        try:
            report = await self._run()
            self.failed = False
            return report
        finally:
            await self._teardown()

    async def _run(self) -> Report:
        cfg = self.cfg
        url = cfg.nats_url or await self._start_server()
        bus = self.bus = await self._connect(url)
        self.progress(f"measuring the JetStream ceiling ({cfg.ceiling_msgs} messages)")
        try:
            ceil = await ceiling.measure(bus.nc, count=cfg.ceiling_msgs, replicas=self._replicas())
        except (nats.errors.TimeoutError, TimeoutError) as exc:
            raise LoadtestError(
                f"JetStream ceiling: the servers at {url} did not answer in time ({exc or 'timeout'}); "
                "give --ceiling-msgs 0 to run without it"
            ) from exc
        self.progress(f"JetStream ceiling: publish {ceil.publish_per_s}/s, pull+ack {ceil.pull_ack_per_s}/s")

        loop = asyncio.get_running_loop()
        t0 = self._t0 = time.perf_counter()
        self._cpu_t0 = self._cpu_now()  # nats and the harness already worked for the ceiling
        deadline = loop.time() + cfg.startup_timeout
        if cfg.start_services:
            await self._start_services(url)
            took = time.perf_counter() - t0
            self.progress(f"inventory + {cfg.replicas} allocator(s) ready after {took:.1f} s")
        await self._check_provisioned()
        await self._start_ledger(url, deadline=deadline)
        fleet = await self.children.spawn(
            "fleet",
            role="fleet",
            module="tools.loadtest.fleet",
            config=self._base_config(url, self._fleet_keys()),
            args=[
                *("--nodes", str(cfg.nodes), "--apply-ms", str(cfg.apply_ms)),
                *("--cleanup-fail-share", str(cfg.cleanup_fail_share)),
                *self._fleet_args(),
            ],
            stdout_pipe=True,
        )
        self.checker = await self.children.spawn(
            "checker",
            role="checker",
            module="tools.loadtest.checker",
            config=self._base_config(url, self._harness_keys()),
            stdin_pipe=True,
            stdout_pipe=True,
        )
        events = self.fleet_events = FleetEvents(fleet)
        self.tasks.spawn("fleet-stdout", events.read, restart=False)
        ready = await events.wait("ready", deadline=deadline, alive=self.children.check)
        self.progress(f"fleet: {cfg.nodes} inventories stored in {ready.get('seconds')} s")
        await self._wait_registered(deadline=deadline)
        self.progress(f"inventory registered {cfg.nodes} nodes after {time.perf_counter() - t0:.1f} s")

        publisher = AsyncPublisher(bus.acks, window=1024)
        self.tasks.spawn("publish", publisher.run)
        workload = Workload(pinned=cfg.pinned, shares=cfg.shares)
        gpus = fleet_gpus(self.plan)
        driver = LoadDriver(
            bus.nc,
            publisher,
            stream=RequestStream(seed=cfg.seed, run=self.run_id, nodes=self.names, workload=workload),
            fleet_gpus=gpus,
            util=cfg.util,
            requests=cfg.requests,
            rate=cfg.rate,
            max_in_flight=cfg.max_in_flight or auto_in_flight(gpus, workload),
            seed=cfg.seed,
            give_up=cfg.give_up_s,
        )
        await driver.observe()
        try:
            ready_s = await self._probe(driver, t0=t0, deadline=deadline)
            self.progress(f"allocator deciding {ready_s:.2f} s after the services started")
            await self._scraping_every_target()
            idle = await self._idle() if cfg.idle_s > 0 else CpuFigures()
            report = await self._load(driver, publisher, ceil=ceil, ready_s=ready_s)
            report.idle_cpu_pct = idle
            report.wall_s = round(time.perf_counter() - t0, 3)
            return report
        finally:
            await driver.close()

    async def _load(
        self, driver: LoadDriver, publisher: AsyncPublisher, *, ceil: ceiling.Ceiling, ready_s: float
    ) -> Report:
        cfg = self.cfg
        bus = self.bus
        assert bus is not None
        load = f"open loop, {driver.max_in_flight} in flight" if cfg.rate is None else f"{cfg.rate:g}/s"
        self.progress(f"load: {cfg.requests} requests, {load}, fleet kept at {cfg.util:.0%} of its GPUs")
        checkpoints = {max(1, cfg.requests * k // 4): self._snapshot_hook(f"snapshot-{k}") for k in (1, 2, 3)}
        fault = self._server_fault(checkpoints)
        self.tasks.spawn("progress", lambda: self._report_progress(driver), restart=False)
        cpu_load0 = self._cpu_now()  # per decision: the load and the drain, not the start-up
        await driver.run(checkpoints=checkpoints, alive=self.children.check)
        self.progress(f"all {cfg.requests} submitted; draining (up to {cfg.drain_s:g} s)")
        drained = await driver.drain(timeout=cfg.drain_s, alive=self.children.check)
        if not await publisher.flush(timeout=10.0):
            self.progress(f"warning: publishes still unacknowledged: {publisher.stats.last_error}")
        await self._finish_checks()
        ledger = await self._ledger_counts()
        placed = invariants.check(
            await invariants.snapshot(bus.js), self.violations, shares=invariants.LOADTEST_SHARES
        )
        self.children.check()
        self.children.sample_rss()
        report = self._report(driver, placed, ceil=ceil, ready_s=ready_s, drained=drained)
        report.ledger = ledger
        if fault is not None and fault.kind == "kill":
            report.nats_kill = fault.figures
        elif fault is not None:
            report.nats_partition = fault.figures
        ports = {c.name: c.ops_port for c in self.children.children if c.role == "allocator" and c.ops_port}
        counters = await replicastats.read_counters(ports)
        report.by_replica = replicastats.by_replica(replicastats.decided(driver.reqs.values()), counters)
        inventory = [c.ops_port for c in self.children.children if c.role == "inventory" and c.ops_port]
        report.nodes_lost = await replicastats.nodes_lost(inventory[0]) if inventory else None
        if self.scraper is not None:
            report.scrape = await self.scraper.read_targets(window_s=time.perf_counter() - self._t0)
        now = self._cpu_now()
        report.cpu_s = meter.cpu_figures(meter.since(now, self._cpu_t0))
        report.cpu_ms_per_decision, report.cpu_ms_per_decision_total = meter.per_decision(
            meter.since(now, cpu_load0), driver.first_outcomes
        )
        return report

    def _server_fault(self, checkpoints: dict[int, Callable[[], None]]) -> ServerFault | None:
        """With ``--kill-server-at`` or ``--partition-server-at``: a checkpoint that takes a
        server away and brings it back, in the background (:mod:`tools.loadtest.faults`),
        beside a snapshot due at the same submit."""
        cfg = self.cfg
        if self.prod is None or self.prod.cluster is None or self.bus is None:
            return None
        kind: FaultKind
        if cfg.kill_server_at is not None:
            share, kind, down_s = cfg.kill_server_at, "kill", cfg.kill_down_s
        elif cfg.partition_server_at is not None:
            share, kind, down_s = cfg.partition_server_at, "partition", cfg.partition_s
        else:
            return None
        fault = ServerFault(self.prod.cluster, self.bus, kind=kind, down_s=down_s, progress=self.progress)
        at = max(1, int(cfg.requests * share))
        snapshot = checkpoints.get(at)

        def strike() -> None:
            self._checks.append(
                self.tasks.spawn(f"nats-{kind}", lambda: fault.run(started=self._t0), restart=False)
            )
            if snapshot is not None:
                snapshot()

        checkpoints[at] = strike
        return fault

    async def _finish_checks(self) -> None:
        """Wait (bounded) for the mid-run checks still reading, so that every snapshot taken is
        counted and the final check does not compete with one for the server."""
        running = [t for t in self._checks if not t.done()]
        if not running:
            return
        _, stuck = await asyncio.wait(running, timeout=SNAPSHOT_TIMEOUT_S)
        if stuck:
            self.progress(f"warning: {len(stuck)} mid-run check(s) unanswered after {SNAPSHOT_TIMEOUT_S:g}s")

    async def _idle(self) -> CpuFigures:
        """CPU share of every process over ``idle_s`` of heartbeats only (no requests)."""
        self.progress(f"idle for {self.cfg.idle_s:g} s: heartbeats only")
        before = self._cpu_now()
        began = time.perf_counter()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.idle_s
        while loop.time() < deadline:
            self.children.check()
            await asyncio.sleep(min(0.5, max(0.0, deadline - loop.time())))
        took = time.perf_counter() - began
        after = self._cpu_now()
        pct: dict[str, float | None] = {}
        for key, used_before in before.items():
            used_after = after.get(key)
            if used_before is not None and used_after is not None:
                pct[key] = (used_after - used_before) / took * 100
        return meter.cpu_figures(pct)

    def _cpu_now(self) -> dict[str, float | None]:
        return meter.cpu_now(self.children, self._nats_pids())

    def _nats_pids(self) -> list[int]:
        if self.prod is not None:
            return self.prod.server_pids()
        pid = self.server.pid if self.server is not None else None
        return [pid] if pid is not None else []

    def _replicas(self) -> int:
        """How the run's streams are replicated: as the chart does in production."""
        return self.prod.replicas if self.prod is not None else self.settings.stream_replicas

    # -- stages -----------------------------------------------------------------------------

    async def _start_server(self) -> str:
        if self.cfg.profile == "production":
            return await self._start_production()
        self.server = EmbeddedNats()
        try:
            await asyncio.to_thread(self.server.start)
        except EmbeddedServerError as exc:
            raise LoadtestError(f"embedded nats-server: {str(exc).splitlines()[0]}") from exc
        self.progress(f"nats-server at {self.server.url}")
        return self.server.url

    async def _start_production(self) -> str:
        """Three servers with TLS and the callout, the callout itself, and the check that
        they refuse what they must (:mod:`tools.loadtest.production`)."""
        prod = self.prod = Production(
            self.run_dir, self.settings, isolated=self.cfg.partition_server_at is not None
        )
        url = await prod.start()
        self.progress(f"nats cluster of {len(prod.server_pids())} (TLS, auth callout) at {url}")
        await prod.start_callout(self.children, self._base_config(url), port=free_ports(1)[0])
        self.security = await prod.security()
        return url

    async def _start_scraper(self, targets: dict[str, int]) -> None:
        """Prometheus, started; the wait until it scrapes every target (its discovery takes up
        to 5 s) runs beside the fleet's start and is awaited before the load."""
        scraper = self.scraper = Scraper(self.run_dir, interval_s=self.cfg.scrape_interval_s)
        [port] = free_ports(1)
        await scraper.start(self.children, targets, port=port)
        self._scraping = asyncio.ensure_future(scraper.wait_ready())

    async def _scraping_every_target(self) -> None:
        if self._scraping is not None:
            await self._scraping
            names = ", ".join(self.scraper.names) if self.scraper is not None else ""
            self.progress(f"prometheus scraping {names} every {self.cfg.scrape_interval_s:g} s")

    def _harness_keys(self) -> dict[str, object]:
        """How the harness and its checker and ledger connect (production: a trusted user)."""
        return self.prod.harness() if self.prod is not None else {}

    def _fleet_keys(self) -> dict[str, object]:
        return self.prod.fleet() if self.prod is not None else {}

    def _fleet_args(self) -> list[str]:
        if self.prod is None:
            return []
        return ["--token-dir", str(self.prod.node_tokens(self.names))]

    async def _connect(self, url: str) -> Bus:
        settings = msgspec.structs.replace(
            self.settings, nats_url=url, service="loadtest", **self._harness_keys()
        )
        try:
            return await asyncio.wait_for(Bus.open(settings, provision_streams=False), CONNECT_S)
        except TimeoutError as exc:
            raise LoadtestError(f"cannot reach NATS at {url}: no connection within {CONNECT_S:g}s") from exc
        except (OSError, nats.errors.Error) as exc:
            raise LoadtestError(f"cannot reach NATS at {url}: {exc}") from exc

    def _base_config(self, url: str, keys: dict[str, object] | None = None) -> dict[str, object]:
        """A child's config file: the server, logging, and ``keys`` (who it is, the CA)."""
        s = self.settings
        return {
            "nats_url": url,
            "log_level": s.log_level,
            "log_json": True,
            "heartbeat_interval": s.heartbeat_interval,
            # Passed on only when set (TANDEM_NATS_PING_INTERVAL for the harness): each role's
            # own default otherwise (services.runtime.nats.connection).
            **({"nats_ping_interval": s.nats_ping_interval} if s.nats_ping_interval is not None else {}),
            **(keys or {}),
        }

    async def _start_services(self, url: str) -> None:
        s = self.settings
        ports = free_ports(1 + self.cfg.replicas)
        names = [("inventory", "inventory", "inventory-0")] + [
            ("allocator", f"allocator-{i}", f"allocator-{i}") for i in range(self.cfg.replicas)
        ]
        started: list[Child] = []
        for (role, name, instance), port in zip(names, ports, strict=True):
            config = {
                **self._base_config(url),
                "ops_port": port,
                "stream_replicas": self._replicas(),
                "node_policy": s.node_policy,
                "node_lost_after": s.node_lost_after,
                # The class of the harness's share requests, beside the configured ones.
                "device_classes": {**s.device_classes, SHARED_CLASS: SHARED_DEVICE_CLASS},
                **(self.prod.component(role) if self.prod is not None else {}),
            }
            child = await self.children.spawn(
                name, role=role, module=f"services.{role}", config=config, env={"TANDEM_INSTANCE": instance}
            )
            started.append(child)
            if self.prod is not None:  # one at a time, as tools/chaos does: see docs/benchmarks.md
                await self.children.wait_ready(child, timeout=SERVICE_READY_S)
        await asyncio.gather(*(self.children.wait_ready(c, timeout=SERVICE_READY_S) for c in started))
        if self.prod is not None:
            callout = [c for c in self.children.children if c.role == "callout"]
            targets = {c.name: c.ops_port for c in [*started, *callout] if c.ops_port is not None}
            await self._start_scraper(targets)

    async def _check_provisioned(self) -> None:
        """The buckets the fleet and the checks read exist (the services create them)."""
        assert self.bus is not None
        for bucket in (subjects.KV_NODES, subjects.KV_ALLOCS):
            try:
                await self.bus.js.key_value(bucket)
            except BucketNotFoundError as exc:
                raise LoadtestError(
                    f"no KV bucket {bucket} on the server: are inventory and the allocators running there?"
                ) from exc

    async def _wait_registered(self, *, deadline: float) -> None:
        assert self.bus is not None
        await wait_registered(
            self.bus.js,
            self.names,
            deadline=deadline,
            alive=self.children.check,
            why=f"after {self.cfg.startup_timeout:g}s (see --start-timeout; logs: {self.run_dir})",
        )

    async def _probe(self, driver: LoadDriver, *, t0: float, deadline: float) -> float:
        loop = asyncio.get_running_loop()
        probe = probe_request(run=self.run_id, node=self.names[-1])
        req: Req = driver.submit(probe, measured=False)
        while req.assigned is None:
            self.children.check()
            if loop.time() > deadline:
                why = "unschedulable" if req.failed else "no answer"
                raise LoadtestError(
                    f"the allocator placed no probe request on {self.names[-1]} within "
                    f"{self.cfg.startup_timeout:g}s ({why}; logs: {self.run_dir})"
                )
            await asyncio.sleep(0.01)
        driver.release(probe.request_id)
        return req.assigned - t0

    async def _start_ledger(self, url: str, *, deadline: float) -> None:
        """The ledger's reader (:mod:`tools.loadtest.ledgerwatch`), following before the
        fleet's first record is read and before any request: every write of the run is in it."""
        ledger = self.ledger = await self.children.spawn(
            "ledger",
            role="ledger",
            module="tools.loadtest.ledgerwatch",
            config=self._base_config(url, self._harness_keys()),
            stdin_pipe=True,
            stdout_pipe=True,
        )
        assert ledger.proc.stdout is not None
        loop = asyncio.get_running_loop()
        try:
            line = await asyncio.wait_for(ledger.proc.stdout.readline(), max(1.0, deadline - loop.time()))
        except TimeoutError as exc:
            raise LoadtestError(f"the ledger did not start following in time (log: {ledger.log})") from exc
        if not line:
            raise ledger.died()
        try:
            said = msgspec.json.decode(line, type=dict[str, Any])
        except msgspec.DecodeError as exc:
            raise LoadtestError(f"the ledger said {line[:200]!r} (log: {ledger.log})") from exc
        if said.get("event") != ledgerwatch.READY_EVENT:
            raise LoadtestError(f"the ledger said {line[:200]!r} (log: {ledger.log})")

    async def _ledger_counts(self) -> LedgerCounts:
        """The ledger's counts after the drain, with the fleet's: overlaps it refused at apply,
        cleanups it failed on purpose. A ledger that cannot answer is reported (``error``), the
        run goes on."""
        events = self.fleet_events
        fleet = {
            "overlap_at_apply": events.seen["overlap"] if events is not None else 0,
            "cleanup_failures_injected": events.seen["cleanup_failed"] if events is not None else 0,
        }
        ledger = self.ledger
        assert ledger is not None and ledger.proc.stdin is not None and ledger.proc.stdout is not None
        ledger.proc.stdin.write(ledgerwatch.FINISH_COMMAND + b"\n")
        await ledger.proc.stdin.drain()
        error = ""
        answer: ledgerwatch.LedgerAnswer | None = None
        try:
            line = await asyncio.wait_for(ledger.proc.stdout.readline(), LEDGER_TIMEOUT_S)
        except TimeoutError:
            error = f"no answer in {LEDGER_TIMEOUT_S:g}s (log: {ledger.log})"
        else:
            if not line:
                raise ledger.died()
            try:
                answer = msgspec.json.decode(line, type=ledgerwatch.LedgerAnswer)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                error = f"answered {line[:200]!r}: {exc}"
        if answer is None:
            answer = ledgerwatch.LedgerAnswer(counts=LedgerCounts(error=error))
        counts = msgspec.structs.replace(answer.counts, **fleet)
        if counts.error is not None:
            self.progress(f"warning: the ledger is incomplete: {counts.error}")
        if counts.revisions_missed:
            self.progress(
                f"warning: the ledger missed {counts.revisions_missed} node-record revisions "
                "(removed before it read them): it cannot vouch for those"
            )
        for example in answer.examples:
            self.progress(f"ledger: {example}")
        return counts

    def _snapshot_hook(self, name: str) -> Callable[[], None]:
        """A checkpoint hook: check the invariants on a KV snapshot, in the background, taken by
        the checker process (:mod:`tools.loadtest.checker`, which says why)."""

        async def take() -> None:
            checker = self.checker
            assert checker is not None and checker.proc.stdin is not None and checker.proc.stdout is not None
            async with self._checker_turn:  # one question at a time: answers come in order
                checker.proc.stdin.write(invariants.CHECKER_COMMAND + b"\n")
                await checker.proc.stdin.drain()
                try:
                    line = await asyncio.wait_for(checker.proc.stdout.readline(), SNAPSHOT_TIMEOUT_S)
                except TimeoutError as exc:
                    raise LoadtestError(
                        f"{name}: no answer from the checker in {SNAPSHOT_TIMEOUT_S:g}s (log: {checker.log})"
                    ) from exc
            if not line:
                raise checker.died()
            try:
                found = msgspec.json.decode(line, type=invariants.Found)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise LoadtestError(f"{name}: the checker answered {line[:200]!r}: {exc}") from exc
            if found.error is not None:
                self.progress(f"warning: {name} not checked: {found.error}")
            self.violations.add(found)

        def start() -> None:
            self._checks.append(self.tasks.spawn(name, take, restart=False))

        return start

    async def _report_progress(self, driver: LoadDriver) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            self.children.sample_rss()
            self.progress(
                f"  submitted {len(driver.reqs)}/{driver.total}, answered {driver.first_outcomes}, "
                f"GPUs held {driver.held_gpus / max(1, driver.fleet_gpus):.0%}, "
                f"being freed {driver.releasing_gpus / max(1, driver.fleet_gpus):.0%}, "
                f"pending {driver.pending_gpus / max(1, driver.fleet_gpus):.0%}, "
                f"in flight {driver.in_flight_gpus / max(1, driver.fleet_gpus):.0%}"
            )

    # -- result -----------------------------------------------------------------------------

    def _report(
        self,
        driver: LoadDriver,
        placed: dict[str, str],
        *,
        ceil: ceiling.Ceiling,
        ready_s: float,
        drained: bool,
    ) -> Report:
        cfg = self.cfg
        reqs = driver.reqs
        lost = lost_requests(reqs, placed)
        if lost:
            self.progress(f"lost: {', '.join(lost[:10])}{' ...' if len(lost) > 10 else ''}")
        for what, ids in (
            ("held on two nodes at once", self.violations.double_placed),
            ("assigned to two nodes, one after the other", driver.extra_placements),
        ):
            if ids:
                named = ", ".join(sorted(ids)[:10]) + (" ..." if len(ids) > 10 else "")
                self.progress(f"placed twice ({what}): {named}")
        assigned = sum(1 for rid, r in reqs.items() if r.assigned is not None or rid in placed)
        unschedulable = sum(
            1 for rid, r in reqs.items() if r.failed and r.assigned is None and rid not in placed
        )
        decided_first = [r for r in reqs.values() if r.assigned is not None and r.first == r.assigned]
        to_assigned = [(r.assigned - r.submitted) * 1000 for r in decided_first if r.assigned is not None]
        to_applied = [(r.applied - r.submitted) * 1000 for r in decided_first if r.applied is not None]
        decisions_per_s = None
        start, last = driver.started, driver.last_first
        if start is not None and last is not None and last > start:
            decisions_per_s = round(driver.first_outcomes / (last - start), 1)
        load_s = (driver.submit_done or driver.started or 0.0) - (driver.started or 0.0)
        report = Report(
            nodes=cfg.nodes,
            replicas=cfg.replicas,
            requests=cfg.requests,
            rate=cfg.rate,
            assigned=assigned,
            unschedulable=unschedulable,
            decisions_per_s=decisions_per_s,
            submit_to_assigned_ms=percentiles(to_assigned),
            submit_to_applied_ms=percentiles(to_applied),
            lost=len(lost),
            double_held=len(self.violations.double_held),
            jetstream_ceiling=CeilingFigures(ceil.publish_per_s, ceil.pull_ack_per_s),
            rss_mb=meter.rss(self.children, self._nats_pids()),
            ready_s=round(ready_s, 3),
            double_placed=len(self.violations.double_placed | driver.extra_placements),
            overcommitted=len(self.violations.overcommitted),
            shares=cfg.shares,
            cleanup_fail_share=cfg.cleanup_fail_share,
            shares_assigned=sum(1 for r in reqs.values() if r.shared and r.assigned is not None),
            released=sum(1 for r in reqs.values() if r.released is not None),
            freed=sum(1 for r in reqs.values() if r.freed is not None),
            rejected=sum(1 for r in reqs.values() if r.rejected),
            cancelled=driver.cancelled,
            recovered=driver.recovered,
            util_target=cfg.util,
            util_peak=round(driver.peak_held_gpus / max(1, driver.fleet_gpus), 3),
            util_mean=round(driver.util_sum / driver.util_samples, 3) if driver.util_samples else None,
            load_s=round(load_s, 3),
            arrival_wait_s=round(driver.arrival_wait_s, 3),
            drained=drained,
            snapshots=self.violations.snapshots,
            profile=cfg.profile,
            nats_servers=len(self._nats_pids()) or 1,
            stream_replicas=self._replicas(),
            security=self.security,
        )
        stall = longest_gap([r.first for r in reqs.values() if r.first is not None], start=start or 0.0)
        if stall is not None:
            report.longest_stall_s, report.longest_stall_from_s = stall
        return report

    # -- teardown ---------------------------------------------------------------------------

    async def _teardown(self) -> None:
        fleet = [c for c in self.children.children if c.role == "fleet"]
        services = [c for c in self.children.children if c.role != "fleet"]
        await self.children.stop(fleet, grace=10.0)
        if self.fleet_events is not None:
            with contextlib.suppress(TimeoutError):  # its last line, read before EOF
                await asyncio.wait_for(self.fleet_events.closed.wait(), 2.0)
            stats = self.fleet_events.events.get("stats")
            if stats is not None:
                counts = ", ".join(f"{k} {v}" for k, v in stats.items() if k != "event")
                self.progress(f"fleet: {counts}")
        await self.children.stop(services, grace=15.0)
        if self._scraping is not None:
            self._scraping.cancel()  # a failure of a run already failing is not reported twice
            await asyncio.gather(self._scraping, return_exceptions=True)
        await self.tasks.aclose()
        if self.bus is not None:
            with contextlib.suppress(Exception):
                await self.bus.close()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        if self.prod is not None:
            await self.prod.stop()
        if self.failed or self.cfg.keep_logs or not self.own_dir:
            self.progress(f"logs of the services and the fleet: {self.run_dir}")
        else:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def kill_now(self) -> None:
        """Last resort when the event loop is gone (a second Ctrl-C): SIGKILL everything."""
        self.children.kill_now()
        if self.server is not None:
            self.server.stop()
        if self.prod is not None:
            self.prod.kill_now()


async def run_loadtest(cfg: LoadConfig, settings: Settings, *, progress: Progress) -> Report:
    cfg.check()
    return await Harness(cfg, settings, progress=progress).run()
