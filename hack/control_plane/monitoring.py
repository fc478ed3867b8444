"""Prometheus, prometheus-operator and prometheus-adapter in the local cluster, built from their published Go
modules (no registry), the way most clusters run them: the operator turns a `Prometheus` resource into a
Prometheus server and the ServiceMonitors it selects into its scrape configuration; the adapter serves that
Prometheus's series to HPAs as the custom metrics API.

- `build()`: the four binaries (Prometheus with Kubernetes service discovery only, the operator and its
  config reloader, the adapter), each written as a one-binary image archive the real node imports, beside
  KEDA's. Its own stamp. Prometheus's `plugins/plugins.go` is where its service discovery mechanisms are
  chosen (`make plugins` writes it from `plugins.yml`): the build keeps only Kubernetes', which is all the
  operator configures here, and skips compiling the cloud providers' SDKs.
- `manifests()`: what the projects ship to install themselves, rendered from the module sources: the
  operator's `example/rbac` (its Deployment and RBAC, Prometheus's RBAC and a `Prometheus`), its CRDs, and
  the adapter's `deploy/manifests`, all in namespace `monitoring`, with our images, placed on the real node.
  Prometheus selects the ServiceMonitors labelled `SELECTED` in every namespace (as kube-prometheus-stack
  selects its release's label) and scrapes every `SCRAPE_INTERVAL`; the
  adapter serves the custom metrics API (not the resource metrics API its shipped APIService names) with
  `ADAPTER_RULES`, the rule docs/operations.md gives for `warmstart_worker_requests_waiting`.
- `install()`: apply them and wait until Prometheus answers and the custom metrics API is Available.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from . import build, versions
from .addons import AddonBinary, addons_dir, archive_path, build_images, build_is_current, module_source
from .cluster import ControlPlane, ControlPlaneError, wait_for

PROMETHEUS_MODULE = "github.com/prometheus/prometheus"
OPERATOR_MODULE = "github.com/prometheus-operator/prometheus-operator"
ADAPTER_MODULE = "sigs.k8s.io/prometheus-adapter"
NAMESPACE = "monitoring"
PROMETHEUS_NAME = "warmstart"
# The Service the operator creates for every Prometheus of a namespace; the operator's default address.
PROMETHEUS_SERVICE = "prometheus-operated"
PROMETHEUS_PORT = 9090
CUSTOM_METRICS_API = "v1beta1.custom.metrics.k8s.io"
SCRAPE_INTERVAL = "5s"
# The label Prometheus selects ServiceMonitors by, as kube-prometheus-stack selects its release's by default.
SELECTED = {"release": "monitoring"}
# How often the adapter lists the series its rules match: a new endpoint's metric is served this long after
# its first scrape at most (the adapter ships 1m).
ADAPTER_RELIST_INTERVAL = "10s"
RECIPE = 1
INSTALL_TIMEOUT = 240.0
_VERSION_FLAG = "-X=github.com/prometheus/common/version.Version"

BINARIES = (
    AddonBinary(
        "prometheus", PROMETHEUS_MODULE, versions.PROMETHEUS_MODULE_VERSION, "./cmd/prometheus",
        "/bin/prometheus", "quay.io/prometheus/prometheus", f"{_VERSION_FLAG}={versions.PROMETHEUS}",
    ),
    AddonBinary(
        "prometheus-operator", OPERATOR_MODULE, versions.PROMETHEUS_OPERATOR, "./cmd/operator",
        "/bin/operator", "quay.io/prometheus-operator/prometheus-operator",
        f"{_VERSION_FLAG}={versions.PROMETHEUS_OPERATOR}",
    ),
    AddonBinary(
        "prometheus-config-reloader", OPERATOR_MODULE, versions.PROMETHEUS_OPERATOR,
        "./cmd/prometheus-config-reloader", "/bin/prometheus-config-reloader",
        "quay.io/prometheus-operator/prometheus-config-reloader",
        f"{_VERSION_FLAG}={versions.PROMETHEUS_OPERATOR}",
    ),
    AddonBinary(
        "prometheus-adapter", ADAPTER_MODULE, versions.PROMETHEUS_ADAPTER, "./cmd/adapter", "/adapter",
        "registry.k8s.io/prometheus-adapter/prometheus-adapter",
    ),
)  # fmt: skip
PROMETHEUS, OPERATOR, RELOADER, ADAPTER = BINARIES

# The rule docs/operations.md gives: the workers' queue per pod, under its own name.
ADAPTER_RULES = {
    "rules": [
        {
            "seriesQuery": 'warmstart_worker_requests_waiting{namespace!="",pod!=""}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
            "name": {"matches": "^(.*)$", "as": "${1}"},
            "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
        }
    ]
}


def stamp_path() -> Path:
    return addons_dir() / "monitoring-stamp.json"


def manifests_path() -> Path:
    return addons_dir() / "monitoring.yaml"


def wanted_stamp() -> dict[str, object]:
    return {
        "recipe": RECIPE,
        "prometheus": versions.PROMETHEUS,
        "prometheus-operator": versions.PROMETHEUS_OPERATOR,
        "prometheus-adapter": versions.PROMETHEUS_ADAPTER,
        "binaries": [binary.name for binary in BINARIES],
    }


def is_cached() -> bool:
    return build_is_current(stamp_path(), wanted_stamp(), BINARIES, manifests_path())


def missing_reason() -> str | None:
    if is_cached():
        return None
    return (
        f"Prometheus, prometheus-operator and prometheus-adapter are not built in {addons_dir()}: "
        "run `hack/control-plane addons`"
    )


def built_images() -> dict[str, Path]:
    """Image reference -> archive, for the real node to import; empty until `build()` ran."""
    if not is_cached():
        return {}
    return {binary.reference: archive_path(binary) for binary in BINARIES}


# -- build ---------------------------------------------------------------------------------------------------


def keep_only_kubernetes_discovery(source: Path) -> None:
    """What `make plugins` writes for a plugins.yml naming only Kubernetes service discovery."""
    (source / "plugins" / "plugins.go").write_text(
        "// Written by warmstart's testbed build: Kubernetes service discovery only.\n\n"
        "package plugins\n\n"
        'import _ "github.com/prometheus/prometheus/discovery/kubernetes"\n'
    )


def use_published_api_modules(source: Path) -> None:
    """The operator's go.mod replaces its API and client modules with directories of its repository that its
    module archive leaves out; the published modules of the same version are what the replace stands for."""
    modules = [f"{OPERATOR_MODULE}/pkg/{name}" for name in ("apis/monitoring", "client")]
    build.run_go(["mod", "edit", *(f"-dropreplace={module}" for module in modules)], cwd=source)
    build.run_go(["get", *(f"{module}@v{versions.PROMETHEUS_OPERATOR}" for module in modules)], cwd=source)


def build_monitoring(force: bool = False) -> None:
    if is_cached() and not force:
        built = ", ".join(f"{binary.name} {binary.version}" for binary in BINARIES)
        print(f"monitoring: cached in {addons_dir()} ({built})")
        return
    progress = build.Progress("monitoring")
    stamp_path().unlink(missing_ok=True)
    progress.step("collecting the manifests prometheus-operator and prometheus-adapter ship")
    manifests_path().write_text(yaml.safe_dump_all(shipped_manifests()))
    keep_only_kubernetes_discovery(module_source(PROMETHEUS.module, PROMETHEUS.version))
    use_published_api_modules(module_source(OPERATOR.module, OPERATOR.version))
    build_images(progress, BINARIES, addons_dir() / "monitoring-build")
    stamp_path().write_text(json.dumps(wanted_stamp(), indent=2) + "\n")
    progress.step(f"done: images in {addons_dir() / 'images'}")


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads a bare `=` as its `value` type, which PyYAML cannot build; the CRDs list `=` among a
    field's allowed values (a relabeling's operators), meaning the string."""


