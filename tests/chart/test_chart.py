"""The Helm chart, rendered and linted by the Helm SDK (``helm-python-sdk``, no helm binary),
every manifest validated against the Kubernetes OpenAPI schema (``kubernetes-validate --strict``).

Variants: default values (secure: bundled NATS with TLS and the auth callout, chart-generated
CAs, NetworkPolicies, the admission VAP), cert-manager, metrics, external NATS with per-component
credentials or with the callout, and everything off. Beyond schema validity the tests check the
wiring a schema cannot see: the webhook's caBundle signs the serving certificate whose names
cover the Service the webhook calls; only the node agent is privileged; RBAC is the minimum each
component needs; every component's NATS token, account and role agree with the callout's
identities; no ConfigMap holds secret material; the rendered config file loads into the
services' Settings. test_chart_nats.py runs the secure render's NATS side on real servers.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import re
import shlex
import subprocess
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import msgspec
import pytest
import yaml
from cryptography import x509

from services.admission import names as admission_names
from services.admission import podwrites as admission_podwrites
from services.runtime.settings import load_settings
from tests.celchecks import failing

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "tandem"
RELEASE, NAMESPACE = "tandem", "tandem-system"
K8S = kubernetes_validate.latest_version()
# Custom resources have no schema in kubernetes-validate; their fields are asserted below.
CRD_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/")

VARIANTS: dict[str, dict[str, Any]] = {
    # Secure by default: bundled NATS with TLS and the auth callout, NetworkPolicies, the VAP.
    "default": {},
    # DRA on: node agents write their own node's ResourceSlices (docs/dra.md).
    "dra": {"dra": {"enabled": True}},
    "cert-manager": {
        "admission": {"certManager": {"enabled": True}},
        "nats": {"tls": {"certManager": {"enabled": True}}},
    },
    "metrics": {
        "metrics": {"serviceMonitor": {"enabled": True}},
        "networkPolicy": {
            "metricsFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
            ],
            "natsMonitoringFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
            ],
            "nodeAgentCIDRs": ["10.0.0.0/16"],
        },
    },
    "external-nats": {
        "nats": {
            "bundled": False,
            "url": "tls://nats.messaging.svc:4222",
            "auth": {"mode": "creds", "credentialsSecret": {"name": "tandem-nats-creds"}},
            "tls": {"caSecret": {"name": "messaging-ca", "key": "ca.pem"}},
            "streamReplicas": 3,
        },
        "otlp": {"endpoint": "http://jaeger-collector.observability:4318"},
        "deviceClasses": {
            "default": {"scope": "pcie-switch"},
            "h100-ib": {
                "gpu_models": ["H100"],
                "nic_link_type": "infiniband",
                "scope": "pcie-root",
                "policy": "required",
            },
        },
        "nodeagent": {"backend": "simulated", "topologyFile": "dgx-h100"},
    },
    "external-callout": {
        "nats": {
            "bundled": False,
            "url": "tls://nats.messaging.svc:4222",
            "tls": {"caSecret": {"name": "ca"}},
        }
    },
    # Everything off, as a test cluster might run it (and as tests/image runs it).
    "insecure": {
        "nats": {"auth": {"mode": "none"}, "tls": {"enabled": False}, "replicas": 1},
        "networkPolicy": {"enabled": False},
        "admission": {"podPatchPolicy": {"enabled": False}},
    },
}
COMPONENTS = ("allocator", "inventory", "admission", "nodeagent")
PODS_POLICY = f"{RELEASE}-admission-pods"


def render(values: dict[str, Any] | None = None, *, release: str = RELEASE) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values or {}, name=release, namespace=NAMESPACE, is_install=True)
    docs: list[dict[str, Any]] = []
    for name, text in files.items():
        if name.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def notes(values: dict[str, Any] | None = None) -> str:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return next(t for n, t in files.items() if n.endswith("NOTES.txt"))


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]


def tandem_images(docs: list[dict[str, Any]]) -> set[str]:
    """The images of every Tandem container (all but the bundled NATS), the install hook's too."""
    pods = [w for w in workloads(docs) if component(w) != "nats"] + find(docs, "Job")
    return {c["image"] for w in pods for c in w["spec"]["template"]["spec"]["containers"]}


def component(doc: dict[str, Any]) -> str:
    return str(doc["metadata"]["labels"]["app.kubernetes.io/component"])


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(VARIANTS[request.param])


def test_lint_is_clean_for_every_variant() -> None:
    for name, values in VARIANTS.items():
        report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version="v1.31.0")
        assert report["errors"] == [], (name, report)
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], (name, report)


