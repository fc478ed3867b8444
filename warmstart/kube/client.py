"""The API server as plain dicts: server-side apply, create, get, list, watch, patch, delete.

Built on the `kubernetes` package: its kubeconfig loaders, its ApiClient (authentication, TLS) and its
dynamic client (paths, query parameters, content types). The kinds warmstart reads and writes are known
up front, so the dynamic client runs without discovery, whose requests would carry no timeout. Every call
carries a request timeout. Errors surface as KubeError (with the HTTP status); transient ones (5xx, 429,
connection failures, a reply that is not JSON) as TransientKubeError.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from warmstart.api import labels as L

DEFAULT_TIMEOUT = 15.0
MERGE = "application/merge-patch+json"
CRD_KIND = "CustomResourceDefinition"
Labels = Mapping[str, str] | str  # a label selector: labels to equal, or the selector's text


@dataclass(frozen=True)
class Kind:
    api_version: str
    plural: str
    namespaced: bool = True


KINDS: dict[str, Kind] = {
    "Deployment": Kind("apps/v1", "deployments"),
    "ReplicaSet": Kind("apps/v1", "replicasets"),
    "DaemonSet": Kind("apps/v1", "daemonsets"),
    "Service": Kind("v1", "services"),
    "Pod": Kind("v1", "pods"),
    "Event": Kind("v1", "events"),
    "HorizontalPodAutoscaler": Kind("autoscaling/v2", "horizontalpodautoscalers"),
    "ScaledObject": Kind("keda.sh/v1alpha1", "scaledobjects"),
    "HTTPScaledObject": Kind("http.keda.sh/v1alpha1", "httpscaledobjects"),
    "ServiceMonitor": Kind("monitoring.coreos.com/v1", "servicemonitors"),
    CRD_KIND: Kind("apiextensions.k8s.io/v1", "customresourcedefinitions", namespaced=False),
    L.ENDPOINT_KIND: Kind(L.API_VERSION, L.ENDPOINT_PLURAL),
    L.SNAPSHOT_KIND: Kind(L.API_VERSION, L.SNAPSHOT_PLURAL),
}


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class TransientKubeError(KubeError):
    """Worth retrying: the API server is overloaded, restarting or unreachable."""


def load_configuration(kubeconfig: str | None = None) -> Any:
    """A `kubernetes.client.Configuration`: `kubeconfig` when one is named; else the in-cluster service
    account when there is one, else the kubeconfig KUBECONFIG or ~/.kube/config names."""
    from kubernetes import client, config

    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        return configuration
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(client_configuration=configuration)
    return configuration


def api_client(kubeconfig: str | None = None, pool_size: int = 16) -> Any:
    """A `kubernetes.client.ApiClient` configured by `load_configuration`, with `pool_size` connections."""
    from kubernetes import client

    configuration = load_configuration(kubeconfig)
    configuration.connection_pool_maxsize = pool_size
    return client.ApiClient(configuration)


def with_timeout(api: Any, seconds: float) -> Any:
    """`api` (a generated API object, e.g. CoordinationV1Api) for code that calls it without a request
    timeout (the client's leader election): each call carries `seconds` as its timeout, and a transport
    failure (that timeout included) raises ApiException, as a failed request does, instead of urllib3's."""
    return _TimedApi(api, seconds)


class _TimedApi:
    def __init__(self, api: Any, seconds: float) -> None:
        self._api, self._seconds = api, seconds

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._api, name)
        if not callable(found):
            return found

        @functools.wraps(found)
        def timed(*args: Any, **kwargs: Any) -> Any:
            from kubernetes.client.exceptions import ApiException
            from urllib3.exceptions import HTTPError

            try:
                return found(*args, _request_timeout=self._seconds, **kwargs)
            except (HTTPError, OSError) as exc:
                raise ApiException(status=0, reason=f"{name}: {exc}") from exc

        return timed