_Loader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))


def _load_all(text: str) -> list[dict[str, Any]]:
    return [document for document in yaml.load_all(text, Loader=_Loader) if document]


def _documents(directory: Path) -> list[dict[str, Any]]:
    return [document for path in sorted(directory.glob("*.yaml")) for document in _load_all(path.read_text())]


def shipped_manifests() -> list[dict[str, Any]]:
    operator = Path(build.download_module(OPERATOR_MODULE, f"v{versions.PROMETHEUS_OPERATOR}")["Dir"])
    adapter = Path(build.download_module(ADAPTER_MODULE, f"v{versions.PROMETHEUS_ADAPTER}")["Dir"])
    # Left out: the operator's ServiceMonitor of itself, the adapter's NetworkPolicy and PodDisruptionBudget.
    unused = ("ServiceMonitor", "NetworkPolicy", "PodDisruptionBudget")
    documents = [
        *_documents(operator / "example" / "prometheus-operator-crd"),
        *_documents(operator / "example" / "rbac" / "prometheus-operator"),
        *_documents(operator / "example" / "rbac" / "prometheus"),
        *_documents(adapter / "deploy" / "manifests"),
    ]
    return [document for document in documents if document["kind"] not in unused]


def main_with(force: bool) -> int:
    try:
        build_monitoring(force=force)
    except build.BuildError as error:
        print(f"monitoring build failed: {error}", file=sys.stderr)
        return 1
    return 0


