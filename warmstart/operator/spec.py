"""A typed view of InferenceEndpoint.spec, with the CRD's defaults applied.

The API server already validated and defaulted what it stored; this module applies the same defaults so
the reconcile logic works on objects built elsewhere too (tests, dry runs), and it re-checks the rules the
operator depends on, so a spec from an older CRD version fails with a message that names the field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from warmstart.api import labels as L
from warmstart.worker_flags import worker_flags_problem

ENGINES = ("vllm", "builtin")
AUTOSCALING_MODES = ("none", "hpa", "keda", "http")
SCALE_TO_ZERO_MODES = ("keda", "http")
METRIC_MODES = ("hpa", "keda")  # mode http scales on the concurrent requests the add-on's interceptor counts
DTYPES = ("auto", "float32", "float16", "bfloat16")
# Worker flags the operator sets from the spec: in engine.args they are refused, naming the field to use.
OPERATOR_FLAGS = {
    "--mode": "",
    "--engine": "engine.kind",
    "--model": "model.uri",
    "--served-model-name": "model.servedName",
    "--dtype": "engine.dtype",
    "--device": "resources.gpus",
    "--tensor-parallel-size": "engine.tensorParallelSize",
    "--host": "",
    "--port": "engine.port",
    "--revision": "model.revision",
    "--control-dir": "",
}
METRIC_SOURCES = ("Pods", "External")
PRESTAGE_POLICIES = ("None", "PageCache")  # PageCache: node agents keep the snapshot in their page cache
DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
T = TypeVar("T")


@dataclass(frozen=True)
class SpecProblem:
    """One thing wrong with a spec, at the path of its field (relative to `spec`)."""

    path: str
    problem: str

    def __str__(self) -> str:
        return f"spec.{self.path}: {self.problem}" if self.path else f"spec: {self.problem}"


class InvalidSpec(ValueError):
    """The spec cannot be reconciled. It carries every problem found (at least one), each with its field's
    path; the message names them all, the first problem's path first."""

    def __init__(self, path: str = "", problem: str = "", problems: Sequence[SpecProblem] = ()) -> None:
        self.problems = tuple(problems) or (SpecProblem(path, problem),)
        super().__init__("; ".join(str(found) for found in self.problems))
        self.path = self.problems[0].path


class Problems:
    """Collects the problems of the sections of one spec, so that one bad section does not hide another."""

    def __init__(self) -> None:
        self.found: list[SpecProblem] = []

    def check(self, parse: Callable[[], T], fallback: T) -> T:
        """`parse()`, or `fallback` with its problems recorded when it raises InvalidSpec."""
        try:
            return parse()
        except InvalidSpec as exc:
            self.found.extend(exc.problems)
            return fallback

    def raise_if_any(self) -> None:
        if self.found:
            raise InvalidSpec(problems=self.found)


@dataclass(frozen=True)
class ModelSpec:
    uri: str
    revision: str = ""
    served_name: str = ""

    @property
    def name_on_api(self) -> str:
        return self.served_name or self.uri


@dataclass(frozen=True)
class EngineSpec:
    kind: str
    image: str
    version: str = ""
    args: tuple[str, ...] = ()
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    port: int = 8000
    image_pull_policy: str = "IfNotPresent"


@dataclass(frozen=True)
class ResourceSpec:
    gpus: int = 1
    gpu_product: str = ""
    cpu: str = ""
    memory: str = ""


@dataclass(frozen=True)
class MetricSpec:
    name: str
    target: str
    source: str = "Pods"
    query: str = ""


@dataclass(frozen=True)
class HttpScalingSpec:
    """Mode http: the KEDA HTTP add-on's interceptor holds requests while the endpoint is at zero."""

    hosts: tuple[str, ...] = ()  # empty: the children builder routes "<name>.<namespace>"
    path_prefixes: tuple[str, ...] = ()
    target_concurrency: int = 1
    cold_start_timeout_seconds: int = 120
    response_timeout_seconds: int = 600


@dataclass(frozen=True)
class AutoscalingSpec:
    mode: str = "none"
    min_replicas: int = 1
    max_replicas: int = 4
    metric: MetricSpec | None = None
    http: HttpScalingSpec = HttpScalingSpec()
    prometheus_address: str = DEFAULT_PROMETHEUS
    polling_interval_seconds: int = 15
    cooldown_seconds: int = 300


@dataclass(frozen=True)
class SnapshotPolicy:
    enabled: bool = True
    signing_key_secret: str = ""
    retention: int = 2
    max_capture_attempts: int = 5
    capture_timeout_seconds: int = 3600
    prestage: str = "None"


