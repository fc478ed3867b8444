"""Autoscaling on the workers' own metrics, the way platforms run it, on the real node: prometheus-operator
runs a Prometheus that scrapes what the endpoint's ServiceMonitor (and the chart's) select, prometheus-adapter
serves `warmstart_worker_requests_waiting` to the HPA as a per-pod custom metric (mode `hpa`, the flagship
example's), and KEDA's Prometheus scaler reads the same series (mode `keda`). All of it built from the
projects' Go modules and installed from the manifests they ship (`hack/control-plane addons`).

One endpoint serves the whole module, in a namespace of its own: a new ServiceMonitor is scraped only once
its configuration reaches Prometheus (minutes), so the tests share it and change only its autoscaling, in
order: the dashboard's panels while it serves, then mode `hpa`, then mode `keda`. Load comes from a client pod
through the endpoint's Service; a worker batching one sequence at a time (`--max-num-seqs 1`) queues what
four clients send, so its queue is the signal.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from control_plane.cluster import ControlPlane, wait_for
from control_plane.node import RealNode
from endpoint_flow import (
    ENDPOINT,
    RELEASE,
    endpoint,
    get,
    install,
    pod_url,
    ready_snapshot,
    start_client,
    timed_completion,
    uninstall,
    waiter,
)
from metrics_flow import (
    METRIC,
    MONITORED,
    custom_metric,
    query,
    report,
    scale_out_under_load,
    scaled_on_queue,
    scrape_configured,
    started_as,
)
from node_plugin import HostPython

from warmstart.api import labels as L

pytestmark = pytest.mark.spawns

NAMESPACE = "prometheus-autoscaling"
LOAD_SECONDS = 120
DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "warmstart" / "dashboards" / "warmstart.json"


def served_endpoint(chart_image: str, node: RealNode, host_python: HostPython, mode: str) -> dict[str, Any]:
    """The module's endpoint: scraped, restored, pre-staged, autoscaled on its queue in `mode` (or "none")."""
    body = scaled_on_queue(endpoint(ENDPOINT, NAMESPACE, chart_image, node, host_python, True), mode)
    body["spec"]["snapshot"]["prestage"] = "PageCache"  # the dashboard's pre-staging panel
    if mode == "none":
        body["spec"]["autoscaling"] = {"mode": "none"}
    return body


@pytest.fixture(scope="module")
def served(
    kube: ControlPlane, real_node: RealNode, chart_image: str, host_python: HostPython, prometheus: str
) -> Iterator[str]:
    """The chart (its own ServiceMonitors on), a client pod and the endpoint serving from a restored replica,
    scraped by Prometheus; the namespace.

    As in a cluster whose agents Prometheus scrapes before any endpoint exists, the capture and the restore
    happen once the agent has been scraped and the endpoint's ServiceMonitor is in Prometheus's
    configuration: the endpoint (its ServiceMonitor with it) starts at zero replicas without snapshots, and
    snapshots are turned on after."""
    kube.kubectl("create", "namespace", NAMESPACE)
    kube.wait_default_service_account(NAMESPACE)
    try:
        install(kube, chart_image, real_node, NAMESPACE, MONITORED)
        start_client(kube, NAMESPACE, chart_image, real_node)
        body = served_endpoint(chart_image, real_node, host_python, "none")
        idle = {**body, "spec": {**body["spec"], "replicas": 0, "snapshot": {"enabled": False}}}
        kube.kubectl("apply", "-f", "-", input=json.dumps(idle))
        wait = waiter(kube, NAMESPACE)
        agent_scraped = f'up{{namespace="{NAMESPACE}",service="{RELEASE}-warmstart-agent-metrics"}}'
        wait(lambda: query(kube, NAMESPACE, prometheus, agent_scraped), "the agent scraped")
        wait(lambda: scrape_configured(kube, NAMESPACE, prometheus, ENDPOINT),
             "the endpoint's ServiceMonitor in Prometheus's configuration")  # fmt: skip
        kube.kubectl("apply", "-f", "-", input=json.dumps(body))
        wait(lambda: ready_snapshot(kube, NAMESPACE), "the snapshot")
        wait(lambda: started_as(kube, NAMESPACE, 1, L.ROLE_RESTORE), "one restored replica")
        scraped = f'{METRIC}{{namespace="{NAMESPACE}",service="{ENDPOINT}"}}'
        wait(lambda: query(kube, NAMESPACE, prometheus, scraped), f"{scraped} in Prometheus")
        yield NAMESPACE
    finally:
        uninstall(kube, NAMESPACE)
        kube.kubectl("delete", "namespace", NAMESPACE, "--wait=false", "--ignore-not-found", check=False)


