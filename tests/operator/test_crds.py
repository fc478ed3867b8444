"""Static checks of the CRDs and the chart: one CRD source, the contract's shape, defaults in sync."""

from __future__ import annotations

import base64
import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import container_settings, helm_binary, helm_template

from warmstart.agent.settings import AgentSettings
from warmstart.api.snapshot import FactsChanged
from warmstart.checkpoint import hugepages
from warmstart.operator.settings import OperatorSettings
from warmstart.operator.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO / "crds"
CHART = REPO / "charts" / "warmstart"


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((CRDS / name).read_text())


def version_of(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return version


def test_endpoint_crd_contract():
    crd = load("inferenceendpoints.yaml")
    assert crd["spec"]["group"] == "warmstart.dev" and crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["shortNames"] == ["iep"]
    assert "warmstart" in crd["spec"]["names"]["categories"]
    version = version_of(crd)
    assert version["name"] == "v1alpha1"
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]
    assert [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")] == [
        "Phase", "Ready", "Restored", "Snapshot", "Reason", "Age",
    ]  # fmt: skip
    paths = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert (paths["Ready"], paths["Reason"]) == (".status.ready", ".status.reason")
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["model", "engine"]
    snapshot = spec["properties"]["snapshot"]
    assert snapshot["default"] == {}
    # Storage is the chart's choice (agent.store, agent.objectStore), not an endpoint's: a stale
    # snapshot.storage is pruned by the API server, since nothing here keeps unknown fields.
    assert "storage" not in snapshot["properties"]
    assert "x-kubernetes-preserve-unknown-fields" not in snapshot
    assert "x-kubernetes-preserve-unknown-fields" not in spec
    assert "x-kubernetes-validations" not in snapshot  # no rule asks for a claim any more
    assert spec["properties"]["engine"]["properties"]["kind"]["enum"] == ["vllm", "builtin"]
    assert spec["properties"]["replicas"]["minimum"] == 0
    autoscaling = spec["properties"]["autoscaling"]
    assert autoscaling["properties"]["mode"]["enum"] == ["none", "hpa", "keda", "http"]
    rules = " ".join(r["rule"] for r in autoscaling["x-kubernetes-validations"])
    assert "self.minReplicas <= self.maxReplicas" in rules and "keda" in rules and "has(self.metric)" in rules
    assert "self.mode in ['keda', 'http']" in rules and "!has(self.http)" in rules
    http = autoscaling["properties"]["http"]["properties"]
    assert {
        "hosts",
        "pathPrefixes",
        "targetConcurrency",
        "coldStartTimeoutSeconds",
        "responseTimeoutSeconds",
    } == set(http)
    assert http["targetConcurrency"]["minimum"] == 1
    prestage = spec["properties"]["snapshot"]["properties"]["prestage"]
    assert prestage["enum"] == ["None", "PageCache"] and prestage["default"] == "None"
    assert prestage["description"]


def test_snapshot_crd_contract():
    crd = load("inferencesnapshots.yaml")
    assert crd["spec"]["names"]["shortNames"] == ["isnap"]
    schema = version_of(crd)["schema"]["openAPIV3Schema"]["properties"]
    spec_fields = {"endpoint", "requestKeyHash", "requestKey", "signingKeySecret"}
    assert set(schema["spec"]["properties"]) == spec_fields
    status = schema["status"]["properties"]
    assert status["phase"]["enum"] == ["Pending", "Capturing", "Ready", "Failed", "Invalid", "Stale"]
    assert status["staleReason"]["enum"] == [str(reason) for reason in FactsChanged]
    assert {"node", "gpu", "storagePath", "sizeBytes", "manifestDigest", "timings", "attempts"} <= set(status)


def apply_defaults(schema: dict[str, Any], value: dict[str, Any]) -> dict[str, Any]:
    """The API server's structural defaulting: fill absent fields that have a default, recursively."""
    for key, sub in schema.get("properties", {}).items():
        if key not in value and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])
        if isinstance(value.get(key), dict):
            apply_defaults(sub, value[key])
    return value


def test_crd_defaults_agree_with_the_operator_defaults():
    spec_schema = version_of(load("inferenceendpoints.yaml"))["schema"]["openAPIV3Schema"]["properties"][
        "spec"
    ]
    minimal = {"model": {"uri": "m"}, "engine": {"kind": "builtin", "image": "img"}}
    defaulted = apply_defaults(spec_schema, copy.deepcopy(minimal))
    assert defaulted["autoscaling"]["mode"] == "none" and defaulted["replicas"] == 1
    assert defaulted["snapshot"] == {
        "enabled": True, "retention": 2, "maxCaptureAttempts": 5, "captureTimeoutSeconds": 3600,
        "prestage": "None",
    }  # fmt: skip
    assert parse_spec(defaulted) == parse_spec(minimal)
    http_mode = {**minimal, "autoscaling": {"mode": "http", "minReplicas": 0, "http": {}}}
    defaulted = apply_defaults(spec_schema, copy.deepcopy(http_mode))
    assert defaulted["autoscaling"]["http"]["coldStartTimeoutSeconds"] == 120
    assert parse_spec(defaulted) == parse_spec(http_mode)


