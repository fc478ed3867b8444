"""Parsing an InferenceEndpoint spec for the operator: the models of warmstart.api.endpoint, plus the rules
only the operator checks (engine.args the worker would refuse, a model revision for an engine without
one), every problem named with its field's path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails, InitErrorDetails

from warmstart.api.endpoint import (
    MORE_RULES,
    EndpointSpec,
    EngineSpec,
    Loc,
    ModelSpec,
    ResourceSpec,
    rule_broken,
)
from warmstart.api.worker_options import worker_flags_problem

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


@dataclass(frozen=True)
class SpecProblem:
    """One thing wrong with a spec, at the path of its field (relative to `spec`)."""

    path: str
    problem: str

    def __str__(self) -> str:
        return f"spec.{self.path}: {self.problem}" if self.path else f"spec: {self.problem}"


class InvalidSpec(ValueError):
    """The spec cannot be reconciled: every problem found (at least one), named in the message."""

    def __init__(self, problems: Sequence[SpecProblem]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(str(found) for found in self.problems))


def _operator_rules(
    model: ModelSpec | None, engine: EngineSpec, resources: ResourceSpec | None
) -> Iterable[InitErrorDetails]:
    # engine.args are `warmstart worker` flags: refuse the first the spec sets, else those it would reject.
    flag = next((f for f in (arg.split("=", 1)[0] for arg in engine.args) if f in OPERATOR_FLAGS), "")
    if flag:
        use = f": use {OPERATOR_FLAGS[flag]}" if OPERATOR_FLAGS[flag] else ""
        yield rule_broken((), f"{flag} is set by the operator{use}", field="engine.args")
    elif problem := worker_flags_problem(list(engine.args)):
        yield rule_broken((), f"the worker would refuse them: {problem}", field="engine.args")
    if model is not None and model.revision and engine.kind != "vllm":
        message = "is a Hugging Face revision: it needs engine.kind vllm"
        yield rule_broken((), message, field="model.revision")


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
        raise InvalidSpec([SpecProblem("", "must be an object")])
    try:
        return EndpointSpec.model_validate(spec, context={MORE_RULES: _operator_rules})
    except ValidationError as exc:
        raise InvalidSpec([_problem(error) for error in exc.errors()]) from None
