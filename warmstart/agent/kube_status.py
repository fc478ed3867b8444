"""The node agent's reads and writes on the API server: pods, InferenceSnapshots, their status, Events.

Every call carries a timeout. Status writes are merge patches on the status subresource, so the agent only
touches the fields it owns and never races the operator's own writes on other fields.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from warmstart.api import labels as L
from warmstart.api.snapshot import AGENT, SnapshotStatus, status_patch
from warmstart.clock import format_time, utc_now

log = logging.getLogger(__name__)

API_TIMEOUT = 15.0
EVENT_SOURCE = "warmstart-agent"


class KubeStatus:
    """Thin typed wrapper over the kubernetes client for what the agent needs."""

    def __init__(self, api_client: Any, node: str, timeout: float = API_TIMEOUT) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.node = node
        self.timeout = timeout

    # --- reads ---------------------------------------------------------------------------------------

    def node_pod_selectors(self) -> dict[str, str]:
        """The selectors of this node's worker pods, for the list and the watch alike."""
        return {"field_selector": f"spec.nodeName={self.node}", "label_selector": L.ENDPOINT_LABEL}

    def list_node_pods(self) -> tuple[list[dict[str, Any]], str]:
        """Worker pods scheduled on this node (as plain dicts) and the list's resourceVersion."""
        listing = self.core.list_pod_for_all_namespaces(
            **self.node_pod_selectors(), _request_timeout=self.timeout
        )
        pods = [self.core.api_client.sanitize_for_serialization(pod) for pod in listing.items]
        return pods, listing.metadata.resource_version

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            pod = self.core.read_namespaced_pod(name, namespace, _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self.core.api_client.sanitize_for_serialization(pod)

    def get_snapshot(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get_custom(L.SNAPSHOT_PLURAL, namespace, name)

    def get_endpoint(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get_custom(L.ENDPOINT_PLURAL, namespace, name)

    def list_snapshots(self) -> list[dict[str, Any]]:
        listing = self.custom.list_cluster_custom_object(
            L.GROUP, L.VERSION, L.SNAPSHOT_PLURAL, _request_timeout=self.timeout
        )
        return list(listing.get("items", []))

    def _get_custom(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.custom.get_namespaced_custom_object(
                L.GROUP, L.VERSION, namespace, plural, name, _request_timeout=self.timeout
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def get_owner(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """A ReplicaSet or Deployment (the links between a worker pod and its InferenceEndpoint)."""
        from kubernetes.client.exceptions import ApiException

        readers = {
            "ReplicaSet": self.apps.read_namespaced_replica_set,
            "Deployment": self.apps.read_namespaced_deployment,
        }
        if kind not in readers:
            return None
        try:
            found = readers[kind](name, namespace, _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self.core.api_client.sanitize_for_serialization(found)

    # --- writes --------------------------------------------------------------------------------------

    def patch_snapshot_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            L.GROUP, L.VERSION, namespace, L.SNAPSHOT_PLURAL, name, {"status": status},
            _request_timeout=self.timeout,
        )  # fmt: skip

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
        from kubernetes.client.exceptions import ApiException

        meta = snap["metadata"]
        body = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": status}
        try:
            self.custom.patch_namespaced_custom_object_status(
                L.GROUP, L.VERSION, meta["namespace"], L.SNAPSHOT_PLURAL, meta["name"], body,
                _request_timeout=self.timeout,
            )  # fmt: skip
        except ApiException as exc:
            if exc.status in (404, 409):  # gone, or changed since it was read
                return False
            raise
        return True

    def annotate_pod(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Set the pod's `warmstart.dev/status` annotation to `status` (JSON) with the time it was written."""
        value = json.dumps({**status, "at": format_time()}, sort_keys=True)
        body = {"metadata": {"annotations": {L.STATUS_ANNOTATION: value}}}
        self.core.patch_namespaced_pod(name, namespace, body, _request_timeout=self.timeout)

    def event(self, involved: dict[str, Any], kind: str, event_type: str, reason: str, message: str) -> None:
        """Record an Event on `involved` (a pod or an InferenceSnapshot); failures are logged, not raised."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        meta = involved["metadata"]
        now = utc_now()
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(name=f"{meta['name']}.{uuid.uuid4().hex[:12]}"),
            involved_object=client.V1ObjectReference(
                api_version=involved.get("apiVersion", "v1"),
                kind=kind,
                name=meta["name"],
                namespace=meta["namespace"],
                uid=meta.get("uid"),
            ),  # fmt: skip
            type=event_type,
            reason=reason,
            message=message[:1024],
            source=client.V1EventSource(component=EVENT_SOURCE, host=self.node),
            reporting_component=EVENT_SOURCE,
            reporting_instance=self.node,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        try:
            self.core.create_namespaced_event(meta["namespace"], body, _request_timeout=self.timeout)
        except (ApiException, OSError) as exc:
            where = f"{meta['namespace']}/{meta['name']}"
            log.warning("could not record event %s on %s: %s", reason, where, exc)
