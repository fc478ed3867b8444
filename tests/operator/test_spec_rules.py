"""The spec model's rules (warmstart/api/endpoint.py) behave like the CRD's on a real API server.

The CRD's schema is generated from the model, but the model's validators and the CRD's CEL rules are two
statements of each rule: each CEL rule's valid example is accepted and its invalid one refused by both, and
values generated for every field from the CRD's schema (at and past each bound, outside each enum, of the
wrong type) get the same verdict from both. The operator's own rules, which the CRD cannot state, are the
one allowed difference.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from warmstart.api import labels as L
from warmstart.operator.spec import InvalidSpec, parse_spec

CRD = Path(__file__).resolve().parents[2] / "crds" / "inferenceendpoints.yaml"
# Rules only the operator checks: the worker's flags, and a revision for an engine that cannot fetch one.
OPERATOR_ONLY = {"engine.args", "model.revision"}


def crd_spec_schema() -> dict[str, Any]:
    (version,) = yaml.safe_load(CRD.read_text())["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


VALID = {
    "model": {"uri": "Qwen/Qwen3-0.6B", "revision": "main", "servedName": "qwen"},
    "engine": {"kind": "vllm", "image": "w:1", "version": "0.26", "args": ["--enforce-eager"]},
    "resources": {"gpus": 2, "gpuProduct": "NVIDIA-H200", "cpu": "4", "memory": "64Gi"},
    "replicas": 2,
    "autoscaling": {
        "mode": "keda",
        "minReplicas": 0,
        "maxReplicas": 4,
        "metric": {"name": "waiting", "target": "2", "source": "Pods", "query": "sum(waiting)"},
        "prometheus": {"serverAddress": "http://prometheus:9090"},
        "pollingIntervalSeconds": 15,
        "cooldownSeconds": 300,
    },
    "snapshot": {"enabled": True, "signingKeySecret": "k", "retention": 2, "prestage": "PageCache"},
    "template": {
        "nodeSelector": {"pool": "h200"},
        "tolerations": [{"key": "k", "operator": "Equal", "value": "v", "effect": "NoSchedule"}],
        "env": [{"name": "A", "value": "1"}],
        "labels": {"team": "ml"},
        "annotations": {"note": "x"},
        "serviceAccountName": "sa",
        "priorityClassName": "high",
        "volumes": [{"name": "cache", "emptyDir": {}}],
        "volumeMounts": [{"name": "cache", "mountPath": "/cache", "readOnly": True, "subPath": "m"}],
    },
    "service": {"type": "ClusterIP", "port": 80},
    "monitoring": {"serviceMonitor": True, "interval": "30s"},
}
HTTP_MODE = {
    "mode": "http",
    "minReplicas": 0,
    "http": {"hosts": ["q.example.com"], "pathPrefixes": ["/v1/"], "targetConcurrency": 2},
}
METRIC = {"name": "m", "target": "1"}


def spec_with(**sections: Any) -> dict[str, Any]:
    return {**copy.deepcopy(VALID), **sections}


def autoscaling(**fields: Any) -> dict[str, Any]:
    return spec_with(autoscaling=fields)


def template(**fields: Any) -> dict[str, Any]:
    return spec_with(template=fields)


VOLUME = {"name": "cache", "emptyDir": {}}
# Each CEL rule of the CRD's spec, by its message: (a spec it accepts, a spec it refuses).
CEL_EXAMPLES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "engine.tensorParallelSize runs one process per GPU": (
        spec_with(engine={"kind": "vllm", "image": "w:1", "tensorParallelSize": 2}, resources={"gpus": 2}),
        spec_with(engine={"kind": "vllm", "image": "w:1", "tensorParallelSize": 2}, resources={"gpus": 1}),
    ),
    "resources.gpuProduct needs resources.gpus > 0": (
        spec_with(resources={"gpus": 1, "gpuProduct": "NVIDIA-H200"}),
        spec_with(resources={"gpus": 0, "gpuProduct": "NVIDIA-H200"}),
    ),
    "autoscaling.minReplicas must be less than or equal to autoscaling.maxReplicas": (
        autoscaling(mode="hpa", minReplicas=2, maxReplicas=2, metric=METRIC),
        autoscaling(mode="hpa", minReplicas=3, maxReplicas=2, metric=METRIC),
    ),
    "autoscaling.minReplicas 0 (scale to zero) needs autoscaling.mode keda or http": (
        autoscaling(mode="http", minReplicas=0),
        autoscaling(mode="hpa", minReplicas=0, metric=METRIC),
    ),
    "autoscaling.minReplicas 0 with autoscaling.mode keda needs autoscaling.metric.query": (
        autoscaling(mode="keda", minReplicas=0, metric={**METRIC, "query": "sum(rate(ingress[1m]))"}),
        autoscaling(mode="keda", minReplicas=0, metric=METRIC),
    ),
    "autoscaling.metric is required when autoscaling.mode is hpa or keda": (
        autoscaling(mode="hpa", metric=METRIC),
        autoscaling(mode="keda"),
    ),
    "autoscaling.metric is not used with autoscaling.mode http": (
        autoscaling(mode="http"),
        autoscaling(mode="http", metric=METRIC),
    ),
    "autoscaling.http is only used with autoscaling.mode http": (
        autoscaling(mode="http", http={}),
        autoscaling(mode="hpa", metric=METRIC, http={}),
    ),
    "autoscaling.metric.query is only used with autoscaling.mode keda": (
        autoscaling(mode="keda", metric={**METRIC, "query": "sum(m)"}),
        autoscaling(mode="hpa", metric={**METRIC, "query": "sum(m)"}),
    ),
    "every template.volumeMounts entry names a volume of template.volumes": (
        template(volumes=[VOLUME], volumeMounts=[{"name": "cache", "mountPath": "/c"}]),
        template(volumes=[VOLUME], volumeMounts=[{"name": "other", "mountPath": "/c"}]),
    ),
    "volume names control and shm are reserved for the operator": (
        template(volumes=[{"name": "controls", "emptyDir": {}}]),
        template(volumes=[{"name": "control", "emptyDir": {}}]),
    ),
    "volume names must be unique": (
        template(volumes=[VOLUME, {**VOLUME, "name": "other"}]),
        template(volumes=[VOLUME, VOLUME]),
    ),
    "mount paths /run/warmstart/control and /dev/shm are the operator's": (
        template(volumes=[VOLUME], volumeMounts=[{"name": "cache", "mountPath": "/dev/shm2"}]),
        template(volumes=[VOLUME], volumeMounts=[{"name": "cache", "mountPath": "/dev/shm/"}]),
    ),
}


def crd_rules(schema: dict[str, Any]) -> Iterator[str]:
    for rule in schema.get("x-kubernetes-validations", []):
        yield " ".join(rule["message"].split())
    for sub in [*schema.get("properties", {}).values(), *([schema["items"]] if "items" in schema else [])]:
        yield from crd_rules(sub)


def test_every_cel_rule_has_examples():
    rules = list(crd_rules(crd_spec_schema()))
    covered = {rule: [prefix for prefix in CEL_EXAMPLES if rule.startswith(prefix)] for rule in rules}
    assert {rule: len(prefixes) for rule, prefixes in covered.items()} == dict.fromkeys(rules, 1)
    assert len(CEL_EXAMPLES) == len(rules)


class Verdicts:
    """The API server's and the model's verdict on one spec: None (accepted) or what each says is wrong."""

    def __init__(self, kube, namespace: str) -> None:
        self.api = client.CustomObjectsApi(kube.api_client())
        self.namespace = namespace

    def server_defaults(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The spec as the API server would store it (validated, pruned and defaulted), stored nowhere."""
        body = {"apiVersion": L.API_VERSION, "kind": L.ENDPOINT_KIND, "metadata": {"name": "agree"}}
        created = self.api.create_namespaced_custom_object(
            L.GROUP, L.VERSION, self.namespace, L.ENDPOINT_PLURAL, {**body, "spec": spec}, dry_run="All"
        )
        return created["spec"]

    def server(self, spec: dict[str, Any]) -> str | None:
        try:
            self.server_defaults(spec)
        except ApiException as exc:
            if exc.status not in (400, 422):
                raise
            return json.loads(exc.body)["message"]
        return None

    @staticmethod
    def model(spec: dict[str, Any]) -> InvalidSpec | None:
        try:
            parse_spec(spec)
        except InvalidSpec as exc:
            return exc
        return None

    def disagreement(self, spec: dict[str, Any]) -> str | None:
        """Why the two verdicts differ, or None where they agree (or only an operator-only rule refused).
        Refusals agree when they name the same field, or one names a field within the other's (the model
        names a list of strings with an empty one where the API server names the item)."""
        server, model = self.server(spec), self.model(spec)
        if server is None and model is not None:
            if {problem.path for problem in model.problems} <= OPERATOR_ONLY:
                return None
            return f"only the model refuses it: {model}"
        if server is not None and model is None:
            return f"only the API server refuses it: {server}"
        if server is not None and model is not None:
            named = set(re.findall(r"spec(?:\.[A-Za-z]+|\[\d+\])*", server))
            paths = {f"spec.{problem.path}" for problem in model.problems}
            if not any(path.startswith(field) or field.startswith(path) for path in paths for field in named):
                return f"they name different fields: API server {server!r}, model {model}"
        return None