# -- install -------------------------------------------------------------------------------------------------


def _image_of(upstream: str) -> str:
    images = {binary.upstream_image: binary.reference for binary in BINARIES}
    name = upstream.split("@")[0].rsplit(":", 1)[0]
    if name not in images:
        raise ControlPlaneError(f"no build of {upstream}")
    return images[name]


CLUSTER_SCOPED = ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "APIService")


def _in_namespace(document: dict[str, Any]) -> dict[str, Any]:
    """The shipped object moved from `default` (where the operator's example installs) to NAMESPACE; what
    belongs in another namespace (the adapter's reader of kube-system's authentication ConfigMap) stays."""
    metadata = document["metadata"]
    if document["kind"] in CLUSTER_SCOPED:
        metadata.pop("namespace", None)  # the adapter's manifests give some cluster-scoped objects one
    elif metadata.get("namespace", "default") == "default":
        metadata["namespace"] = NAMESPACE
    for subject in document.get("subjects", []):
        if subject.get("namespace", "default") == "default":
            subject["namespace"] = NAMESPACE
    return document


def _placed_pod(pod: dict[str, Any], placement: dict[str, Any]) -> None:
    pod.update(placement)
    for container in pod["containers"]:
        container["image"] = _image_of(container["image"])
        container["imagePullPolicy"] = "Never"
        container.pop("resources", None)


def _operator(document: dict[str, Any], placement: dict[str, Any]) -> dict[str, Any]:
    pod = document["spec"]["template"]["spec"]
    _placed_pod(pod, placement)
    container = pod["containers"][0]
    _set_flags(container, {"--prometheus-config-reloader": RELOADER.reference})
    return document


def _set_flags(container: dict[str, Any], flags: dict[str, str]) -> None:
    """The container's `--flag=value` arguments named in `flags` given those values."""
    args = [arg.partition("=") for arg in container["args"]]
    container["args"] = [f"{flag}={flags[flag]}" if flag in flags else f"{flag}{eq}{value}"
                         for flag, eq, value in args]  # fmt: skip


def _prometheus(document: dict[str, Any], placement: dict[str, Any]) -> dict[str, Any]:
    """One Prometheus that scrapes the ServiceMonitors and PodMonitors labelled SELECTED, in any namespace."""
    document["metadata"]["name"] = PROMETHEUS_NAME
    document["spec"] = {
        "image": PROMETHEUS.reference,
        "version": f"v{versions.PROMETHEUS}",
        "replicas": 1,
        "serviceAccountName": document["spec"]["serviceAccountName"],
        "serviceMonitorSelector": {"matchLabels": SELECTED},
        "serviceMonitorNamespaceSelector": {},
        "podMonitorSelector": {"matchLabels": SELECTED},
        "podMonitorNamespaceSelector": {},
        "scrapeInterval": SCRAPE_INTERVAL,
        "evaluationInterval": SCRAPE_INTERVAL,
        **placement,
    }
    return document


def prometheus_url() -> str:
    return f"http://{PROMETHEUS_SERVICE}.{NAMESPACE}.svc:{PROMETHEUS_PORT}"


def _adapter(document: dict[str, Any], placement: dict[str, Any]) -> dict[str, Any]:
    pod = document["spec"]["template"]["spec"]
    _placed_pod(pod, placement)
    document["spec"]["replicas"] = 1
    container = pod["containers"][0]
    _set_flags(container, {"--prometheus-url": f"{prometheus_url()}/",
                           "--metrics-relist-interval": ADAPTER_RELIST_INTERVAL})  # fmt: skip
    return document


def _custom_metrics_api(document: dict[str, Any]) -> dict[str, Any]:
    """The adapter's APIService, for the custom metrics API its rules serve."""
    document["metadata"]["name"] = CUSTOM_METRICS_API
    document["spec"]["group"] = "custom.metrics.k8s.io"
    return document


