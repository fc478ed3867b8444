"""InferenceEndpoint's spec and status as pydantic models: fields, types, bounds, defaults, rules.

The CRD is generated from them (hack/generate_crds.py): each field's description, the API server's default
where it has one (`json_schema_extra`), and the CEL rules next to the model or field they check. The
validators state the same rules for the operator, which parses specs with these models so reconcile works
on objects built elsewhere too (tests, dry runs) and a spec from an older CRD version fails naming the field;
tests/operator/test_spec_rules.py runs both on the same examples on a real API server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

from warmstart.api import labels as L
from warmstart.api.schema import ONE_PER_TYPE, AnyObject, Condition, Int64, Status, cel, rules

DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
RESERVED_VOLUMES = frozenset({"control", "shm"})
RESERVED_MOUNT_PATHS = frozenset({L.CONTROL_DIR_PATH, "/dev/shm"})
# The validation context's key for the rules across model, engine and resources that a caller adds.
MORE_RULES = "more_rules"
Loc = tuple[str | int, ...]
T = TypeVar("T")


def rule_broken(loc: Loc, message: str, field: str = "") -> InitErrorDetails:
    """A rule of the spec broken at `loc` (relative to the model checking it), or at `field` (a path from
    `spec`) for a rule that one model checks about fields of others."""
    context = {"field": field} if field else None
    return InitErrorDetails(type=PydanticCustomError("spec_rule", message, context), loc=loc, input=None)


def raise_broken(model: type[BaseModel], broken: list[InitErrorDetails]) -> None:
    if broken:
        raise ValidationError.from_exception_data(model.__name__, broken)


def _int_as_text(value: Any) -> Any:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _distinct_non_empty_strings(value: Any) -> Any:
    if not isinstance(value, list | tuple) or not all(isinstance(item, str) and item for item in value):
        raise PydanticCustomError("spec_rule", "must be a list of non-empty strings")
    if len(set(value)) < len(value):
        raise PydanticCustomError("spec_rule", "must not repeat an item")
    return value


def _as_dicts(items: tuple[BaseModel, ...]) -> tuple[dict[str, Any], ...]:
    """Pod fields pass through as the objects the user wrote (core/v1 shapes), once checked."""
    return tuple(item.model_dump(by_alias=True, exclude_unset=True) for item in items)


# A Kubernetes int-or-string (a quantity, a metric target): the operator keeps its text.
IntOrString = Annotated[
    str, BeforeValidator(_int_as_text), Field(json_schema_extra={"x-kubernetes-int-or-string": True})
]
# A set of non-empty strings (x-kubernetes-list-type: set); an empty item is named on the list.
DistinctStrings = Annotated[
    tuple[T, ...],
    BeforeValidator(_distinct_non_empty_strings),
    Field(strict=False, json_schema_extra={"x-kubernetes-list-type": "set"}),
]
HostName = Annotated[
    str,
    Field(
        max_length=253,
        pattern=r"^(\*|(\*\.)?[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*)$",
    ),
]
PathPrefix = Annotated[str, Field(max_length=1024, pattern="^/")]


class Section(BaseModel):
    """A part of the spec: camelCase on the API, snake_case here; strict types as the API server's schema."""

    model_config = ConfigDict(
        alias_generator=to_camel, strict=True, frozen=True, use_attribute_docstrings=True
    )


class ModelSpec(Section):
    uri: str = Field(min_length=1, max_length=1024)
    """Where the weights come from: a Hugging Face id (org/name), hf://, s3://, pvc:// or a path inside the
    image."""
    revision: str = Field("", max_length=256)
    """Revision (commit, tag) of the model; part of the request key."""
    served_name: str = Field("", max_length=256)
    """Model name on the OpenAI API (default the uri)."""

    @property
    def name_on_api(self) -> str:
        return self.served_name or self.uri


