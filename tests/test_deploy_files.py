"""Deployment files checked offline, as CI can: Kubernetes manifests (each file and the
kustomize output) against the Kubernetes API schemas in strict mode, the shell scripts with
shellcheck, the Dockerfile with hadolint. The tools come from PyPI (dev extras); a missing
tool fails here rather than skipping."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s" / "base"
OVERLAYS = ROOT / "k8s" / "overlays"
KUBERNETES_VERSION = "1.34.0"  # the version the manifests are written for (kind's node)
BIN = Path(sys.executable).parent
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "ClusterRole", "ClusterRoleBinding"}


def tool(name: str) -> str:
    path = BIN / name
    assert path.exists(), f"{name} is missing from {BIN}: install the dev extras"
    return str(path)


def kustomize_build(directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize DIRECTORY``: kustomize itself, as `kubectl apply -k` renders."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its built-in kustomize) is missing: install it"
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            tool("kubernetes-validate"),
            "--strict",
            "--kubernetes-version",
            KUBERNETES_VERSION,
            "--quiet",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    "manifest", sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
)
def test_each_manifest_validates_strictly(manifest: str) -> None:
    result = validate(K8S / manifest)
    assert result.returncode == 0, result.stdout + result.stderr


def rendered_and_validated(directory: Path, tmp_path: Path) -> dict[tuple[str, str], Any]:
    """The kustomization rendered, validated strictly, by (kind, name)."""
    docs = kustomize_build(directory)
    rendered = tmp_path / f"{directory.name}.yaml"
    rendered.write_text(yaml.safe_dump_all(docs))
    result = validate(rendered)
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(
        d["metadata"].get("namespace") == "hascheduler" for d in docs if d["kind"] != "Namespace"
    )
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_the_ha_overlay_makes_every_cluster_three_members(tmp_path: Path) -> None:
    by_kind = rendered_and_validated(OVERLAYS / "ha", tmp_path)
    config = by_kind[("ConfigMap", "hascheduler-config")]["data"]
    members = [f"mongodb-{i}.mongodb:27017" for i in range(3)]
    assert all(m in config["HASCHEDULER_MONGODB_URI"] for m in members)
    assert "replicaSet=rs0" in config["HASCHEDULER_MONGODB_URI"]
    assert "w=majority" in config["HASCHEDULER_MONGODB_URI"]
    from hascheduler.brokers.nats.publisher import NatsEndpoint

    broker = NatsEndpoint.parse(config["HASCHEDULER_BROKER"])
    assert broker.servers == [f"nats://nats-{i}.nats-cluster:4222" for i in range(3)]
    assert broker.replicas == 3
    for name in ("mongodb", "nats"):
        workload = by_kind[("StatefulSet", name)]
        assert workload["spec"]["replicas"] == 3
        pod = workload["spec"]["template"]["spec"]
        required = pod["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert required[0]["topologyKey"] == "kubernetes.io/hostname"
        assert pod["topologySpreadConstraints"]
        assert by_kind[("PodDisruptionBudget", name)]["spec"]["maxUnavailable"] == 1
    for name in ("hascheduler", "hascheduler-worker"):
        spread = by_kind[("Deployment", name)]["spec"]["template"]["spec"][
            "topologySpreadConstraints"
        ]
        assert spread[0]["labelSelector"]["matchLabels"]["app.kubernetes.io/name"] == name
    # The rs-init job names all three members, and initiates only when not yet initiated.
    script = by_kind[("Job", "mongodb-rs-init")]["spec"]["template"]["spec"]["containers"][0][
        "command"
    ][-1]
    assert all(m in script for m in members)
    assert "NotYetInitialized" in script
    assert "replSetReconfig" in script
    nats = by_kind[("StatefulSet", "nats")]
    args = nats["spec"]["template"]["spec"]["containers"][0]["args"]
    routes = args[args.index("--routes") + 1].split(",")
    assert routes == [f"nats://nats-{i}.nats-cluster:6222" for i in range(3)]
    assert args[args.index("--server_name") + 1] == "$(POD_NAME)"
    assert nats["spec"]["serviceName"] == "nats-cluster"
    assert by_kind[("Service", "nats-cluster")]["spec"]["clusterIP"] == "None"
    routes_policy = by_kind[("NetworkPolicy", "nats-routes")]["spec"]
    assert routes_policy["ingress"][0]["ports"] == [{"port": 6222, "protocol": "TCP"}]


def test_the_rabbitmq_overlay_replaces_nats_with_a_three_node_cluster(tmp_path: Path) -> None:
    by_kind = rendered_and_validated(OVERLAYS / "rabbitmq", tmp_path)
    assert not [k for k in by_kind if k[1] == "nats"]
    config = by_kind[("ConfigMap", "hascheduler-config")]["data"]
    assert "HASCHEDULER_BROKER" not in config  # credentials: from the Secret instead
    for name in ("hascheduler", "hascheduler-worker"):
        env = by_kind[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]["env"]
        broker = next(e for e in env if e["name"] == "HASCHEDULER_BROKER")
        assert broker["valueFrom"]["secretKeyRef"] == {"name": "hascheduler-rabbitmq", "key": "url"}
    rabbit = by_kind[("StatefulSet", "rabbitmq")]["spec"]
    assert rabbit["replicas"] == 3
    assert rabbit["podManagementPolicy"] == "Parallel"
    conf = by_kind[("ConfigMap", "rabbitmq-config")]["data"]["rabbitmq.conf"]
    nodes = [f"rabbit@rabbitmq-{i}.rabbitmq-nodes.hascheduler.svc.cluster.local" for i in range(3)]
    assert all(n in conf for n in nodes)
    assert by_kind[("PodDisruptionBudget", "rabbitmq")]["spec"]["maxUnavailable"] == 1
    egress = by_kind[("NetworkPolicy", "hascheduler")]["spec"]["egress"]
    reached = {
        r["to"][0].get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name"): [
            p["port"] for p in r["ports"]
        ]
        for r in egress
    }
    assert reached["rabbitmq"] == [5672]
    assert "nats" not in reached
    example = yaml.safe_load((OVERLAYS / "rabbitmq" / "rabbitmq-secret.example.yaml").read_text())
    assert example["metadata"]["name"] == "hascheduler-rabbitmq"
    assert set(example["stringData"]) == {"user", "password", "erlang-cookie", "url"}
    assert example["stringData"]["url"].startswith("amqp://")


def test_the_local_overlay_changes_only_what_a_cluster_without_dns_forces(tmp_path: Path) -> None:
    """k8s/overlays/local (scripts/k8s-local-demo.sh): MongoDB and NATS outside the
    cluster, the 1.20 budget, images never pulled; every other object as in the base."""
    base = {(d["kind"], d["metadata"]["name"]): d for d in kustomize_build(K8S)}
    local = {(d["kind"], d["metadata"]["name"]): d for d in kustomize_build(OVERLAYS / "local")}
    budget = local.pop(("PodDisruptionBudget", "hascheduler"))
    # No schema set of this validator reaches 1.20: the rest is validated as the base is,
    # and the whole overlay is applied to a real 1.20 API server by the demo.
    rendered = tmp_path / "local.yaml"
    rendered.write_text(yaml.safe_dump_all(list(local.values())))
    result = validate(rendered)
    assert result.returncode == 0, result.stdout + result.stderr

    assert budget["apiVersion"] == "policy/v1beta1"
    assert budget["spec"] == base[("PodDisruptionBudget", "hascheduler")]["spec"]
    outside = {
        ("StatefulSet", "mongodb"),
        ("Service", "mongodb"),
        ("Job", "mongodb-rs-init"),
        ("NetworkPolicy", "mongodb"),
        ("NetworkPolicy", "mongodb-rs-init"),
        ("StatefulSet", "nats"),
        ("Service", "nats"),
        ("NetworkPolicy", "nats"),
    }
    assert set(base) - set(local) == outside | {("PodDisruptionBudget", "hascheduler")}
    assert set(local) <= set(base)

    config = local[("ConfigMap", "hascheduler-config")]["data"]
    base_config = base[("ConfigMap", "hascheduler-config")]["data"]
    assert config["HASCHEDULER_MONGODB_URI"] == (
        "mongodb://172.17.0.1:27017/hascheduler?replicaSet=rs0"
    )
    assert config["HASCHEDULER_BROKER"] == "nats://172.17.0.1:4222"
    changed = {k for k in base_config if config[k] != base_config[k]}
    assert changed == {"HASCHEDULER_MONGODB_URI", "HASCHEDULER_BROKER"}
    assert set(config) == set(base_config)

    egress = local[("NetworkPolicy", "hascheduler")]["spec"]["egress"]
    assert egress == [
        {
            "to": [{"ipBlock": {"cidr": "172.17.0.1/32"}}],
            "ports": [{"port": 27017, "protocol": "TCP"}, {"port": 4222, "protocol": "TCP"}],
        }
    ]
    for name in ("hascheduler", "hascheduler-worker"):
        pods = local[("Deployment", name)]["spec"]["template"]["spec"]
        assert [c["imagePullPolicy"] for c in pods["containers"]] == ["Never"]
        pods["containers"][0]["imagePullPolicy"] = "IfNotPresent"
    local[("ConfigMap", "hascheduler-config")]["data"] = base_config
    local[("NetworkPolicy", "hascheduler")]["spec"]["egress"] = base[
        ("NetworkPolicy", "hascheduler")
    ]["spec"]["egress"]
    assert all(local[key] == base[key] for key in local), "changed beyond what is forced"


def test_kustomize_output_validates_and_holds_what_the_demo_needs(tmp_path: Path) -> None:
    by_kind = rendered_and_validated(K8S, tmp_path)
    deployment = by_kind[("Deployment", "hascheduler")]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert deployment["spec"]["replicas"] == 3
    assert {
        "name": "POD_NAME",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
    } in container["env"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["limits"]
    assert container["resources"]["requests"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # Longer than the leader's drain (DispatchSettings.drain_timeout_s) plus the handover.
    from hascheduler.replica.publishing import DispatchSettings

    assert pod["terminationGracePeriodSeconds"] > DispatchSettings().drain_timeout_s + 10
    assert pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    service = by_kind[("Service", "hascheduler")]
    kind_config = yaml.safe_load((ROOT / "kind-config.yaml").read_text())
    mapped = {
        m["containerPort"] for n in kind_config["nodes"] for m in n.get("extraPortMappings", [])
    }
    assert service["spec"]["ports"][0]["nodePort"] in mapped
    assert ("PodDisruptionBudget", "hascheduler") in by_kind
    assert ("Deployment", "hascheduler-worker") in by_kind
    mongo = by_kind[("StatefulSet", "mongodb")]
    assert mongo["spec"]["volumeClaimTemplates"]
    assert "readinessProbe" in mongo["spec"]["template"]["spec"]["containers"][0]
    assert "rs.initiate" in str(by_kind[("Job", "mongodb-rs-init")])
    assert by_kind[("StatefulSet", "nats")]["spec"]["volumeClaimTemplates"]


def test_scripts_pass_shellcheck() -> None:
    scripts = sorted(
        str(p)
        for p in (ROOT / "scripts").iterdir()
        if p.suffix == ".sh" or p.name in {"hascheduler", "test"}
    )
    result = subprocess.run(
        [tool("shellcheck"), *scripts, str(ROOT / ".ci" / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for script in scripts:
        text = Path(script).read_text()
        if not Path(script).name.startswith("_"):  # sourced, not run
            assert "set -euo pipefail" in text, script


def test_dockerfile_passes_hadolint_and_runs_as_non_root() -> None:
    dockerfile = ROOT / "Dockerfile"
    result = subprocess.run(
        [tool("hadolint"), str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = dockerfile.read_text()
    assert text.count("FROM ") >= 2, "multi-stage"
    final_stage = text.rsplit("FROM ", 1)[1]
    assert "USER 10001" in final_stage
    # The production image (the last stage) takes the product's virtualenv, never the one
    # with the development tools.
    assert "--from=build " in final_stage
    assert "devbuild" not in final_stage
    assert "gcc" not in final_stage
    assert "build-essential" not in final_stage


def test_kind_scripts_check_their_tools_first(tmp_path: Path) -> None:
    # With an empty PATH (bash found by absolute path) each says what is missing, exit 2.
    for script in ("kind-demo.sh", "kind-down.sh"):
        result = subprocess.run(
            ["/bin/bash", str(ROOT / "scripts" / script)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env={"PATH": str(tmp_path)},
        )
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
    from hascheduler.api.access import AccessConfigError, legacy_grants

    for scope, text in example["stringData"].items():
        with pytest.raises(AccessConfigError, match="CHANGE-ME"):
            legacy_grants({f"HASCHEDULER_{scope.upper()}_TOKENS": text})

    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    workloads = [d for d in docs if d["kind"] in {"Deployment", "StatefulSet", "Job"}]
    for workload in workloads:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert any(
            p["podSelector"]["matchLabels"].items() <= labels.items() for p in policies.values()
        ), workload["metadata"]["name"]

    def ports(rules: list[dict[str, Any]]) -> set[int]:
        return {p["port"] for rule in rules for p in rule.get("ports", [])}

    scheduler = policies["hascheduler"]
    assert set(scheduler["policyTypes"]) == {"Ingress", "Egress"}
    assert ports(scheduler["ingress"]) == {container["ports"][0]["containerPort"]}
    assert ports(scheduler["egress"]) == {27017, 4222, 53}
    assert ":27017/" in config["HASCHEDULER_MONGODB_URI"]
    assert config["HASCHEDULER_BROKER"].endswith(":4222")
    mongo_clients = {
        s["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
        for rule in policies["mongodb"]["ingress"]
        for s in rule["from"]
    }
    assert mongo_clients == {"hascheduler", "mongodb-rs-init", "mongodb"}
    assert "ingress" not in policies["hascheduler-worker"]  # no connections in at all
