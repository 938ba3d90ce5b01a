"""``promtool check rules`` on the chart's alert rules and ``promtool test rules`` on their
unit tests (tests/prometheus/alerts_test.yaml: every alert against synthetic series)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.prometheus.conftest import CHART_FILES, Tools

HERE = Path(__file__).resolve().parent


def test_promtool_checks_the_rule_file(prom_tools: Tools) -> None:
    out = subprocess.run(
        [prom_tools.promtool, "check", "rules", str(CHART_FILES / "alerts.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rules = sum(len(g["rules"]) for g in yaml.safe_load((CHART_FILES / "alerts.yaml").read_text())["groups"])
    assert f"SUCCESS: {rules} rules found" in out.stdout


def test_every_alert_has_a_unit_test_and_they_pass(prom_tools: Tools) -> None:
    groups = yaml.safe_load((CHART_FILES / "alerts.yaml").read_text())["groups"]
    alerts = {r["alert"] for g in groups for r in g["rules"]}
    tests = yaml.safe_load((HERE / "alerts_test.yaml").read_text())["tests"]
    tested = {t["alertname"] for case in tests for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert tested == alerts, f"alerts without a firing test: {alerts - tested}"
    out = subprocess.run(
        [prom_tools.promtool, "test", "rules", "alerts_test.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=HERE,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_links_a_runbook_that_exists() -> None:
    """docs/runbooks.md has a section per alert, and the alert's runbook_url is its anchor in
    the project's repository (the chart's home)."""
    chart = yaml.safe_load((CHART_FILES.parent / "Chart.yaml").read_text())
    base = f"{chart['home']}/blob/main/docs/runbooks.md#"
    runbooks = (HERE.parents[1] / "docs" / "runbooks.md").read_text()
    # GitHub's anchor of a heading made of one word: the word in lowercase.
    anchors = {line[3:].strip().lower() for line in runbooks.splitlines() if line.startswith("## ")}
    groups = yaml.safe_load((CHART_FILES / "alerts.yaml").read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    for rule in rules:
        assert rule["annotations"]["runbook_url"] == base + rule["alert"].lower(), rule["alert"]
        assert rule["alert"].lower() in anchors, f"docs/runbooks.md has no section {rule['alert']}"
    assert anchors == {r["alert"].lower() for r in rules}, "a runbook without its alert"
