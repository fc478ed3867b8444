"""The InferenceSnapshot status model: every field has its writers, and the CRD and the model agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from warmstart.api.snapshot import AGENT, OPERATOR, WRITERS, Phase, SnapshotStatus, status_patch

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
    patch = status_patch(AGENT, phase=Phase.READY, snapshot_id="abc", size_bytes=3)
    assert patch == {"phase": "Ready", "snapshotId": "abc", "sizeBytes": 3}
    assert type(patch["phase"]) is str
    assert status_patch(OPERATOR, retry_after=None) == {"retryAfter": None}


def test_a_field_is_refused_to_a_component_that_does_not_own_it() -> None:
    with pytest.raises(PermissionError, match="status.snapshotId .* written by \\['agent'\\]"):
        status_patch(OPERATOR, snapshot_id="abc")
    with pytest.raises(PermissionError, match="retryAfter"):
        status_patch(AGENT, retry_after="2026-01-01T00:00:00Z")
    with pytest.raises(KeyError, match="storagepath"):
        status_patch(AGENT, storagepath="x")


def test_reading_a_status_defaults_what_is_missing_and_ignores_what_is_unknown() -> None:
    status = SnapshotStatus.of({"status": {"phase": "Failed", "attempts": 3, "somethingNew": 1}})
    assert (status.phase, status.attempt, status.retry_after) == (Phase.FAILED, 3, None)
    assert SnapshotStatus.of(None).phase == Phase.PENDING
    assert SnapshotStatus.of({"status": {"attempts": None}}).attempt == 1
