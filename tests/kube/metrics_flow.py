"""An endpoint autoscaled on its workers' queue through Prometheus on the real node, under a bounded load from
the client pod: what the Prometheus autoscaling test and `benchmarks/scale_on_metrics.py` share."""

from __future__ import annotations

import json
import math
import subprocess
import time
import urllib.parse
from dataclasses import asdict, dataclass
from typing import Any

from control_plane import monitoring
from control_plane.cluster import ControlPlane, wait_for
from endpoint_flow import (
    ENDPOINT,
    START_TIMEOUT,
    diagnostics,
    events_of,
    get,
    load_argv,
    pod_url,
    ready_workers,
    stop_load,
    timed_completion,
    waiter,
    worker_pods,
)

from warmstart.api import labels as L

METRIC = "warmstart_worker_requests_waiting"
COOLDOWN_SECONDS = 15
# The endpoint's ServiceMonitor, scraped every 5 s, labelled for the testbed's Prometheus; the chart's values
# that add its own (operator, agent) the same.
SCRAPE_INTERVAL = "5s"
SCRAPED = {"serviceMonitor": True, "interval": SCRAPE_INTERVAL, "labels": monitoring.SELECTED}
MONITORED = {
    "metrics": {
        "serviceMonitor": {"enabled": True, "interval": SCRAPE_INTERVAL, "labels": monitoring.SELECTED}
    }
}
# Run in the client pod: one GET of Prometheus's HTTP API; prints the answer's data.
PROMETHEUS_GET = """
import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=20) as response:
    print(json.dumps(json.loads(response.read())["data"]))
"""


def scaled_on_queue(body: dict[str, Any], mode: str) -> dict[str, Any]:
    """The endpoint scraped by its ServiceMonitor and autoscaled 1..2 on its workers' queue."""
    spec = body["spec"]
    spec["engine"]["args"] = ["--max-num-seqs", "1"]
    spec["monitoring"] = SCRAPED
    spec["autoscaling"] = {
        "mode": mode,
        "minReplicas": 1,
        "maxReplicas": 2,
        "cooldownSeconds": COOLDOWN_SECONDS,
        "pollingIntervalSeconds": 5,
        "metric": {"name": METRIC, "target": "1"},
    }
    return body


def prometheus_get(kube: ControlPlane, namespace: str, url: str) -> Any:
    """The data of one answer of Prometheus's HTTP API, asked from the client pod."""
    script = ["python3", "-c", PROMETHEUS_GET, url]
    return json.loads(kube.kubectl("exec", "-n", namespace, "client", "--", *script, timeout=60).stdout)


def query(kube: ControlPlane, namespace: str, prometheus: str, expression: str) -> list[dict[str, Any]]:
    """An instant query from the client pod: the result vector."""
    return prometheus_get(
        kube, namespace, f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expression})}"
    )["result"]


def scrape_configured(kube: ControlPlane, namespace: str, prometheus: str, service_monitor: str) -> bool:
    """Whether the configuration Prometheus runs scrapes what ServiceMonitor `service_monitor` of `namespace`
    selects (prometheus-operator names the job after it)."""
    config = prometheus_get(kube, namespace, f"{prometheus}/api/v1/status/config")["yaml"]
    return f"serviceMonitor/{namespace}/{service_monitor}/" in config


def custom_metric(kube: ControlPlane, namespace: str) -> list[dict[str, Any]]:
    """The per-pod values the custom metrics API serves for METRIC in `namespace`."""
    path = f"/apis/custom.metrics.k8s.io/v1beta1/namespaces/{namespace}/pods/*/{METRIC}"
    result = kube.kubectl("get", "--raw", path, check=False)
    return json.loads(result.stdout)["items"] if result.returncode == 0 else []


def started_as(kube: ControlPlane, namespace: str, count: int, role: str) -> list[dict[str, Any]] | None:
    pods = ready_workers(kube, namespace, role)
    return pods if len(pods) == count else None


def hpa_metric_value(kube: ControlPlane, namespace: str, name: str) -> float | None:
    """The metric's current average as the HPA's own status reports it."""
    hpa = get(kube, "hpa", namespace, name)
    for metric in (hpa or {}).get("status", {}).get("currentMetrics") or []:
        current = (metric.get("pods") or metric.get("external") or {}).get("current", {})
        if "averageValue" in current:
            return quantity(current["averageValue"])
    return None


