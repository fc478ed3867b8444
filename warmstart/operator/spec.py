"""InferenceEndpoint.spec as one pydantic model: its fields, types, bounds, defaults and rules.

The API server already validated and defaulted what it stored; the operator parses specs with this model
so the reconcile logic works on objects built elsewhere too (tests, dry runs), and so a spec from an older
CRD version fails with a message that names the field. The CRD states the same schema and rules for the API
server (crds/inferenceendpoints.yaml); tests/operator/test_spec_agrees_with_crd.py runs both on the same
examples. A few rules are the operator's alone: engine.args the worker would refuse, a model revision for
an engine without one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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
from warmstart.worker_flags import worker_flags_problem

DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
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
    "--probe-port": "engine.port",
    "--start-timeout": "",
    "--revision": "model.revision",
    "--control-dir": "",
}
RESERVED_VOLUMES = frozenset({"control", "shm"})
RESERVED_MOUNT_PATHS = frozenset({L.CONTROL_DIR_PATH, "/dev/shm"})
Loc = tuple[str | int, ...]
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
DistinctStrings = Annotated[tuple[T, ...], BeforeValidator(_distinct_non_empty_strings), Field(strict=False)]
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

    model_config = ConfigDict(alias_generator=to_camel, strict=True, frozen=True)


class ModelSpec(Section):
    uri: str = Field(min_length=1, max_length=1024)
    revision: str = Field("", max_length=256)
    served_name: str = Field("", max_length=256)

    @property
    def name_on_api(self) -> str:
        return self.served_name or self.uri


class EngineSpec(Section):
    kind: Literal["vllm", "builtin"]
    image: str = Field(min_length=1, max_length=512)
    version: str = Field("", max_length=64)
    args: tuple[Annotated[str, Field(max_length=1024)], ...] = Field((), max_length=128, strict=False)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    tensor_parallel_size: int = Field(1, ge=1, le=8)
    port: int = Field(8000, ge=1024, le=65535)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class ResourceSpec(Section):
    gpus: int = Field(1, ge=0, le=8)
    gpu_product: str = Field("", max_length=63, pattern=r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
    cpu: IntOrString = Field("", pattern=r"^([0-9]+m?|[0-9]+\.[0-9]+)$")
    memory: IntOrString = Field("", pattern=r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?)?$")

    @model_validator(mode="after")
    def _gpu_product_needs_gpus(self) -> Self:
        if self.gpu_product and self.gpus == 0:
            raise_broken(ResourceSpec, [rule_broken(("gpuProduct",), "needs resources.gpus > 0")])
        return self


class MetricSpec(Section):
    name: str = Field(min_length=1, max_length=253)
    target: IntOrString = Field(pattern=r"^[0-9]+(\.[0-9]+)?m?$")
    source: Literal["Pods", "External"] = "Pods"
    query: str = Field("", max_length=4096)


class PrometheusSpec(Section):
    server_address: str = Field(DEFAULT_PROMETHEUS, pattern=r"^https?://")


class HttpScalingSpec(Section):
    """Mode http: the KEDA HTTP add-on's interceptor holds requests while the endpoint is at zero."""

    hosts: DistinctStrings[HostName] = Field((), max_length=32)  # empty: routes "<name>.<namespace>"
    path_prefixes: DistinctStrings[PathPrefix] = Field((), max_length=32)
    target_concurrency: int = Field(1, ge=1, le=1000)
    cold_start_timeout_seconds: int = Field(120, ge=1, le=3600)
    response_timeout_seconds: int = Field(600, ge=1, le=86400)


class AutoscalingSpec(Section):
    mode: Literal["none", "hpa", "keda", "http"] = "none"
    min_replicas: int = Field(1, ge=0, le=1000)
    max_replicas: int = Field(4, ge=1, le=1000)
    metric: MetricSpec | None = None
    prometheus: PrometheusSpec = Field(default_factory=PrometheusSpec)
    polling_interval_seconds: int = Field(15, ge=1, le=3600)
    cooldown_seconds: int = Field(300, ge=0, le=86400)
    http: HttpScalingSpec = Field(default_factory=HttpScalingSpec)

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
    signing_key_secret: str = Field("", max_length=253)
    retention: int = Field(2, ge=1, le=20)
    max_capture_attempts: int = Field(5, ge=1, le=20)
    capture_timeout_seconds: int = Field(3600, ge=30, le=86400)
    prestage: Literal["None", "PageCache"] = "None"  # PageCache: node agents keep it in their page cache


class Toleration(Section):
    key: str = ""
    operator: Literal["Exists", "Equal"] | None = None
    value: str = ""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(Section):
    name: str = Field(min_length=1)
    value: str = ""
    value_from: dict[str, Any] = Field(
        default_factory=dict, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )


