"""What the models of both CRDs share: their CEL rules' form, Kubernetes' formats, conditions.

The CRDs' openAPIV3Schemas are generated from the models (hack/generate_crds.py): what pydantic's JSON
schema cannot say is said here with `json_schema_extra`, in the Kubernetes keywords themselves.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

RULES = "x-kubernetes-validations"


def cel(rule: str, message: str, field_path: str = "") -> dict[str, str]:
    """One CEL rule the API server checks, and the message `kubectl` shows when it fails."""
    return {"rule": rule, "message": message, **({"fieldPath": field_path} if field_path else {})}


def rules(*checks: dict[str, str]) -> dict[str, Any]:
    """The `json_schema_extra` of a model or field the API server checks with these CEL rules."""
    return {RULES: list(checks)}


Int64 = Annotated[int, Field(json_schema_extra={"format": "int64"})]
Timestamp = Annotated[str, Field(json_schema_extra={"format": "date-time"})]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
# Kept as written, any fields (the API server does not prune them).
AnyObject = Annotated[dict[str, Any], Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})]


class Status(BaseModel):
    """A status section: camelCase on the API, built by its Python names. What the API server stores passed
    the schema generated from the model, so it reads back as the model (a field it does not know: ignored)."""

    model_config = ConfigDict(
        alias_generator=to_camel, frozen=True, use_attribute_docstrings=True, validate_by_name=True
    )


class Condition(Status):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str | None = None
    message: str | None = None
    last_transition_time: Timestamp | None = None
    observed_generation: Int64 | None = None


ONE_PER_TYPE = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}
