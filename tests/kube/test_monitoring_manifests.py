"""What the testbed installs of Prometheus, prometheus-operator and prometheus-adapter, from the manifests
the projects ship (skips where `hack/control-plane addons` has not built them): our images on the real node,
the objects moved out of `default` but the adapter's reader in kube-system left there, the adapter serving
the custom metrics API with the rule the docs give, and Prometheus selecting what the tests label."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from control_plane import monitoring

PLACEMENT = {"nodeSelector": {"warmstart.dev/real-node": "true"}, "tolerations": []}
OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


@pytest.fixture(scope="module")
def documents() -> list[dict[str, Any]]:
    if reason := monitoring.missing_reason():
        pytest.skip(reason)
    return monitoring.manifests(PLACEMENT)


def find(documents: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in documents if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def test_every_pod_runs_our_image_on_the_real_node(documents: list[dict[str, Any]]) -> None:
    ours = {binary.reference for binary in monitoring.BINARIES}
    pods = [d["spec"]["template"]["spec"] for d in documents if d["kind"] == "Deployment"]
    assert len(pods) == 2
    for pod in pods:
        assert pod["nodeSelector"] == PLACEMENT["nodeSelector"]
        assert {container["image"] for container in pod["containers"]} <= ours
    prometheus = find(documents, "Prometheus", monitoring.PROMETHEUS_NAME)["spec"]
    assert prometheus["image"] == monitoring.PROMETHEUS.reference
    assert prometheus["serviceMonitorSelector"] == {"matchLabels": monitoring.SELECTED}
    operator = find(documents, "Deployment", "prometheus-operator")["spec"]["template"]["spec"]
    reloader = f"--prometheus-config-reloader={monitoring.RELOADER.reference}"
    assert reloader in operator["containers"][0]["args"]


def test_nothing_stays_in_default_and_the_authentication_reader_stays_in_kube_system(
    documents: list[dict[str, Any]],
) -> None:
    namespaces = {d["metadata"].get("namespace") for d in documents}
    assert "default" not in namespaces
    reader = find(documents, "RoleBinding", "resource-metrics-auth-reader")
    assert reader["metadata"]["namespace"] == "kube-system"
    for document in documents:
        if document["kind"] in monitoring.CLUSTER_SCOPED:
            assert "namespace" not in document["metadata"], document["metadata"]
        for subject in document.get("subjects", []):
            assert subject.get("namespace") in (monitoring.NAMESPACE, "kube-system"), subject


def test_the_adapter_serves_the_custom_metrics_api_with_the_rule_the_docs_give(
    documents: list[dict[str, Any]],
) -> None:
    api = find(documents, "APIService", monitoring.CUSTOM_METRICS_API)["spec"]
    assert api["group"] == "custom.metrics.k8s.io"
    config = yaml.safe_load(find(documents, "ConfigMap", "adapter-config")["data"]["config.yaml"])
    documented = re.search(r"```yaml\n(    rules:.*?)```", OPERATIONS.read_text(), re.S)
    assert documented, "docs/operations.md gives no adapter rule"
    assert config == yaml.safe_load(documented.group(1)) == monitoring.ADAPTER_RULES
    adapter = find(documents, "Deployment", "prometheus-adapter")["spec"]["template"]["spec"]
    assert f"--prometheus-url={monitoring.prometheus_url()}/" in adapter["containers"][0]["args"]