class Volume(Section):
    """A core/v1 Volume: the operator checks its name, the API server the rest when it creates the pods."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
    name: str = Field(min_length=1, max_length=63)


class VolumeMount(Section):
    name: str = Field(min_length=1)
    mount_path: str = Field(max_length=1024, pattern="^/")
    read_only: bool | None = None
    sub_path: str = ""


def PodObjects(item: type[Section], most: int | None = None) -> Any:
    """A list of core/v1 objects of `item`'s shape, kept as the dicts the user wrote once they are checked."""
    return Annotated[tuple[item, ...], Field(strict=False, max_length=most), AfterValidator(_as_dicts)]


Tolerations = PodObjects(Toleration)
EnvVars = PodObjects(EnvVar)
Volumes = PodObjects(Volume, most=32)
VolumeMounts = PodObjects(VolumeMount, most=32)


class PodOverrides(Section):
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: Tolerations = ()
    env: EnvVars = ()
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    service_account_name: str = ""
    priority_class_name: str = ""
    volumes: Volumes = ()
    volume_mounts: VolumeMounts = ()

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
    port: int = Field(80, ge=1, le=65535)


class MonitoringSpec(Section):
    service_monitor: bool = False
    interval: str = Field("15s", pattern="^[0-9]+(ms|s|m)$")
    labels: dict[str, str] = Field(default_factory=dict)


class EndpointSpec(Section):
    """The spec, its defaults applied. Field order matters: the rules across model, engine and resources
    run once those three are valid, and each section is checked whatever the others hold."""

    model: ModelSpec
    engine: EngineSpec
    resources: ResourceSpec = Field(default_factory=ResourceSpec, validate_default=True)
    replicas: int = Field(1, ge=0, le=1000)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    snapshot: SnapshotPolicy = Field(default_factory=SnapshotPolicy)
    template: PodOverrides = Field(default_factory=PodOverrides)
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)

    @field_validator("resources", mode="wrap")
    @classmethod
    def _sections_fit(
        cls, value: Any, validate: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> ResourceSpec:
        """The rules across sections, and engine.args against the worker's flags. A model's own validators
        run only once all its fields are valid: checked here, once model, engine and resources are (as
        far as they can be), they are named beside every other section's problems."""
        model, engine = info.data.get("model"), info.data.get("engine")
        resources, broken = None, []
        try:
            resources = validate(value)
        except ValidationError as exc:
            broken = [_rebuilt(error) for error in exc.errors()]
        if isinstance(engine, EngineSpec):
            model = model if isinstance(model, ModelSpec) else None
            broken += _broken_across(model, engine, resources)
        raise_broken(EndpointSpec, broken)
        return resources


def _rebuilt(error: ErrorDetails) -> InitErrorDetails:
    """A caught error, to be raised again with others."""
    context = error.get("ctx") if error["type"] == "spec_rule" else None
    return InitErrorDetails(
        type=PydanticCustomError(error["type"], error["msg"], context), loc=error["loc"], input=error["input"]
    )


def _broken_across(
    model: ModelSpec | None, engine: EngineSpec, resources: ResourceSpec | None
) -> Iterable[InitErrorDetails]:
    yield from _broken_args(engine.args)
    if model is not None and model.revision and engine.kind != "vllm":
        message = "is a Hugging Face revision: it needs engine.kind vllm"
        yield rule_broken((), message, field="model.revision")
    if resources is not None and resources.gpus and engine.tensor_parallel_size > resources.gpus:
        message = (
            f"runs one process per GPU: {engine.tensor_parallel_size} needs resources.gpus of at least that "
            f"(it is {resources.gpus})"
        )
        yield rule_broken((), message, field="engine.tensorParallelSize")


def _broken_args(args: Sequence[str]) -> Iterable[InitErrorDetails]:
    """engine.args are `warmstart worker` flags: refuse those it would reject and those the spec sets."""
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in OPERATOR_FLAGS:
            use = f": use {OPERATOR_FLAGS[flag]}" if OPERATOR_FLAGS[flag] else ""
            yield rule_broken((), f"{flag} is set by the operator{use}", field="engine.args")
            return
    problem = worker_flags_problem(list(args))
    if problem:
        yield rule_broken((), f"the worker would refuse them: {problem}", field="engine.args")


def _path(loc: Loc) -> str:
    """("template", "volumes", 0, "name") -> "template.volumes[0].name"."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def _problem(error: ErrorDetails) -> SpecProblem:
    context = error.get("ctx") or {}
    path = context.get("field") or _path(error["loc"])
    if error["type"] == "missing":
        return SpecProblem(path, "is required")
    if error["type"] == "spec_rule":
        return SpecProblem(path, error["msg"])
    # pydantic's "Input should be ...", "String should have ..." in the words of the other problems
    message = re.sub(r"^\w+ should ", "must ", error["msg"]).replace("a valid tuple", "a list")
    return SpecProblem(path, f"{message}, got {error['input']!r}")


def parse_spec(spec: dict[str, Any]) -> EndpointSpec:
    """Parse and default an InferenceEndpoint spec. Raises InvalidSpec naming every problem found."""
    if not isinstance(spec, dict):
        raise InvalidSpec("", "must be an object")
    try:
        return EndpointSpec.model_validate(spec)
    except ValidationError as exc:
        raise InvalidSpec(problems=[_problem(error) for error in exc.errors()]) from None
