"""What operators deploy, checked here: every Kubernetes manifest against the Kubernetes schemas
(offline, kubernetes-validate), the KServe runtime and InferenceService against KServe's own
generated models of its CRDs, the ServiceMonitor against the fields the Prometheus Operator's CRD
defines for what it uses, and every query of the Grafana dashboard against the metrics the real
server exports."""

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, Server, make_repository

DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.33.0"


def documents(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_kustomization_lists_every_manifest_and_each_exists():
    k = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    listed = set(k["resources"])
    on_disk = {p.name for p in (DEPLOY / "kubernetes").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


@pytest.mark.parametrize("path", sorted((DEPLOY / "kubernetes").glob("*.yaml")), ids=lambda p: p.name)
def test_kubernetes_manifests_validate(path):
    import kubernetes_validate
    for doc in documents(path):
        if doc.get("kind") in ("Kustomization", "ServiceMonitor"):
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_deployment_is_hardened_and_probed():
    (d,) = documents(DEPLOY / "kubernetes" / "deployment.yaml")
    pod = d["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["resources"]["requests"]["cpu"] == c["resources"]["limits"]["cpu"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert "startupProbe" in c
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["FERRITE_HOST"] == "0.0.0.0" and env["FERRITE_LOG_FORMAT"] == "json"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert Path(env["FERRITE_AUTH_TOKEN_FILE"]).parent.as_posix() in mounts
    assert Path(env["FERRITE_TENANT_CONFIG"]).parent.as_posix() in mounts
    (hpa,) = documents(DEPLOY / "kubernetes" / "hpa.yaml")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "ferrite_pending_requests"


# The fields of monitoring.coreos.com/v1 ServiceMonitor that the manifest uses (from the Prometheus
# Operator's CRD): anything else, or a wrong type, is an error.
SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "properties": {"matchLabels": {"type": "object"}}},
                "endpoints": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"}, "path": {"type": "string"},
                        "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        "authorization": {
                            "type": "object", "additionalProperties": False,
                            "properties": {
                                "type": {"type": "string"},
                                "credentials": {"type": "object", "additionalProperties": False, "required": ["key"],
                                                "properties": {"name": {"type": "string"}, "key": {"type": "string"},
                                                               "optional": {"type": "boolean"}}},
                            },
                        },
                    },
                }},
            },
        },
    },
}


def test_the_service_monitor_uses_fields_of_its_crd():
    import jsonschema
    (doc,) = documents(DEPLOY / "kubernetes" / "servicemonitor.yaml")
    jsonschema.validate(doc, SERVICE_MONITOR)
    (svc,) = documents(DEPLOY / "kubernetes" / "service.yaml")
    assert doc["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}


def kserve_check(*args):
    """kserve_models.py (a process of its own: KServe's gRPC stubs and tritonclient's collide in one)."""
    return subprocess.run([sys.executable, str(Path(__file__).with_name("kserve_models.py")), *args],
                          capture_output=True, text=True, timeout=120)


def test_the_kserve_runtime_and_inference_service_fit_kserves_crds():
    r = kserve_check(str(DEPLOY / "kserve" / "servingruntime.yaml"), "V1alpha1ClusterServingRuntime",
                     str(DEPLOY / "kserve" / "inferenceservice.yaml"), "V1beta1InferenceService")
    assert r.returncode == 0, r.stdout + r.stderr
    (runtime,) = documents(DEPLOY / "kserve" / "servingruntime.yaml")
    assert runtime["metadata"]["name"] == "kserve-ferrite"
    spec = runtime["spec"]
    assert {f["name"] for f in spec["supportedModelFormats"]} == {"onnx"}
    assert set(spec["protocolVersions"]) == {"v2", "grpc-v2"}
    (c,) = spec["containers"]
    assert "--model-repository=/mnt/models" in c["args"] and c["ports"][0]["containerPort"] == 8080
    assert c["securityContext"]["runAsNonRoot"] is True
    (isvc,) = documents(DEPLOY / "kserve" / "inferenceservice.yaml")
    assert isvc["spec"]["predictor"]["model"]["runtime"] == "kserve-ferrite"


def test_a_misspelled_field_is_caught(tmp_path):
    (runtime,) = documents(DEPLOY / "kserve" / "servingruntime.yaml")
    runtime["spec"]["containers"][0]["argz"] = []
    bad = tmp_path / "runtime.yaml"
    bad.write_text(yaml.safe_dump(runtime))
    r = kserve_check(str(bad), "V1alpha1ClusterServingRuntime")
    assert r.returncode == 1 and "'argz' is not a field of V1Container" in r.stdout, r.stdout + r.stderr


def test_every_dashboard_query_names_an_exported_metric(tmp_path):
    dashboard = json.loads((DEPLOY / "grafana" / "ferrite.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    named = {m for e in exprs for m in re.findall(r"\b((?:ferrite|process)_[a-z_]+)\b", e)}
    assert any(v["name"] == "model" for v in dashboard["templating"]["list"])
    # As deployed (deploy/kubernetes): with tenants.
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("[default]\nrate = 100\n[tenants.acme]\nrate = 10\n")
    s = Server(make_repository(tmp_path / "repo", ("mlp",)), "--tenant-header", "x-tenant", "--tenant-config", str(tenants))
    try:
        body = urllib.request.urlopen(s.metrics_url, timeout=10).read().decode()
    finally:
        s.stop()
    families = set(re.findall(r"^# TYPE (\S+) (\S+)", body, re.M))
    exported = set()
    for name, kind in families:
        exported.add(name)
        if kind == "histogram":
            exported |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    missing = sorted(named - exported)
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"


@pytest.mark.parametrize("path", sorted((DEPLOY / "kubernetes" / "redis-cluster").glob("*.yaml")), ids=lambda p: p.name)
def test_the_redis_cluster_overlay_validates(path):
    import kubernetes_validate
    for doc in documents(path):
        if doc.get("kind") == "Kustomization":
            assert "../" in doc["resources"]
            (patch,) = doc["patches"]
            (op,) = yaml.safe_load(patch["patch"])
            assert op["path"] == "/spec/template/spec/containers/0/env/-"
            assert op["value"]["name"] == "FERRITE_CACHE_REDIS_URL" and op["value"]["value"].startswith("redis+cluster://")
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_redis_cluster_is_six_nodes_announcing_hostnames():
    docs = {d["kind"]: d for d in documents(DEPLOY / "kubernetes" / "redis-cluster" / "redis-cluster.yaml")}
    conf = docs["ConfigMap"]["data"]["redis.conf"]
    assert "cluster-enabled yes" in conf and "maxmemory-policy allkeys-lru" in conf
    assert docs["StatefulSet"]["spec"]["replicas"] == 6 and docs["Service"]["spec"]["clusterIP"] == "None"
    assert "--cluster-replicas 1" in docs["Job"]["spec"]["template"]["spec"]["containers"][0]["args"][0]


def test_the_haproxy_example_is_valid_and_checks_readiness():
    import shutil
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    cfg = DEPLOY / "haproxy" / "haproxy.cfg"
    r = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert cfg.read_text().count("option httpchk GET /v2/health/ready") == 2