class EngineSpec(Section):
    kind: Literal["vllm", "builtin"]
    """Engine adapter: vllm (production) or builtin (small torch engine)."""
    image: str = Field(min_length=1, max_length=512)
    """Worker container image (runs `warmstart worker`)."""
    version: str = Field("", max_length=64)
    """Engine version; part of the request key (the snapshot identity has the version the worker reports)."""
    args: tuple[Annotated[str, Field(max_length=1024)], ...] = Field((), max_length=128, strict=False)
    """Extra `warmstart worker` flags, e.g. --max-num-seqs 64, --enforce-eager, --engine-arg key=value (see
    `warmstart worker --help`). Flags the operator sets from the spec (--port, --dtype, --device, ...) and
    flags the worker does not know are rejected."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Weights dtype of the worker (--dtype); auto keeps the model's own. Part of the request key."""
    tensor_parallel_size: int = Field(1, ge=1, le=8)
    """Processes, one per GPU, the model is split over (--tensor-parallel-size); at most resources.gpus. Part
    of the request key."""
    port: int = Field(8000, ge=1024, le=65535)
    """Port of the worker's OpenAI-compatible HTTP server."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Pull policy of the worker image."""


RESOURCE_RULES = rules(
    cel("!has(self.gpuProduct) || self.gpus > 0", "resources.gpuProduct needs resources.gpus > 0",
        ".gpuProduct"),
)  # fmt: skip


