"""The Helm chart: lint, render every mode, validate every manifest against the Kubernetes schemas,
refuse bad values, and hand the bridge a config it accepts.

helm comes from ``tools/helm.sh`` (built once with ``go install`` into the cache; about five
minutes the first time on two cores, then instant). Kubernetes object schemas come from the
``kubernetes-validate`` package (offline); prometheus-operator objects are checked against the small
schemas below, and the PrometheusRule's groups with ``promtool check rules``. When helm or the
schemas cannot be had the tests are skipped, or fail under ``CI=true``.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.conftest import unavailable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]  # the first run builds helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kv-event-bridge"
K8S_VERSIONS = ["1.29", "1.37"]  # native sidecars need 1.29; the newest schemas kubernetes-validate ships
CASES = {
    "default": [],
    "deployment": ["ci/deployment-values.yaml"],
    "sharded": ["ci/sharded-values.yaml"],
    "sidecar": ["ci/sidecar-values.yaml"],
}
ENV = {"POD_NAME": "release-kv-event-bridge-1", "POD_NAMESPACE": "ml", "KAFKA_PASSWORD": "secret"}

Manifest = dict[str, Any]


@pytest.fixture(scope="session")
def helm() -> str:
    try:
        out = subprocess.run(["bash", str(ROOT / "tools" / "helm.sh")], capture_output=True, text=True, timeout=1500)
    except (OSError, subprocess.TimeoutExpired) as exc:
        unavailable("helm", exc)
    if out.returncode != 0:
        unavailable("helm", f"tools/helm.sh failed:\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def kubernetes_validate() -> Any:
    try:
        import kubernetes_validate
    except ImportError as exc:
        unavailable("kubernetes-validate (pip install kubernetes-validate)", exc)
    return kubernetes_validate


def _helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, cwd=CHART)
    if check and out.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{out.stderr}")
    return out


def _template_args(files: list[str], sets: list[str]) -> list[str]:
    args = ["template", "rel", ".", "--namespace", "ml"]
    for f in files:
        args += ["-f", f]
    for s in sets:
        args += ["--set", s]
    return args


def render(helm: str, files: list[str] = [], sets: list[str] = []) -> list[Manifest]:  # noqa: B006
    out = _helm(helm, *_template_args(files, sets))
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[Manifest], kind: str, name_suffix: str = "") -> Manifest:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind}*{name_suffix}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def containers(doc: Manifest) -> list[Manifest]:
    spec = doc["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def config_text(docs: list[Manifest]) -> str:
    """The rendered config.yaml, from the Secret that holds it."""
    secrets = [d for d in docs if d["kind"] == "Secret" and "config.yaml" in d.get("data", {})]
    assert len(secrets) == 1, [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"]
    return base64.b64decode(secrets[0]["data"]["config.yaml"]).decode()


def config_of(docs: list[Manifest]) -> dict[str, Any]:
    return yaml.safe_load(config_text(docs))  # type: ignore[no-any-return]


def bridge_check(tmp_path: Path, docs: list[Manifest]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "config.yaml"
    path.write_text(config_text(docs))
    return subprocess.run(
        [sys.executable, "-m", "bridge", "--config", str(path), "--check", "--offline"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **ENV},
    )


# -- prometheus-operator objects: just enough schema to catch a broken template --------------------

_META = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}, "labels": {"type": "object"}}}
_RELABELS = {"type": "array", "items": {"type": "object"}}
_ENDPOINT = {
    "type": "object",
    "required": ["port"],
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "interval": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
        "scrapeTimeout": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
        "relabelings": _RELABELS,
        "metricRelabelings": _RELABELS,
    },
    "additionalProperties": False,
}
_SELECTOR = {
    "type": "object",
    "properties": {"matchLabels": {"type": "object", "minProperties": 1, "additionalProperties": {"type": "string"}}},
    "required": ["matchLabels"],
}


def _operator_object(spec: dict[str, Any]) -> dict[str, Any]:
    """A prometheus-operator object (monitoring.coreos.com/v1) whose spec has exactly ``spec``'s properties."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "metadata": _META,
            "spec": {"type": "object", **spec, "additionalProperties": False},
        },
    }


