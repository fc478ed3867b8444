"""The node agent's reads and writes on the API server: pods, InferenceSnapshots, their status, Events.

Every call carries a timeout. Status writes are merge patches on the status subresource, so the agent only
touches the fields it owns and never races the operator's own writes on other fields.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import uuid
from typing import Any

from warmstart.api import labels as L

log = logging.getLogger(__name__)

API_TIMEOUT = 15.0
EVENT_SOURCE = "warmstart-agent"


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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

    def annotate_pod(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Set the pod's `warmstart.dev/status` annotation to `status` (JSON) with the time it was written."""
        value = json.dumps({**status, "at": utc_now()}, sort_keys=True)
        body = {"metadata": {"annotations": {L.STATUS_ANNOTATION: value}}}
        self.core.patch_namespaced_pod(name, namespace, body, _request_timeout=self.timeout)

    def event(self, involved: dict[str, Any], kind: str, event_type: str, reason: str, message: str) -> None:
        """Record an Event on `involved` (a pod or an InferenceSnapshot); failures are logged, not raised."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        meta = involved["metadata"]
        now = dt.datetime.now(dt.UTC)
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
