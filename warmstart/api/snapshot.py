"""The InferenceSnapshot's spec and status: its phases and one typed model of each, every status field with
its one writer.

The node agent reports what happened on its node: the capture attempt it worked on and how it went
(`captureAttempt`, `captureState`, `captureMessage`), the snapshot's facts, the restore failures. The
operator plans attempts (`attempts`, `retryAfter`, `capturePod`) and derives `phase`, `reason` and
`message` from both (`derive_phase`), so no field has two writers and no write can undo another's.
A status write goes through `status_patch`, which refuses a field its writer does not own.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from typing_extensions import TypedDict

from warmstart.api.schema import (
    ONE_PER_TYPE,
    AnyObject,
    Condition,
    Int64,
    Sha256,
    Status,
    Timestamp,
    cel,
    rules,
)


class Phase(StrEnum):
    PENDING = "Pending"
    CAPTURING = "Capturing"
    READY = "Ready"
    FAILED = "Failed"
    INVALID = "Invalid"
    STALE = "Stale"  # what it was taken of changed (the pods' model or engine): never restored again


class FactsChanged(StrEnum):
    """Why a restore pod was refused because it differs from its snapshot's capture (the pod's doing, not
    the snapshot's): the node agent's `refused` in the pod's status annotation, with `factsDigest`, the
    digest of the facts the pod showed. The operator then retires the snapshot (Stale) and captures again."""

    MODEL_CHANGED = "ModelChanged"  # the model's files
    ENGINE_CHANGED = "EngineChanged"  # the engine, its version or its flags


REFUSED_KEY, FACTS_DIGEST_KEY = "refused", "factsDigest"


IN_PROGRESS = (Phase.PENDING, Phase.CAPTURING)
MAX_RESTORE_FAILURES = 3  # a snapshot that failed this many restores is Invalid, never tried again

OPERATOR, AGENT = "operator", "agent"


class CaptureState(StrEnum):
    """How the agent's capture attempt (`captureAttempt`) went."""

    CAPTURING = "Capturing"
    CAPTURED = "Captured"
    FAILED = "Failed"


class SnapshotSpec(BaseModel):
    """`spec` of an InferenceSnapshot: the request it was taken for, set by the operator creating it."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        frozen=True,
        use_attribute_docstrings=True,
        json_schema_extra=rules(
            cel("self == oldSelf",
                "InferenceSnapshot.spec is immutable: a different request is a different snapshot"),
        ),
    )  # fmt: skip
    endpoint: str = Field(min_length=1, max_length=253)
    """The InferenceEndpoint (same namespace) this snapshot serves."""
    request_key_hash: Sha256
    """SHA-256 of the canonical request key JSON."""
    request_key: AnyObject
    """What the endpoint asks for (model reference, engine, image, args, resources), as the operator computes
    it; the snapshot's runtime identity is in status.identity."""
    signing_key_secret: str | None = None
    """The endpoint's spec.snapshot.signingKeySecret when it was created, recorded only: the node agents' own
    key signs and verifies."""


@dataclass(frozen=True)
class WrittenBy:
    """Marks a status field with the components that write it."""

    writers: frozenset[str]


BY_OPERATOR, BY_AGENT = WrittenBy(frozenset({OPERATOR})), WrittenBy(frozenset({AGENT}))


class CapturedGpu(TypedDict, total=False):
    product: str
    uuid: str
    computeCapability: str
    driverVersion: str