class _KnownKinds:
    """The dynamic client's discoverer, without discovery: it serves the resources of KINDS."""

    def __init__(self, client: Any, cache_file: str | None = None) -> None:
        from kubernetes.dynamic import Resource

        self.resources = {}
        for kind, found in KINDS.items():
            group, _, version = found.api_version.rpartition("/")
            self.resources[kind] = Resource(
                prefix="apis" if group else "api", group=group, api_version=version, kind=kind,
                namespaced=found.namespaced, name=found.plural, client=client,
            )  # fmt: skip

    def get(self, kind: str, **_: Any) -> Any:
        if kind not in self.resources:
            raise ValueError(f"kind {kind!r} is not one warmstart reads or writes")
        return self.resources[kind]


def _excerpt(raw: bytes | str) -> str:
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    return text[:200].strip()


def _error_message(raw: bytes | str | None) -> str:
    """The Status message of an error reply; the text itself when the body is not a JSON Status (the API
    server answers an unknown path with a plain-text "404 page not found")."""
    if not raw:
        return "(empty reply)"
    with suppress(ValueError):
        data = json.loads(raw)
        if isinstance(data, dict) and data.get("message"):
            return str(data["message"])
    return _excerpt(raw)


def _json_body(raw: bytes | None, what: str) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError as exc:  # a proxy or a half-started server answering 2xx with a page, not JSON
        raise TransientKubeError(0, f"{what}: the reply is not JSON: {_excerpt(raw)}") from exc
    return data if isinstance(data, dict) else {}


