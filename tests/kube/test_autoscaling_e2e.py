"""Autoscaling on the real node with real KEDA: scale from zero that holds the first request, and a load that
scales an endpoint out and back.

KEDA (operator, metrics apiserver) and its HTTP add-on (operator, interceptor, scaler) run in pods on the
real node from the manifests the projects ship, built from their Go modules (`hack/control-plane addons`).
The operator fronts an endpoint with an HTTPScaledObject (`autoscaling.mode: http`): the interceptor counts
the requests in flight, KEDA scales the InferenceEndpoint's scale subresource from zero itself and through
an HPA on the external metrics API above one, and the agent restores each new replica from the snapshot.
All traffic comes from a client pod inside the test's namespace.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from control_plane.cluster import ControlPlane
from control_plane.node import RealNode
from endpoint_flow import (
    COLD_ENDPOINT,
    ENDPOINT,
    HOLD_SECONDS,
    LOAD_SECONDS,
    at_zero,
    autoscaled,
    client_pod,
    endpoint,
    events_of,
    get,
    install,
    load_argv,
    ready,
    ready_snapshot,
    ready_workers,
    routed_host,
    timed_completion,
    uninstall,
    waiter,
    worker_pods,
)
from node_plugin import HostPython

from warmstart.api import labels as L

pytestmark = pytest.mark.spawns


@pytest.fixture
def release(
    kube: ControlPlane, real_node: RealNode, chart_image: str, keda: str, namespace: str
) -> Iterator[str]:
    store = install(kube, chart_image, real_node, namespace)
    kube.kubectl("apply", "-f", "-", input=client_pod(namespace, chart_image, real_node))
    try:
        yield store
    finally:
        uninstall(kube, namespace)


def restored_replicas(kube: ControlPlane, namespace: str, count: int) -> list[dict[str, Any]] | None:
    """The endpoint's Ready restored replicas when there are exactly `count` of them."""
    pods = ready_workers(kube, namespace, L.ROLE_RESTORE)
    return pods if len(pods) == count else None


@pytest.mark.integration
def test_a_request_at_zero_replicas_is_held_and_answered_by_a_restored_replica(
    kube: ControlPlane,
    real_node: RealNode,
    chart_image: str,
    host_python: HostPython,
    keda: str,
    namespace: str,
    release: str,
) -> None:
    for name, snapshots in ((ENDPOINT, True), (COLD_ENDPOINT, False)):
        body = autoscaled(endpoint(name, namespace, chart_image, real_node, host_python, snapshots), 0, 2)
        kube.kubectl("apply", "-f", "-", input=json.dumps(body))
    wait = waiter(kube, namespace)
    wait(lambda: ready_snapshot(kube, namespace, ENDPOINT), "the snapshot captured at zero replicas")
    wait(lambda: at_zero(kube, namespace, ENDPOINT) and at_zero(kube, namespace, COLD_ENDPOINT),
         "both endpoints at zero replicas")  # fmt: skip
    url = f"http://{keda}/v1/completions"

    answers = {}
    for name in (ENDPOINT, COLD_ENDPOINT):
        host = routed_host(kube, namespace, name)
        answers[name], seconds = timed_completion(kube, namespace, url, host, timeout=HOLD_SECONDS)
        print(f"{name}: request at zero replicas answered in {seconds:.2f}s")
    assert answers[ENDPOINT] == answers[COLD_ENDPOINT] and answers[ENDPOINT]

    # The held request was answered by the replica KEDA asked for and the agent restored.
    restored = ready_workers(kube, namespace, L.ROLE_RESTORE)
    assert len(restored) == 1, [p["metadata"]["name"] for p in worker_pods(kube, namespace, L.ROLE_RESTORE)]
    reasons = {event["reason"] for event in events_of(kube, namespace, restored[0]["metadata"]["name"])}
    assert "Restored" in reasons and "RestoreFailed" not in reasons, reasons
    assert not worker_pods(kube, namespace, L.ROLE_COLD, ENDPOINT)
    assert [ready(p) for p in worker_pods(kube, namespace, L.ROLE_COLD, COLD_ENDPOINT)] == [True]

    # With no requests, KEDA takes the endpoint back to zero after its cooldown.
    wait(lambda: at_zero(kube, namespace, ENDPOINT), "the endpoint back at zero after its cooldown")


@pytest.mark.integration
def test_load_through_the_interceptor_scales_out_to_a_restored_replica_and_back(
    kube: ControlPlane,
    real_node: RealNode,
    chart_image: str,
    host_python: HostPython,
    keda: str,
    namespace: str,
    release: str,
) -> None:
    body = autoscaled(endpoint(ENDPOINT, namespace, chart_image, real_node, host_python, True), 1, 2)
    kube.kubectl("apply", "-f", "-", input=json.dumps(body))
    wait = waiter(kube, namespace)
    wait(lambda: ready_snapshot(kube, namespace, ENDPOINT), "the snapshot")
    first = wait(lambda: restored_replicas(kube, namespace, 1), "one restored replica")[0]
    host = routed_host(kube, namespace, ENDPOINT)

    argv = load_argv(namespace, f"http://{keda}/v1/completions", host, LOAD_SECONDS)
    load = subprocess.Popen([str(kube.binary("kubectl")), *argv], env=kube.tool_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    started = time.monotonic()
    try:
        two = wait(lambda: restored_replicas(kube, namespace, 2), "a second replica", LOAD_SECONDS)
        print(f"scaled 1 -> 2 in {time.monotonic() - started:.1f}s of load")
    finally:
        out, err = load.communicate(timeout=LOAD_SECONDS + 90)
    assert load.returncode == 0, err
    counts = json.loads(out)
    assert counts["answered"] > 0 and counts["failed"] == 0, counts

    second = next(p for p in two if p["metadata"]["name"] != first["metadata"]["name"])
    reasons = {event["reason"] for event in events_of(kube, namespace, second["metadata"]["name"])}
    assert "Restored" in reasons and "RestoreFailed" not in reasons, reasons
    scaled = get(kube, "iep", namespace, ENDPOINT)
    assert scaled is not None and scaled["spec"]["replicas"] == 2

    # The load is over: the HPA's recommendation falls and the endpoint comes back to its minimum.
    def back_to_one() -> bool:
        scaled_back = get(kube, "iep", namespace, ENDPOINT)
        replicas = scaled_back["spec"]["replicas"] if scaled_back else None
        return replicas == 1 and len(worker_pods(kube, namespace, L.ROLE_RESTORE)) == 1

    wait(back_to_one, "back to one replica")