def _monitor(endpoints: str) -> dict[str, Any]:
    """ServiceMonitor and PodMonitor: the same but for the name of the endpoints list."""
    return _operator_object(
        {
            "required": ["selector", endpoints],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": {"type": "object"},
                endpoints: {"type": "array", "minItems": 1, "items": _ENDPOINT},
            },
        }
    )


_RULE = {
    "type": "object",
    "required": ["expr"],
    "properties": {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"type": ["string", "integer"]},
        "for": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
_GROUP = {
    "type": "object",
    "required": ["name", "rules"],
    "properties": {"name": {"type": "string"}, "rules": {"type": "array", "items": _RULE}},
}
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _monitor("endpoints"),
    "PodMonitor": _monitor("podMetricsEndpoints"),
    "PrometheusRule": _operator_object(
        {"required": ["groups"], "properties": {"groups": {"type": "array", "minItems": 1, "items": _GROUP}}}
    ),
}


def validate(kv: Any, doc: Manifest) -> None:
    kind = doc["kind"]
    if kind in CRD_SCHEMAS:
        import jsonschema

        jsonschema.validate(doc, CRD_SCHEMAS[kind])
        return
    for version in K8S_VERSIONS:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            raise AssertionError(f"{kind}/{doc['metadata']['name']} invalid for Kubernetes {version}: {exc}") from exc


def sidecar_patched_deployment(docs: list[Manifest]) -> Manifest:
    """A vLLM Deployment with the chart's patch.yaml applied the way `kubectl patch` merges it
    (containers, initContainers and volumes by name; annotations by key)."""
    patch = yaml.safe_load(by_kind(docs, "ConfigMap", "-sidecar")["data"]["patch.yaml"])
    vllm: Manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vllm", "namespace": "ml"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app.kubernetes.io/name": "vllm"}},
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/name": "vllm"}},
                "spec": {
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai:latest",
                            "args": ["--model", "m", "--kv-events-config", '{"enable_kv_cache_events": true}'],
                            "ports": [{"name": "http", "containerPort": 8000}],
                            "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
                        }
                    ],
                    "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
                },
            },
        },
    }
    out = copy.deepcopy(vllm)
    tmpl, ptmpl = out["spec"]["template"], patch["spec"]["template"]
    tmpl["metadata"].setdefault("annotations", {}).update(ptmpl["metadata"]["annotations"])
    for key in ("containers", "initContainers", "volumes"):
        if key in ptmpl["spec"]:
            have = {c["name"] for c in tmpl["spec"].get(key, [])}
            assert not have & {c["name"] for c in ptmpl["spec"][key]}, f"{key} names clash with the vLLM pod's"
            tmpl["spec"].setdefault(key, []).extend(ptmpl["spec"][key])
    return out


# -- tests ----------------------------------------------------------------------------------------


def test_values_schema_is_generated_from_the_config_structs() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "chart_schema.py"), "--check"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr


