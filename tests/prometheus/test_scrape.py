"""A real Prometheus scrapes a running ``tandem up`` (and the admission webhook's metrics):
every metric of docs/metrics.md is there with its documented type, and every query of the
chart's dashboard and every alert expression returns data once some load went through
(requests placed, one pending then placed, released, devices failed and cordoned, garbage
dead-lettered)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml
from prometheus_client import start_http_server

from schemas import subjects
from services.admission.webhook import Webhook
from services.runtime.observe.metrics import service_registry
from tests.prometheus.conftest import CHART_FILES, ROOT, Tools

TANDEM = str(Path(sys.executable).parent / "tandem")
SCRAPE_S = 1
# Alerts the load below makes true (the rest are checked for their signal, and fire in
# promtool's unit tests: 15 minutes pending, a lost node, a stuck cleanup need more than a test).
FIRED_BY_LOAD = {"TandemDevicesUnhealthy", "TandemDevicesCordoned", "TandemDeadLetters"}
# `<signal> <op> <threshold>`, optionally `or absent(<selector>)` (fires when nothing reports).
COMPARISON = re.compile(
    r"^(?P<signal>.*?)\s*(>|<|>=|<=|==|!=)\s*[0-9.e+-]+\s*(or\s+absent\((?P<absent>.*)\))?\s*$", re.S
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def documented() -> dict[str, str]:
    """Metric name → type, from the table of docs/metrics.md."""
    table = (ROOT / "docs" / "metrics.md").read_text()
    rows = re.findall(r"^\| `(tandem_[a-z_]+)` \| (counter|gauge|histogram) \|", table, re.M)
    assert len(rows) >= 25
    return dict(rows)


def get(url: str, **params: str) -> Any:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(url + query, timeout=10) as resp:
        return json.loads(resp.read())


def wait_for(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.3)
    pytest.fail(f"timed out waiting for {what}")


def tandem(nats_url: str, *args: str, ok: bool = True) -> str:
    out = subprocess.run([TANDEM, *args, "--nats", nats_url], capture_output=True, text=True, timeout=60)
    if ok:
        assert out.returncode == 0, f"tandem {' '.join(args)}: {out.stdout}{out.stderr}"
    return out.stdout


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, int]]]:
    log = tmp_path_factory.mktemp("up") / "up.log"
    nats_port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                TANDEM,
                "up",
                "--port",
                str(nats_port),
                "--ops-port",
                "0",
                "--node",
                "dgx-h100:1:h100",
                "--node",
                "pcie-4gpu-2nic:1:pcie",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    ports: dict[str, int] = {}

    def started() -> bool:
        assert proc.poll() is None, log.read_text()
        found = re.findall(r"^  ([\w-]+): http://127\.0\.0\.1:(\d+)/metrics", log.read_text(), re.M)
        ports.update({name: int(port) for name, port in found})
        return "nodeagents" in ports

    try:
        wait_for("tandem up", started, timeout=60)
        yield f"nats://127.0.0.1:{nats_port}", ports
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def admission_port() -> int:
    """The webhook's metrics, served the way the admission process serves them."""
    port = free_port()
    start_http_server(port, addr="127.0.0.1", registry=service_registry("admission", ready=lambda: True))
    hook = Webhook(device_classes={})
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u1",
            "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
            "operation": "CREATE",
            "object": {},
        },
    }
    assert hook.answer(json.dumps(review).encode())[0] == 200
    assert hook.answer(b"not json")[0] == 400
    return port