@pytest.fixture
def verdicts(kube, crds, namespace) -> Verdicts:
    return Verdicts(kube, namespace)


@pytest.mark.integration
@pytest.mark.any_cluster
@pytest.mark.parametrize("message", sorted(CEL_EXAMPLES))
def test_each_cel_rule_accepts_and_refuses_alike(verdicts, message):
    accepted, refused = CEL_EXAMPLES[message]
    assert verdicts.server(accepted) is None and verdicts.model(accepted) is None
    server = verdicts.server(refused)
    assert server is not None and message in " ".join(server.split())
    assert verdicts.model(refused) is not None
    assert verdicts.disagreement(refused) is None


def leaves(schema: dict[str, Any], path: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple, dict]]:
    """(path, schema) of every field of the spec, list items at index 0."""
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from leaves(sub, (*path, name))
    if "items" in schema:
        yield from leaves(schema["items"], (*path, 0))


def candidates(schema: dict[str, Any]) -> Iterator[Any]:
    """Values at and past the schema's limits, and of the wrong type."""
    if schema.get("x-kubernetes-int-or-string"):
        yield from ("1", 1, "1.5", 1.5, "1m", "64Gi", "a b", True)
    elif "enum" in schema:
        yield from (*schema["enum"], "Nope", 1)
    elif schema.get("type") == "integer":
        for bound, step in (("minimum", -1), ("maximum", 1)):
            if bound in schema:
                yield from (schema[bound], schema[bound] + step)
        yield from ("1", 1.5, True)
    elif schema.get("type") == "boolean":
        yield from (False, "true", 1)
    elif schema.get("type") == "string":
        yield from ("", "a", "a b", "/a", "*.a.b", 7)
        if "maxLength" in schema:
            yield from ("a" * schema["maxLength"], "a" * (schema["maxLength"] + 1))
    elif schema.get("type") == "array":
        yield from ("a", [], ["a", "a"], [7])
        if "maxItems" in schema:
            yield [f"/a{index}" for index in range(schema["maxItems"] + 1)]
    elif schema.get("type") == "object":
        yield from ("a", [], {"a": 7}, {"a": "b"})


