"""Where restore pods would rather run: on the node that captured their snapshot, when no other node can
read it.

The chart chooses the node agents' snapshot store and tells the operator which kind it is. A node-local
store (a hostPath on each node) holds a snapshot only where it was captured: a restore pod scheduled
anywhere else starts cold. A shared volume or an object store reaches every node (the object store after
one pull into the node's cache), so there the scheduler is left free to spread the replicas.

The preference is never a requirement: a replica that does not fit on that node runs elsewhere, cold,
rather than not at all.
"""

from __future__ import annotations

from typing import Any

NODE_LOCAL = "node-local"
SHARED_VOLUME = "shared-volume"
OBJECT_STORE = "object-store"
SNAPSHOT_STORES = (NODE_LOCAL, SHARED_VOLUME, OBJECT_STORE)
# The scheduler's largest weight: among the nodes that fit, the one holding the snapshot wins over spreading.
PREFERENCE_WEIGHT = 100


def restore_node(store: str, snapshot_node: str) -> str:
    """The node restore pods should prefer ("" for none): the snapshot's own, where only it holds it."""
    return snapshot_node if store == NODE_LOCAL else ""


def _preference(node: str) -> dict[str, Any]:
    # The node's name, not its kubernetes.io/hostname label: the two differ on some clouds.
    match = {"key": "metadata.name", "operator": "In", "values": [node]}
    return {"weight": PREFERENCE_WEIGHT, "preference": {"matchFields": [match]}}


def prefer_node(pod_spec: dict[str, Any], node: str) -> None:
    """Add a preference for `node` to `pod_spec`'s node affinity, beside any affinity it already has."""
    node_affinity = pod_spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    node_affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(_preference(node))


def preferred_node(pod_spec: dict[str, Any]) -> str:
    """The node `prefer_node` added to `pod_spec` ("" if none)."""
    node_affinity = (pod_spec.get("affinity") or {}).get("nodeAffinity") or {}
    for term in node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []:
        values = ((term.get("preference") or {}).get("matchFields") or [{}])[0].get("values") or [""]
        if term == _preference(values[0]):
            return str(values[0])
    return ""
