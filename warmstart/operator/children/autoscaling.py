"""What scales the workers: a HorizontalPodAutoscaler, a KEDA ScaledObject or an HTTPScaledObject, all
targeting the InferenceEndpoint's scale subresource."""

from __future__ import annotations

from typing import Any

from warmstart.api import labels as L
from warmstart.api.endpoint import EndpointSpec
from warmstart.operator.children.owner import Owner, object_metadata


def _scale_target(owner: Owner) -> dict[str, str]:
    return {"apiVersion": owner.api_version, "kind": owner.kind, "name": owner.name}


def _scale_down_behavior(spec: EndpointSpec) -> dict[str, Any]:
    """Replicas are removed once the metric has stayed low for cooldownSeconds (an HPA's own default window
    is 300 s, cooldownSeconds' default)."""
    return {"scaleDown": {"stabilizationWindowSeconds": spec.autoscaling.cooldown_seconds}}


def horizontal_pod_autoscaler(owner: Owner, spec: EndpointSpec) -> dict[str, Any]:
    """autoscaling/v2 HPA on the endpoint's scale subresource, from a per-pod or an external metric."""
    scaling = spec.autoscaling
    target = {"type": "AverageValue", "averageValue": scaling.metric.target}
    if scaling.metric.source == "External":
        metric = {
            "type": "External",
            "external": {
                "metric": {
                    "name": scaling.metric.name,
                    "selector": {"matchLabels": {L.ENDPOINT_LABEL: owner.name}},
                },
                "target": target,
            },
        }
    else:
        metric = {"type": "Pods", "pods": {"metric": {"name": scaling.metric.name}, "target": target}}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": object_metadata(owner, owner.name, "autoscaler"),
        "spec": {
            "scaleTargetRef": _scale_target(owner),
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [metric],
            "behavior": _scale_down_behavior(spec),
        },
    }


def scaled_object(owner: Owner, spec: EndpointSpec) -> dict[str, Any]:
    """KEDA ScaledObject with a Prometheus trigger; minReplicaCount 0 scales the endpoint to zero."""
    scaling = spec.autoscaling
    selector = f'namespace="{owner.namespace}",service="{owner.name}"'
    query = scaling.metric.query or f"sum({scaling.metric.name}{{{selector}}})"
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": object_metadata(owner, owner.name, "autoscaler"),
        "spec": {
            "scaleTargetRef": _scale_target(owner),
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "pollingInterval": scaling.polling_interval_seconds,
            "cooldownPeriod": scaling.cooldown_seconds,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _scale_down_behavior(spec)}},
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": scaling.prometheus_address,
                        "query": query,
                        "threshold": str(scaling.metric.target),
                    },
                }
            ],
        },
    }


def http_scaled_object(owner: Owner, spec: EndpointSpec) -> dict[str, Any]:
    """KEDA HTTP add-on HTTPScaledObject: its interceptor holds a request while the endpoint is at zero,
    KEDA scales the endpoint up, and the request goes on to the endpoint's Service once a replica is Ready."""
    scaling = spec.autoscaling
    http = scaling.http
    # No hosts given: the interceptor's routing table spans the cluster, so the namespace is part of the host.
    routing: dict[str, Any] = {"hosts": list(http.hosts) or [f"{owner.name}.{owner.namespace}"]}
    if http.path_prefixes:
        routing["pathPrefixes"] = list(http.path_prefixes)
    return {
        "apiVersion": "http.keda.sh/v1alpha1",
        "kind": "HTTPScaledObject",
        "metadata": object_metadata(owner, owner.name, "autoscaler"),
        "spec": {
            **routing,
            "scaleTargetRef": {**_scale_target(owner), "service": owner.name, "port": spec.service.port},
            "replicas": {"min": scaling.min_replicas, "max": scaling.max_replicas},
            "scaledownPeriod": scaling.cooldown_seconds,
            "scalingMetric": {"concurrency": {"targetValue": http.target_concurrency}},
            "timeouts": {
                "conditionWait": f"{http.cold_start_timeout_seconds}s",
                "responseHeader": f"{http.response_timeout_seconds}s",
            },
        },
    }
