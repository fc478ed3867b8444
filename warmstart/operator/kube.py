"""A thin, dict-based Kubernetes API client for the operator (server-side apply, create, list, delete).

Built on the `kubernetes` package's ApiClient for authentication and TLS. Errors surface as KubeError
(with the HTTP status), transient ones (5xx, 429, connection failures) as TransientKubeError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from warmstart.api import labels as L

APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
CRD_KIND = "CustomResourceDefinition"


@dataclass(frozen=True)
class Resource:
    api_version: str
    plural: str
    namespaced: bool = True

    @property
    def version_path(self) -> str:
        """The group version's discovery document."""
        return "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"

    def path(self, namespace: str = "", name: str = "", subresource: str = "") -> str:
        parts = [self.version_path]
        if self.namespaced and namespace:
            parts += ["namespaces", namespace]
        parts.append(self.plural)
        if name:
            parts.append(name)
        if subresource:
            parts.append(subresource)
        return "/".join(parts)


RESOURCES: dict[str, Resource] = {
    "Deployment": Resource("apps/v1", "deployments"),
    "DaemonSet": Resource("apps/v1", "daemonsets"),
    "Service": Resource("v1", "services"),
    "Pod": Resource("v1", "pods"),
    "Event": Resource("v1", "events"),
    "HorizontalPodAutoscaler": Resource("autoscaling/v2", "horizontalpodautoscalers"),
    "ScaledObject": Resource("keda.sh/v1alpha1", "scaledobjects"),
    "HTTPScaledObject": Resource("http.keda.sh/v1alpha1", "httpscaledobjects"),
    "ServiceMonitor": Resource("monitoring.coreos.com/v1", "servicemonitors"),
    CRD_KIND: Resource("apiextensions.k8s.io/v1", "customresourcedefinitions", namespaced=False),
    L.ENDPOINT_KIND: Resource(L.API_VERSION, L.ENDPOINT_PLURAL),
    L.SNAPSHOT_KIND: Resource(L.API_VERSION, L.SNAPSHOT_PLURAL),
}


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class TransientKubeError(KubeError):
    """Worth retrying: the API server is overloaded, restarting or unreachable."""


def resource_of(obj: dict[str, Any]) -> Resource:
    kind = obj.get("kind", "")
    if kind not in RESOURCES:
        raise ValueError(f"kind {kind!r} is not one the operator manages")
    return RESOURCES[kind]


def _json_body(raw: bytes | None, method: str, path: str) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError as exc:  # a proxy or a half-started server answering 2xx with a page, not JSON
        raise TransientKubeError(0, f"{method} {path}: the reply is not JSON: {_excerpt(raw)}") from exc
    return data if isinstance(data, dict) else {}


def _error_message(raw: bytes | None) -> str:
    """The Status message of an error reply; the text itself when the body is not a JSON Status (the API
    server answers an unknown path with a plain-text "404 page not found")."""
    if not raw:
        return "(empty reply)"
    try:
        data = json.loads(raw)
    except ValueError:
        return _excerpt(raw)
    if isinstance(data, dict) and data.get("message"):
        return str(data["message"])
    return _excerpt(raw)


def _excerpt(raw: bytes, limit: int = 200) -> str:
    return raw[:limit].decode("utf-8", errors="replace").strip()


class Kube:
    def __init__(self, api_client: Any, timeout: float = 15.0) -> None:
        self.api = api_client
        self.timeout = timeout

    @classmethod
    def from_environment(cls, pool_size: int = 32) -> Kube:
        """In-cluster service account if there is one, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
        from kubernetes import client, config

        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
        configuration.connection_pool_maxsize = pool_size
        return cls(client.ApiClient(configuration))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            request = self.api.param_serialize(
                method,
                path,
                query_params=query or [],
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = self.api.call_api(*request, _request_timeout=self.timeout)
            response.read()
        except ApiException as exc:  # raised for some failures before a response exists
            raise TransientKubeError(exc.status or 0, str(exc.reason)) from exc
        except (HTTPError, OSError) as exc:
            raise TransientKubeError(0, f"{method} {path}: {exc}") from exc
        if 200 <= response.status <= 299:
            return _json_body(response.data, method, path)
        error = TransientKubeError if response.status >= 500 or response.status == 429 else KubeError
        raise error(response.status, f"{method} {path}: {_error_message(response.data)}")

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply with force: creates the object or puts the fields we own back."""
        meta = obj["metadata"]
        path = resource_of(obj).path(meta.get("namespace", ""), meta["name"])
        query = [("fieldManager", L.FIELD_MANAGER), ("force", "true")]
        return self.request("PATCH", path, obj, query, APPLY)

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Create; None when it already exists."""
        path = resource_of(obj).path(obj["metadata"].get("namespace", ""))
        try:
            return self.request("POST", path, obj, [("fieldManager", L.FIELD_MANAGER)])
        except KubeError as exc:
            if exc.status == 409:
                return None
            raise

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", RESOURCES[kind].path(namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self, kind: str, namespace: str, selector: dict[str, str], fields: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """Objects of `kind` in `namespace` ("" for all namespaces) matching labels and fields."""
        query = [("labelSelector", L.label_selector(selector))]
        if fields:
            query.append(("fieldSelector", ",".join(f"{key}={value}" for key, value in fields.items())))
        data = self.request("GET", RESOURCES[kind].path(namespace), query=query)
        return list(data.get("items") or [])

    def served_verbs(self, kind: str) -> frozenset[str]:
        """What discovery says the API server lets clients do with `kind` (empty: not served)."""
        resource = RESOURCES[kind]
        try:
            data = self.request("GET", resource.version_path)
        except KubeError as exc:
            if exc.status == 404:
                return frozenset()
            raise
        for entry in data.get("resources") or []:
            if entry.get("name") == resource.plural:
                return frozenset(entry.get("verbs") or [])
        return frozenset()

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete in the background; False when it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            self.request("DELETE", RESOURCES[kind].path(namespace, name), body)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def patch(
        self, kind: str, namespace: str, name: str, patch: dict[str, Any], subresource: str = ""
    ) -> dict:
        return self.request(
            "PATCH", RESOURCES[kind].path(namespace, name, subresource), patch, content_type=MERGE
        )

    def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return self.patch(kind, namespace, name, {"status": status}, "status")