# The role the shipped binding gives the HPA controller names; the adapter's manifests leave it out.
CUSTOM_METRICS_READER = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "ClusterRole",
    "metadata": {"name": "custom-metrics-server-resources"},
    "rules": [
        {"apiGroups": ["custom.metrics.k8s.io"], "resources": ["*"], "verbs": ["get", "list", "watch"]}
    ],
}


def manifests(placement: dict[str, Any]) -> list[dict[str, Any]]:
    documents: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        CUSTOM_METRICS_READER,
    ]
    for document in _load_all(manifests_path().read_text()):
        document = _in_namespace(document)
        kind, name = document["kind"], document["metadata"]["name"]
        if kind == "Deployment" and name == "prometheus-operator":
            document = _operator(document, placement)
        elif kind == "Deployment" and name == "prometheus-adapter":
            document = _adapter(document, placement)
        elif kind == "Prometheus":
            document = _prometheus(document, placement)
        elif kind == "APIService":
            document = _custom_metrics_api(document)
        elif kind == "ConfigMap" and name == "adapter-config":
            document["data"] = {"config.yaml": yaml.safe_dump(ADAPTER_RULES)}
        documents.append(document)
    return documents


def install(plane: ControlPlane, placement: dict[str, Any], timeout: float = INSTALL_TIMEOUT) -> str:
    """Install the three; returns Prometheus's address in the cluster once it answers and the custom metrics
    API is Available (raises with their state if not)."""
    documents = manifests(placement)
    crds = [d for d in documents if d["kind"] == "CustomResourceDefinition"]
    rest = [d for d in documents if d["kind"] != "CustomResourceDefinition"]
    for batch in (crds, rest):
        plane.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", "-",
            input="\n---\n".join(yaml.safe_dump(document) for document in batch), timeout=120,
        )  # fmt: skip
        if batch is crds:
            plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                          *(f"crd/{d['metadata']['name']}" for d in crds), timeout=70)  # fmt: skip
    try:
        for name in ("prometheus-operator", "prometheus-adapter"):
            plane.kubectl("rollout", "status", f"deployment/{name}", "-n", NAMESPACE,
                          f"--timeout={int(timeout)}s", timeout=timeout + 10)  # fmt: skip
        wait_for(lambda: prometheus_ready(plane), timeout=timeout, interval=1.0,
                 message=f"Prometheus {NAMESPACE}/{PROMETHEUS_NAME} Available")  # fmt: skip
        wait_for(lambda: api_service_available(plane), timeout=timeout, interval=1.0,
                 message=f"APIService {CUSTOM_METRICS_API} Available")  # fmt: skip
    except (ControlPlaneError, TimeoutError, subprocess.TimeoutExpired) as error:
        raise ControlPlaneError(f"Prometheus did not come up: {error}\n{state(plane)}") from error
    return prometheus_url()


def prometheus_ready(plane: ControlPlane) -> bool:
    result = plane.kubectl("get", "prometheus", PROMETHEUS_NAME, "-n", NAMESPACE, "-o", "json", check=False)
    if result.returncode != 0:
        return False
    conditions = json.loads(result.stdout).get("status", {}).get("conditions", [])
    return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)


def api_service_available(plane: ControlPlane) -> bool:
    result = plane.kubectl("get", "apiservice", CUSTOM_METRICS_API, "-o", "json", check=False)
    if result.returncode != 0:
        return False
    conditions = json.loads(result.stdout).get("status", {}).get("conditions", [])
    return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)


def state(plane: ControlPlane) -> str:
    """The pods, the Prometheus resource, the APIService and recent logs: what a failed install is diagnosed
    with."""
    parts = [
        plane.kubectl("get", "pods,statefulsets", "-n", NAMESPACE, "-o", "wide", check=False).stdout,
        plane.kubectl("get", "prometheus", "-n", NAMESPACE, "-o", "yaml", check=False).stdout[-3000:],
        plane.kubectl("get", "apiservice", CUSTOM_METRICS_API, "-o", "yaml", check=False).stdout[-1500:],
    ]
    for workload in ("deployment/prometheus-operator", "deployment/prometheus-adapter",
                     f"statefulset/prometheus-{PROMETHEUS_NAME}"):  # fmt: skip
        logs = plane.kubectl("logs", "-n", NAMESPACE, workload, "--all-containers", "--tail=15", check=False)
        parts.append(f"--- {workload}:\n{logs.stdout}{logs.stderr}")
    return "\n".join(parts)
