"""A real Prometheus scraping every component of a run, as the chart's ServiceMonitor does.

The production profile starts Debian's ``prometheus`` (``make prometheus`` installs it) as one
more child of the run, with one static target per component's ops port (``/metrics``): every
allocator replica, the inventory and the auth callout, at the chart's interval
(``metrics.serviceMonitor.interval``, 30 s; ``--scrape-interval`` changes it). Its scrapes
cost the components what they cost them in a cluster, and Prometheus's own CPU is counted as
``prometheus``.

At the end :func:`read_targets` asks Prometheus's HTTP API what it saw: the health of each
target (``/api/v1/targets``) and how many scrapes it stored for it (``count_over_time(up[…])``,
one ``up`` sample per scrape).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

import aiohttp
import yaml

from tools.loadtest.errors import LoadtestError
from tools.loadtest.procs import Child, Children
from tools.loadtest.report import ScrapeFigures, Target

CHART_INTERVAL_S = 30.0  # deploy/helm/tandem/values.yaml metrics.serviceMonitor.interval
READY_S = 60.0
ASK_S = 10.0


def binary() -> str:
    found = shutil.which("prometheus")
    if not found:
        raise LoadtestError(
            "the production profile needs Prometheus (Debian's package: `sudo make prometheus`), "
            "or run --profile dev"
        )
    return found


def config(targets: dict[str, int], *, interval_s: float) -> str:
    """One job per component (its name), its ops port on 127.0.0.1."""
    every = f"{interval_s:g}s"
    doc = {
        "global": {"scrape_interval": every, "evaluation_interval": every, "scrape_timeout": every},
        "scrape_configs": [
            {
                "job_name": name,
                "honor_labels": True,  # as the chart's ServiceMonitor (honorLabels)
                "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
            }
            for name, port in targets.items()
        ],
    }
    return yaml.safe_dump(doc, sort_keys=False)


class Scraper:
    def __init__(self, run_dir: Path, *, interval_s: float) -> None:
        self.dir = run_dir / "prometheus"
        self.interval_s = interval_s
        self.port = 0
        self.names: list[str] = []  # the jobs it scrapes
        self.child: Child | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, children: Children, targets: dict[str, int], *, port: int) -> None:
        """Start Prometheus; :meth:`wait_ready` says when it scrapes every target."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port
        conf = self.dir / "prometheus.yml"
        conf.write_text(config(targets, interval_s=self.interval_s))
        self.child = await children.spawn_exec(
            "prometheus",
            role="prometheus",
            argv=[
                binary(),
                f"--config.file={conf}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
        )
        self.names = list(targets)

    async def wait_ready(self) -> None:
        """Until Prometheus is ready and has every target in its scrape pool (its discovery
        hands static targets over up to 5 s after the start): from then on each is scraped
        every interval."""
        assert self.child is not None
        targets = len(self.names)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_S
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while True:
                if not self.child.alive:
                    raise self.child.died()
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                    async with http.get(f"{self.url}/api/v1/targets") as resp:
                        if len((await resp.json())["data"]["activeTargets"]) >= targets:
                            return
                if loop.time() > deadline:
                    raise LoadtestError(
                        f"prometheus not scraping its {targets} targets after {READY_S:g}s "
                        f"(log: {self.child.log})"
                    )
                await asyncio.sleep(0.2)

    async def read_targets(self, *, window_s: float) -> ScrapeFigures:
        """Each job's health and the scrapes stored for it over the last ``window_s``."""
        figures = ScrapeFigures(interval_s=self.interval_s)
        span = f"{max(1, int(window_s) + 1)}s"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ASK_S)) as http:
                async with http.get(f"{self.url}/api/v1/targets") as resp:
                    active = (await resp.json())["data"]["activeTargets"]
                params = {"query": f"count_over_time(up[{span}])"}
                async with http.get(f"{self.url}/api/v1/query", params=params) as resp:
                    counts = (await resp.json())["data"]["result"]
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
            figures.error = f"cannot read its API: {exc!r}"
            return figures
        scrapes = {c["metric"].get("job", ""): int(float(c["value"][1])) for c in counts}
        for t in active:
            job = t["labels"].get("job", "")
            figures.targets[job] = Target(
                up=t.get("health") == "up", scrapes=scrapes.get(job, 0), last_error=t.get("lastError", "")
            )
        return figures