class SnapshotStatus(Status):
    """`status` of an InferenceSnapshot, read into Python names (the API's are camelCase)."""

    phase: Annotated[Phase, BY_OPERATOR] = Phase.PENDING
    """Derived by the operator from what the agent reported: Pending, Capturing, Ready, Failed (retried with
    backoff), Invalid (never restored again) or Stale (the pods' model or engine changed since it was taken:
    never restored again, a new capture follows)."""
    reason: Annotated[str | None, BY_OPERATOR] = None
    """Why it is in its phase (Pending, Capturing, Captured, CaptureFailed, CapturePodFailed, RestoreFailures,
    Retrying, ModelChanged, EngineChanged)."""
    message: Annotated[str | None, BY_OPERATOR] = None
    """Details of the reason."""
    attempts: Annotated[int, BY_OPERATOR] = Field(1, ge=0)
    """Capture attempts made so far."""
    retry_after: Annotated[Timestamp | None, BY_OPERATOR] = None
    """When the next capture attempt starts, after a failed one."""
    restore_failures: Annotated[int | None, BY_AGENT] = Field(None, ge=0)
    """Consecutive restores of this snapshot that failed, on all nodes together (each agent adds its own,
    conditional on the resourceVersion it read); at 3 it is Invalid. A successful restore sets it back to
    0."""
    restore_failure_message: Annotated[str | None, BY_AGENT] = None
    """Why the last restore failed."""
    stale_reason: Annotated[FactsChanged | None, BY_OPERATOR] = None
    """Why it is Stale, set by the operator when the node agent refused a restore pod whose model files
    (ModelChanged) or engine, its version or flags (EngineChanged) differ from the capture's."""
    stale_message: Annotated[str | None, BY_OPERATOR] = None
    """What differed, as the node agent said when it refused the restore pod."""
    stale_facts_digest: Annotated[Sha256 | None, BY_OPERATOR] = None
    """SHA-256 of the refused pod's facts; the operator captures again once per change of these facts."""
    capture_pod: Annotated[str | None, BY_OPERATOR] = None
    """The capture pod of the current attempt."""
    capture_attempt: Annotated[int | None, BY_AGENT] = Field(None, ge=1)
    """The capture attempt the node agent last worked on (written by the agent)."""
    capture_state: Annotated[CaptureState | None, BY_AGENT] = None
    """How that attempt went (written by the agent; the operator derives phase)."""
    capture_message: Annotated[str | None, BY_AGENT] = None
    """What the agent said of the attempt (its failure, or the size captured)."""
    node: Annotated[str | None, BY_AGENT] = None
    """The node it was captured on."""
    identity: Annotated[AnyObject | None, BY_AGENT] = None
    """The runtime identity the worker measured and the agent recorded at capture (model files' digest, engine
    version, image digest, GPU): what the snapshot is valid for."""
    identity_hash: Annotated[Sha256 | None, BY_AGENT] = None
    """SHA-256 of the canonical identity JSON (the store manifest's identity_hash)."""
    gpu: Annotated[CapturedGpu | None, BY_AGENT] = None
    """The GPU it was captured on (empty on CPU)."""
    storage_path: Annotated[str | None, BY_AGENT] = None
    """The snapshot's directory, relative to the snapshot store's root."""
    snapshot_id: Annotated[str | None, BY_AGENT] = None
    """The snapshot's id in the snapshot store (its manifest's id)."""
    size_bytes: Annotated[Int64 | None, BY_AGENT] = Field(None, ge=0)
    """Bytes of the snapshot's files in the store."""
    manifest_digest: Annotated[str | None, BY_AGENT] = Field(None, pattern=r"^sha256:[0-9a-f]{64}$")
    """SHA-256 of the store manifest's exact bytes."""
    timings: Annotated[dict[str, float] | None, BY_AGENT] = None
    """Seconds per capture phase (e.g. lock, checkpoint, dump, publish, total)."""
    started_at: Annotated[Timestamp | None, BY_AGENT] = None
    """When the agent started the capture."""
    completed_at: Annotated[Timestamp | None, BY_AGENT] = None
    """When the capture ended."""
    # Not written yet; kopf's own bookkeeping.
    observed_generation: Int64 | None = None
    conditions: Annotated[list[Condition] | None, Field(json_schema_extra=ONE_PER_TYPE)] = None
    kopf: AnyObject | None = None

    @classmethod
    def of(cls, snapshot: dict[str, Any] | None) -> SnapshotStatus:
        """The typed status of an InferenceSnapshot object (unknown keys ignored, missing ones defaulted), its
        values as the API server stored them: an enum's is a plain string, equal to the enum member."""
        raw = (snapshot or {}).get("status") or {}
        fields = {info.alias: raw.get(info.alias) for info in cls.model_fields.values()}
        return cls.model_construct(**{alias: value for alias, value in fields.items() if value is not None})

    @property
    def attempt(self) -> int:
        return int(self.attempts or 1)

    @property
    def captured(self) -> bool:
        return self.capture_state == CaptureState.CAPTURED and bool(self.snapshot_id)


def derive_phase(status: SnapshotStatus, capture_pod_failure: str = "") -> tuple[Phase, str, str]:
    """(phase, reason, message) from what the agent reported and what the operator saw of the capture pod.

    `capture_pod_failure` says why the current attempt's capture pod ended without a capture ("" if it
    did not): the pod died or hit its deadline before the agent could report anything.
    """
    failures = int(status.restore_failures or 0)
    if failures >= MAX_RESTORE_FAILURES:
        return (
            Phase.INVALID,
            "RestoreFailures",
            f"{failures} restores failed: {status.restore_failure_message}",
        )
    if status.stale_reason:
        return Phase.STALE, status.stale_reason, status.stale_message or status.stale_reason
    if status.captured:
        return Phase.READY, "Captured", status.capture_message or "captured"
    this_attempt = status.capture_attempt == status.attempt
    if this_attempt and status.capture_state == CaptureState.FAILED:
        return Phase.FAILED, "CaptureFailed", status.capture_message or "capture failed"
    if capture_pod_failure:
        return Phase.FAILED, "CapturePodFailed", capture_pod_failure
    if this_attempt and status.capture_state == CaptureState.CAPTURING:
        return Phase.CAPTURING, "Capturing", status.capture_message or "capturing"
    return Phase.PENDING, "Pending", f"waiting for capture attempt {status.attempt}"


WRITERS: dict[str, frozenset[str]] = {
    str(info.alias): mark.writers
    for info in SnapshotStatus.model_fields.values()
    for mark in info.metadata
    if isinstance(mark, WrittenBy)
}


def status_patch(writer: str, **fields: Any) -> dict[str, Any]:
    """A merge patch of `status` from `writer`'s fields (Python names; None clears a field)."""
    patch = {}
    for name, value in fields.items():
        api_name = to_camel(name)
        writers = WRITERS.get(api_name)
        if writers is None:
            raise KeyError(f"InferenceSnapshot status has no field {api_name!r}")
        if writer not in writers:
            raise PermissionError(
                f"status.{api_name} of an InferenceSnapshot is written by {sorted(writers)}"
            )
        patch[api_name] = str(value) if isinstance(value, StrEnum) else value
    return patch
