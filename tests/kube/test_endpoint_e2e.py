"""The product end to end on the real node: `helm install` of the chart (the project's image), an
InferenceEndpoint of the builtin engine on CPU, a capture pod the agent DaemonSet checkpoints, and replicas
the agent restores into real pods, answering through the Service exactly as a cold pod does.

Nothing plays a part here: the operator and the agent run in their pods from the chart, the workers are
containers the kubelet starts, and every status is written by its owner. The workers run the chart's image
with this test run's Python environment mounted in (`template.volumes`), as a user mounts a model cache:
an image with torch would take a CI run minutes to build.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from control_plane.cluster import ControlPlane, wait_for
from control_plane.node import RealNode
from endpoint_flow import (
    COLD_ENDPOINT,
    ENDPOINT,
    START_TIMEOUT,
    client_pod,
    completion,
    diagnostics,
    endpoint,
    events_of,
    get,
    install,
    items,
    ready,
    snapshot_volume,
    uninstall,
    worker_pods,
)
from node_plugin import HostPython

from warmstart.api import labels as L


@pytest.fixture
def release(kube: ControlPlane, real_node: RealNode, chart_image: str, namespace: str) -> Iterator[str]:
    """The chart installed into the test's namespace; returns the agent's store directory on the node."""
    store = install(kube, chart_image, real_node, namespace)
    try:
        yield store
    finally:
        uninstall(kube, namespace)


@pytest.mark.integration
def test_helm_install_capture_and_restore_replicas_on_the_real_node(
    kube: ControlPlane,
    real_node: RealNode,
    chart_image: str,
    host_python: HostPython,
    namespace: str,
    release: str,
) -> None:
    claim = snapshot_volume(kube, namespace, release)
    kube.kubectl("apply", "-f", "-", input=client_pod(namespace, chart_image, real_node))
    for name, uses in ((COLD_ENDPOINT, None), (ENDPOINT, claim)):
        body = endpoint(name, namespace, chart_image, real_node, host_python, uses)
        kube.kubectl("apply", "-f", "-", input=json.dumps(body))

    def wait(predicate: Any, message: str) -> Any:
        try:
            return wait_for(predicate, timeout=START_TIMEOUT, interval=1.0, message=message)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{diagnostics(kube, namespace)}") from None

    # The reference: the same model cold-started by an endpoint without snapshots, through its Service.
    wait(lambda: any(ready(p) for p in worker_pods(kube, namespace, L.ROLE_COLD, COLD_ENDPOINT)),
         "the cold endpoint's replica Ready")  # fmt: skip
    cold_url = f"http://{get(kube, 'service', namespace, COLD_ENDPOINT)['spec']['clusterIP']}/v1/completions"
    cold_answer = wait(lambda: completion(kube, namespace, cold_url), "a completion from the cold replica")

    # The capture pod is checkpointed by the agent; the snapshot records the runtime identity it measured.
    selector = f"{L.ENDPOINT_LABEL}={ENDPOINT}"
    snap = wait(
        lambda: next((s for s in items(kube, "isnap", namespace, selector) if s.get("status", {}).get("phase")
                      == "Ready"), None),
        "the InferenceSnapshot Ready",
    )  # fmt: skip
    identity = snap["status"]["identity"]
    assert identity["image"].startswith("sha256:") or "@sha256:" in identity["image"], identity
    assert identity["engine"] == "builtin" and identity["model_digest"], identity

    kube.kubectl("scale", f"iep/{ENDPOINT}", "-n", namespace, "--replicas=2")
    restored = wait(
        lambda: (pods := [p for p in worker_pods(kube, namespace, L.ROLE_RESTORE) if ready(p)])
        and len(pods) == 2 and pods,
        "two restore replicas Ready",
    )  # fmt: skip
    for pod in restored:
        reasons = {event["reason"] for event in events_of(kube, namespace, pod["metadata"]["name"])}
        assert "Restored" in reasons, (pod["metadata"]["name"], reasons)
        assert "RestoreRefused" not in reasons and "RestoreFailed" not in reasons, reasons
        direct = f"http://{pod['status']['podIP']}:8000/v1/completions"
        assert completion(kube, namespace, direct) == cold_answer
    assert not worker_pods(kube, namespace, L.ROLE_COLD), "the cold replica was replaced"
    url = f"http://{get(kube, 'service', namespace, ENDPOINT)['spec']['clusterIP']}/v1/completions"
    for _ in range(4):  # through the Service, whichever replica answers
        assert completion(kube, namespace, url) == cold_answer