class ResourceSpec(Section):
    model_config = ConfigDict(json_schema_extra=RESOURCE_RULES)
    gpus: int = Field(1, ge=0, le=8)
    """nvidia.com/gpu per worker (0 runs on CPU)."""
    gpu_product: str = Field("", max_length=63, pattern=r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
    """GPU product (node label nvidia.com/gpu.product, e.g. NVIDIA-H200); part of the request key."""
    cpu: IntOrString = Field("", pattern=r"^([0-9]+m?|[0-9]+\.[0-9]+)$")
    """CPU request of each worker (a quantity: 4, 500m); no limit is set."""
    memory: IntOrString = Field("", pattern=r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?)?$")
    """Memory request and limit of each worker (a quantity: 64Gi). A restored worker is charged against it
    like a cold one."""

    @model_validator(mode="after")
    def _gpu_product_needs_gpus(self) -> Self:
        if self.gpu_product and self.gpus == 0:
            raise_broken(ResourceSpec, [rule_broken(("gpuProduct",), "needs resources.gpus > 0")])
        return self


class MetricSpec(Section):
    name: str = Field(min_length=1, max_length=253)
    """Metric name, e.g. warmstart_worker_requests_waiting (what the workers export)."""
    target: IntOrString = Field(pattern=r"^[0-9]+(\.[0-9]+)?m?$")
    """Target average value per replica."""
    source: Literal["Pods", "External"] = "Pods"
    """HPA metric source: Pods (per-pod metric) or External."""
    query: str = Field("", max_length=4096)
    """KEDA Prometheus query; default sum of the metric over this endpoint's pods."""


class PrometheusSpec(Section):
    server_address: str = Field(DEFAULT_PROMETHEUS, pattern=r"^https?://")
    """URL of the Prometheus server KEDA queries."""


class HttpScalingSpec(Section):
    """Mode http: the KEDA HTTP add-on's interceptor holds requests while the endpoint is at zero."""

    hosts: DistinctStrings[HostName] = Field((), max_length=32)
    """Host header values routed to this endpoint (the interceptor ignores a port); default
    "<name>.<namespace>". A leading "*." matches subdomains as the add-on does."""
    path_prefixes: DistinctStrings[PathPrefix] = Field((), max_length=32)
    """Request paths routed to this endpoint, e.g. /v1/; default every path."""
    target_concurrency: int = Field(1, ge=1, le=1000)
    """Concurrent requests per replica the add-on scales towards."""
    cold_start_timeout_seconds: int = Field(120, ge=1, le=3600)
    """How long the interceptor holds a request waiting for a Ready replica (a restore, or a cold start while
    the endpoint has no snapshot yet)."""
    response_timeout_seconds: int = Field(600, ge=1, le=86400)
    """How long the interceptor waits for response headers once it forwarded a request; a completion without
    stream sends them only when it is done."""


AUTOSCALING_RULES = rules(
    cel("self.minReplicas <= self.maxReplicas",
        "autoscaling.minReplicas must be less than or equal to autoscaling.maxReplicas", ".minReplicas"),
    cel("self.minReplicas > 0 || self.mode in ['keda', 'http']",
        "autoscaling.minReplicas 0 (scale to zero) needs autoscaling.mode keda or http", ".minReplicas"),
    cel("self.mode != 'keda' || self.minReplicas > 0 || !has(self.metric) || "
        "(has(self.metric.query) && self.metric.query != '')",
        "autoscaling.minReplicas 0 with autoscaling.mode keda needs autoscaling.metric.query on a metric "
        "that exists while no worker runs (your ingress's or gateway's request rate): the default query "
        "reads the workers' own series, which no worker reports at zero replicas; or use autoscaling.mode "
        "http, whose interceptor holds requests at zero",
        ".minReplicas"),
    cel("!(self.mode in ['hpa', 'keda']) || has(self.metric)",
        "autoscaling.metric is required when autoscaling.mode is hpa or keda", ".metric"),
    cel("self.mode != 'http' || !has(self.metric)",
        "autoscaling.metric is not used with autoscaling.mode http: it scales on concurrent requests "
        "(autoscaling.http.targetConcurrency)",
        ".metric"),
    cel("self.mode == 'http' || !has(self.http)", "autoscaling.http is only used with autoscaling.mode http",
        ".http"),
    cel("!has(self.metric) || !has(self.metric.query) || self.mode == 'keda'",
        "autoscaling.metric.query is only used with autoscaling.mode keda", ".metric.query"),
)  # fmt: skip


class AutoscalingSpec(Section):
    model_config = ConfigDict(json_schema_extra=AUTOSCALING_RULES)
    mode: Literal["none", "hpa", "keda", "http"] = "none"
    """none; hpa (an autoscaling/v2 HPA on metric); keda (a KEDA ScaledObject with a Prometheus trigger on
    metric); http (a KEDA HTTP add-on HTTPScaledObject: its interceptor holds requests while the endpoint is
    at zero replicas and scales on concurrent requests)."""
    min_replicas: int = Field(1, ge=0, le=1000)
    """0 (scale to zero) is allowed with modes keda and http only."""
    max_replicas: int = Field(4, ge=1, le=1000)
    """Most replicas the autoscaler may ask for."""
    metric: MetricSpec | None = None
    """What modes hpa and keda scale on."""
    prometheus: PrometheusSpec = Field(default_factory=PrometheusSpec)
    """Where mode keda's Prometheus trigger sends its query."""
    polling_interval_seconds: int = Field(15, ge=1, le=3600)
    """How often KEDA queries Prometheus (mode keda)."""
    cooldown_seconds: int = Field(300, ge=0, le=86400)
    """Seconds the load must stay low before replicas are removed (the HPA's scale-down stabilization window
    in modes hpa and keda, KEDA cooldownPeriod to zero, add-on scaledownPeriod)."""
    http: HttpScalingSpec = Field(default_factory=HttpScalingSpec)
    """Mode http only. Clients send requests to the add-on's interceptor proxy Service (e.g.
    keda-add-ons-http-interceptor-proxy.keda:8080) with one of hosts as the Host header; the interceptor
    forwards them to this endpoint's Service."""

    @property
    def prometheus_address(self) -> str:
        return self.prometheus.server_address

    @model_validator(mode="after")
    def _modes_fit(self) -> Self:
        raise_broken(AutoscalingSpec, list(self._broken_rules()))
        return self

    def _broken_rules(self) -> Iterable[InitErrorDetails]:
        if self.min_replicas > self.max_replicas:
            yield rule_broken(("minReplicas",), "must be less than or equal to autoscaling.maxReplicas")
        if self.min_replicas == 0 and self.mode not in ("keda", "http"):
            yield rule_broken(("minReplicas",), "0 (scale to zero) needs autoscaling.mode keda or http")
        if self.mode in ("hpa", "keda") and self.metric is None:
            yield rule_broken(("metric",), f"is required when autoscaling.mode is {self.mode}")
        if self.mode == "keda" and self.min_replicas == 0 and self.metric and not self.metric.query:
            yield rule_broken(
                ("minReplicas",),
                "0 with autoscaling.mode keda needs autoscaling.metric.query on a metric that exists while "
                "no worker runs (your ingress's or gateway's request rate): the default query reads the "
                "workers' own series, which no worker reports at zero replicas, so nothing would scale the "
                "endpoint back up; or use autoscaling.mode http, whose interceptor holds requests at zero",
            )
        if self.mode == "http" and self.metric is not None:
            yield rule_broken(
                ("metric",),
                "is not used with autoscaling.mode http: it scales on concurrent requests "
                "(autoscaling.http.targetConcurrency)",
            )
        if "http" in self.model_fields_set and self.mode != "http":
            yield rule_broken(("http",), "is only used with autoscaling.mode http")
        if self.metric is not None and self.metric.query and self.mode != "keda":
            yield rule_broken(("metric", "query"), "is only used with autoscaling.mode keda")


class SnapshotPolicy(Section):
    enabled: bool = True
    """false: nothing is captured and every replica cold-starts."""
    signing_key_secret: str = Field("", max_length=253)
    """Recorded on the endpoint's InferenceSnapshots only. Manifests are signed and verified with the node
    agents' key (the chart's agent.signingKeySecret), never with a key from the endpoint's namespace: the
    agent restores images as root, so the key that vouches for them is not a tenant's."""
    retention: int = Field(2, ge=1, le=20)
    """InferenceSnapshots kept per endpoint, the current one included."""
    max_capture_attempts: int = Field(5, ge=1, le=20)
    """Capture attempts before the operator gives up (SnapshotReady turns CaptureFailed and replicas keep
    starting cold); a failed attempt is retried with exponential backoff."""
    capture_timeout_seconds: int = Field(3600, ge=30, le=86400)
    """Deadline of a capture pod from its creation (also its activeDeadlineSeconds): a capture not done by
    then (pod unschedulable, stuck, dead) fails the attempt, retried with backoff."""
    prestage: Literal["None", "PageCache"] = "None"
    """PageCache: the node agents keep this endpoint's Ready snapshots in their nodes' page cache (within
    their byte budget, newest first), so the next replica scheduled there restores without reading its
    snapshot from disk. None: nothing is staged ahead."""


class Toleration(Section):
    key: str = ""
    operator: Literal["Exists", "Equal"] | None = None
    value: str = ""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: Int64 | None = None


class EnvVar(Section):
    name: str = Field(min_length=1)
    value: str = ""
    value_from: AnyObject = Field(default_factory=dict)


class Volume(Section):
    """A core/v1 Volume: the operator checks its name, the API server the rest when it creates the pods."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
    name: str = Field(min_length=1, max_length=63)


class VolumeMount(Section):
    name: str = Field(min_length=1)
    mount_path: str = Field(max_length=1024, pattern="^/")
    read_only: bool | None = None
    sub_path: str = ""


def PodObjects(item: type[Section], most: int | None = None, checks: dict[str, Any] | None = None) -> Any:
    """A list of core/v1 objects of `item`'s shape, kept as the dicts the user wrote once they are checked."""
    field = Field(strict=False, max_length=most, json_schema_extra=checks)
    return Annotated[tuple[item, ...], field, AfterValidator(_as_dicts)]


Tolerations = PodObjects(Toleration)
EnvVars = PodObjects(EnvVar)
VOLUME_RULES = rules(
    cel("self.all(v, !(v.name in ['control', 'shm']))",
        "volume names control and shm are reserved for the operator"),
    cel("self.all(a, self.exists_one(b, b.name == a.name))", "volume names must be unique"),
)  # fmt: skip
Volumes = PodObjects(Volume, most=32, checks=VOLUME_RULES)
MOUNT_RULES = rules(
    cel("self.all(m, !m.mountPath.matches('^(/run/warmstart/control|/dev/shm)/*$'))",
        "mount paths /run/warmstart/control and /dev/shm are the operator's"),
)  # fmt: skip
VolumeMounts = PodObjects(VolumeMount, most=32, checks=MOUNT_RULES)
TEMPLATE_RULES = rules(
    cel("!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
        "self.volumes.exists(v, v.name == m.name))",
        "every template.volumeMounts entry names a volume of template.volumes", ".volumeMounts"),
)  # fmt: skip


class PodOverrides(Section):
    model_config = ConfigDict(json_schema_extra=TEMPLATE_RULES)
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the worker pods must match, e.g. nvidia.com/gpu.product."""
    tolerations: Tolerations = ()
    """Tolerations of the worker pods (core/v1 Toleration)."""
    env: EnvVars = ()
    """Environment variables of the worker container (core/v1 EnvVar); one named like a variable the operator
    sets replaces it."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Labels added to the worker pods; the operator's own labels win over them."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Annotations added to the worker pods."""
    service_account_name: str = ""
    """ServiceAccount of the worker pods. Without one they run as the namespace's default account with no API
    token mounted (a worker never calls the API)."""
    priority_class_name: str = ""
    """PriorityClass of the worker pods."""
    volumes: Volumes = ()
    """Extra volumes of the worker pods (core/v1 Volume objects: a model cache, a CA bundle). The namespace's
    Pod Security admission applies to them as to any pod. The names control and shm are the operator's."""
    volume_mounts: VolumeMounts = ()
    """Mounts of `template.volumes` in the worker container."""

    @model_validator(mode="after")
    def _operator_volumes_are_kept(self) -> Self:
        raise_broken(PodOverrides, [*self._broken_volumes(), *self._broken_mounts()])
        return self

    def _broken_volumes(self) -> Iterable[InitErrorDetails]:
        names = [volume["name"] for volume in self.volumes]
        for index, name in enumerate(names):
            if name in RESERVED_VOLUMES:
                yield rule_broken(("volumes", index, "name"), f"{name!r} is reserved for the operator")
            elif name in names[:index]:
                yield rule_broken(
                    ("volumes", index, "name"), f"{name!r} is repeated: volume names are unique"
                )

    def _broken_mounts(self) -> Iterable[InitErrorDetails]:
        names = {volume["name"] for volume in self.volumes}
        for index, mount in enumerate(self.volume_mounts):
            if mount["name"] not in names:
                yield rule_broken(("volumeMounts", index, "name"), "names no volume of template.volumes")
            if mount["mountPath"].rstrip("/") in RESERVED_MOUNT_PATHS:
                yield rule_broken(("volumeMounts", index, "mountPath"), "is one of the operator's mounts")


class ServiceSpec(Section):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Service type."""
    port: int = Field(80, ge=1, le=65535)
    """Port of the Service; it forwards to the worker's port (engine.port)."""


class MonitoringSpec(Section):
    service_monitor: bool = False
    """Create a prometheus-operator ServiceMonitor for the workers."""
    interval: str = Field("15s", pattern="^[0-9]+(ms|s|m)$")
    """Scrape interval of the ServiceMonitor."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Labels of the ServiceMonitor besides the operator's: what your Prometheus's serviceMonitorSelector
    selects (kube-prometheus-stack's, unless told otherwise, its release's `release` label)."""


SPEC_RULES = rules(
    cel("!has(self.resources) || !has(self.resources.gpus) || self.resources.gpus == 0 || "
        "!has(self.engine.tensorParallelSize) || self.engine.tensorParallelSize <= self.resources.gpus",
        "engine.tensorParallelSize runs one process per GPU: it needs resources.gpus of at least that",
        ".engine.tensorParallelSize"),
)  # fmt: skip
# Rules a caller adds across model, engine and resources (a section that failed its own checks is None).
MoreRules = Callable[[ModelSpec | None, EngineSpec, ResourceSpec | None], Iterable[InitErrorDetails]]


class EndpointSpec(Section):
    """The spec, its defaults applied. Field order matters: the rules across model, engine and resources
    run once those three are valid, and each section is checked whatever the others hold."""

    model_config = ConfigDict(json_schema_extra=SPEC_RULES)
    model: ModelSpec
    """The model to serve."""
    engine: EngineSpec
    """The engine the worker pods run, and their image."""
    resources: ResourceSpec = Field(
        default_factory=ResourceSpec, validate_default=True, json_schema_extra={"default": {"gpus": 1}}
    )
    """What each worker pod gets."""
    replicas: int = Field(1, ge=0, le=1000)
    """Desired workers. HPA and KEDA set this through the scale subresource."""
    autoscaling: AutoscalingSpec = Field(
        default_factory=AutoscalingSpec,
        json_schema_extra={"default": {"mode": "none", "minReplicas": 1, "maxReplicas": 4}},
    )
    """The autoscaler the operator creates for this endpoint, and its bounds."""
    snapshot: SnapshotPolicy = Field(default_factory=SnapshotPolicy, json_schema_extra={"default": {}})
    """Snapshot policy (default: enabled). The node agents keep every snapshot in the store the chart gives
    them (agent.store, agent.objectStore), never one an endpoint names; set enabled: false for cold starts
    only."""
    template: PodOverrides = Field(default_factory=PodOverrides)
    """Overrides for the worker pods."""
    service: ServiceSpec = Field(default_factory=ServiceSpec, json_schema_extra={"default": {}})
    """The Service in front of the workers, named like the endpoint."""
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec, json_schema_extra={"default": {}})
    """Scraping of the workers' /metrics."""

    @field_validator("resources", mode="wrap")
    @classmethod
    def _sections_fit(
        cls, value: Any, validate: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> ResourceSpec:
        """The rules across sections, with a caller's (`MORE_RULES` in the context). A model's own
        validators run only once all its fields are valid: checked here, once model, engine and resources
        are (as far as they can be), they are named beside every other section's problems."""
        model, engine = info.data.get("model"), info.data.get("engine")
        resources, broken = None, []
        try:
            resources = validate(value)
        except ValidationError as exc:
            broken = [_rebuilt(error) for error in exc.errors()]
        if isinstance(engine, EngineSpec):
            model = model if isinstance(model, ModelSpec) else None
            more: MoreRules | None = (info.context or {}).get(MORE_RULES)
            broken += more(model, engine, resources) if more else ()
            if resources is not None and resources.gpus and engine.tensor_parallel_size > resources.gpus:
                message = (
                    f"runs one process per GPU: {engine.tensor_parallel_size} needs resources.gpus of at "
                    f"least that (it is {resources.gpus})"
                )
                broken.append(rule_broken((), message, field="engine.tensorParallelSize"))
        raise_broken(EndpointSpec, broken)
        return resources


def _rebuilt(error: ErrorDetails) -> InitErrorDetails:
    """A caught error, to be raised again with others."""
    context = error.get("ctx") if error["type"] == "spec_rule" else None
    return InitErrorDetails(
        type=PydanticCustomError(error["type"], error["msg"], context), loc=error["loc"], input=error["input"]
    )


class EndpointStatus(Status):
    """`status` of an InferenceEndpoint: the operator writes all of it (warmstart/operator/status.py)."""

    phase: Literal["Pending", "Capturing", "Ready", "Degraded", "ScaledToZero"] | None = None
    """Pending, Capturing (no replica ready yet, a snapshot being captured), Ready, Degraded or
    ScaledToZero."""
    reason: str | None = None
    """Reason of the condition that explains the phase (Degraded's when Degraded, SnapshotReady's when
    Capturing, Progressing's when Ready and still scaling or rolling out, else Ready's)."""
    message: str | None = None
    """Message of that condition."""
    observed_generation: Int64 | None = None
    """The spec generation this status describes."""
    replicas: int | None = None
    """Worker pods that exist (the Deployment's replicas)."""
    ready_replicas: int | None = None
    """Worker pods that are Ready."""
    ready: str | None = None
    """Ready replicas / desired replicas, as kubectl shows a Deployment's."""
    restored_replicas: int | None = None
    """Ready replicas that a node agent restored from a snapshot (not cold-started)."""
    selector: str | None = None
    """Label selector of the worker pods, for the scale subresource."""
    request_key_hash: str | None = None
    """SHA-256 of what the spec asks a snapshot for (the snapshots' spec.requestKeyHash)."""
    current_snapshot: str | None = None
    """The Ready InferenceSnapshot new replicas restore from."""
    worker_role: Literal["cold", "restore"] | None = None
    """What new worker pods do. restore while a snapshot is Ready, and also while the one the workers were
    restored from is gone and another is captured (new pods then cold-start): the Deployment's template
    changes once, to the next Ready snapshot."""
    capture_attempts: int | None = None
    """Attempts of the capture under way or last made."""
    children: list[str] | None = None
    """Kinds of the objects this endpoint owns (named like the endpoint)."""
    last_restore_seconds: float | None = None
    """Seconds the node agent took for the newest restore (verify, CRIU and CUDA restore, resume)."""
    last_cold_start_seconds: float | None = None
    """Seconds from the newest cold-started worker's container start to its pod turning Ready, as the kubelet
    records them (to within the readiness probe period)."""
    conditions: list[Condition] | None = Field(None, json_schema_extra=ONE_PER_TYPE)
    """Ready (True while at least one replica is Ready; False with reason ScaledToZero at zero replicas),
    SnapshotReady, Progressing (ScalingUp, ScalingDown, RollingOut, Capturing) and Degraded. A condition
    explained by the pods carries their cause: Unschedulable (the scheduler's message), MissingVolume,
    ContainerConfigError, ContainerCreateFailed, ImagePullFailed, CrashLoopBackOff, NoNodeAgent (a capture or
    restore pod on a node without a Ready node agent); InvalidSpec names every problem of the spec."""
    kopf: AnyObject | None = None