@pytest.mark.spawns
def test_helm_lint_is_clean():
    result = subprocess.run([helm_binary(), "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.spawns
def test_values_schema_rejects_bad_values():
    bad = helm_template(CHART, "--set", "operator.replicas=6", check=False)
    assert bad.returncode != 0 and "replicas" in bad.stderr
    typo = helm_template(CHART, "--set", "operator.replica=1", check=False)
    assert typo.returncode != 0 and "replica" in typo.stderr
    negative = helm_template(CHART, "--set", "agent.prestage.maxBytes=-1", check=False)
    assert negative.returncode != 0 and "maxBytes" in negative.stderr
    thp = helm_template(CHART, "--set", "agent.transparentHugepages=sometimes", check=False)
    assert thp.returncode != 0 and "transparentHugepages" in thp.stderr


@pytest.mark.spawns
def test_agent_is_optional_and_privileged_when_on():
    def kinds(*flags: str) -> dict[str, dict]:
        out = helm_template(CHART, *flags).stdout
        return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(out) if d}

    with_agent = kinds()
    daemonset = with_agent["DaemonSet/t-warmstart-agent"]
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod["containers"][0]["securityContext"]["privileged"] is True
    args = pod["containers"][0]["args"]
    assert args[args.index("agent") + 1 :] == ["--prestage-interval=30", "--prestage-max-bytes=68719476736"]
    # The signing key is a Secret the chart makes (or the user's), never a file in the store workers mount.
    secret = with_agent["Secret/t-warmstart-signing-key"]
    assert len(base64.b64decode(secret["data"]["key"])) == 64
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["signing-key"]["secret"]["secretName"] == "t-warmstart-signing-key"
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["WARMSTART_SIGNING_KEY"] == "/etc/warmstart/signing/key"
    own_key = kinds("--set", "agent.signingKeySecret=mine")
    assert "Secret/t-warmstart-signing-key" not in own_key
    own_pod = own_key["DaemonSet/t-warmstart-agent"]["spec"]["template"]["spec"]
    assert {v["name"]: v for v in own_pod["volumes"]}["signing-key"]["secret"]["secretName"] == "mine"
    tuned = kinds("--set", "agent.prestage.maxBytes=0", "--set-json", "agent.prestage.intervalSeconds=2.5")
    tuned_args = tuned["DaemonSet/t-warmstart-agent"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert tuned_args[-2:] == ["--prestage-interval=2.5", "--prestage-max-bytes=0"]
    settings = container_settings(pod["containers"][0], "agent", AgentSettings)
    assert (settings.prestage_interval, settings.prestage_max_bytes) == (30.0, 64 << 30)
    assert settings.transparent_hugepages is None  # the node's setting is left alone unless asked
    huge = kinds("--set", "agent.transparentHugepages=always")
    huge_container = huge["DaemonSet/t-warmstart-agent"]["spec"]["template"]["spec"]["containers"][0]
    assert huge_container["args"][-1] == "--transparent-hugepages=always"
    assert container_settings(huge_container, "agent", AgentSettings).transparent_hugepages == "always"
    # The host's setting mounted where the agent writes it (hugepages.node_setting), only when asked.
    huge_pod = huge["DaemonSet/t-warmstart-agent"]["spec"]["template"]["spec"]
    thp_mount = {m["name"]: m for m in huge_container["volumeMounts"]}["transparent-hugepages"]
    assert Path(thp_mount["mountPath"]) == hugepages.HOST_THP_ENABLED.parent and not thp_mount.get("readOnly")
    thp_volume = {v["name"]: v for v in huge_pod["volumes"]}["transparent-hugepages"]["hostPath"]
    assert thp_volume["path"] == str(hugepages.THP_ENABLED.parent)
    assert "transparent-hugepages" not in {v["name"] for v in pod["volumes"]}
    without = kinds("--set", "agent.enabled=false")
    assert not any(key.startswith(("DaemonSet/", "ClusterRole/t-warmstart-agent")) for key in without)
    operator = without["Deployment/t-warmstart-operator"]["spec"]["template"]["spec"]["containers"][0]
    assert "--all-namespaces" in operator["args"]
    assert json.dumps(operator["livenessProbe"]["httpGet"]["path"]) == '"/healthz"'


@pytest.mark.spawns
def test_the_operator_is_told_where_the_agents_run():
    def operator_settings(*flags: str) -> OperatorSettings:
        docs = [d for d in yaml.safe_load_all(helm_template(CHART, *flags).stdout) if d]
        (deployment,) = [
            d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-operator")
        ]
        return container_settings(deployment["spec"]["template"]["spec"]["containers"][0], "operator",
                                  OperatorSettings)  # fmt: skip

    docs = [d for d in yaml.safe_load_all(helm_template(CHART).stdout) if d]
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    lookup = operator_settings().agents
    assert lookup is not None and lookup.namespace == daemonset["metadata"]["namespace"]
    assert lookup.selector == daemonset["spec"]["selector"]["matchLabels"]
    assert operator_settings("--set", "agent.enabled=false").agents is None
    (role,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-operator")]
    assert any("pods" in r["resources"] and "list" in r["verbs"] for r in role["rules"])
    assert any("events" in r["resources"] and "list" in r["verbs"] for r in role["rules"])
