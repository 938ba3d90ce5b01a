"""The pure pieces of ``tandem loadtest``'s production profile: the servers' config, the
Prometheus config, CPU per decision. The profile itself runs in
``tests/integration/test_loadtest.py``."""

from __future__ import annotations

from pathlib import Path

import yaml

from tools.loadtest import meter, scrape
from tools.loadtest.production import Pki, server_config
from tools.loadtest.report import CpuFigures


def test_the_server_config_has_tls_for_clients_and_routes_and_the_callout_with_one_trusted_user() -> None:
    pki = Pki(ca=Path("/run/ca.crt"), cert=Path("/run/tls.crt"), key=Path("/run/tls.key"))
    conf = server_config(pki, issuer="AISSUER", auth_nkey="UAUTH", harness_nkey="UHARNESS")
    client_tls, cluster = conf.split("cluster {", 1)
    assert 'cert_file: "/run/tls.crt"' in client_tls and "ca_file" not in client_tls
    # Both ends of a route verify the other's certificate against the CA.
    assert 'ca_file: "/run/ca.crt"' in cluster.split("accounts:")[0]
    assert 'auth_users: [\n      "UAUTH"\n      "UHARNESS"\n    ]' in conf  # both bypass the callout
    tandem = conf[conf.index("TANDEM:") : conf.index("SYS:")]
    assert 'nkey: "UHARNESS"' in tandem  # a user of the Tandem account (not of AUTH)


def test_prometheus_scrapes_one_job_per_component_at_the_interval() -> None:
    doc = yaml.safe_load(scrape.config({"allocator-0": 9001, "inventory": 9002}, interval_s=30))
    assert doc["global"]["scrape_interval"] == "30s"
    jobs = {c["job_name"]: c["static_configs"][0]["targets"] for c in doc["scrape_configs"]}
    assert jobs == {"allocator-0": ["127.0.0.1:9001"], "inventory": ["127.0.0.1:9002"]}
    assert all(c["honor_labels"] for c in doc["scrape_configs"])


def test_cpu_per_decision_per_process_and_in_all() -> None:
    figures, total = meter.per_decision({"allocator": 2.0, "nats": 3.0, "callout": None}, 1000)
    assert (figures.allocator, figures.nats, figures.callout, total) == (2.0, 3.0, None, 5.0)
    assert meter.per_decision({"allocator": 2.0}, 0) == (CpuFigures(), None)
