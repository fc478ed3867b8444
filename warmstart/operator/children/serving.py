"""How the workers are reached and watched: the Service and the ServiceMonitor."""

from __future__ import annotations

from typing import Any

from warmstart.api import labels as L
from warmstart.api.endpoint import EndpointSpec
from warmstart.operator.children.owner import Owner, object_metadata, worker_selector


def service(owner: Owner, spec: EndpointSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(owner, owner.name, L.WORKER_COMPONENT),
        "spec": {
            "type": spec.service.type,
            "selector": worker_selector(owner.name),
            "ports": [{"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def service_monitor(owner: Owner, spec: EndpointSpec) -> dict[str, Any]:
    metadata = object_metadata(owner, owner.name, "monitoring")
    metadata["labels"] = {**spec.monitoring.labels, **metadata["labels"]}  # the operator's own win
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": worker_selector(owner.name)},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": spec.monitoring.interval}],
        },
    }