def dashboard_queries(namespace: str) -> list[tuple[str, str]]:
    """(panel title, query) for every panel of the chart's dashboard, its variables set as Grafana would."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [
        (panel["title"], target["expr"].replace("$namespace", namespace).replace("$__rate_interval", "5m"))
        for panel in panels
        for target in panel.get("targets", [])
    ]


def has_data(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(sample["value"][1])) for sample in result)


@pytest.mark.integration
def test_every_dashboard_panel_has_data_while_the_endpoint_serves(
    kube: ControlPlane, prometheus: str, served: str
) -> None:
    """First in the module: the session's Prometheus has scraped nothing else of the project yet, so no other
    namespace's series answer the panels that span the cluster."""
    restored = started_as(kube, served, 1, L.ROLE_RESTORE)
    assert restored, "the endpoint's restored replica is gone"
    for _ in range(3):
        timed_completion(kube, served, pod_url(restored[0]))

    queries = dashboard_queries(served)
    assert len(queries) >= 10, queries

    def empty_panels() -> list[str]:
        return [f"{title}: {expr}" for title, expr in queries
                if not has_data(query(kube, served, prometheus, expr))]  # fmt: skip

    try:
        wait_for(lambda: not empty_panels(), timeout=90, interval=5.0, message="every panel with data")
    except TimeoutError:
        pytest.fail("panels with no data:\n" + "\n".join(empty_panels()))


@pytest.mark.integration
def test_hpa_on_the_queue_through_prometheus_adapter_scales_out_to_a_restored_replica_and_back(
    kube: ControlPlane, real_node: RealNode, chart_image: str, host_python: HostPython, served: str
) -> None:
    body = served_endpoint(chart_image, real_node, host_python, "hpa")
    kube.kubectl("apply", "-f", "-", input=json.dumps(body))
    wait = waiter(kube, served)
    wait(lambda: get(kube, "hpa", served, ENDPOINT), "the HPA")
    # Scraped through the endpoint's ServiceMonitor, served by the adapter under its own name.
    wait(lambda: custom_metric(kube, served), f"{METRIC} in the custom metrics API")

    # Cold-started replicas scale the same way: benchmarks/scale_on_metrics.py times both.
    times = scale_out_under_load(kube, served, L.ROLE_RESTORE, ENDPOINT, LOAD_SECONDS)
    report("hpa, restored", times)


@pytest.mark.integration
def test_keda_prometheus_trigger_scales_out_to_a_restored_replica_and_back(
    kube: ControlPlane, real_node: RealNode, chart_image: str, host_python: HostPython, prometheus: str,
    served: str,
) -> None:  # fmt: skip
    body = served_endpoint(chart_image, real_node, host_python, "keda")
    body["spec"]["autoscaling"]["prometheus"] = {"serverAddress": prometheus}
    kube.kubectl("apply", "-f", "-", input=json.dumps(body))
    # KEDA's HPA is named after the ScaledObject; the operator removed its own HPA of mode hpa.
    hpa = f"keda-hpa-{ENDPOINT}"
    wait = waiter(kube, served)
    wait(lambda: get(kube, "hpa", served, hpa) and not get(kube, "hpa", served, ENDPOINT), "KEDA's HPA alone")

    times = scale_out_under_load(kube, served, L.ROLE_RESTORE, hpa, LOAD_SECONDS)
    report("keda, restored", times)
