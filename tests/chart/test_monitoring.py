"""The chart's Grafana dashboard ConfigMap and PrometheusRule: off by default, rendered from
the chart's files (files/dashboard.json, files/alerts.yaml) when enabled, valid manifests."""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.chart.test_chart import CHART, K8S, NAMESPACE, RELEASE, find, one, render

ENABLED = {"metrics": {"dashboards": {"enabled": True}, "prometheusRule": {"enabled": True}}}


def test_neither_is_rendered_by_default() -> None:
    docs = render()
    assert find(docs, "PrometheusRule") == []
    labelled = [d for d in find(docs, "ConfigMap") if "grafana_dashboard" in d["metadata"].get("labels", {})]
    assert labelled == []


def test_dashboard_configmap_carries_the_sidecar_label_and_the_chart_file() -> None:
    docs = render(ENABLED)
    cm = one(docs, "ConfigMap", f"{RELEASE}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == NAMESPACE
    kubernetes_validate.validate(cm, K8S, strict=True)
    dashboard = json.loads(cm["data"]["tandem.json"])
    assert dashboard == json.loads((CHART / "files" / "dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for metric in (
        "tandem_allocator_decisions_total",
        "tandem_allocator_pending_requests",
        "tandem_allocator_oldest_pending_seconds",
        "tandem_allocator_pairs_total",
        "tandem_node_devices",
        "tandem_nodeagent_devices",
        "tandem_dead_letters_total",
        "tandem_consumer_pending_messages",
        "tandem_nats_reconnects_total",
    ):
        assert any(metric in e for e in exprs), metric
    assert any("histogram_quantile(0.99" in e for e in exprs)


def test_dashboard_labels_and_namespace_follow_values() -> None:
    values: dict[str, Any] = {
        "metrics": {"dashboards": {"enabled": True, "labels": {"dash": "yes"}, "namespace": "monitoring"}}
    }
    cm = one(render(values), "ConfigMap", f"{RELEASE}-dashboard")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["dash"] == "yes"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # Helm merges maps with the defaults


def test_prometheus_rule_holds_every_alert_of_the_rule_file() -> None:
    labels = {"release": "kube-prometheus-stack"}
    values = {"metrics": {"prometheusRule": {"enabled": True, "labels": labels}}}
    rule = one(render(values), "PrometheusRule", RELEASE)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    source = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    assert rule["spec"] == source
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert alerts == {
        "TandemRequestsPendingTooLong",
        "TandemDevicesUnhealthy",
        "TandemDevicesCordoned",
        "TandemCleanupNotVerified",
        "TandemDeadLetters",
        "TandemAllocatorNotReady",
        "TandemNodeAgentLost",
        "TandemAdmissionNotReady",
        "TandemInventoryNotReady",
        "TandemConsumerLagging",
    }
    # Go templates of the annotations reach Prometheus untouched (Helm does not expand them).
    descriptions = [r["annotations"]["description"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert any("{{ $value" in d for d in descriptions)


def test_lint_is_clean_with_both_enabled() -> None:
    report = helm.lint(CHART, ENABLED, strict=True, namespace=NAMESPACE, kube_version="v1.31.0")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_schema_rejects_a_misspelt_key() -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as err:
        chart.validate_schema({"metrics": {"prometheusRule": {"enable": True}}})
    assert "/metrics/prometheusRule" in str(err.value)
