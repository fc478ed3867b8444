"""The node agent's reads and writes on the API server: pods, InferenceSnapshots, their status, Events.

Through the shared client (`warmstart.kube`), so every call carries a timeout. Status writes are merge
patches on the status subresource, so the agent only touches the fields it owns and never races the
operator's own writes on other fields.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

from warmstart.api import labels as L
from warmstart.api.snapshot import AGENT, SnapshotStatus, status_patch
from warmstart.host.clock import format_time
from warmstart.kube.client import Kube, KubeError
from warmstart.kube.events import record_event

log = logging.getLogger(__name__)

EVENT_SOURCE = "warmstart-agent"  # its Events' source, and the writer of its changes
OWNER_KINDS = ("ReplicaSet", "Deployment")  # the links between a worker pod and its InferenceEndpoint


class KubeStatus:
    """What the agent reads and writes, for the pods on its node `node`."""

    def __init__(self, api_client: Any, node: str) -> None:
        self.kube = Kube(api_client, field_manager=EVENT_SOURCE)
        self.node = node
        self._on_this_node = {"spec.nodeName": node}  # the field selector of its pods

    def list_node_pods(self) -> tuple[list[dict[str, Any]], str]:
        """Worker pods scheduled on this node and the list's resourceVersion."""
        return self.kube.list_with_version("Pod", "", L.ENDPOINT_LABEL, self._on_this_node)

    def watch_node_pods(self, resource_version: str, seconds: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """(type, pod) of each change to the pods `list_node_pods` lists, from `resource_version` on."""
        return self.kube.watch("Pod", "", seconds, L.ENDPOINT_LABEL, self._on_this_node, resource_version)

    def snapshots_version(self) -> str:
        """InferenceSnapshots' resourceVersion (all namespaces) now: a watch from it sees later changes."""
        return self.kube.list_with_version(L.SNAPSHOT_KIND, "", "")[1]

    def watch_snapshots(self, resource_version: str, seconds: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """(type, InferenceSnapshot) of each change to one, in any namespace, after `resource_version`."""
        return self.kube.watch(L.SNAPSHOT_KIND, "", seconds, resource_version=resource_version)

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.kube.get("Pod", namespace, name)

    def get_snapshot(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.kube.get(L.SNAPSHOT_KIND, namespace, name)

    def get_endpoint(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.kube.get(L.ENDPOINT_KIND, namespace, name)

    def list_snapshots(self) -> list[dict[str, Any]]:
        return self.kube.list(L.SNAPSHOT_KIND, "", "")

    def get_owner(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.kube.get(kind, namespace, name) if kind in OWNER_KINDS else None

    def patch_snapshot_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.kube.patch_status(L.SNAPSHOT_KIND, namespace, name, status)

    def add_restore_failure(self, namespace: str, name: str, reason: str, attempts: int = 20) -> int | None:
        """Add one failure to the snapshot's cluster-wide count (`status.restoreFailures`) and return the
        new count (None when the snapshot is gone).

        Agents on every node add to the one count: each write carries the resourceVersion it read as a
        precondition, so a concurrent writer makes the API server answer 409 and the count is read again.
        """
        for _ in range(attempts):
            snap = self.get_snapshot(namespace, name)
            if snap is None:
                return None
            count = int(SnapshotStatus.of(snap).restore_failures or 0) + 1
            patch = status_patch(AGENT, restore_failures=count, restore_failure_message=reason[:1024])
            if self._patch_status_unless_changed(snap, patch):
                return count
        raise RuntimeError(f"{namespace}/{name}: restore failure not counted ({attempts} writes conflicted)")

    def clear_restore_failures(self, snap: dict[str, Any]) -> None:
        """A restore of `snap` succeeded: its failures were not consecutive, their count starts again
        (unless a failure is counted at the same moment: that one is never wiped out). Nothing is asked of
        the API server when `snap` shows none, as it does after almost every restore. Best effort: the
        restore is done whatever the API server answers."""
        if not SnapshotStatus.of(snap).restore_failures:
            return
        meta = snap["metadata"]
        try:
            fresh = self.get_snapshot(meta["namespace"], meta["name"])
            if fresh is not None and SnapshotStatus.of(fresh).restore_failures:
                self._patch_status_unless_changed(fresh, status_patch(AGENT, restore_failures=0))
        except Exception as exc:  # any client or transport error
            log.warning("%s/%s: restore failures not reset: %s", meta["namespace"], meta["name"], exc)

    def _patch_status_unless_changed(self, snap: dict[str, Any], status: dict[str, Any]) -> bool:
        """Merge `status` into the snapshot's status if it is still at `snap`'s resourceVersion."""
        meta = snap["metadata"]
        body = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": status}
        try:
            self.kube.patch(L.SNAPSHOT_KIND, meta["namespace"], meta["name"], body, "status")
        except KubeError as exc:
            if exc.status in (404, 409):  # gone, or changed since it was read
                return False
            raise
        return True

    def annotate_pod(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Set the pod's `warmstart.dev/status` annotation to `status` (JSON) with the time it was written."""
        value = json.dumps({**status, "at": format_time()}, sort_keys=True)
        self.kube.patch("Pod", namespace, name, {"metadata": {"annotations": {L.STATUS_ANNOTATION: value}}})

    def event(self, involved: dict[str, Any], kind: str, event_type: str, reason: str, message: str) -> None:
        """Record an Event on `involved` (a pod or an InferenceSnapshot); failures are logged, not raised."""
        record_event(self.kube, involved, kind, event_type, reason, message, EVENT_SOURCE, host=self.node)