@pytest.fixture(scope="module")
def prometheus(
    prom_tools: Tools,
    up: tuple[str, dict[str, int]],
    admission_port: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    _, ports = up
    work = tmp_path_factory.mktemp("prometheus")
    targets = {**ports, "admission": admission_port}
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "scrape_configs": [
            {"job_name": name, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            for name, port in targets.items()
        ],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with (work / "prometheus.log").open("w") as out:
        proc = subprocess.Popen(
            [
                prom_tools.prometheus,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("prometheus ready", lambda: bool(urllib.request.urlopen(f"{url}/-/ready", timeout=2)))

        def all_up() -> bool:
            active = get(f"{url}/api/v1/targets")["data"]["activeTargets"]
            return sum(t["health"] == "up" for t in active) == len(targets)

        wait_for("every target up", all_up)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def dead_letter(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    await nc.jetstream().publish(subjects.ALLOC_REQUEST, b"\xc1 not msgpack")
    await nc.close()


@pytest.fixture(scope="module")
def loaded(up: tuple[str, dict[str, int]], prometheus: str) -> str:
    nats_url, _ = up
    first = tandem(nats_url, "submit", "--gpus", "8", "--rdma", "8", "--pod", "default/first")
    assert "\nassigned: " in first, first
    second = tandem(nats_url, "submit", "--gpus", "8", "--rdma", "8", "--pod", "default/second", ok=False)
    assert "\npending: " in second, second
    tandem(nats_url, "submit", "--gpus", "2", "--pod", "default/small")
    wait_for(
        "Prometheus to see the request pending",
        lambda: bool(query(prometheus, "max(tandem_allocator_pending_requests) >= 1")),
    )
    tandem(nats_url, "release", "--pod", "default/first")
    tandem(nats_url, "requests")
    explain = ("explain", "--pod", "default/second")
    wait_for("the pending request placed", lambda: "assigned" in tandem(nats_url, *explain))
    tandem(nats_url, "device", "fail", "pcie-0", "gpu3")
    tandem(nats_url, "device", "cordon", "pcie-0", "gpu2")
    asyncio.run(dead_letter(nats_url))
    after_load = (
        'sum(tandem_node_devices{node="pcie-0",kind="gpu",state="unhealthy"}) == 1',
        'sum(tandem_node_devices{node="pcie-0",kind="gpu",state="cordoned"}) == 1',
        'sum(tandem_dead_letters_total{service="allocator"}) >= 1',
        # The agent's own count of the change, scraped from the agent (the gauges above come
        # from the inventory, which can be scraped first).
        'sum(tandem_nodeagent_health_changes_total{healthy="false"}) >= 1',
        'sum(tandem_nodeagent_devices{node="pcie-0",kind="gpu",state="cordoned"}) == 1',
        "tandem_consumer_pending_messages",  # polled every 5 s by the services
    )
    wait_for(
        "Prometheus to have scraped the state after the load",
        lambda: all(query(prometheus, expr) for expr in after_load),
    )
    return prometheus


def query(url: str, expr: str) -> list[dict[str, Any]]:
    answer = get(f"{url}/api/v1/query", query=expr)
    assert answer["status"] == "success", (expr, answer)
    return list(answer["data"]["result"])


def test_every_documented_metric_is_scraped_with_its_type(loaded: str) -> None:
    metadata = get(f"{loaded}/api/v1/metadata")["data"]
    for name, kind in documented().items():
        series = f"{name}_count" if kind == "histogram" else name
        assert query(loaded, series), f"{name}: no series"
        # OpenMetrics (what prometheus_client's own server answers) names a counter without _total.
        types = {m["type"] for m in metadata.get(name, []) or metadata.get(name.removesuffix("_total"), [])}
        assert types == {kind}, f"{name}: documented {kind}, scraped {types or 'no metadata'}"


def test_state_gauges_match_what_was_done(loaded: str) -> None:
    def value(expr: str) -> float:
        result = query(loaded, expr)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    assert value('max(tandem_inventory_nodes{status="ready"})') == 2
    assert value('sum(tandem_node_devices{node="pcie-0",kind="gpu",state="unhealthy"})') == 1
    assert value('sum(tandem_node_devices{node="pcie-0",kind="gpu",state="cordoned"})') == 1
    assert value('sum(tandem_node_devices{node="h100-0",kind="gpu",state="allocated"})') == 8
    # The same states as each node's agent knows them, scraped from the agents' port.
    assert value('sum(tandem_nodeagent_devices{node="pcie-0",kind="gpu",state="unhealthy"})') == 1
    assert value('sum(tandem_nodeagent_devices{node="pcie-0",kind="gpu",state="cordoned"})') == 1
    assert value('sum(tandem_nodeagent_devices{node="h100-0",kind="gpu",state="allocated"})') == 8
    assert value('sum(tandem_nodeagent_devices{node="h100-0",kind="nic"})') == value(
        'sum(tandem_node_devices{node="h100-0",kind="nic"})'
    )
    assert value("sum(tandem_allocator_pending_age_at_placement_seconds_count)") == 1
    assert value("sum(tandem_nodeagent_submit_to_applied_seconds_count)") >= 3
    assert value('sum(tandem_dead_letters_total{service="allocator"})') >= 1


def test_every_dashboard_query_returns_data(loaded: str) -> None:
    """Each panel's query, with the dashboard's variables at "All" (Grafana sends ``.*``),
    returns data; each is scoped to the chosen release (namespace), so two releases in one
    Prometheus do not add up."""
    dashboard = json.loads((CHART_FILES / "dashboard.json").read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "namespace", "node"}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 20
    unscoped = [e for e in exprs if e.count("tandem_") != e.count('namespace=~"$namespace"')]
    assert unscoped == [], f"queries not scoped to the namespace variable: {unscoped}"
    empty = [e for e in exprs if not query(loaded, e.replace("$namespace", ".*").replace("$node", ".*"))]
    assert empty == [], f"dashboard queries without data: {empty}"


def test_every_alert_expression_is_evaluated(loaded: str) -> None:
    groups = yaml.safe_load((CHART_FILES / "alerts.yaml").read_text())["groups"]
    for rule in (r for g in groups for r in g["rules"]):
        match = COMPARISON.match(rule["expr"])
        assert match, f"{rule['alert']}: expected `<signal> <op> <threshold>` [or absent(...)]"
        if match["absent"]:
            assert query(loaded, match["absent"]), f"{rule['alert']}: {match['absent']!r} has no data"
        assert query(loaded, match["signal"]), f"{rule['alert']}: its signal {match['signal']!r} has no data"
        fired = query(loaded, rule["expr"])
        if rule["alert"] in FIRED_BY_LOAD:
            assert fired, f"{rule['alert']}: {rule['expr']!r} returned nothing after the load"
        else:
            assert fired == [], f"{rule['alert']}: true without cause: {fired}"