def test_every_manifest_validates_strictly(variant: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = variant
    assert len(docs) >= 15
    for doc in docs:
        if doc["apiVersion"].startswith(CRD_GROUPS):
            continue
        try:
            kubernetes_validate.validate(doc, K8S, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_schema_rejects_bad_values_naming_the_key() -> None:
    cases = {
        "/deviceClasses/x/scope": {"deviceClasses": {"x": {"scope": "rack"}}},
        "/deviceClasses/x": {"deviceClasses": {"x": {"gpu_model": ["H100"]}}},  # typo of gpu_models
        "/nodeagent/topologyFile": {"nodeagent": {"backend": "simulated"}},
        "/nats/bundled": {"nats": {"bundled": "yes"}},
        "/admission/webhook/failurePolicy": {"admission": {"webhook": {"failurePolicy": "Maybe"}}},
        # A password in the URL would land in the ConfigMap: refused, credentials come from nats.auth.
        "/nats/url": {"nats": {"bundled": False, "url": "nats://tandem:s3cret@nats.nats.svc:4222"}},
        "/nats/auth/mode": {"nats": {"auth": {"mode": "password"}}},
        "/nats/auth/credentialsSecret": {"nats": {"auth": {"mode": "creds"}}},
        "/networkPolicy/nodeAgentCIDRs/0": {"networkPolicy": {"nodeAgentCIDRs": ["gpu-nodes"]}},
    }
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema({})
        for where, values in cases.items():
            with pytest.raises(helm.HelmValuesError) as err:
                chart.validate_schema(values)
            assert where in str(err.value), (where, str(err.value))


def test_generated_ca_signs_the_serving_cert_for_the_webhook_service() -> None:
    docs = render()
    hook = one(docs, "MutatingWebhookConfiguration")
    (webhook,) = hook["webhooks"]
    svc_ref = webhook["clientConfig"]["service"]
    service = one(docs, "Service", svc_ref["name"])
    assert svc_ref["namespace"] == service["metadata"]["namespace"] == NAMESPACE
    assert svc_ref["path"] == "/mutate" and svc_ref["port"] == 443
    assert service["spec"]["ports"] == [
        {"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}
    ]

    secret = one(docs, "Secret", f"{RELEASE}-admission-tls")
    assert secret["type"] == "kubernetes.io/tls"
    assert webhook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    ca = x509.load_pem_x509_certificate(base64.b64decode(webhook["clientConfig"]["caBundle"]))
    serving = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    serving.verify_directly_issued_by(ca)  # raises if the bundle did not sign it
    names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert f"{svc_ref['name']}.{NAMESPACE}.svc" in names  # the name kube-apiserver dials

    # The Service reaches the webhook container, which serves that Secret.
    deploy = one(docs, "Deployment", svc_ref["name"])
    assert service["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert {"name": "webhook", "containerPort": 8443, "protocol": "TCP"} in container["ports"]
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert container["readinessProbe"]["httpGet"] == {
        "path": "/healthz",
        "port": "webhook",
        "scheme": "HTTPS",
    }


def test_webhook_scope_failure_policy_and_opt_out() -> None:
    (webhook,) = one(render(), "MutatingWebhookConfiguration")["webhooks"]
    assert webhook["admissionReviewVersions"] == ["v1"] and webhook["sideEffects"] == "None"
    assert webhook["failurePolicy"] == "Fail"
    assert webhook["rules"] == [
        {
            "operations": ["CREATE"],
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    exprs = {e["key"]: e for e in webhook["namespaceSelector"]["matchExpressions"]}
    assert exprs["tandem.io/admission"] == {
        "key": "tandem.io/admission",
        "operator": "NotIn",
        "values": ["disabled"],
    }
    assert NAMESPACE in exprs["kubernetes.io/metadata.name"]["values"]  # never blocks its own pods
    (cond,) = webhook["matchConditions"]
    assert "tandem.io/" in cond["expression"]


def test_cert_manager_variant_injects_the_ca_into_the_webhook() -> None:
    docs = render(VARIANTS["cert-manager"])
    assert find(docs, "Secret") == []  # cert-manager writes them
    hook = one(docs, "MutatingWebhookConfiguration")
    (webhook,) = hook["webhooks"]
    assert "caBundle" not in webhook["clientConfig"]
    cert = one(docs, "Certificate", f"{RELEASE}-admission")
    assert (
        hook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
        == f"{NAMESPACE}/{cert['metadata']['name']}"
    )
    svc = webhook["clientConfig"]["service"]["name"]
    assert f"{svc}.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]
    issuer = one(docs, "Issuer", f"{RELEASE}-admission-selfsigned")
    assert issuer["spec"] == {"selfSigned": {}}
    assert cert["spec"]["issuerRef"] == {
        "name": issuer["metadata"]["name"],
        "kind": "Issuer",
        "group": "cert-manager.io",
    }
    deploy = one(docs, "Deployment", svc)
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == cert["spec"]["secretName"]

    own = render(
        {
            "admission": {
                "certManager": {"enabled": True, "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}
            }
        }
    )
    assert find(own, "Issuer", f"{RELEASE}-admission-selfsigned") == []
    assert one(own, "Certificate", f"{RELEASE}-admission")["spec"]["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
    }


def test_only_the_nodeagent_is_privileged(variant: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = variant
    seen = set()
    for w in workloads(docs):
        comp = component(w)
        seen.add(comp)
        pod = w["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c.get("securityContext") or {}
            if comp == "nodeagent":
                assert sc.get("privileged") is True
                # The image's default user is 65532; the agent must opt into root explicitly.
                assert (sc.get("runAsUser"), sc.get("runAsNonRoot")) == (0, False)
                continue
            assert sc.get("privileged") is False, (comp, c["name"])
            assert sc.get("allowPrivilegeEscalation") is False, (comp, c["name"])
            assert sc.get("capabilities") == {"drop": ["ALL"]}, (comp, c["name"])
            assert sc.get("readOnlyRootFilesystem") is True, (comp, c["name"])
        if comp != "nodeagent":
            assert pod["securityContext"]["runAsNonRoot"] is True, comp
            assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), comp
            assert not any("hostPath" in v for v in pod.get("volumes", [])), comp
    assert {"allocator", "inventory", "admission", "nodeagent"} <= seen


def test_nodeagent_daemonset_mounts_what_it_needs_on_gpu_nodes() -> None:
    ds = one(render(), "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["hostPID"] is True
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert paths == {
        "device-plugins": "/var/lib/kubelet/device-plugins",
        "sys": "/sys",
        "dev": "/dev",
        "netns": "/var/run/netns",
        "cdi": "/var/run/cdi",
        "state": "/var/lib/tandem",
    }
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def rules(role: dict[str, Any]) -> set[tuple[str, str, str, tuple[str, ...]]]:
    out = set()
    for r in role["rules"]:
        for group in r["apiGroups"]:
            for res in r["resources"]:
                for verb in r["verbs"]:
                    out.add((group, res, verb, tuple(r.get("resourceNames", ()))))
    return out


def test_rbac_is_the_minimum_each_component_needs(variant: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = variant
    admission_sa, callout_sa = f"{RELEASE}-admission", f"{RELEASE}-authcallout"
    hook_sa = f"{RELEASE}-nats-auth-hook"
    callout = one(render(VARIANTS[name]), "ConfigMap", f"{RELEASE}-config")["data"]["tandem.yaml"]
    has_callout = "auth_identities" in callout
    assert rules(one(docs, "ClusterRole", admission_sa)) == {
        ("", "pods", "get", ()),
        ("", "pods", "list", ()),
        ("", "pods", "watch", ()),
        ("", "pods", "patch", ()),
        ("", "pods/eviction", "create", ()),
        ("", "events", "create", ()),
        ("", "events", "get", ()),
        ("", "events", "patch", ()),
        # Nodes' fabric labels, read only (services.admission.nodelabels).
        ("", "nodes", "get", ()),
        ("", "nodes", "list", ()),
        ("", "nodes", "watch", ()),
        ("tandem.io", "deviceclaims", "get", ()),
        ("tandem.io", "deviceclaims", "list", ()),
        ("tandem.io", "deviceclaims", "watch", ()),
        ("tandem.io", "deviceclaims", "patch", ()),
        ("tandem.io", "deviceclaims/status", "patch", ()),
    }
    assert rules(one(docs, "Role", f"{admission_sa}-lease")) == {
        ("coordination.k8s.io", "leases", "create", ()),
        ("coordination.k8s.io", "leases", "get", (f"{RELEASE}-bridge",)),
        ("coordination.k8s.io", "leases", "patch", (f"{RELEASE}-bridge",)),
    }
    expected_roles = {admission_sa}
    if has_callout:
        # TokenReviews (cluster-scoped), and the node agents' pods for API servers before 1.30.
        assert rules(one(docs, "ClusterRole", callout_sa)) == {
            ("authentication.k8s.io", "tokenreviews", "create", ())
        }
        assert rules(one(docs, "Role", callout_sa)) == {("", "pods", "get", ())}
        # The install hook: only its Secret by name (create cannot be limited by name in RBAC).
        assert rules(one(docs, "Role", hook_sa)) == {
            ("", "secrets", "create", ()),
            ("", "secrets", "get", (f"{RELEASE}-nats-auth",)),
            ("", "secrets", "patch", (f"{RELEASE}-nats-auth",)),
        }
        expected_roles |= {callout_sa}
    dra = name == "dra"
    if dra:
        # ResourceSlices, cluster-wide in RBAC; the policy narrows them to the agent's own node
        # (tested against the real API server: tests/cluster/test_dra_rbac.py).
        nodeagent_slices = f"{RELEASE}-nodeagent-resourceslices"
        # ... and reads (get only) the claims kubelet asks its DRA plugin to prepare.
        assert rules(one(docs, "ClusterRole", nodeagent_slices)) == {
            ("resource.k8s.io", "resourceslices", verb, ())
            for verb in ("get", "list", "watch", "create", "update", "delete")
        } | {("resource.k8s.io", "resourceclaims", "get", ())}
        assert one(docs, "ValidatingAdmissionPolicyBinding", nodeagent_slices)["spec"]["policyName"] == (
            nodeagent_slices
        )
        expected_roles |= {nodeagent_slices}
        # The admission service allocates pods' DRA claims (docs/dra.md, "Who may write a
        # claim's allocation"; the policy narrows status writes to driver tandem.io).
        admission_claims = f"{admission_sa}-resourceclaims"
        assert rules(one(docs, "ClusterRole", admission_claims)) == {
            ("resource.k8s.io", "resourceclaims", verb, ()) for verb in ("get", "list", "watch", "update")
        } | {
            ("resource.k8s.io", sub, verb, ())
            for sub in ("resourceclaims/status", "resourceclaims/binding")
            for verb in ("update", "patch")
        } | {("resource.k8s.io", "resourceclaimtemplates", "get", ())}
        vap = one(docs, "ValidatingAdmissionPolicy", admission_claims)
        assert vap["spec"]["matchConstraints"]["resourceRules"][0]["resources"] == ["resourceclaims/status"]
        expected_roles |= {admission_claims}
    assert {r["metadata"]["name"] for r in find(docs, "ClusterRole")} == expected_roles
    for binding in find(docs, "ClusterRoleBinding") + find(docs, "RoleBinding"):
        bound = (
            binding["roleRef"]["name"]
            .removesuffix("-lease")
            .removesuffix("-resourceslices")
            .removesuffix("-resourceclaims")
        )
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": bound, "namespace": NAMESPACE}]
    for doc in docs:
        assert "*" not in str(doc.get("rules", "")), doc["metadata"]["name"]
    # Components that do not talk to the Kubernetes API get no API token.
    for w in workloads(docs):
        pod = w["spec"]["template"]["spec"]
        api_users = ("admission", "authcallout", "nodeagent") if dra else ("admission", "authcallout")
        assert pod["automountServiceAccountToken"] is (component(w) in api_users), component(w)
    lease_arg = next(w for w in workloads(docs) if component(w) == "admission")["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert lease_arg[lease_arg.index("--lease-name") + 1] == f"{RELEASE}-bridge"


def test_single_admission_replica_runs_without_leader_election() -> None:
    docs = render({"admission": {"replicas": 1}})
    deploy = one(docs, "Deployment", f"{RELEASE}-admission")
    assert "--leader-elect" not in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert find(docs, "Role", f"{RELEASE}-admission-lease") == []
    assert find(docs, "PodDisruptionBudget", f"{RELEASE}-admission") == []


def test_commands_run_existing_modules_with_the_shared_config(
    variant: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = variant
    cm = one(docs, "ConfigMap", f"{RELEASE}-config")
    for w in workloads(docs):
        if component(w) == "nats":
            continue
        (c,) = w["spec"]["template"]["spec"]["containers"]
        assert c["command"][:2] == ["python", "-m"], shlex.join(c["command"])
        module = c["command"][2]
        assert module == f"services.{component(w)}"
        assert importlib.util.find_spec(f"{module}.__main__") is not None, module
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["TANDEM_CONFIG"] == "/etc/tandem/config/tandem.yaml"
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["config"] == "/etc/tandem/config"
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]


def test_pdbs_cover_the_replicated_services(variant: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = variant
    pdbs = {component(p): p for p in find(docs, "PodDisruptionBudget")}
    for w in workloads(docs):
        comp = component(w)
        if comp == "nodeagent" or int(w["spec"]["replicas"]) < 2:  # nothing to keep available
            continue
        pdb = pdbs[comp]
        assert (
            pdb["spec"]["selector"]["matchLabels"].items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        )


def settings_from(docs: list[dict[str, Any]], tmp_path: Path) -> Any:
    cm = one(docs, "ConfigMap", f"{RELEASE}-config")
    path = tmp_path / "tandem.yaml"
    path.write_text(cm["data"]["tandem.yaml"])
    return load_settings("test", config=path, environ={})


def test_rendered_config_loads_into_settings(tmp_path: Path) -> None:
    s = settings_from(render(VARIANTS["external-nats"]), tmp_path)
    assert s.nats_url == "tls://nats.messaging.svc:4222" and s.stream_replicas == 3
    assert s.otlp_endpoint == "http://jaeger-collector.observability:4318"
    assert set(s.device_classes) == {"default", "h100-ib"}
    assert s.device_classes["h100-ib"].scope == "pcie-root" and s.device_classes["h100-ib"].gpu_models == [
        "H100"
    ]
    assert (s.backend, s.topology_file) == ("simulated", "dgx-h100")


def test_node_metrics_max_reaches_the_allocators_config(tmp_path: Path) -> None:
    assert settings_from(render(), tmp_path).node_metrics_max == 1000
    assert settings_from(render({"metrics": {"nodeMetricsMax": 0}}), tmp_path).node_metrics_max == 0


def test_gpu_share_replicas_reach_the_node_agents_config(tmp_path: Path) -> None:
    """Off by default (no share resource); a value turns the device plugin's share resource on,
    and the host agent's own config check accepts what the chart writes."""
    from services.nodeagent.host_agent import HostAgentConfig

    assert settings_from(render(), tmp_path).host_agent == {}
    s = settings_from(render({"nodeagent": {"gpuShareReplicas": 4}}), tmp_path)
    assert msgspec.convert(s.host_agent, HostAgentConfig).gpu_share_replicas == 4


def test_dra_turns_the_kubelet_plugin_on_with_its_sockets_mounted_where_kubelet_looks(tmp_path: Path) -> None:
    """dra.enabled: the agent serves kubelet's DRA plugin API; its socket and kubelet's plugin
    registry are hostPath mounts at the host's own paths (the endpoint it registers is a path
    kubelet opens), and the agent's own config check accepts what the chart writes."""
    from services.nodeagent.dra.plugin import PluginPaths

    assert settings_from(render(), tmp_path).dra_plugin is False
    values = {"dra": {"enabled": True, "kubeletPluginsDir": "/var/lib/k0s/kubelet/plugins"}}
    docs = render(values)
    s = settings_from(docs, tmp_path)
    paths = msgspec.convert(s.dra_plugin_paths, PluginPaths)
    assert (s.dra_slices, s.dra_plugin) == (True, True)
    assert str(paths.dra_socket) == "/var/lib/k0s/kubelet/plugins/tandem.io/dra.sock"
    assert str(paths.registration_socket) == "/var/lib/kubelet/plugins_registry/tandem.io-reg.sock"
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    for name, path in (("dra-plugin", paths.plugin_dir), ("dra-registry", paths.registry_dir)):
        assert host[name] == mounts[name] == path


def test_mig_resource_reaches_the_node_agents_config(tmp_path: Path) -> None:
    """Off by default; on, the device plugin serves tandem.io/mig, alone or with shares."""
    from services.nodeagent.host_agent import HostAgentConfig

    assert settings_from(render(), tmp_path).host_agent == {}
    s = settings_from(render({"nodeagent": {"migResource": True}}), tmp_path)
    cfg = msgspec.convert(s.host_agent, HostAgentConfig)
    assert (cfg.mig_resource, cfg.gpu_share_replicas) == (True, 0)
    s = settings_from(render({"nodeagent": {"migResource": True, "gpuShareReplicas": 2}}), tmp_path)
    cfg = msgspec.convert(s.host_agent, HostAgentConfig)
    assert (cfg.mig_resource, cfg.gpu_share_replicas) == (True, 2)


def test_external_nats_credentials_are_per_component_and_mounted_where_settings_point() -> None:
    docs = render(VARIANTS["external-nats"])
    assert find(docs, "StatefulSet") == [] and find(docs, "Job") == []
    for w in workloads(docs):
        (c,) = w["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        creds = volumes["nats-creds"]["secret"]
        # Each component sees only its own key of the Secret (the node agent's runs on every node).
        assert creds["secretName"] == "tandem-nats-creds"
        key = f"{component(w)}.creds"
        assert creds["items"] == [{"key": key, "path": key}]
        assert env["TANDEM_NATS_CREDS"] == f"{mounts['nats-creds']}/{key}"
        assert "TANDEM_NATS_TOKEN_FILE" not in env
        ca = volumes["nats-ca"]["secret"]
        assert ca == {"secretName": "messaging-ca", "items": [{"key": "ca.pem", "path": "ca.crt"}]}
        assert mounts["nats-ca"] == "/etc/tandem/nats-ca"


def test_bundled_nats_is_a_clustered_jetstream_statefulset(tmp_path: Path) -> None:
    docs = render()
    sts = one(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == 3
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert c["image"].startswith("nats:")
    conf = one(docs, "ConfigMap", f"{sts['metadata']['name']}-config")["data"]["nats.conf"]
    assert "jetstream" in conf and "store_dir: /data/jetstream" in conf
    routes = [line.strip() for line in conf.splitlines() if line.strip().startswith("nats://")]
    headless = sts["spec"]["serviceName"]
    assert routes == [
        f"nats://{sts['metadata']['name']}-{i}.{headless}.{NAMESPACE}.svc:6222" for i in range(3)
    ]
    # Monitoring is for kubelet's probes: no Service exposes it.
    for name in (headless, sts["metadata"]["name"]):
        assert "monitor" not in {p["name"] for p in one(docs, "Service", name)["spec"]["ports"]}
    client = one(docs, "Service", sts["metadata"]["name"])
    s = settings_from(docs, tmp_path)
    assert s.nats_url == f"tls://{client['metadata']['name']}.{NAMESPACE}.svc:4222"
    assert s.stream_replicas == 3  # R3 streams on the 3-server cluster
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert one(docs, "PodDisruptionBudget", sts["metadata"]["name"])["spec"]["maxUnavailable"] == 1


def test_the_service_monitor_scrapes_every_component_node_agents_included() -> None:
    """Each metrics Service selects one workload's pods and its ``ops`` port: the node agents'
    too, on their host port, or ``tandem_nodeagent_*`` and TandemCleanupNotVerified go dark."""
    docs = render(VARIANTS["metrics"])
    monitor = one(docs, "ServiceMonitor")
    # honorLabels: the series' own `service` (the component the alerts select on) is kept.
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s", "honorLabels": True}
    ]
    wanted = monitor["spec"]["selector"]["matchLabels"]
    services = [d for d in find(docs, "Service") if wanted.items() <= d["metadata"]["labels"].items()]
    scraped = {}
    for service in services:
        selector = service["spec"]["selector"].items()
        pods = [(w, w["spec"]["template"]["metadata"]["labels"]) for w in workloads(docs)]
        (workload,) = [w for w, labels in pods if selector <= labels.items()]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        ops = {p["name"]: p["containerPort"] for p in container["ports"]}["ops"]
        assert service["spec"]["ports"] == [{"name": "metrics", "port": ops, "targetPort": "ops"}]
        scraped[component(workload)] = ops
    assert scraped == {"allocator": 9090, "inventory": 9090, "admission": 9090, "nodeagent": 9465}
    assert find(render(), "ServiceMonitor") == []  # off by default


def test_every_service_is_probed_on_its_ops_port(tmp_path: Path) -> None:
    docs = render()
    assert settings_from(docs, tmp_path).ops_port == 9090
    for doc in workloads(docs):
        if component(doc) == "nats":
            continue
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        expected = 9465 if component(doc) == "nodeagent" else 9090
        assert ports["ops"] == expected, component(doc)
        if component(doc) == "admission":
            continue  # probed over its webhook port (HTTPS), which proves TLS works too
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "ops"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "ops"}
    agent = one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "TANDEM_OPS_PORT", "value": "9465"} in agent["env"]
    custom = render({"allocator": {"livenessProbe": {"exec": {"command": ["true"]}}}})
    allocator = next(d for d in workloads(custom) if component(d) == "allocator")
    assert allocator["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["exec"]


def test_notes_tell_how_to_request_devices() -> None:
    text = notes(VARIANTS["external-nats"])
    assert "tandem.io/gpu: 4" in text and "tandem.io/rdma: 4" in text
    assert "default, h100-ib" in text
    assert "tls://nats.messaging.svc:4222" in text
    # No registry has the image: the notes say which one the pods pull and how to get it there.
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert f"Image: ghcr.io/tandem-project/tandem:{version}\n" in text
    assert "(`make image`), push it to a\n  registry your nodes pull from" in text
    image = {"repository": "registry.example/tandem", "tag": "dev"}
    custom = notes({**VARIANTS["external-nats"], "image": image})
    assert "Image: registry.example/tandem:dev\n" in custom


def test_chart_image_make_image_and_pyproject_agree_on_the_version() -> None:
    """The image ``make image`` builds is the one the chart deploys by default."""
    root = CHART.parents[2]
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version, "Chart.yaml appVersion must follow pyproject.toml's version"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    images = tandem_images(render())
    assert images == {f"{values['image']['repository']}:{version}"}

    dry = subprocess.run(
        ["make", "--no-print-directory", "-n", "image", "BUILDER=podman"],
        cwd=root, capture_output=True, text=True, check=True,
    )  # fmt: skip
    built = shlex.split(dry.stdout.replace("\\\n", " "))
    tag = built[built.index("--tag") + 1]
    assert tag in images, (tag, images)
    assert f"VERSION={version}" in built
    # An explicit tag still wins over appVersion.
    pinned = tandem_images(render({"image": {"tag": "9.9.9"}}))
    assert pinned == {f"{values['image']['repository']}:9.9.9"}


# --- Secure by default ---------------------------------------------------------------------


def pod_of(docs: list[dict[str, Any]], comp: str) -> dict[str, Any]:
    (w,) = [w for w in workloads(docs) if component(w) == comp]
    return dict(w["spec"]["template"]["spec"])


def container_env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["containers"][0]["env"]}


def mounts_of(pod: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}


def test_every_component_authenticates_with_its_own_projected_token(tmp_path: Path) -> None:
    docs = render()
    settings = settings_from(docs, tmp_path)
    assert settings.auth_namespace == NAMESPACE and settings.auth_audience == "tandem-nats"
    accounts = {sa["metadata"]["name"] for sa in find(docs, "ServiceAccount")}
    roles = set()
    for comp in COMPONENTS:
        pod = pod_of(docs, comp)
        volumes = {v["name"]: v for v in pod["volumes"]}
        (source,) = volumes["nats-token"]["projected"]["sources"]
        assert source == {
            "serviceAccountToken": {"audience": "tandem-nats", "expirationSeconds": 3600, "path": "token"}
        }, comp
        env = container_env(pod)
        assert env["TANDEM_NATS_TOKEN_FILE"] == f"{mounts_of(pod)['nats-token']}/token", comp
        assert not {"TANDEM_NATS_CREDS", "TANDEM_NATS_USER"} & set(env), comp
        # Its account is one the callout knows, as the role of this very component.
        account = pod["serviceAccountName"]
        assert account in accounts and settings.auth_identities[account] == comp, (comp, account)
        roles.add(settings.auth_identities[account])
    assert roles == set(COMPONENTS)
    # The operators' account for `kubectl create token ... --audience tandem-nats`.
    assert settings.auth_identities[f"{RELEASE}-cli"] == "cli" and f"{RELEASE}-cli" in accounts
    assert set(settings.auth_identities) <= accounts  # every identity is a rendered account
    assert settings.auth_identities == load_settings("x", environ={}).auth_identities  # release "tandem"


def test_identities_follow_the_release_name(tmp_path: Path) -> None:
    docs = render(release="gpu")
    cm = one(docs, "ConfigMap", "gpu-tandem-config")
    path = tmp_path / "tandem.yaml"
    path.write_text(cm["data"]["tandem.yaml"])
    identities = load_settings("x", config=path, environ={}).auth_identities
    assert identities == {f"gpu-tandem-{r}": r for r in (*COMPONENTS, "cli")}
    for comp in COMPONENTS:
        assert identities[pod_of(docs, comp)["serviceAccountName"]] == comp


def test_the_auth_callout_runs_with_its_keys_from_the_hooks_secret(tmp_path: Path) -> None:
    docs = render()
    deploy = one(docs, "Deployment", f"{RELEASE}-authcallout")
    assert deploy["spec"]["replicas"] == 2
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["python", "-m", "services.authcallout"]
    assert pod["serviceAccountName"] == f"{RELEASE}-authcallout"
    env, mounts = container_env(pod), mounts_of(pod)
    volumes = {v["name"]: v for v in pod["volumes"]}
    auth = volumes["nats-auth"]["secret"]
    assert auth["secretName"] == f"{RELEASE}-nats-auth"
    # The two seeds, not the server's config; and no token of its own for NATS.
    assert {i["key"] for i in auth["items"]} == {"issuer.nk", "auth.nk"}
    assert env["TANDEM_AUTH_ISSUER_SEED_FILE"] == f"{mounts['nats-auth']}/issuer.nk"
    assert env["TANDEM_NATS_NKEY_SEED"] == f"{mounts['nats-auth']}/auth.nk"
    assert "nats-token" not in volumes and "TANDEM_NATS_TOKEN_FILE" not in env
    s = settings_from(docs, tmp_path)
    assert (s.auth_user_ttl, s.nats_tls_ca) == (3600, f"{mounts['nats-ca']}/ca.crt")

    # The NATS servers include only server.conf from that Secret, next to their own config.
    sts = one(docs, "StatefulSet")
    (config,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    sources = config["projected"]["sources"]
    assert {
        "secret": {"name": f"{RELEASE}-nats-auth", "items": [{"key": "server.conf", "path": "auth.conf"}]}
    } in (sources)
    conf = one(docs, "ConfigMap", f"{RELEASE}-nats-config")["data"]["nats.conf"]
    assert "include ./auth.conf" in conf


def test_the_install_hook_makes_the_callout_keys_before_nats_starts() -> None:
    docs = render()
    job = one(docs, "Job", f"{RELEASE}-nats-auth-hook")
    hook = job["metadata"]["annotations"]
    assert hook["helm.sh/hook"] == "pre-install,pre-upgrade"
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    secret = f"{NAMESPACE}/{RELEASE}-nats-auth"
    assert c["command"] == ["tandem", "nats-config", "--auth-callout", "/tmp/nats-auth", "--secret", secret]
    assert (
        c["image"]
        == one(docs, "Deployment", f"{RELEASE}-authcallout")["spec"]["template"]["spec"]["containers"][0][
            "image"
        ]
    )
    assert mounts_of(pod)["tmp"] == "/tmp"  # where it writes; the root filesystem is read-only
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"]
    assert pod["serviceAccountName"] == f"{RELEASE}-nats-auth-hook" and pod["automountServiceAccountToken"]
    # Its account, role and binding exist before it runs (lower weight) and go with it.
    for kind in ("ServiceAccount", "Role", "RoleBinding"):
        meta = one(docs, kind, f"{RELEASE}-nats-auth-hook")["metadata"]["annotations"]
        assert meta["helm.sh/hook"] == hook["helm.sh/hook"]
        assert int(meta["helm.sh/hook-weight"]) < int(hook["helm.sh/hook-weight"])
        assert "hook-succeeded" in meta["helm.sh/hook-delete-policy"]
    assert (
        find(render(VARIANTS["insecure"]), "Job") == []
        and find(render(VARIANTS["external-nats"]), "Job") == []
    )


def test_generated_nats_ca_signs_a_certificate_for_the_service_and_every_server(tmp_path: Path) -> None:
    docs = render()
    secret = one(docs, "Secret", f"{RELEASE}-nats-tls")
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert f"{RELEASE}-nats.{NAMESPACE}.svc" in names  # what the clients dial
    assert f"*.{RELEASE}-nats-headless.{NAMESPACE}.svc" in names  # what the routes dial
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)

    sts = one(docs, "StatefulSet")
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == secret["metadata"]["name"]
    tls_dir = mounts_of(sts["spec"]["template"]["spec"])["tls"]
    conf = one(docs, "ConfigMap", f"{RELEASE}-nats-config")["data"]["nats.conf"]
    assert conf.count(f"cert_file: {tls_dir}/tls.crt") == 2  # clients and routes
    assert f"ca_file: {tls_dir}/ca.crt" in conf  # routes verify each other

    # Clients: tls:// and the CA, and only the CA of that Secret (never the server's key).
    for comp in (*COMPONENTS, "authcallout"):
        pod = pod_of(docs, comp)
        ca_volume = next(v for v in pod["volumes"] if v["name"] == "nats-ca")
        assert ca_volume["secret"] == {
            "secretName": secret["metadata"]["name"],
            "items": [{"key": "ca.crt", "path": "ca.crt"}],
        }, comp
        assert mounts_of(pod)["nats-ca"] == "/etc/tandem/nats-ca"
    assert settings_from(docs, tmp_path).nats_tls_ca == "/etc/tandem/nats-ca/ca.crt"

    cm = render(VARIANTS["cert-manager"])
    cert_spec = one(cm, "Certificate", f"{RELEASE}-nats")["spec"]
    assert cert_spec["secretName"] == secret["metadata"]["name"]
    assert {"server auth", "client auth"} <= set(cert_spec["usages"])
    assert cert_spec["issuerRef"]["name"] == f"{RELEASE}-nats-ca"
    assert one(cm, "Certificate", f"{RELEASE}-nats-ca")["spec"]["isCA"] is True
    # nats-server reads its certificate at start: the renewed one is loaded by a reload.
    pod = one(cm, "StatefulSet")["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    reloader = next(c for c in pod["containers"] if c["name"] == "tls-reloader")
    assert "--signal reload=/tmp/nats.pid" in reloader["command"][-1]
    assert {m["name"] for m in reloader["volumeMounts"]} == {"tls", "tmp"}
    assert [c["name"] for c in one(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"]] == ["nats"]


# Key material, passwords, the callout's server block, an nkey seed (S + key type + base32).
SECRET_MARKERS = ("PRIVATE KEY", "BEGIN CERTIFICATE", "password", "auth_users", "accounts:")
NKEY_SEED = re.compile(r"\bS[AOUNCX][A-Z2-7]{50,}")


def test_no_configmap_holds_secret_material(variant: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = variant
    maps = find(docs, "ConfigMap")
    assert maps, name
    for cm in maps:
        for key, text in (cm.get("data") or {}).items():
            for marker in SECRET_MARKERS:
                assert marker not in text, (name, cm["metadata"]["name"], key, marker)
            assert not re.search(r"(nats|tls)://[^/\s\"]*@", text), (name, cm["metadata"]["name"], key)
            assert not NKEY_SEED.search(text), (name, cm["metadata"]["name"], key)
        assert not cm.get("binaryData"), cm["metadata"]["name"]
    # Nor a copy of anything the render keeps in a Secret (certificates and keys).
    texts = [t for cm in maps for t in (cm.get("data") or {}).values()]
    for secret in find(docs, "Secret"):
        for key, value in secret.get("data", {}).items():
            plain = base64.b64decode(value).decode()
            body = plain.split("-----")[2].strip()[:64]  # a PEM's first base64 line
            leaked = [t for t in texts if body in t or value[:64] in t]
            assert not leaked, (name, secret["metadata"]["name"], key)


def test_network_policies_admit_only_tandem_to_nats() -> None:
    docs = render()
    by_name = {p["metadata"]["name"]: p for p in find(docs, "NetworkPolicy")}
    deny = by_name[f"{RELEASE}-default-deny"]["spec"]
    assert deny == {
        "podSelector": {
            "matchLabels": {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": RELEASE}
        },
        "policyTypes": ["Ingress"],
    }
    nats = by_name[f"{RELEASE}-nats"]["spec"]
    sts = one(docs, "StatefulSet")
    assert nats["podSelector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    ingress = {r["ports"][0]["port"]: r.get("from") for r in nats["ingress"]}
    assert set(ingress) == {"client", "cluster"}  # monitoring: from nothing by default
    clients = ingress["client"]
    assert clients is not None
    (tandem,) = [p for p in clients if "podSelector" in p]
    (expr,) = tandem["podSelector"]["matchExpressions"]
    assert set(expr["values"]) == {"allocator", "inventory", "admission", "authcallout"}
    assert {p["ipBlock"]["cidr"] for p in clients if "ipBlock" in p} == {"0.0.0.0/0", "::/0"}  # node agents
    assert ingress["cluster"] == [{"podSelector": {"matchLabels": nats["podSelector"]["matchLabels"]}}]
    webhook = by_name[f"{RELEASE}-admission-webhook"]["spec"]
    assert webhook["ingress"] == [{"ports": [{"port": "webhook", "protocol": "TCP"}]}]
    assert f"{RELEASE}-metrics" not in by_name  # nobody scrapes until told who may

    monitored = {p["metadata"]["name"]: p["spec"] for p in find(render(VARIANTS["metrics"]), "NetworkPolicy")}
    monitoring = VARIANTS["metrics"]["networkPolicy"]["metricsFrom"]
    assert monitored[f"{RELEASE}-metrics"]["ingress"] == [
        {"from": monitoring, "ports": [{"port": "ops", "protocol": "TCP"}]}
    ]
    nats_rules = {r["ports"][0]["port"]: r["from"] for r in monitored[f"{RELEASE}-nats"]["ingress"]}
    assert nats_rules["monitor"] == monitoring
    assert [p["ipBlock"]["cidr"] for p in nats_rules["client"] if "ipBlock" in p] == ["10.0.0.0/16"]
    assert find(render(VARIANTS["insecure"]), "NetworkPolicy") == []


def test_one_policy_guards_tandems_pods_and_admission_may_change_only_gated_ones() -> None:
    docs = render()
    policy = one(docs, "ValidatingAdmissionPolicy", PODS_POLICY)
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["pods"]}
    ]
    # No match condition: each would have the API server convert the pod once more.
    assert "matchConditions" not in spec
    assert [
        p["metadata"]["name"]
        for p in find(docs, "ValidatingAdmissionPolicy")
        if "pods" in p["spec"]["matchConstraints"]["resourceRules"][0]["resources"]
    ] == [PODS_POLICY]
    account = one(docs, "ClusterRoleBinding", f"{RELEASE}-admission")["subjects"][0]
    tandem = next(v for v in spec["variables"] if v["name"] == "tandem")
    assert (
        tandem["expression"]
        == f"request.userInfo.username == 'system:serviceaccount:{NAMESPACE}:{account['name']}'"
    )
    names = " ".join(v["expression"] for v in spec["variables"])
    # The label and the gate the webhook sets (services.admission.names).
    assert f"'{admission_names.MANAGED}' in oldObject.metadata.labels" in names
    assert f"g.name == '{admission_names.GATE}'" in names
    binding = one(docs, "ValidatingAdmissionPolicyBinding", PODS_POLICY)["spec"]
    assert binding == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    # Each half can be switched off alone; the policy goes with both.
    patch_only = one(
        render({"admission": {"podGuardPolicy": {"enabled": False}}}),
        "ValidatingAdmissionPolicy",
        PODS_POLICY,
    )["spec"]
    assert patch_only["matchConstraints"]["resourceRules"][0]["operations"] == ["UPDATE"]
    assert all("variables.tandem" in v["expression"] for v in patch_only["validations"])
    guard_only = one(
        render({"admission": {"podPatchPolicy": {"enabled": False}}}),
        "ValidatingAdmissionPolicy",
        PODS_POLICY,
    )["spec"]
    assert len(guard_only["validations"]) == 4
    both_off = {"admission": {"podPatchPolicy": {"enabled": False}, "podGuardPolicy": {"enabled": False}}}
    assert find(render(both_off), "ValidatingAdmissionPolicy", PODS_POLICY) == []


def pods_policy_denials(values: dict[str, Any] | None = None) -> Callable[..., list[str]]:
    """The pods policy's CEL, evaluated (cel-python, its variables in order as the API server
    defines them) on a request: the messages of the validations that deny it."""
    import celpy

    spec = one(render(values), "ValidatingAdmissionPolicy", PODS_POLICY)["spec"]
    env = celpy.Environment()
    variables_cel = [(v["name"], env.program(env.compile(v["expression"]))) for v in spec["variables"]]
    checks = [
        (v.get("message") or v["messageExpression"], env.program(env.compile(v["expression"])))
        for v in spec["validations"]
    ]

    def denied(old: dict[str, Any] | None, new: dict[str, Any], user: str = "alice") -> list[str]:
        act: dict[str, Any] = {
            "request": celpy.json_to_cel(
                {
                    "userInfo": {"username": user},
                    "operation": "UPDATE" if old else "CREATE",
                    "namespace": "ml",
                }
            ),
            "oldObject": celpy.json_to_cel(old or {}),
            "object": celpy.json_to_cel(new),
        }
        variables: dict[str, Any] = {}
        for name, program in variables_cel:  # each may use the ones before it
            act["variables"] = celpy.celtypes.MapType(
                {celpy.celtypes.StringType(k): val for k, val in variables.items()}
            )
            variables[name] = program.evaluate(act)
        act["variables"] = celpy.celtypes.MapType(
            {celpy.celtypes.StringType(k): v for k, v in variables.items()}
        )
        return failing(checks, act)

    return denied


def test_nodeagent_ops_port_binds_its_nodes_address() -> None:
    pod = pod_of(render(), "nodeagent")
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    names = [e["name"] for e in pod["containers"][0]["env"]]
    assert env["TANDEM_OPS_HOST"]["value"] == "$(HOST_IP)" and names.index("HOST_IP") < names.index(
        "TANDEM_OPS_HOST"
    )
    for comp in ("allocator", "inventory", "admission"):
        assert "TANDEM_OPS_HOST" not in container_env(pod_of(render(), comp))  # their own pod network


def test_pod_patch_policy_admits_the_bridges_bind_and_nothing_else() -> None:
    """The patch half on the pods the bridge really patches (the guard half switched off, so
    what is denied here is the patch half's alone)."""
    from tests.unit.test_admission_helpers import deployment_pod, merge_patch
    from tests.unit.test_admission_podrules import assignment, persisted

    denied = pods_policy_denials({"admission": {"podGuardPolicy": {"enabled": False}}})
    bridge = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-admission"
    gated = persisted(deployment_pod(gpu="2", rdma="2"))  # as the webhook left it: label + gate
    bound = merge_patch(gated, admission_podwrites.bind_patch(gated, assignment("gpu-7")))
    assert denied(gated, bound, bridge) == []  # the bridge's own bind

    stranger = copy.deepcopy(gated)
    del stranger["metadata"]["labels"][admission_names.MANAGED]
    stranger["spec"]["schedulingGates"] = []
    assert any(
        "tandem.io/managed" in m for m in denied(stranger, merge_patch(stranger, {"metadata": {}}), bridge)
    )
    started = merge_patch(bound, {"metadata": {"annotations": {"x": "y"}}})
    assert any("scheduling gate" in m for m in denied(bound, started, bridge))  # no longer gated
    unlabelled = merge_patch(gated, {"metadata": {"labels": {admission_names.MANAGED: None}}})
    assert any("tandem.io/managed" in m for m in denied(gated, unlabelled, bridge))
    swapped = copy.deepcopy(gated)
    swapped["spec"]["containers"][0]["image"] = "evil.example/miner:latest"
    assert any("images" in m for m in denied(gated, swapped, bridge))
    assert denied(stranger, swapped, "system:serviceaccount:kube-system:replicaset-controller") == []


def test_guard_policy_keeps_tandems_fields_tandems_and_device_pods_behind_the_webhook() -> None:
    """The whole pods policy on the pods the webhook, the bridge and others really create and
    change. The real API server runs it in tests/cluster/test_bypass.py."""
    from tests.unit.test_admission_helpers import deployment_pod, merge_patch
    from tests.unit.test_admission_podrules import assignment, persisted

    denied = pods_policy_denials()
    bridge = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-admission"

    gated = persisted(deployment_pod(gpu="2", rdma="2"))  # as the webhook left it: label + gate
    assert denied(None, gated) == []  # created through the webhook
    ungated = copy.deepcopy(gated)
    ungated["spec"]["schedulingGates"] = []
    assert any("did not pass" in m for m in denied(None, ungated))  # a namespace the webhook skips
    assert denied(None, deployment_pod(gpu=None, rdma=None)) == []  # no devices asked: not Tandem's
    bound = merge_patch(gated, admission_podwrites.bind_patch(gated, assignment("gpu-7")))
    assert denied(gated, bound, user=bridge) == []  # the bridge's own bind
    assert any(
        "scheduling gate" in m for m in denied(gated, merge_patch(gated, {"spec": {"schedulingGates": []}}))
    )
    assert any(
        "tandem.io/assignment" in m
        for m in denied(
            bound, merge_patch(bound, {"metadata": {"annotations": {admission_names.ASSIGNMENT: "{}"}}})
        )
    )
    assert any(
        "tandem.io/managed" in m
        for m in denied(gated, merge_patch(gated, {"metadata": {"labels": {admission_names.MANAGED: None}}}))
    )
    assert (
        denied(bound, merge_patch(bound, {"metadata": {"annotations": {"team": "ml"}}})) == []
    )  # anything else


def test_webhook_match_condition_selects_pods_that_ask_for_tandem_devices() -> None:
    """The webhook's matchConditions CEL, evaluated (cel-python) on real pod shapes."""
    import celpy

    from tests.unit.test_admission_helpers import deployment_pod

    (webhook,) = one(render(), "MutatingWebhookConfiguration")["webhooks"]
    (condition,) = webhook["matchConditions"]
    env = celpy.Environment()
    program = env.program(env.compile(condition["expression"]))

    def sent(pod: dict[str, Any]) -> bool:
        result = program.evaluate({"object": celpy.json_to_cel(pod)})
        assert isinstance(result, celpy.celtypes.BoolType), result
        return bool(result)

    asks = deployment_pod(gpu="2", rdma="2")
    assert sent(asks)
    plain = copy.deepcopy(asks)
    for c in plain["spec"]["containers"]:
        c["resources"] = {"limits": {"cpu": "1"}}
    assert not sent(plain)
    bare = copy.deepcopy(plain)
    for c in bare["spec"]["containers"]:
        del c["resources"]
    assert not sent(bare)
    init = copy.deepcopy(bare)
    init["spec"]["initContainers"] = [
        {"name": "i", "image": "x", "resources": {"requests": {"tandem.io/gpu": "1"}}}
    ]
    assert sent(init)