@dataclass(frozen=True)
class PodOverrides:
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    env: tuple[dict[str, Any], ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    service_account_name: str = ""
    priority_class_name: str = ""
    volumes: tuple[dict[str, Any], ...] = ()
    volume_mounts: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class ServiceSpec:
    type: str = "ClusterIP"
    port: int = 80


@dataclass(frozen=True)
class MonitoringSpec:
    service_monitor: bool = False
    interval: str = "15s"


@dataclass(frozen=True)
class EndpointSpec:
    model: ModelSpec
    engine: EngineSpec
    resources: ResourceSpec = ResourceSpec()
    replicas: int = 1
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    snapshot: SnapshotPolicy = SnapshotPolicy()
    template: PodOverrides = PodOverrides()
    service: ServiceSpec = ServiceSpec()
    monitoring: MonitoringSpec = MonitoringSpec()


def _section(data: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidSpec(f"{path}{key}", f"must be an object, got {type(value).__name__}")
    return value


def _int(data: dict[str, Any], key: str, default: int, path: str, lo: int, hi: int) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSpec(f"{path}{key}", f"must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidSpec(f"{path}{key}", f"must be between {lo} and {hi}, got {value}")
    return value


def _choice(data: dict[str, Any], key: str, default: str, path: str, allowed: tuple[str, ...]) -> str:
    value = data.get(key, default)
    if value not in allowed:
        raise InvalidSpec(f"{path}{key}", f"must be one of {', '.join(allowed)}, got {value!r}")
    return str(value)


def _flag(data: dict[str, Any], key: str, default: bool, path: str) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise InvalidSpec(f"{path}{key}", f"must be true or false, got {value!r}")
    return value


def _text(data: dict[str, Any], key: str, path: str, required: bool = False) -> str:
    value = data.get(key, "")
    if value is None:
        value = ""
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        raise InvalidSpec(f"{path}{key}", f"must be a string, got {value!r}")
    if required and not str(value):
        raise InvalidSpec(f"{path}{key}", "is required")
    return str(value)


def _strings(data: dict[str, Any], key: str, path: str) -> tuple[str, ...]:
    value = data.get(key) or []
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise InvalidSpec(f"{path}{key}", "must be a list of non-empty strings")
    return tuple(value)


def parse_model(spec: dict[str, Any]) -> ModelSpec:
    if "model" not in spec:
        raise InvalidSpec("model", "is required (model.uri names the weights to serve)")
    data = _section(spec, "model", "")
    return ModelSpec(
        uri=_text(data, "uri", "model.", required=True),
        revision=_text(data, "revision", "model."),
        served_name=_text(data, "servedName", "model."),
    )


def parse_engine(spec: dict[str, Any]) -> EngineSpec:
    """The engine section; its args are checked against the worker's flags apart (`check_worker_flags`),
    so that a bad flag does not hide the section's other problems."""
    if "engine" not in spec:
        raise InvalidSpec("engine", "is required (engine.kind and engine.image)")
    data = _section(spec, "engine", "")
    args = data.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise InvalidSpec("engine.args", "must be a list of strings")
    return EngineSpec(
        kind=_choice(data, "kind", "", "engine.", ENGINES),
        image=_text(data, "image", "engine.", required=True),
        version=_text(data, "version", "engine."),
        args=tuple(args),
        dtype=_choice(data, "dtype", "auto", "engine.", DTYPES),
        tensor_parallel_size=_int(data, "tensorParallelSize", 1, "engine.", 1, 8),
        port=_int(data, "port", 8000, "engine.", 1024, 65535),
        image_pull_policy=_choice(
            data, "imagePullPolicy", "IfNotPresent", "engine.", ("Always", "IfNotPresent", "Never")
        ),
    )


def check_worker_flags(args: Sequence[str]) -> None:
    """engine.args are `warmstart worker` flags: refuse those it would reject and those the spec sets."""
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in OPERATOR_FLAGS:
            field = OPERATOR_FLAGS[flag]
            use = f": use {field}" if field else ""
            raise InvalidSpec("engine.args", f"{flag} is set by the operator{use}")
    problem = worker_flags_problem(args)
    if problem:
        raise InvalidSpec("engine.args", f"the worker would refuse them: {problem}")


def parse_resources(spec: dict[str, Any]) -> ResourceSpec:
    data = _section(spec, "resources", "")
    resources = ResourceSpec(
        gpus=_int(data, "gpus", 1, "resources.", 0, 8),
        gpu_product=_text(data, "gpuProduct", "resources."),
        cpu=_text(data, "cpu", "resources."),
        memory=_text(data, "memory", "resources."),
    )
    if resources.gpu_product and resources.gpus == 0:
        raise InvalidSpec("resources.gpuProduct", "needs resources.gpus > 0")
    return resources


def parse_metric(data: dict[str, Any] | None) -> MetricSpec | None:
    if not data:
        return None
    return MetricSpec(
        name=_text(data, "name", "autoscaling.metric.", required=True),
        target=_text(data, "target", "autoscaling.metric.", required=True),
        source=_choice(data, "source", "Pods", "autoscaling.metric.", METRIC_SOURCES),
        query=_text(data, "query", "autoscaling.metric."),
    )


def parse_http_scaling(data: dict[str, Any]) -> HttpScalingSpec:
    prefix = "autoscaling.http."
    path_prefixes = _strings(data, "pathPrefixes", prefix)
    for index, path_prefix in enumerate(path_prefixes):
        if not path_prefix.startswith("/"):
            raise InvalidSpec(f"{prefix}pathPrefixes[{index}]", f"must start with /, got {path_prefix!r}")
    return HttpScalingSpec(
        hosts=_strings(data, "hosts", prefix),
        path_prefixes=path_prefixes,
        target_concurrency=_int(data, "targetConcurrency", 1, prefix, 1, 1000),
        cold_start_timeout_seconds=_int(data, "coldStartTimeoutSeconds", 120, prefix, 1, 3600),
        response_timeout_seconds=_int(data, "responseTimeoutSeconds", 600, prefix, 1, 86400),
    )


def parse_autoscaling(spec: dict[str, Any]) -> AutoscalingSpec:
    data = _section(spec, "autoscaling", "")
    prefix = "autoscaling."
    scaling = AutoscalingSpec(
        mode=_choice(data, "mode", "none", prefix, AUTOSCALING_MODES),
        min_replicas=_int(data, "minReplicas", 1, prefix, 0, 1000),
        max_replicas=_int(data, "maxReplicas", 4, prefix, 1, 1000),
        metric=parse_metric(_section(data, "metric", prefix)),
        prometheus_address=_text(
            _section(data, "prometheus", prefix), "serverAddress", prefix + "prometheus."
        )
        or DEFAULT_PROMETHEUS,
        polling_interval_seconds=_int(data, "pollingIntervalSeconds", 15, prefix, 1, 3600),
        cooldown_seconds=_int(data, "cooldownSeconds", 300, prefix, 0, 86400),
        http=parse_http_scaling(_section(data, "http", prefix)),
    )
    _check_autoscaling(scaling, data)
    return scaling


def _check_autoscaling(scaling: AutoscalingSpec, data: dict[str, Any]) -> None:
    """The rules across fields that the CRD's validations also state."""
    if scaling.min_replicas > scaling.max_replicas:
        raise InvalidSpec("autoscaling.minReplicas", "must be less than or equal to autoscaling.maxReplicas")
    if scaling.min_replicas == 0 and scaling.mode not in SCALE_TO_ZERO_MODES:
        raise InvalidSpec("autoscaling.minReplicas", "0 (scale to zero) needs autoscaling.mode keda or http")
    if scaling.mode in METRIC_MODES and scaling.metric is None:
        raise InvalidSpec("autoscaling.metric", f"is required when autoscaling.mode is {scaling.mode}")
    if scaling.mode == "http" and scaling.metric is not None:
        raise InvalidSpec(
            "autoscaling.metric",
            "is not used with autoscaling.mode http: it scales on concurrent requests "
            "(autoscaling.http.targetConcurrency)",
        )
    if data.get("http") is not None and scaling.mode != "http":
        raise InvalidSpec("autoscaling.http", "is only used with autoscaling.mode http")


def parse_snapshot(spec: dict[str, Any]) -> SnapshotPolicy:
    data = _section(spec, "snapshot", "")
    policy = SnapshotPolicy(
        enabled=_flag(data, "enabled", True, "snapshot."),
        signing_key_secret=_text(data, "signingKeySecret", "snapshot."),
        retention=_int(data, "retention", 2, "snapshot.", 1, 20),
        max_capture_attempts=_int(data, "maxCaptureAttempts", 5, "snapshot.", 1, 20),
        capture_timeout_seconds=_int(data, "captureTimeoutSeconds", 3600, "snapshot.", 30, 86400),
        prestage=_choice(data, "prestage", "None", "snapshot.", PRESTAGE_POLICIES),
    )
    return policy


def _string_map(data: dict[str, Any], key: str, path: str) -> dict[str, str]:
    value = _section(data, key, path)
    return {str(k): str(v) for k, v in value.items()}


def _object_list(data: dict[str, Any], key: str, path: str) -> tuple[dict[str, Any], ...]:
    value = data.get(key) or []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise InvalidSpec(f"{path}{key}", "must be a list of objects")
    return tuple(value)


def parse_template(spec: dict[str, Any]) -> PodOverrides:
    data = _section(spec, "template", "")
    prefix = "template."
    volumes = _extra_volumes(data, prefix)
    return PodOverrides(
        node_selector=_string_map(data, "nodeSelector", prefix),
        tolerations=_object_list(data, "tolerations", prefix),
        env=_object_list(data, "env", prefix),
        labels=_string_map(data, "labels", prefix),
        annotations=_string_map(data, "annotations", prefix),
        service_account_name=_text(data, "serviceAccountName", prefix),
        priority_class_name=_text(data, "priorityClassName", prefix),
        volumes=volumes,
        volume_mounts=_extra_mounts(data, prefix, {str(volume["name"]) for volume in volumes}),
    )


RESERVED_VOLUMES = frozenset({"control", "shm"})
RESERVED_MOUNT_PATHS = frozenset({L.CONTROL_DIR_PATH, "/dev/shm"})


def _extra_volumes(data: dict[str, Any], path: str) -> tuple[dict[str, Any], ...]:
    """The schema checks these too; the operator checks again for objects that predate a schema change."""
    volumes = _object_list(data, "volumes", path)
    names = [str(volume.get("name", "")) for volume in volumes]
    for index, name in enumerate(names):
        if not name or name in RESERVED_VOLUMES or name in names[:index]:
            raise InvalidSpec(f"{path}volumes[{index}].name", f"{name!r} is empty, reserved or repeated")
    return volumes


def _extra_mounts(data: dict[str, Any], path: str, names: set[str]) -> tuple[dict[str, Any], ...]:
    mounts = _object_list(data, "volumeMounts", path)
    for index, mount in enumerate(mounts):
        if mount.get("name") not in names:
            raise InvalidSpec(f"{path}volumeMounts[{index}].name", "names no volume of template.volumes")
        if str(mount.get("mountPath", "")).rstrip("/") in RESERVED_MOUNT_PATHS:
            raise InvalidSpec(f"{path}volumeMounts[{index}].mountPath", "is one of the operator's mounts")
    return mounts


def parse_service(spec: dict[str, Any]) -> ServiceSpec:
    data = _section(spec, "service", "")
    return ServiceSpec(
        type=_choice(data, "type", "ClusterIP", "service.", ("ClusterIP", "NodePort", "LoadBalancer")),
        port=_int(data, "port", 80, "service.", 1, 65535),
    )


def parse_monitoring(spec: dict[str, Any]) -> MonitoringSpec:
    data = _section(spec, "monitoring", "")
    return MonitoringSpec(
        service_monitor=_flag(data, "serviceMonitor", False, "monitoring."),
        interval=_text(data, "interval", "monitoring.") or "15s",
    )


def _check_across(model: ModelSpec, engine: EngineSpec, resources: ResourceSpec) -> list[SpecProblem]:
    """The rules that tie the model, engine and resources sections together."""
    problems = []
    if model.revision and engine.kind != "vllm":
        problems.append(
            SpecProblem("model.revision", "is a Hugging Face revision: it needs engine.kind vllm")
        )
    if resources.gpus and engine.tensor_parallel_size > resources.gpus:
        problems.append(
            SpecProblem(
                "engine.tensorParallelSize",
                f"runs one process per GPU: {engine.tensor_parallel_size} needs resources.gpus of at least "
                f"that (it is {resources.gpus})",
            )
        )
    return problems


def parse_spec(spec: dict[str, Any]) -> EndpointSpec:
    """Parse and default an InferenceEndpoint spec. Raises InvalidSpec naming every problem found: each
    section is checked whatever the others hold (within a section, up to its first problem)."""
    if not isinstance(spec, dict):
        raise InvalidSpec("", "must be an object")
    problems = Problems()
    model = problems.check(lambda: parse_model(spec), None)
    engine = problems.check(lambda: parse_engine(spec), None)
    if engine is not None:
        problems.check(lambda: check_worker_flags(engine.args), None)
    resources = problems.check(lambda: parse_resources(spec), None)
    if model is not None and engine is not None and resources is not None:
        problems.found.extend(_check_across(model, engine, resources))
    parsed = EndpointSpec(
        model=model or ModelSpec(uri=""),
        engine=engine or EngineSpec(kind="", image=""),
        resources=resources or ResourceSpec(),
        replicas=problems.check(lambda: _int(spec, "replicas", 1, "", 0, 1000), 0),
        autoscaling=problems.check(lambda: parse_autoscaling(spec), AutoscalingSpec()),
        snapshot=problems.check(lambda: parse_snapshot(spec), SnapshotPolicy()),
        template=problems.check(lambda: parse_template(spec), PodOverrides()),
        service=problems.check(lambda: parse_service(spec), ServiceSpec()),
        monitoring=problems.check(lambda: parse_monitoring(spec), MonitoringSpec()),
    )
    problems.raise_if_any()
    return parsed
