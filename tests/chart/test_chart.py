"""The Helm chart, rendered and linted by the Helm SDK (``helm-python-sdk``, no helm binary),
every manifest validated against the Kubernetes OpenAPI schema (``kubernetes-validate --strict``).

Variants: default values (chart-generated CA, external NATS), cert-manager, bundled NATS, and
external NATS with a credentials Secret. Beyond schema validity the tests check the wiring a
schema cannot see: the webhook's caBundle signs the serving certificate whose names cover the
Service the webhook calls; only the node agent is privileged; RBAC is the minimum the bridge
needs; the rendered config file loads into the services' Settings.
"""

from __future__ import annotations

import base64
import importlib.util
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from cryptography import x509

from services.runtime.settings import load_settings

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "tandem"
RELEASE, NAMESPACE = "tandem", "tandem-system"
K8S = kubernetes_validate.latest_version()
# Custom resources have no schema in kubernetes-validate; their fields are asserted below.
CRD_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/")

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "cert-manager": {"admission": {"certManager": {"enabled": True}}},
    "bundled-nats": {"nats": {"bundled": True}, "metrics": {"serviceMonitor": {"enabled": True}}},
    "external-nats": {
        "nats": {
            "url": "tls://nats.messaging.svc:4222",
            "credentialsSecret": {"name": "tandem-nats-creds", "key": "tandem.creds"},
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
}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
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

    secret = one(docs, "Secret")
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
    assert find(docs, "Secret") == []  # cert-manager writes it
    hook = one(docs, "MutatingWebhookConfiguration")
    (webhook,) = hook["webhooks"]
    assert "caBundle" not in webhook["clientConfig"]
    cert = one(docs, "Certificate")
    assert (
        hook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
        == f"{NAMESPACE}/{cert['metadata']['name']}"
    )
    svc = webhook["clientConfig"]["service"]["name"]
    assert f"{svc}.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]
    issuer = one(docs, "Issuer")
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
    assert find(own, "Issuer") == []
    assert one(own, "Certificate")["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer"}


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


def test_rbac_is_the_minimum_the_bridge_needs(variant: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = variant
    admission_sa = f"{RELEASE}-admission"
    (cluster_role,) = find(docs, "ClusterRole")
    assert rules(cluster_role) == {
        ("", "pods", "get", ()),
        ("", "pods", "list", ()),
        ("", "pods", "watch", ()),
        ("", "pods", "patch", ()),
        ("", "events", "create", ()),
        ("", "events", "get", ()),
        ("", "events", "patch", ()),
    }
    (role,) = find(docs, "Role")
    assert rules(role) == {
        ("coordination.k8s.io", "leases", "create", ()),
        ("coordination.k8s.io", "leases", "get", (f"{RELEASE}-bridge",)),
        ("coordination.k8s.io", "leases", "patch", (f"{RELEASE}-bridge",)),
    }
    for binding in find(docs, "ClusterRoleBinding") + find(docs, "RoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": admission_sa, "namespace": NAMESPACE}
        ]
    for doc in docs:
        assert "*" not in str(doc.get("rules", "")), doc["metadata"]["name"]
    # Components that do not talk to the Kubernetes API get no token.
    for w in workloads(docs):
        pod = w["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is (component(w) == "admission"), component(w)
    lease_arg = next(w for w in workloads(docs) if component(w) == "admission")["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert lease_arg[lease_arg.index("--lease-name") + 1] == f"{RELEASE}-bridge"


def test_single_admission_replica_runs_without_leader_election() -> None:
    docs = render({"admission": {"replicas": 1}})
    deploy = one(docs, "Deployment", f"{RELEASE}-admission")
    assert "--leader-elect" not in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert find(docs, "Role") == [] and find(docs, "PodDisruptionBudget", f"{RELEASE}-admission") == []


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
        if comp == "nodeagent":
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


def test_external_nats_credentials_are_mounted_where_settings_point(tmp_path: Path) -> None:
    docs = render(VARIANTS["external-nats"])
    assert find(docs, "StatefulSet") == []
    for w in workloads(docs):
        (c,) = w["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        assert volumes["nats-creds"]["secret"]["secretName"] == "tandem-nats-creds"
        assert env["TANDEM_NATS_CREDS"] == f"{mounts['nats-creds']}/tandem.creds"


def test_bundled_nats_is_a_clustered_jetstream_statefulset(tmp_path: Path) -> None:
    docs = render(VARIANTS["bundled-nats"])
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
    one(docs, "Service", headless)
    client = one(docs, "Service", sts["metadata"]["name"])
    s = settings_from(docs, tmp_path)
    assert s.nats_url == f"nats://{client['metadata']['name']}.{NAMESPACE}.svc:4222"
    assert s.stream_replicas == 3  # R3 streams on the 3-server cluster
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert one(docs, "PodDisruptionBudget", sts["metadata"]["name"])["spec"]["maxUnavailable"] == 1
    monitor = one(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]


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


def test_chart_image_make_image_and_pyproject_agree_on_the_version() -> None:
    """The image ``make image`` builds is the one the chart deploys by default."""
    root = CHART.parents[2]
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version, "Chart.yaml appVersion must follow pyproject.toml's version"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    images = {c["image"] for w in workloads(render()) for c in w["spec"]["template"]["spec"]["containers"]}
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
    pinned = {
        c["image"]
        for w in workloads(render({"image": {"tag": "9.9.9"}}))
        for c in w["spec"]["template"]["spec"]["containers"]
    }
    assert pinned == {f"{values['image']['repository']}:9.9.9"}