@contextmanager
def _errors(what: str) -> Iterator[None]:
    """The client's and the transport's exceptions as KubeError, naming `what` was asked."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        yield
    except ApiException as exc:
        status = int(exc.status or 0)
        transient = status == 0 or status >= 500 or status == 429
        message = _error_message(exc.body) if exc.body is not None or status else str(exc.reason)
        raise (TransientKubeError if transient else KubeError)(status, f"{what}: {message}") from exc
    except (HTTPError, OSError) as exc:
        raise TransientKubeError(0, f"{what}: {exc}") from exc


def _selectors(labels: Labels, fields: Mapping[str, str] | None) -> dict[str, str | None]:
    label_selector = labels if isinstance(labels, str) else L.label_selector(dict(labels))
    field_selector = ",".join(f"{key}={value}" for key, value in (fields or {}).items())
    return {"label_selector": label_selector or None, "field_selector": field_selector or None}


class Kube:
    """The API server's objects as plain dicts, through one `kubernetes` ApiClient."""

    def __init__(
        self, api_client: Any, timeout: float = DEFAULT_TIMEOUT, field_manager: str = L.FIELD_MANAGER
    ) -> None:
        from kubernetes.dynamic import DynamicClient

        self.timeout = timeout
        self.field_manager = field_manager  # who made each write, in the objects' managedFields
        self.dynamic = DynamicClient(api_client, discoverer=_KnownKinds)

    @classmethod
    def from_environment(cls) -> Kube:
        return cls(api_client(pool_size=32))

    def _call(self, what: str, verb: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        with _errors(what):
            reply = verb(*args, serialize=False, _request_timeout=self.timeout, **kwargs)
            return _json_body(reply.data, what)

    def _call_unless(
        self, status: int, what: str, verb: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> dict[str, Any] | None:
        """`_call`; None when the API server answers `status` (404: not there, 409: there already)."""
        try:
            return self._call(what, verb, *args, **kwargs)
        except KubeError as exc:
            if exc.status == status:
                return None
            raise

    def _resource(self, kind: str) -> Any:
        return self.dynamic.resources.get(kind=kind)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply with force: creates the object or puts the fields we own back."""
        meta, resource = obj["metadata"], self._resource(obj.get("kind", ""))
        what = f"PATCH {resource.path(meta['name'], meta.get('namespace'))}"
        return self._call(
            what, self.dynamic.server_side_apply, resource, obj,
            field_manager=self.field_manager, force_conflicts=True,
        )  # fmt: skip

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Create; None when it already exists."""
        resource = self._resource(obj.get("kind", ""))
        namespace = obj["metadata"].get("namespace")
        return self._call_unless(
            409, f"POST {resource.path(namespace=namespace)}", self.dynamic.create, resource, obj,
            namespace=namespace, field_manager=self.field_manager,
        )  # fmt: skip

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        resource = self._resource(kind)
        return self._call_unless(
            404, f"GET {resource.path(name, namespace)}", self.dynamic.get, resource, name, namespace
        )

    def list(
        self,
        kind: str,
        namespace: str,
        labels: Labels,
        fields: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Objects of `kind` in `namespace` ("" for all namespaces) matching labels and fields."""
        return self.list_with_version(kind, namespace, labels, fields)[0]

    def list_with_version(
        self,
        kind: str,
        namespace: str,
        labels: Labels,
        fields: Mapping[str, str] | None = None,
    ) -> tuple[list[dict[str, Any]], str]:
        """`list`, and the list's resourceVersion (to watch from)."""
        resource = self._resource(kind)
        data = self._call(
            f"GET {resource.path(namespace=namespace)}", self.dynamic.get, resource,
            namespace=namespace or None, **_selectors(labels, fields),
        )  # fmt: skip
        return list(data.get("items") or []), str((data.get("metadata") or {}).get("resourceVersion") or "")

    def watch(
        self,
        kind: str,
        namespace: str,
        seconds: int,
        labels: Labels = "",
        fields: Mapping[str, str] | None = None,
        resource_version: str | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(type, object) of each change to objects of `kind` for up to `seconds` (the API server ends the
        watch then; the request times out a little later if it does not). An ERROR event (e.g. 410: the
        resourceVersion is too old to watch from) raises KubeError: list again."""
        from kubernetes import watch

        resource = self._resource(kind)
        with _errors(f"WATCH {resource.path(namespace=namespace)}"):
            for event in watch.Watch().stream(
                self.dynamic.get, resource, namespace=namespace or None, serialize=False,
                resource_version=resource_version, timeout_seconds=seconds,
                _request_timeout=seconds + self.timeout, **_selectors(labels, fields),
            ):  # fmt: skip
                if event:  # None: a blank line in the stream
                    yield event["type"], event["raw_object"]

    def served_verbs(self, kind: str) -> frozenset[str]:
        """What discovery says the API server lets clients do with `kind` (empty: not served)."""
        resource = self._resource(kind)
        path = f"/{resource.prefix}/{resource.group_version}"
        data = self._call_unless(404, f"GET {path}", self.dynamic.request, "get", path) or {}
        for entry in data.get("resources") or []:
            if entry.get("name") == resource.name:
                return frozenset(entry.get("verbs") or [])
        return frozenset()

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete in the background; False when it was already gone."""
        resource = self._resource(kind)
        deleted = self._call_unless(
            404, f"DELETE {resource.path(name, namespace)}", self.dynamic.delete, resource, name, namespace,
            propagation_policy="Background",
        )  # fmt: skip
        return deleted is not None

    def patch(
        self, kind: str, namespace: str, name: str, patch: dict[str, Any], subresource: str = ""
    ) -> dict[str, Any]:
        """A merge patch of the object (of its `subresource`, e.g. status). A `metadata.resourceVersion` in
        `patch` is a precondition: the API server answers 409 when the object has changed since."""
        resource = self._resource(kind)
        path = resource.path(name, namespace) + (f"/{subresource}" if subresource else "")
        return self._call(
            f"PATCH {path}", self.dynamic.request, "patch", path, patch,
            content_type=MERGE, field_manager=self.field_manager,
        )  # fmt: skip

    def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return self.patch(kind, namespace, name, {"status": status}, "status")