def test_chart_readme_is_generated_from_the_values(helm: str, tmp_path: Path) -> None:
    tool = [sys.executable, str(ROOT / "tools" / "chart_readme.py"), "--check"]
    out = subprocess.run(tool, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    shown = _helm(helm, "show", "readme", ".").stdout
    assert shown.rstrip("\n") == (CHART / "README.md").read_text().rstrip("\n")
    assert "[`ci/deployment-values.yaml`](ci/deployment-values.yaml)" in shown
    assert (CHART / "ci" / "deployment-values.yaml").read_text().strip() in shown
    values_text = (CHART / "values.yaml").read_text()
    for key in yaml.safe_load(values_text):
        assert f"| `{key}" in shown, f"{key} is not in the chart README"
    assert "| `config.checkpoint.from_sinks` | `true` | Ask the sinks where each stream stands" in shown
    # an edited description, without regenerating, is drift
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "values.yaml").write_text(values_text.replace("# -- Pin an image digest", "# -- Pin a digest"))
    out = subprocess.run([*tool, "--chart", str(chart)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 1 and "README.md is out of date: run python tools/chart_readme.py" in out.stderr


@pytest.mark.parametrize("case", sorted(CASES))
def test_lint_is_clean(helm: str, case: str) -> None:
    args = ["lint", "--strict", "."]
    for f in CASES[case]:
        args += ["-f", f]
    out = _helm(helm, *args)
    assert "0 chart(s) failed" in out.stdout
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_manifest_validates(helm: str, kubernetes_validate: Any, case: str) -> None:
    docs = render(helm, CASES[case])
    assert docs
    for doc in docs:
        validate(kubernetes_validate, doc)
    if case == "sidecar":
        validate(kubernetes_validate, sidecar_patched_deployment(docs))


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_config_passes_the_bridge_check(helm: str, tmp_path: Path, case: str) -> None:
    out = bridge_check(tmp_path, render(helm, CASES[case]))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "config ok" in out.stdout
    assert "warning" not in out.stderr  # no secret in plain text: the chart's way is secretEnv


def test_default_is_one_hardened_deployment(helm: str) -> None:
    docs = render(helm)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment", "Secret", "Service", "ServiceAccount"]
    dep = by_kind(docs, "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["args"] == ["--config", "/etc/kv-event-bridge/config.yaml"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["ports"] == [{"name": "metrics", "containerPort": 9300, "protocol": "TCP"}]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts == {"/etc/kv-event-bridge": "config", "/var/lib/kv-event-bridge": "checkpoint", "/tmp": "tmp"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["checkpoint"] and "emptyDir" in volumes["tmp"]
    assert by_kind(docs, "Service")["spec"]["ports"][0]["port"] == 9300


def test_deployment_with_secrets_persistence_and_monitoring(helm: str) -> None:
    docs = render(helm, CASES["deployment"])
    (c,) = containers(by_kind(docs, "Deployment"))
    secret = next(e for e in c["env"] if e["name"] == "KAFKA_PASSWORD")
    assert secret["valueFrom"] == {"secretKeyRef": {"name": "kafka-credentials", "key": "password"}}
    assert config_of(docs)["sinks"][0]["sasl_password"] == "${KAFKA_PASSWORD}"  # verbatim: the bridge substitutes
    pvc = by_kind(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["storageClassName"] == "fast" and pvc["spec"]["resources"]["requests"]["storage"] == "256Mi"
    volumes = {v["name"]: v for v in by_kind(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["checkpoint"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    sm = by_kind(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert by_kind(docs, "PrometheusRule")["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_dashboard_and_rules_embed_the_files(helm: str, tmp_path: Path, promtool: str) -> None:
    docs = render(helm, CASES["deployment"])
    dash = by_kind(docs, "ConfigMap", "-dashboard")
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dash["metadata"]["annotations"] == {"grafana_folder": "Inference"}
    (text,) = dash["data"].values()
    assert json.loads(text) == json.loads((CHART / "files" / "dashboard.json").read_text())
    rule = by_kind(docs, "PrometheusRule")
    source = yaml.safe_load((CHART / "files" / "alerts.rules.yaml").read_text())
    assert rule["spec"]["groups"] == source["groups"]  # {{ $labels.x }} templates untouched
    rules_file = tmp_path / "rendered.rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_monitoring_objects_toggle(helm: str) -> None:
    kinds = {d["kind"] for d in render(helm)}
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    sets = ["serviceMonitor.enabled=true", "prometheusRule.enabled=true", "grafanaDashboard.enabled=true"]
    docs = render(helm, sets=sets)
    assert {"ServiceMonitor", "PrometheusRule"} <= {d["kind"] for d in docs}
    assert by_kind(docs, "ConfigMap", "-dashboard")["metadata"]["labels"]["grafana_dashboard"] == "1"
    for s in sets:
        assert len(render(helm, sets=[s])) == len(render(helm)) + 1, s


def test_sharded_statefulset(helm: str, tmp_path: Path) -> None:
    docs = render(helm, CASES["sharded"])
    sts = by_kind(docs, "StatefulSet")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["serviceName"] == by_kind(docs, "Service", "-headless")["metadata"]["name"]
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "checkpoint"
    assert not [d for d in docs if d["kind"] in ("Deployment", "PersistentVolumeClaim")]
    shard = config_of(docs)["discovery"]["dns"]["shard"]
    assert shard == {"count": 3, "index": "auto", "pod_name": "${POD_NAME}"}
    # scaling changes the config, so every shard restarts with the new count
    three = by_kind(docs, "StatefulSet")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    four = by_kind(render(helm, CASES["sharded"], ["replicas=4"]), "StatefulSet")
    assert four["spec"]["template"]["metadata"]["annotations"]["checksum/config"] != three


def test_config_change_rolls_the_pods(helm: str) -> None:
    def checksum(sets: list[str]) -> str:
        dep = by_kind(render(helm, sets=sets), "Deployment")
        return str(dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    assert checksum([]) == checksum([])
    assert checksum([]) != checksum(["config.log.level=debug"])
    assert checksum([]) == checksum(["resources.limits.memory=2Gi"])  # not a config change


def test_sidecar_renders_a_patch_and_no_workload(helm: str) -> None:
    docs = render(helm, CASES["sidecar"])
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "ConfigMap", "PodMonitor", "PrometheusRule", "Secret"]
    config = config_of(docs)
    assert "discovery" not in config and config["sources"][0]["name"] == "${POD_NAME}"
    patched = sidecar_patched_deployment(docs)
    (bridge,) = patched["spec"]["template"]["spec"]["initContainers"]
    assert bridge["restartPolicy"] == "Always"  # native sidecar: outlives the engine at shutdown
    assert "readinessProbe" not in bridge  # a broker outage must not take the engine out of its Service
    assert bridge["securityContext"]["runAsUser"] == 10001
    mounts = {m["name"] for m in bridge["volumeMounts"]}
    assert mounts == {v["name"] for v in patched["spec"]["template"]["spec"]["volumes"]} - {"shm"}
    pm = by_kind(docs, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "vllm"}
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == bridge["ports"][0]["name"]

    plain = render(helm, CASES["sidecar"], ["sidecar.native=false"])
    patch = yaml.safe_load(by_kind(plain, "ConfigMap", "-sidecar")["data"]["patch.yaml"])
    assert [c["name"] for c in patch["spec"]["template"]["spec"]["containers"]] == ["kv-event-bridge"]
    assert "restartPolicy" not in patch["spec"]["template"]["spec"]["containers"][0]


# -- defaults that do not surprise an operator --------------------------------------------------


def values_file(tmp_path: Path, values: dict[str, Any], name: str = "values.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(values))
    return str(path)


def test_listing_sources_turns_the_default_discovery_off(helm: str, tmp_path: Path) -> None:
    default = config_of(render(helm))
    assert default["discovery"]["dns"]["name"] == "vllm-kv.${POD_NAMESPACE}.svc.cluster.local"
    assert "sources" not in default
    sources = [{"name": "a", "endpoint": "tcp://10.0.0.1:5557"}]
    listed = render(helm, [values_file(tmp_path, {"config": {"sources": sources}})])
    assert "discovery" not in config_of(listed) and config_of(listed)["sources"] == sources
    dropped = config_of(render(helm, [values_file(tmp_path, {"config": {"sources": sources, "discovery": None}})]))
    assert "discovery" not in dropped and dropped["sources"] == sources  # the old recipe still works
    asked = {"config": {"sources": sources, "discovery": {"dns": {"name": "vllm.ml.svc.cluster.local", "port": 5557}}}}
    both = config_of(render(helm, [values_file(tmp_path, asked)]))
    assert both["discovery"]["dns"]["name"] == "vllm.ml.svc.cluster.local" and both["sources"] == sources
    out = bridge_check(tmp_path, listed)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_replaced_pod_asks_the_sinks_in_every_mode(helm: str, case: str) -> None:
    assert config_of(render(helm, CASES[case]))["checkpoint"]["from_sinks"] is True
    off = render(helm, CASES[case], ["config.checkpoint.from_sinks=false"])
    assert config_of(off)["checkpoint"]["from_sinks"] is False


@pytest.mark.parametrize("mode", ["deployment", "sidecar"])
def test_a_literal_password_never_lands_in_a_configmap(helm: str, tmp_path: Path, mode: str) -> None:
    password = "hunter2-in-plain-values"
    sink = {"type": "kafka", "bootstrap_servers": "kafka:9092", "topic": "kv", "sasl_password": password}
    docs = render(helm, [values_file(tmp_path, {"mode": mode, "config": {"sinks": [sink]}})])
    leaks = [f"{d['kind']}/{d['metadata']['name']}" for d in docs if d["kind"] != "Secret" and password in yaml.safe_dump(d)]
    assert not leaks, f"the password is readable in {leaks}"
    assert config_of(docs)["sinks"][0]["sasl_password"] == password
    pod = sidecar_patched_deployment(docs) if mode == "sidecar" else by_kind(docs, "Deployment")
    volumes = {v["name"]: v for v in pod["spec"]["template"]["spec"]["volumes"]}
    (config_volume,) = [v for name, v in volumes.items() if name.endswith("config")]
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert config_volume["secret"] == {"secretName": secret["metadata"]["name"]}


def test_memory_limit_must_hold_the_sinks_queues(helm: str, tmp_path: Path) -> None:
    sinks = [
        {"type": "kafka", "name": "a", "bootstrap_servers": "kafka:9092", "topic": "kv"},
        {"type": "redis", "name": "b", "url": "redis://redis:6379/0"},
    ]
    out = _helm(helm, *_template_args([values_file(tmp_path, {"config": {"sinks": sinks}})], []), check=False)
    assert out.returncode != 0, "two sinks with 64 MiB queues passed a 1Gi limit"
    assert (
        "resources.limits.memory 1Gi (1024 MiB) is below what the sinks' queues may hold: "
        "128 MiB + 9 x 64 MiB (sinks[0] a) + 9 x 64 MiB (sinks[1] b) = 1280 MiB" in out.stderr
    ), out.stderr
    assert "Raise resources.limits.memory to at least 1280 MiB or lower the sinks' queue.max_bytes" in out.stderr
    small = [{**s, "queue": {"max_bytes": "16MiB"}} for s in sinks]
    render(helm, [values_file(tmp_path, {"config": {"sinks": small}})])  # 128 + 2 x 144 MiB fits
    render(helm, [values_file(tmp_path, {"config": {"sinks": sinks}})], ["resources.limits.memory=1.25Gi"])
    render(helm, [values_file(tmp_path, {"config": {"sinks": sinks}})], ["resources.limits=null"])  # no limit
    render(helm, [values_file(tmp_path, {"config": {"sinks": sinks}, "resources": {"limits": {"memory": 1500 * 2**20}}})])
    bytes_bound = [{**sinks[0], "queue": {"max_bytes": 100 * 2**20}}]
    out = _helm(
        helm,
        *_template_args([values_file(tmp_path, {"config": {"sinks": bytes_bound}})], ["resources.limits.memory=512M"]),
        check=False,
    )
    assert "resources.limits.memory 512M (488.3 MiB)" in out.stderr and "9 x 100 MiB (sinks[0] a) = 1028 MiB" in out.stderr, (
        out.stderr
    )
    # a ${VAR} bound is known only in the pod: not checked
    unknown = [{**s, "queue": {"max_bytes": "${QUEUE_BYTES}"}} for s in sinks]
    render(helm, [values_file(tmp_path, {"config": {"sinks": unknown}})])


@pytest.mark.parametrize("mode", ["deployment", "sidecar"])
def test_default_sink_keeps_token_ids_out_of_the_pod_log(helm: str, mode: str) -> None:
    docs = render(helm, sets=[f"mode={mode}"])
    (sink,) = config_of(docs)["sinks"]
    assert sink["type"] == "file" and sink["path"] == "-"
    assert sink["token_ids"] == "drop"


@pytest.mark.parametrize("values", [["ci/sidecar-values.yaml"], []], ids=["ci-values", "mode-only"])
def test_sidecar_reads_its_engine_on_loopback_and_binds(helm: str, tmp_path: Path, values: list[str]) -> None:
    docs = render(helm, values, ["mode=sidecar"])
    config = config_of(docs)
    assert "discovery" not in config
    (source,) = config["sources"]
    assert source["name"] == "${POD_NAME}"
    assert source["endpoint"] == "tcp://127.0.0.1:5557" and source["bind"] is True
    assert source["replay_endpoint"] == "tcp://127.0.0.1:5558"
    out = bridge_check(tmp_path, docs)
    assert out.returncode == 0, out.stdout + out.stderr


def test_disruption_budget_only_for_shards(helm: str) -> None:
    assert not [d for d in render(helm) if d["kind"] == "PodDisruptionBudget"]
    assert not [d for d in render(helm, CASES["sharded"], ["replicas=1"]) if d["kind"] == "PodDisruptionBudget"]
    pdb = by_kind(render(helm, CASES["sharded"]), "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    sts = by_kind(render(helm, CASES["sharded"]), "StatefulSet")
    assert pdb["spec"]["selector"] == sts["spec"]["selector"]


BAD_VALUES: list[tuple[str, dict[str, Any], str]] = [
    ("unknown mode", {"mode": "daemonset"}, "value must be one of 'deployment', 'sidecar'"),
    ("typo at the top", {"replica": 3}, "additional properties 'replica' not allowed"),
    ("bad sink format", {"config": {"sinks": [{"type": "file", "format": "yaml"}]}}, "/config/sinks/0/format"),
    ("unknown sink key", {"config": {"sinks": [{"type": "file", "pathh": "-"}]}}, "'pathh' not allowed"),
    ("kafka without servers", {"config": {"sinks": [{"type": "kafka", "topic": "t"}]}}, "missing property 'bootstrap_servers'"),
    ("unknown config key", {"config": {"sinkz": []}}, "additional properties 'sinkz' not allowed"),
    ("bad duration", {"config": {"checkpoint": {"interval": "soon"}}}, "/config/checkpoint/interval"),
    ("port out of range", {"config": {"discovery": {"dns": {"name": "vllm-kv", "port": 70000}}}}, "/config/discovery"),
    ("secret without key", {"secretEnv": [{"name": "X", "secretName": "s"}]}, "missing property 'key'"),
    ("bad env name", {"secretEnv": [{"name": "1X", "secretName": "s", "key": "k"}]}, "does not match pattern"),
    ("replicas without sharding", {"replicas": 2}, "replicas > 1 needs sharding.enabled"),
    ("checkpoint off the volume", {"config": {"checkpoint": {"path": "/data/c.json"}}}, "must be under checkpoint.mountPath"),
    (
        "sharding without discovery",
        {
            "sharding": {"enabled": True},
            "config": {"discovery": None, "sources": [{"name": "a", "endpoint": "tcp://10.0.0.1:5557"}]},
        },
        "sharding.enabled needs config.discovery.dns",
    ),
    ("metrics disabled", {"config": {"metrics": {"listen": ""}}}, "config.metrics.listen must be host:port"),
    # breaker30h H1: the probes, Service and scrapes reach the pod IP; a loopback listener never answers them
    *(
        (f"metrics on loopback {listen} ({mode})", {"mode": mode, "config": {"metrics": {"listen": listen}}}, message)
        for listen, mode in [
            ("127.0.0.1:9300", "sidecar"),
            ("127.0.0.1:9300", "deployment"),
            ("localhost:9300", "sidecar"),
            ("[::1]:9300", "deployment"),
        ]
        for message in [
            f'config.metrics.listen "{listen}" listens on loopback only: the kubelet\'s probes, the Service and Prometheus '
            "reach the pod IP, where nothing would answer (the probes fail and the pod restarts for ever). Listen on "
            "0.0.0.0:9300 (or [::]:9300) and admit the port only from Prometheus with a NetworkPolicy"
        ]
    ),
    ("PodMonitor without selector", {"mode": "sidecar", "serviceMonitor": {"enabled": True}}, "needs sidecar.podSelector"),
    ("bad image digest", {"image": {"digest": "latest"}}, "/image/digest"),
    ("bad pdb", {"podDisruptionBudget": {"maxUnavailable": "half"}}, "/podDisruptionBudget/maxUnavailable"),
]


@pytest.mark.parametrize(("what", "values", "message"), BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_values_are_refused(helm: str, tmp_path: Path, what: str, values: dict[str, Any], message: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(values))
    out = _helm(helm, *_template_args([str(f)], []), check=False)
    assert out.returncode != 0, f"{what}: helm accepted it"
    assert message in out.stderr, out.stderr


@pytest.mark.parametrize("listen", ["[::]:9301", "0.0.0.0:9301", "10.1.2.3:9301", "[::10]:9301"])
def test_a_metrics_listener_the_pod_ip_reaches_renders_probes_on_its_port(helm: str, listen: str) -> None:
    """The loopback check (breaker30h H1) refuses only loopback: every address, the pod's own, or
    an IPv6 address ending in 1 that is not ::1 renders as before, its port on the probes."""
    docs = render(helm, sets=[f"config.metrics.listen={listen}"])
    (c,) = by_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert c["ports"] == [{"name": "metrics", "containerPort": 9301, "protocol": "TCP"}]
    assert config_of(docs)["metrics"]["listen"] == listen


def test_env_placeholders_pass_the_schema(helm: str, tmp_path: Path) -> None:
    f = tmp_path / "env.yaml"
    values = {"config": {"discovery": {"dns": {"name": "vllm-kv", "port": "${ENGINE_PORT:-5557}", "interval": "${INTERVAL}"}}}}
    f.write_text(yaml.safe_dump(values))
    docs = render(helm, [str(f)])
    assert config_of(docs)["discovery"]["dns"]["port"] == "${ENGINE_PORT:-5557}"


def test_notes_render(helm: str, tmp_path: Path) -> None:
    # NOTES.txt is rendered only by `helm install`, which wants a cluster even with --dry-run here:
    # render it through tpl inside a ConfigMap in a copy of the chart instead.
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "notes-under-test.txt").write_text((CHART / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data:\n  notes: {{ tpl (.Files.Get "notes-under-test.txt") . | toJson }}\n'
    )

    def notes(*files: str, sets: tuple[str, ...] = ()) -> str:
        args = ["template", "rel", str(chart), "--namespace", "ml", "--show-only", "templates/zz-notes.yaml"]
        for f in files:
            args += ["-f", str(CHART / f)]
        for s in sets:
            args += ["--set", s]
        return str(yaml.safe_load(_helm(helm, *args).stdout)["data"]["notes"])

    sidecar = notes("ci/sidecar-values.yaml")
    assert "kubectl -n ml patch deployment YOUR-VLLM-DEPLOYMENT --patch-file kv-event-bridge-patch.yaml" in sidecar
    assert '{{- include "kv-event-bridge.sidecar.container" (index .Subcharts "kv-event-bridge") | nindent 8 }}' in sidecar
    default = notes()
    assert "port-forward svc/rel-kv-event-bridge 9300:9300" in default
    assert "are both off" not in default  # from_sinks is on by default
    assert "checkpoint.persistence.enabled and config.checkpoint.from_sinks are both off" in notes(
        sets=("config.checkpoint.from_sinks=false",)
    )
    assert '"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"' in sidecar
    assert "3 shards (StatefulSet rel-kv-event-bridge)" in notes("ci/sharded-values.yaml")
