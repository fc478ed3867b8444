"""Pure builders for the objects an InferenceEndpoint owns, one module per concern. No API calls: dict in,
dict out."""

from warmstart.operator.children.autoscaling import (
    horizontal_pod_autoscaler,
    http_scaled_object,
    scaled_object,
)
from warmstart.operator.children.owner import Owner, common_labels, selector_string, worker_selector
from warmstart.operator.children.serving import service, service_monitor
from warmstart.operator.children.workers import capture_pod, capture_pod_name, deployment, prestage_daemonset

__all__ = [
    "Owner",
    "capture_pod",
    "capture_pod_name",
    "common_labels",
    "deployment",
    "horizontal_pod_autoscaler",
    "http_scaled_object",
    "prestage_daemonset",
    "scaled_object",
    "selector_string",
    "service",
    "service_monitor",
    "worker_selector",
]
