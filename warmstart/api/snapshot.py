"""The InferenceSnapshot's status: its phases and one typed model of its fields, each with its one writer.

The node agent reports what happened on its node: the capture attempt it worked on and how it went
(`captureAttempt`, `captureState`, `captureMessage`), the snapshot's facts, the restore failures. The
operator plans attempts (`attempts`, `retryAfter`, `capturePod`) and derives `phase`, `reason` and
`message` from both (`derive_phase`), so no field has two writers and no write can undo another's.
A status write goes through `status_patch`, which refuses a field its writer does not own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


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


def _owned(*writers: str, default: Any = None) -> Any:
    return field(default=default, metadata={"writers": frozenset(writers)})


@dataclass(frozen=True)
class SnapshotStatus:
    """`status` of an InferenceSnapshot, read into Python names (the API's are camelCase)."""

    phase: str = _owned(OPERATOR, default=Phase.PENDING)
    reason: str | None = _owned(OPERATOR)
    message: str | None = _owned(OPERATOR)
    attempts: int = _owned(OPERATOR, default=1)
    retry_after: str | None = _owned(OPERATOR)
    capture_pod: str | None = _owned(OPERATOR)  # the pod it made for the current attempt
    capture_attempt: int | None = _owned(AGENT)  # the attempt the agent last worked on
    capture_state: str | None = _owned(AGENT)
    capture_message: str | None = _owned(AGENT)
    node: str | None = _owned(AGENT)
    identity: dict[str, Any] | None = _owned(AGENT)  # the runtime identity, as the store's manifest has it
    identity_hash: str | None = _owned(AGENT)
    gpu: dict[str, str] | None = _owned(AGENT)
    snapshot_id: str | None = _owned(AGENT)  # the snapshot's id in the store
    storage_path: str | None = _owned(AGENT)  # its directory, relative to the store's root
    size_bytes: int | None = _owned(AGENT)
    manifest_digest: str | None = _owned(AGENT)
    timings: dict[str, float] | None = _owned(AGENT)
    started_at: str | None = _owned(AGENT)
    completed_at: str | None = _owned(AGENT)
    restore_failures: int | None = _owned(AGENT)
    restore_failure_message: str | None = _owned(AGENT)
    stale_reason: str | None = _owned(OPERATOR)  # a FactsChanged: the pods no longer match the capture
    stale_message: str | None = _owned(OPERATOR)
    stale_facts_digest: str | None = _owned(OPERATOR)  # the pods' facts it was retired for

    @classmethod
    def of(cls, snapshot: dict[str, Any] | None) -> SnapshotStatus:
        """The typed status of an InferenceSnapshot object (unknown keys ignored, missing ones defaulted)."""
        raw = (snapshot or {}).get("status") or {}
        present = {f.name: raw.get(_api_name(f.name)) for f in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in present.items() if value is not None})

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


def _api_name(python_name: str) -> str:
    head, *rest = python_name.split("_")
    return head + "".join(part.title() for part in rest)


WRITERS: dict[str, frozenset[str]] = {
    _api_name(f.name): f.metadata["writers"] for f in dataclasses.fields(SnapshotStatus)
}


def status_patch(writer: str, **fields: Any) -> dict[str, Any]:
    """A merge patch of `status` from `writer`'s fields (Python names; None clears a field)."""
    patch = {}
    for name, value in fields.items():
        api_name = _api_name(name)
        writers = WRITERS.get(api_name)
        if writers is None:
            raise KeyError(f"InferenceSnapshot status has no field {api_name!r}")
        if writer not in writers:
            raise PermissionError(
                f"status.{api_name} of an InferenceSnapshot is written by {sorted(writers)}"
            )
        patch[api_name] = str(value) if isinstance(value, StrEnum) else value
    return patch
