"""The InferenceSnapshot status model: every field has its writers, and the CRD and the model agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from warmstart.api.snapshot import (
    AGENT,
    OPERATOR,
    WRITERS,
    CaptureState,
    Phase,
    SnapshotStatus,
    derive_phase,
    status_patch,
)

CRD = Path(__file__).resolve().parents[2] / "crds" / "inferencesnapshots.yaml"
UNWRITTEN = {"observedGeneration", "conditions", "kopf"}  # unwritten yet; the operator framework's own


def _status_schema() -> dict:
    version = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]
    return version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]


def test_every_status_field_of_the_crd_has_writers_in_the_model() -> None:
    assert set(_status_schema()) - UNWRITTEN == set(WRITERS)


def test_the_model_phases_are_the_crd_enum() -> None:
    assert _status_schema()["phase"]["enum"] == [phase.value for phase in Phase]


def test_a_patch_uses_the_api_names_and_plain_strings() -> None:
    patch = status_patch(AGENT, capture_state=CaptureState.CAPTURED, snapshot_id="abc", size_bytes=3)
    assert patch == {"captureState": "Captured", "snapshotId": "abc", "sizeBytes": 3}
    assert type(patch["captureState"]) is str
    assert status_patch(OPERATOR, phase=Phase.READY) == {"phase": "Ready"}
    assert status_patch(OPERATOR, retry_after=None) == {"retryAfter": None}


def test_a_field_is_refused_to_a_component_that_does_not_own_it() -> None:
    with pytest.raises(PermissionError, match="status.snapshotId .* written by \\['agent'\\]"):
        status_patch(OPERATOR, snapshot_id="abc")
    with pytest.raises(PermissionError, match="retryAfter"):
        status_patch(AGENT, retry_after="2026-01-01T00:00:00Z")
    with pytest.raises(PermissionError, match="status.phase .* written by \\['operator'\\]"):
        status_patch(AGENT, phase=Phase.READY)
    with pytest.raises(KeyError, match="storagepath"):
        status_patch(AGENT, storagepath="x")


def test_reading_a_status_defaults_what_is_missing_and_ignores_what_is_unknown() -> None:
    status = SnapshotStatus.of({"status": {"phase": "Failed", "attempts": 3, "somethingNew": 1}})
    assert (status.phase, status.attempt, status.retry_after) == (Phase.FAILED, 3, None)
    assert SnapshotStatus.of(None).phase == Phase.PENDING
    assert SnapshotStatus.of({"status": {"attempts": None}}).attempt == 1


def test_every_field_has_exactly_one_writer() -> None:
    assert {name: writers for name, writers in WRITERS.items() if len(writers) != 1} == {}


@pytest.mark.parametrize(
    ("reported", "pod_failure", "phase", "reason"),
    [
        ({}, "", Phase.PENDING, "Pending"),
        ({"attempts": 2, "captureAttempt": 1, "captureState": "Failed"}, "", Phase.PENDING, "Pending"),
        ({"captureAttempt": 1, "captureState": "Capturing"}, "", Phase.CAPTURING, "Capturing"),
        ({"captureAttempt": 1, "captureState": "Capturing"}, "pod gone", Phase.FAILED, "CapturePodFailed"),
        ({}, "capture pod ended (Failed)", Phase.FAILED, "CapturePodFailed"),
        (
            {"captureAttempt": 1, "captureState": "Failed", "captureMessage": "oom"},
            "",
            Phase.FAILED,
            "CaptureFailed",
        ),
        (
            {"captureAttempt": 1, "captureState": "Captured", "snapshotId": "s"},
            "ended",
            Phase.READY,
            "Captured",
        ),
        (
            {"captureState": "Captured", "snapshotId": "s", "restoreFailures": 3},
            "",
            Phase.INVALID,
            "RestoreFailures",
        ),
    ],
)
def test_the_phase_follows_from_what_the_agent_reported(reported, pod_failure, phase, reason) -> None:
    assert derive_phase(SnapshotStatus.of({"status": reported}), pod_failure)[:2] == (phase, reason)
