"""The InferenceSnapshot's status: its phases and one typed model of its fields, each with its writer.

The operator creates InferenceSnapshots and plans capture attempts (Pending, retries); the node agent that
captures or restores reports what happened (Capturing, Ready, Failed, Invalid and the capture's facts).
A status write goes through `status_patch`, which refuses a field its writer does not own, so a new field
cannot silently get a second writer.
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


IN_PROGRESS = (Phase.PENDING, Phase.CAPTURING)

OPERATOR, AGENT = "operator", "agent"


def _owned(*writers: str, default: Any = None) -> Any:
    return field(default=default, metadata={"writers": frozenset(writers)})


@dataclass(frozen=True)
class SnapshotStatus:
    """`status` of an InferenceSnapshot, read into Python names (the API's are camelCase)."""

    # Pending comes from the operator (create, retry); Capturing/Ready/Failed/Invalid from the agent.
    phase: str = _owned(OPERATOR, AGENT, default=Phase.PENDING)
    reason: str | None = _owned(OPERATOR, AGENT)
    message: str | None = _owned(OPERATOR, AGENT)
    attempts: int = _owned(OPERATOR, default=1)
    retry_after: str | None = _owned(OPERATOR)
    capture_pod: str | None = _owned(OPERATOR)  # the pod it made for the current attempt
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

    @classmethod
    def of(cls, snapshot: dict[str, Any] | None) -> SnapshotStatus:
        """The typed status of an InferenceSnapshot object (unknown keys ignored, missing ones defaulted)."""
        raw = (snapshot or {}).get("status") or {}
        present = {f.name: raw.get(_api_name(f.name)) for f in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in present.items() if value is not None})

    @property
    def attempt(self) -> int:
        return int(self.attempts or 1)


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
        patch[api_name] = str(value) if isinstance(value, Phase) else value
    return patch
