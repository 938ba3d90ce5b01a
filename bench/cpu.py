"""CPU time per program over an interval, read from ``/proc`` (Linux only).

A benchmark on a shared machine is often bound by CPU, not by any one program's latency: on a
2-core machine running a whole control plane, pods/s is roughly the two cores' seconds divided
by the CPU a pod costs everywhere. :class:`CpuMeter` says where that CPU goes: it reads each
process's user + system time (``/proc/<pid>/stat``, children already reaped included) at
:meth:`CpuMeter.start` and :meth:`CpuMeter.stop`, names it from its command line
(:func:`program_of`), and sums the differences by name, with the machine's busy share from
``/proc/stat`` beside them. :meth:`CpuUse.beyond` subtracts what each program spends when idle
(heartbeats, leases, watches kept open), so what remains is the cost of the work itself.

A process that exits between the two readings is missed for the time it spent after the first;
the benchmarks that use this keep their programs running across the interval. Only the calling
process and its descendants are counted: a shared machine runs other people's control planes
and Tandem processes under the same names, whose CPU is no cost of this benchmark's pods (it
still shows in the machine's busy share).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
# Control-plane and infrastructure programs, by the basename of argv[0].
BINARIES = {"etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kwok", "nats-server"}


def program_of(argv: list[str], *, me: bool = False) -> str | None:
    """The name CPU is booked under: a known binary, ``python -m services.<name>`` (or
    ``bench.<name>``), ``me`` for the calling process; ``None`` for anything else."""
    if me:
        return "bench (client + watches)"
    if not argv:
        return None
    base = os.path.basename(argv[0])
    if base in BINARIES:
        return base
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        if module.startswith(("services.", "bench.")):
            return module.removeprefix("services.")
    return None


def _proc_times() -> dict[int, tuple[str, float]]:
    """(program, CPU seconds) of every named process now running in the calling process's tree."""
    found: dict[int, tuple[str | None, int, float]] = {}  # pid → (program, parent, seconds)
    mine = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        name = program_of([a.decode(errors="replace") for a in argv if a], me=pid == mine)
        # Fields after the command name (which may hold spaces): ppid is 4, utime, stime 14 and 15.
        fields = stat[stat.rindex(")") + 2 :].split()
        found[pid] = (name, int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS)
    return {
        pid: (name, seconds)
        for pid, (name, _, seconds) in found.items()
        if name is not None and _descends(pid, mine, found)
    }


def _descends(pid: int, root: int, found: Mapping[int, tuple[str | None, int, float]]) -> bool:
    seen: set[int] = set()
    while pid != root:
        if pid in seen or pid not in found:
            return False
        seen.add(pid)
        pid = found[pid][1]
    return True


def _machine() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot."""
    first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in first[:8]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / TICKS, sum(values) / TICKS


@dataclass(frozen=True)
class CpuUse:
    """CPU seconds by program over ``wall`` seconds, and the machine's busy fraction of all
    its cores meanwhile."""

    seconds: dict[str, float]
    wall: float
    busy_share: float

    def cores(self) -> dict[str, float]:
        """Cores each program kept busy on average."""
        return {k: round(v / max(1e-9, self.wall), 3) for k, v in self.seconds.items()}

    def beyond(self, idle: CpuUse, *, per: int) -> dict[str, float]:
        """Milliseconds per unit of work (``per`` units) beyond what each program spends idle
        (``idle``'s rate over this interval), largest first: the cost that scales with work."""
        out: dict[str, float] = {}
        for name, spent in self.seconds.items():
            base = idle.seconds.get(name, 0.0) / max(1e-9, idle.wall) * self.wall
            out[name] = round(1000 * max(0.0, spent - base) / max(1, per), 2)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


class CpuMeter:
    def __init__(self) -> None:
        self._before: dict[int, tuple[str, float]] = {}
        self._machine: tuple[float, float] = (0.0, 0.0)
        self._t0 = 0.0

    def start(self) -> CpuMeter:
        self._before = _proc_times()
        self._machine = _machine()
        self._t0 = time.monotonic()
        return self

    def stop(self) -> CpuUse:
        """What each program spent since :meth:`start`."""
        after = _proc_times()
        busy1, total1 = _machine()
        wall = time.monotonic() - self._t0
        by_name: dict[str, float] = {}
        for pid, (name, seconds) in after.items():
            was = self._before.get(pid)
            spent = seconds - (was[1] if was and was[0] == name else 0.0)
            by_name[name] = by_name.get(name, 0.0) + spent
        busy0, total0 = self._machine
        return CpuUse(
            seconds={k: round(v, 2) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])},
            wall=wall,
            busy_share=round((busy1 - busy0) / max(1e-9, total1 - total0), 3),
        )


def measure(seconds: float) -> CpuUse:
    """What each program spends over the next ``seconds`` (the caller does nothing meanwhile)."""
    meter = CpuMeter().start()
    time.sleep(seconds)
    return meter.stop()
