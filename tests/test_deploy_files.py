"""Deployment files checked offline, as CI can: Kubernetes manifests (each file and the
kustomize output) against the Kubernetes API schemas in strict mode, the shell scripts with
shellcheck, the Dockerfile with hadolint. The tools come from PyPI (dev extras); a missing
tool fails here rather than skipping."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
KUBERNETES_VERSION = "1.34.0"  # the version the manifests are written for (kind's node)
BIN = Path(sys.executable).parent
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "ClusterRole", "ClusterRoleBinding"}


def tool(name: str) -> str:
    path = BIN / name
    assert path.exists(), f"{name} is missing from {BIN}: install the dev extras"
    return str(path)


def kustomize_build(directory: Path) -> list[dict[str, Any]]:
    """The subset of `kustomize build` this base uses: resources, namespace, labels.

    Anything else in the kustomization fails loudly rather than being ignored.
    """
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - {"apiVersion", "kind", "namespace", "labels", "resources"}
    assert not unknown, f"kustomization fields this renderer does not handle: {unknown}"
    labels: dict[str, str] = {}
    for entry in spec.get("labels", []):
        assert set(entry) == {"pairs"}, "only plain label pairs are rendered"
        labels.update(entry["pairs"])
    out = []
    for resource in spec["resources"]:
        for doc in yaml.safe_load_all((directory / resource).read_text()):
            if not doc:
                continue
            meta = doc.setdefault("metadata", {})
            if doc["kind"] not in CLUSTER_SCOPED and "namespace" in spec:
                meta["namespace"] = spec["namespace"]
            meta.setdefault("labels", {}).update(labels)
            out.append(doc)
    return out


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("kubernetes-validate"), "--strict", "--kubernetes-version",
                           KUBERNETES_VERSION, "--quiet", str(path)],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("manifest", sorted(p.name for p in K8S.glob("*.yaml")
                                            if p.name != "kustomization.yaml"))
def test_each_manifest_validates_strictly(manifest: str) -> None:
    result = validate(K8S / manifest)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kustomize_output_validates_and_holds_what_the_demo_needs(tmp_path: Path) -> None:
    docs = kustomize_build(K8S)
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump_all(docs))
    result = validate(rendered)
    assert result.returncode == 0, result.stdout + result.stderr
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert all(d["metadata"].get("namespace") == "hascheduler" for d in docs
               if d["kind"] != "Namespace")
    deployment = by_kind[("Deployment", "hascheduler")]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert deployment["spec"]["replicas"] == 3
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} \
        in container["env"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["limits"]
    assert container["resources"]["requests"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # Longer than the leader's drain (DispatchSettings.drain_timeout_s) plus the handover.
    from hascheduler.dispatch import DispatchSettings
    assert pod["terminationGracePeriodSeconds"] > DispatchSettings().drain_timeout_s + 10
    assert pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    service = by_kind[("Service", "hascheduler")]
    kind_config = yaml.safe_load((ROOT / "kind-config.yaml").read_text())
    mapped = {m["containerPort"] for n in kind_config["nodes"]
              for m in n.get("extraPortMappings", [])}
    assert service["spec"]["ports"][0]["nodePort"] in mapped
    assert ("PodDisruptionBudget", "hascheduler") in by_kind
    assert ("Deployment", "hascheduler-worker") in by_kind
    mongo = by_kind[("StatefulSet", "mongodb")]
    assert mongo["spec"]["volumeClaimTemplates"]
    assert "readinessProbe" in mongo["spec"]["template"]["spec"]["containers"][0]
    assert "rs.initiate" in str(by_kind[("Job", "mongodb-rs-init")])
    assert by_kind[("StatefulSet", "nats")]["spec"]["volumeClaimTemplates"]


def test_kustomize_renderer_refuses_what_it_does_not_render(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\npatches: []\n")
    with pytest.raises(AssertionError, match="patches"):
        kustomize_build(tmp_path)


def test_scripts_pass_shellcheck() -> None:
    scripts = sorted(str(p) for p in (ROOT / "scripts").iterdir()
                     if p.suffix == ".sh" or p.name in {"hascheduler", "test"})
    result = subprocess.run([tool("shellcheck"), *scripts, str(ROOT / ".ci" / "run")],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    for script in scripts:
        text = Path(script).read_text()
        if not script.endswith("_venv.sh"):
            assert "set -euo pipefail" in text, script


def test_dockerfile_passes_hadolint_and_runs_as_non_root() -> None:
    dockerfile = ROOT / "Dockerfile"
    result = subprocess.run([tool("hadolint"), str(dockerfile)], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    text = dockerfile.read_text()
    assert text.count("FROM ") >= 2, "multi-stage"
    final_stage = text.rsplit("FROM ", 1)[1]
    assert "USER 10001" in final_stage
    assert "gcc" not in final_stage
    assert "build-essential" not in final_stage


def test_kind_scripts_check_their_tools_first(tmp_path: Path) -> None:
    # With an empty PATH (bash found by absolute path) each says what is missing, exit 2.
    for script in ("kind-demo.sh", "kind-down.sh"):
        result = subprocess.run(["/bin/bash", str(ROOT / "scripts" / script)],
                                capture_output=True, text=True, timeout=30, check=False,
                                env={"PATH": str(tmp_path)})
        assert result.returncode == 2, result.stderr
        assert "kind" in result.stderr
        assert "needs" in result.stderr


def test_replicas_get_api_tokens_from_a_secret_and_network_policies_cover_every_pod() -> None:
    docs = kustomize_build(K8S)
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    pod = by_kind[("Deployment", "hascheduler")]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    secret_volume = next(v for v in pod["volumes"] if "secret" in v)
    assert secret_volume["secret"]["secretName"] == "hascheduler-tokens"
    mount = next(m for m in container["volumeMounts"] if m["name"] == secret_volume["name"])
    assert mount["readOnly"] is True
    # Listening beyond loopback needs tokens, or the replica would refuse to (see cli).
    config = by_kind[("ConfigMap", "hascheduler-config")]["data"]
    assert config["HASCHEDULER_HTTP_HOST"] == "0.0.0.0"
    for scope in ("write", "read"):
        assert env[f"HASCHEDULER_{scope.upper()}_TOKENS_FILE"] == f"{mount['mountPath']}/{scope}"
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    # The example Secret fits the mount, stays out of the kustomization, and its
    # placeholders are refused, so applying it unchanged cannot open the API.
    example = yaml.safe_load((K8S / "tokens-secret.example.yaml").read_text())
    assert example["metadata"]["name"] == secret_volume["secret"]["secretName"]
    assert set(example["stringData"]) == {"write", "read"}
    assert ("Secret", "hascheduler-tokens") not in by_kind
    from hascheduler.api.access import AccessConfigError, load_tokens
    for scope, text in example["stringData"].items():
        with pytest.raises(AccessConfigError, match="CHANGE-ME"):
            load_tokens({f"HASCHEDULER_{scope.upper()}_TOKENS": text})

    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    workloads = [d for d in docs if d["kind"] in {"Deployment", "StatefulSet", "Job"}]
    for workload in workloads:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert any(p["podSelector"]["matchLabels"].items() <= labels.items()
                   for p in policies.values()), workload["metadata"]["name"]

    def ports(rules: list[dict[str, Any]]) -> set[int]:
        return {p["port"] for rule in rules for p in rule.get("ports", [])}

    scheduler = policies["hascheduler"]
    assert set(scheduler["policyTypes"]) == {"Ingress", "Egress"}
    assert ports(scheduler["ingress"]) == {container["ports"][0]["containerPort"]}
    assert ports(scheduler["egress"]) == {27017, 4222, 53}
    assert ":27017/" in config["HASCHEDULER_MONGODB_URI"]
    assert config["HASCHEDULER_BROKER"].endswith(":4222")
    mongo_clients = {s["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
                     for rule in policies["mongodb"]["ingress"] for s in rule["from"]}
    assert mongo_clients == {"hascheduler", "mongodb-rs-init", "mongodb"}
    assert "ingress" not in policies["hascheduler-worker"]  # no connections in at all