def restored_count(kube: ControlPlane, namespace: str) -> int | None:
    """The endpoint's RESTORED column: Ready replicas a node agent restored."""
    scaled = get(kube, "iep", namespace, ENDPOINT)
    return scaled["status"].get("restoredReplicas") if scaled else None


def quantity(value: str) -> float:
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


@dataclass(frozen=True)
class ScaleOut:
    """Seconds from the load's start to: the autoscaler setting two replicas, the new replica Ready, its first
    answer; the answer's own request time, and the queue's peak per replica as the HPA saw it."""

    decided: float
    ready: float
    answered: float
    request: float
    peak: float

    def row(self) -> dict[str, float]:
        return asdict(self)


def scale_out_under_load(
    kube: ControlPlane, namespace: str, role: str, hpa_name: str, load_seconds: float
) -> ScaleOut:
    """Load through the Service until the autoscaler adds a second replica of `role` (polled every 0.25 s);
    waits for the load to end (every request answered) and for the endpoint to scale back to one replica."""
    wait = waiter(kube, namespace)
    first = wait(lambda: started_as(kube, namespace, 1, role), f"one {role} replica")[0]
    url = f"http://{ENDPOINT}.{namespace}/v1/completions"
    argv = [str(kube.binary("kubectl")), *load_argv(namespace, url, "", load_seconds)]
    pipe = subprocess.PIPE
    load = subprocess.Popen(argv, env=kube.tool_env(), stdout=pipe, stderr=pipe, text=True)
    started, peak, decided = time.monotonic(), 0.0, math.nan

    def second_replica() -> dict[str, Any] | None:
        nonlocal peak, decided
        peak = max(peak, hpa_metric_value(kube, namespace, hpa_name) or 0.0)
        scaled = get(kube, "iep", namespace, ENDPOINT)
        if math.isnan(decided) and scaled and scaled["spec"]["replicas"] == 2:
            decided = time.monotonic() - started
        pods = started_as(kube, namespace, 2, role) or []
        return next((p for p in pods if p["metadata"]["name"] != first["metadata"]["name"]), None)

    try:
        try:
            second = wait_for(second_replica, timeout=load_seconds, interval=0.25, message="a second replica")
        except TimeoutError as exc:
            raise AssertionError(f"{exc} of {role} under load\n{diagnostics(kube, namespace)}") from None
        ready_after = time.monotonic() - started
        answer, seconds = timed_completion(kube, namespace, pod_url(second))
        answered_after = time.monotonic() - started
        if role == L.ROLE_RESTORE:  # while the load still holds two replicas
            wait_for(lambda: restored_count(kube, namespace) == 2, timeout=60, message="RESTORED 2")
    finally:
        stop_load(kube, namespace)
        out, err = load.communicate(timeout=load_seconds + 90)
    assert load.returncode == 0, err
    counts = json.loads(out)
    assert counts["answered"] > 0 and counts["failed"] == 0, counts
    assert answer.token_ids and peak > 0, (answer, peak)
    reasons = {event["reason"] for event in events_of(kube, namespace, second["metadata"]["name"])}
    if role == L.ROLE_RESTORE:
        assert "Restored" in reasons and "RestoreFailed" not in reasons, reasons

    def back_to_one() -> bool:
        scaled = get(kube, "iep", namespace, ENDPOINT)
        replicas = scaled["spec"]["replicas"] if scaled else None
        return replicas == 1 and len(worker_pods(kube, namespace, role)) == 1

    wait(back_to_one, "back to one replica once the load ended", START_TIMEOUT)
    return ScaleOut(decided, ready_after, answered_after, seconds, peak)


def report(label: str, times: ScaleOut) -> None:
    print(
        f"{label}: load start -> autoscaler scales to 2: {times.decided:.1f}s, new replica Ready: "
        f"{times.ready:.1f}s, its first answer: {times.answered:.1f}s "
        f"(the request {times.request:.2f}s); queue peak seen by the HPA {times.peak:.2f}"
    )
