"""Process lifecycle: logging + tracing set up once, graceful shutdown on SIGTERM/SIGINT.

``run(service_main, settings)`` runs ``service_main(stop)`` where ``stop`` is an
:class:`asyncio.Event` set on SIGTERM or SIGINT; the service finishes in-flight work, closes
its consumers and returns. Tracing is flushed on the way out. A stop during a NATS outage is
as clean as any other (exit 0): :meth:`Bus.close` does not wait on a server that is not there.

A service is ready (``/readyz``, ``tandem_ready``) once started and while its NATS connection
is up; one that can be up and connected yet unable to do its work (the inventory while its
node records cannot be written) says why through :class:`ReportsReadiness`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from services.runtime.errors import SettingsError
from services.runtime.nats.bus import Bus, ConnectError
from services.runtime.nats.consumerlag import watch_consumers
from services.runtime.observe.logging import setup_logging
from services.runtime.observe.looplag import watch_loop
from services.runtime.observe.metrics import service_registry
from services.runtime.observe.opsserver import OpsServer
from services.runtime.observe.tracing import setup_tracing, shutdown_tracing
from services.runtime.settings import Settings, load_settings

T = TypeVar("T")


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


# Collections stall the event loop and, under load with Python's defaults, took a large share
# of the allocator's CPU. A young collection is due once the tracked objects grew by the first
# threshold: at 700, each request's state (alive for the few hundred milliseconds of its
# commits, or kept with its record) was scanned again and again on its way to the oldest
# generation. With these thresholds the collections are far fewer for the same work and the
# open-loop throughput is higher (measured with tandem_gc_pause_seconds: docs/benchmarks.md,
# "Measurements behind the code"). Full collections stay ten times rarer than Python's default
# (100, not 10). The wire structs are untracked (``gc=False`` in schemas), and the services freeze their
# long-lived state after loading it; reference cycles are still collected, only later.
GC_THRESHOLDS = (20_000, 10, 100)


def run(main: Callable[[asyncio.Event], Awaitable[None]], settings: Settings) -> None:
    gc.set_threshold(*GC_THRESHOLDS)
    setup_logging(level=settings.log_level, json=settings.log_json, service=settings.service)
    setup_tracing(settings.service, otlp_endpoint=settings.otlp_endpoint)

    async def _runner() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        await main(stop)

    try:
        run_loop(_runner())
    finally:
        shutdown_tracing()


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop: its event loop and socket I/O are written in C, and a
    service's time goes mostly to the event loop and nats-py's socket traffic (measured with
    ``tandem loadtest``: docs/benchmarks.md). Plain asyncio where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:  # e.g. on Windows, where uvloop does not exist
        return asyncio.run(coro)
    return uvloop.run(coro)


class ConnectionClosedForGood(RuntimeError):
    """The service's NATS connection closed and will not come back: restart the process."""


async def _unless_stopped(step: Awaitable[T], stop: asyncio.Event) -> tuple[bool, T | None]:
    """``(True, step's result)``, or ``(False, None)`` when ``stop`` was set first (``step``
    is then cancelled)."""
    task = asyncio.ensure_future(step)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return False, None
    return True, task.result()


async def _until_stopped_or_closed(stop: asyncio.Event, bus: Bus) -> None:
    waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(bus.closed.wait())}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class Runnable(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@runtime_checkable
class ReportsReadiness(Protocol):
    """A service that can be connected yet not ready: ``unready()`` says why (None: ready)."""

    def unready(self) -> str | None: ...


def settings_from_argv(prog: str, service: str, argv: Sequence[str] | None) -> Settings | None:
    """``PROG [--config FILE]``: the settings of ``service``, or None after one line on stderr
    naming what was wrong (the caller exits 2): a bad config file fails at start, with its path."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--config", help="YAML/JSON config file (default: $TANDEM_CONFIG)")
    args = parser.parse_args(argv)
    try:
        return load_settings(service, config=args.config)
    except SettingsError as exc:
        print(f"{service}: {exc}", file=sys.stderr)
        return None


def service_main(
    service: str,
    build: Callable[[Bus, Settings], Awaitable[Runnable]],
    argv: Sequence[str] | None = None,
    *,
    provision_streams: bool = True,
) -> int:
    """``python -m services.<service> [--config FILE]``: load settings (a bad file fails here,
    naming the path), connect, provision (unless ``provision_streams`` is false: the node
    agent's NATS user may not create streams), build the service and run it until SIGTERM."""
    settings = settings_from_argv(f"python -m services.{service}", service, argv)
    if settings is None:
        return 2

    async def main(stop: asyncio.Event) -> None:
        await _run_service(service, settings, build, stop, provision_streams=provision_streams)

    try:
        run(main, settings)
    except SettingsError as exc:  # e.g. a certificate file that cannot be read
        print(f"{service}: {exc}", file=sys.stderr)
        return 2
    except ConnectError as exc:
        print(f"{service}: {exc}", file=sys.stderr)
        return 1
    except ConnectionClosedForGood as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


async def _run_service(
    service: str,
    settings: Settings,
    build: Callable[[Bus, Settings], Awaitable[Runnable]],
    stop: asyncio.Event,
    *,
    provision_streams: bool,
) -> None:
    """One service's life inside its event loop: the ops server, loop-lag and consumer-lag
    watches, the bus (connected, provisioned), the service built and started, then run until
    ``stop`` or until the connection closes for good (:class:`ConnectionClosedForGood`)."""
    started = asyncio.Event()
    bus: Bus | None = None
    svc: Runnable | None = None

    def unready() -> str | None:
        if not started.is_set():
            return "starting"
        if bus is None or not bus.nc.is_connected:
            return "NATS unreachable"
        return svc.unready() if isinstance(svc, ReportsReadiness) else None

    def ready() -> bool:
        return unready() is None

    def alive() -> bool:
        return bus is None or not bus.closed.is_set()

    ops = (
        await OpsServer(
            port=settings.ops_port,
            host=settings.ops_host,
            ready=ready,
            alive=alive,
            reason=unready,
            registry=service_registry(service, ready=ready),
        ).start()
        if settings.ops_port
        else None
    )
    lag = asyncio.get_running_loop().create_task(watch_loop(), name="loop-lag")
    consumers: asyncio.Task[None] | None = None
    try:
        # Every wait on the way up (NATS unreachable, streams not answering) gives way
        # to SIGTERM: Kubernetes must be able to stop a service that never came up.
        opened, bus = await _unless_stopped(Bus.open(settings, provision_streams=provision_streams), stop)
        if not opened or bus is None:
            return
        consumers = asyncio.get_running_loop().create_task(watch_consumers([bus]), name="consumer-lag")
        built, svc = await _unless_stopped(build(bus, settings), stop)
        if not built or svc is None or not (await _unless_stopped(svc.start(), stop))[0]:
            return
        started.set()
        await _until_stopped_or_closed(stop, bus)
        await svc.stop()
    finally:
        lag.cancel()  # held above and cancelled here: not a bare task
        if consumers is not None:
            consumers.cancel()
        if bus is not None:
            await bus.close()
        if ops is not None:
            await ops.stop()
    if bus.closed.is_set() and not stop.is_set():
        raise ConnectionClosedForGood(f"{service}: NATS connection closed for good; exiting")
