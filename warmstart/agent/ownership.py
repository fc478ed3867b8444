"""Which pods the agent acts on: owned by an InferenceEndpoint, or by the InferenceSnapshot they capture.

Ownership is read from ownerReferences and checked against the live owners' uids, never taken from labels
alone (a tenant can set any label on a pod it creates).
"""

from __future__ import annotations

from typing import Any

from warmstart.agent import objects
from warmstart.agent.kube_status import KubeStatus
from warmstart.api import labels as L

OWNER_CHAIN_DEPTH = 3  # pod -> ReplicaSet -> Deployment -> InferenceEndpoint


def owned(kube: KubeStatus, pod: dict[str, Any]) -> bool:
    """Capture pods: owned by the InferenceSnapshot they name; others: by an InferenceEndpoint."""
    namespace, pod_labels = objects.meta(pod)["namespace"], objects.labels(pod)
    refs = objects.meta(pod).get("ownerReferences") or []
    if pod_labels.get(L.ROLE_LABEL) == L.ROLE_CAPTURE:
        snap = kube.get_snapshot(namespace, pod_labels.get(L.SNAPSHOT_LABEL, ""))
        return snap is not None and any(
            ref.get("kind") == L.SNAPSHOT_KIND and ref.get("uid") == objects.meta(snap)["uid"] for ref in refs
        )
    endpoint = pod_labels.get(L.ENDPOINT_LABEL, "")
    return _chain_reaches_endpoint(kube, namespace, refs, endpoint, OWNER_CHAIN_DEPTH)


def _chain_reaches_endpoint(
    kube: KubeStatus, namespace: str, refs: list[dict[str, Any]], endpoint: str, depth: int
) -> bool:
    if depth == 0:
        return False
    for ref in refs:
        if ref.get("kind") == L.ENDPOINT_KIND and str(ref.get("apiVersion", "")).startswith(L.GROUP):
            found = kube.get_endpoint(namespace, ref["name"])
            if found is not None and objects.meta(found)["uid"] == ref.get("uid") and ref["name"] == endpoint:
                return True
        owner = kube.get_owner(ref.get("kind", ""), namespace, ref.get("name", ""))
        if owner is not None and objects.meta(owner)["uid"] == ref.get("uid"):
            parents = objects.meta(owner).get("ownerReferences") or []
            if _chain_reaches_endpoint(kube, namespace, parents, endpoint, depth - 1):
                return True
    return False
