"""What one run of ``tandem loadtest`` is asked to do (the CLI's flags, checked)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tools.loadtest.errors import LoadtestError
from tools.loadtest.scrape import CHART_INTERVAL_S

PROFILES = ("production", "dev")


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    nodes: int = 100
    replicas: int = 1
    requests: int = 1000
    rate: float | None = None  # None: open loop
    util: float = 0.85
    seed: int = 1
    max_in_flight: int | None = None  # None: 5 % of the fleet's GPUs in requests (8 to 1024)
    give_up_s: float = 5.0  # cancel requests pending this long (<= 0: never)
    pinned: float = 0.0
    shares: float = 0.0  # requests for a share of one GPU (mix.SHARED_CLASS)
    nats_url: str | None = None  # None: start an embedded nats-server
    start_services: bool = True  # False: inventory and allocators already run on nats_url
    drain_s: float = 60.0
    ceiling_msgs: int = 20_000
    apply_ms: float = 0.0
    cleanup_fail_share: float = 0.02  # releases whose first cleanup the fleet fails (then retries)
    idle_s: float = 0.0  # > 0: measure CPU shares over this long with heartbeats only
    start_timeout: float | None = None  # None: 60 s + 20 ms per node
    profile: str = "production"  # PROFILES: NATS as the chart installs it, or one plain server
    scrape_interval_s: float = CHART_INTERVAL_S  # production: Prometheus's scrape interval
    kill_server_at: float | None = None  # production: SIGKILL a server after this share of requests
    kill_down_s: float = 3.0  # ... and start it again after this long (tools.loadtest.faults)
    partition_server_at: float | None = None  # production: cut a server off after this share
    partition_s: float = 15.0  # ... and put it back after this long
    log_dir: str | None = None
    keep_logs: bool = False

    def check(self) -> None:
        """Raise :class:`LoadtestError` for the first bad value (one line, names the flag)."""
        problems = [
            (self.nodes < 1, f"--nodes must be at least 1, got {self.nodes}"),
            (self.replicas < 1, f"--replicas must be at least 1, got {self.replicas}"),
            (self.requests < 1, f"--requests must be at least 1, got {self.requests}"),
            (self.rate is not None and not self.rate > 0, f"--rate must be above 0, got {self.rate}"),
            (not 0 < self.util <= 1, f"--util must be in (0, 1], got {self.util}"),
            (
                self.max_in_flight is not None and self.max_in_flight < 1,
                f"--max-in-flight must be at least 1, got {self.max_in_flight}",
            ),
            (not 0 <= self.pinned <= 1, f"--pinned must be in [0, 1], got {self.pinned}"),
            (not 0 <= self.shares <= 1, f"--shares must be in [0, 1], got {self.shares}"),
            (self.drain_s < 0, f"--drain must not be negative, got {self.drain_s}"),
            (self.ceiling_msgs < 0, f"--ceiling-msgs must not be negative, got {self.ceiling_msgs}"),
            (self.apply_ms < 0, f"--apply-ms must not be negative, got {self.apply_ms}"),
            (
                not 0 <= self.cleanup_fail_share <= 1,
                f"--cleanup-fail-share must be in [0, 1], got {self.cleanup_fail_share}",
            ),
            (self.idle_s < 0, f"--idle must not be negative, got {self.idle_s}"),
            (not self.start_services and self.nats_url is None, "--no-services needs --nats URL"),
            (
                self.profile not in PROFILES,
                f"--profile must be one of {', '.join(PROFILES)}, got {self.profile!r}",
            ),
            (
                self.profile == "production" and self.nats_url is not None,
                "--nats URL runs on that server as it is: give --profile dev (the production "
                "profile starts its own servers)",
            ),
            (
                not self.scrape_interval_s > 0,
                f"--scrape-interval must be above 0, got {self.scrape_interval_s}",
            ),
            (
                self.kill_server_at is not None and not 0 < self.kill_server_at < 1,
                f"--kill-server-at must be in (0, 1), got {self.kill_server_at}",
            ),
            (
                self.kill_server_at is not None and self.profile != "production",
                "--kill-server-at needs the production profile (three servers)",
            ),
            (self.kill_down_s < 0, f"--kill-down must not be negative, got {self.kill_down_s}"),
            (
                self.partition_server_at is not None and not 0 < self.partition_server_at < 1,
                f"--partition-server-at must be in (0, 1), got {self.partition_server_at}",
            ),
            (
                self.partition_server_at is not None and self.profile != "production",
                "--partition-server-at needs the production profile (three servers)",
            ),
            (
                self.partition_server_at is not None and self.kill_server_at is not None,
                "--partition-server-at and --kill-server-at: one fault a run",
            ),
            (
                self.partition_server_at is not None and os.geteuid() != 0,
                "--partition-server-at needs root (it runs the servers in network namespaces)",
            ),
            (self.partition_s < 0, f"--partition-for must not be negative, got {self.partition_s}"),
        ]
        for bad, message in problems:
            if bad:
                raise LoadtestError(message)

    @property
    def startup_timeout(self) -> float:
        return self.start_timeout if self.start_timeout is not None else 60.0 + 0.02 * self.nodes
