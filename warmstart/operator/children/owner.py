"""Who owns a child and how every child is labelled: owner references, labels, the workers' selector."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from warmstart.api import labels as L


@dataclass(frozen=True)
class Owner:
    """Enough of an object's metadata to own children."""

    api_version: str
    kind: str
    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Owner:
        meta = body["metadata"]
        return cls(body["apiVersion"], body["kind"], meta["name"], meta["namespace"], meta["uid"])

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def common_labels(endpoint: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "warmstart",
        "app.kubernetes.io/instance": endpoint,
        "app.kubernetes.io/managed-by": L.FIELD_MANAGER,
        "app.kubernetes.io/part-of": "warmstart",
        L.COMPONENT_LABEL: component,
        L.ENDPOINT_LABEL: endpoint,
    }


def worker_selector(endpoint: str) -> dict[str, str]:
    """Selects the serving pods (never the capture pod): Deployment, Service and scale subresource."""
    return {L.ENDPOINT_LABEL: endpoint, L.COMPONENT_LABEL: L.WORKER_COMPONENT}


def selector_string(endpoint: str) -> str:
    return L.label_selector(worker_selector(endpoint))


def object_metadata(owner: Owner, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": common_labels(owner.name, component),
        "ownerReferences": [owner.reference()],
    }
