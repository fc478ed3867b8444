"""Controllers, scheduler and kwok together: a Deployment becomes Ready pods on fake GPU nodes; helm works
against the cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.spawns]


def gpu_deployment(name: str, replicas: int) -> dict:
    labels = {"app": name}
    container = {
        "name": "worker",
        "image": "registry.invalid/worker:1",
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }


def pods(kube, namespace: str, selector: str) -> list[dict]:
    return json.loads(kube.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout)[
        "items"
    ]


def pod_ready(pod: dict) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    running = pod.get("status", {}).get("phase") == "Running"
    return running and any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_deployment_becomes_ready_pods_on_kwok_nodes(kube, namespace):
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(gpu_deployment("worker", 3)))

    def three_ready_pods() -> list[dict]:
        ready = [pod for pod in pods(kube, namespace, "app=worker") if pod_ready(pod)]
        return ready if len(ready) == 3 else []

    ready = kube.wait_for(three_ready_pods, timeout=90, message="3 Running+Ready pods")
    assert {pod["spec"]["nodeName"] for pod in ready} <= {f"kwok-gpu-{i}" for i in range(kube.nodes)}

    def ready_replicas() -> int:
        deployment = kube.kubectl("get", "deployment", "worker", "-n", namespace, "-o", "json").stdout
        return json.loads(deployment)["status"].get("readyReplicas", 0)

    kube.wait_for(lambda: ready_replicas() == 3, timeout=60, message="Deployment readyReplicas == 3")

    kube.kubectl("scale", "deployment", "worker", "-n", namespace, "--replicas=0")
    kube.wait_for(
        lambda: not pods(kube, namespace, "app=worker"), timeout=90, message="pods gone after scale 0"
    )


def test_gpu_capacity_is_enforced_by_the_scheduler(kube, namespace):
    too_big = gpu_deployment("greedy", 1)
    too_big["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "9"
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(too_big))

    def unschedulable() -> bool:
        found = pods(kube, namespace, "app=greedy")
        conditions = found[0].get("status", {}).get("conditions") or [] if found else []
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)

    kube.wait_for(unschedulable, timeout=60, message="a 9-GPU pod reported Unschedulable")


def test_helm_installs_a_chart_into_the_cluster(kube, namespace, tmp_path: Path):
    assert (kube.bin_dir / "helm").is_file()
    chart = tmp_path / "demo"
    kube.helm("create", str(chart))
    kube.helm("lint", str(chart))
    rendered = kube.helm("template", "demo", str(chart)).stdout
    assert "kind: Deployment" in rendered
    kube.helm("install", "demo", str(chart), "-n", namespace, "--wait", "--timeout=90s", timeout=120)
    releases = json.loads(kube.helm("list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("demo", "deployed")]