def placed(spec: dict[str, Any], path: tuple, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    target: Any = spec
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return spec


def base_for(path: tuple) -> dict[str, Any]:
    if path[:2] == ("autoscaling", "http"):
        return autoscaling(**HTTP_MODE)
    return copy.deepcopy(VALID)


def generated_examples() -> Iterator[tuple[str, dict[str, Any]]]:
    for path, schema in leaves(crd_spec_schema()):
        if not path:
            continue
        base = base_for(path)
        try:
            placed(base, path, None)
        except (KeyError, IndexError):
            continue  # test_the_generated_examples_reach_every_field says when a field is left out
        for value in candidates(schema):
            yield f"{'.'.join(map(str, path))}={value!r}"[:120], placed(base, path, value)


def test_the_generated_examples_reach_every_field():
    reached = {name.split("=", 1)[0] for name, _ in generated_examples()}
    fields = {".".join(map(str, path)) for path, _ in leaves(crd_spec_schema()) if path}
    assert fields - reached == set()


@pytest.mark.integration
def test_generated_values_get_the_same_verdict(verdicts):
    found = {}
    for name, spec in generated_examples():
        why = verdicts.disagreement(spec)
        if why:
            found[name] = why
    assert found == {}, "\n".join(f"{name}: {why}" for name, why in found.items())


@pytest.mark.integration
@pytest.mark.parametrize(
    "spec",
    [
        {"model": {"uri": "m"}, "engine": {"kind": "builtin", "image": "i"}},
        {"model": {"uri": "m"}, "engine": {"kind": "vllm", "image": "i"}, "resources": {}, "snapshot": {}},
        autoscaling(mode="http", minReplicas=0, http={}),
        autoscaling(mode="hpa", metric=METRIC, prometheus={}),
        template(tolerations=[{"key": "k"}], env=[{"name": "A"}], volumes=[VOLUME]),
    ],
)
def test_the_api_servers_defaults_parse_like_the_models(verdicts, spec):
    assert parse_spec(verdicts.server_defaults(spec)) == parse_spec(spec)
