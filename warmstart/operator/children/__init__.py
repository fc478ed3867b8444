"""Pure builders for the objects an InferenceEndpoint owns, one module per concern. No API calls: dict in,
dict out."""

from warmstart.operator.children.autoscaling import (
    default_http_host,
    default_prometheus_query,
    horizontal_pod_autoscaler,
    http_scaled_object,
    scaled_object,
)
from warmstart.operator.children.owner import Owner, common_labels, selector_string, worker_selector
from warmstart.operator.children.serving import service, service_monitor
from warmstart.operator.children.workers import (
    PRESTAGE_REQUESTS,
    READY_PROBE_WAIT,
    START_TIMEOUT_SECONDS,
    capture_pod,
    capture_pod_name,
    deployment,
    pod_labels,
    pod_spec,
    prestage_daemonset,
)

__all__ = [
    "Owner",
    "PRESTAGE_REQUESTS",
    "READY_PROBE_WAIT",
    "START_TIMEOUT_SECONDS",
    "capture_pod",
    "capture_pod_name",
    "common_labels",
    "default_http_host",
    "default_prometheus_query",
    "deployment",
    "horizontal_pod_autoscaler",
    "http_scaled_object",
    "pod_labels",
    "pod_spec",
    "prestage_daemonset",
    "scaled_object",
    "selector_string",
    "service",
    "service_monitor",
    "worker_selector",
]
