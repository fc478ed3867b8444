from __future__ import annotations

import datetime as dt

from builders import endpoint_body, snapshot_object

from warmstart.api import labels as L
from warmstart.host.clock import format_time
from warmstart.operator.backoff import Backoff
from warmstart.operator.children import Owner
from warmstart.operator.diagnosis import PodsChanged
from warmstart.operator.request_key import request_key, request_key_hash
from warmstart.operator.snapshots import plan_snapshots
from warmstart.operator.spec import parse_spec

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


def plan(snapshots, now=NOW, **overrides):
    body = endpoint_body(**overrides)
    spec = parse_spec(body["spec"])
    key = request_key(spec)
    result = plan_snapshots(
        Owner.from_body(body),
        spec,
        request_key_hash(key),
        key,
        snapshots,
        now,
        Backoff(base_seconds=10, max_seconds=100),
    )
    return result, request_key_hash(key)


def current_hash(**overrides) -> str:
    return plan([], **overrides)[1]


def test_no_snapshot_creates_one_and_runs_cold():
    result, digest = plan([])
    assert result.role == L.ROLE_COLD
    assert result.create is not None
    assert result.create["metadata"]["name"] == f"qwen-{digest[:10]}"
    assert result.create["metadata"]["labels"][L.REQUEST_KEY_LABEL] == digest[: L.REQUEST_KEY_LABEL_LENGTH]
    assert result.create["spec"]["requestKeyHash"] == digest
    assert result.create["metadata"]["ownerReferences"][0]["kind"] == L.ENDPOINT_KIND
    assert result.capture_attempt == 1 and result.active == result.create["metadata"]["name"]
    assert result.status_patches == {result.active: {"phase": "Pending", "attempts": 1}}


def test_snapshots_disabled_plans_nothing():
    result, _ = plan([], snapshot={"enabled": False})
    assert result.role == L.ROLE_COLD and result.create is None and not result.capture_attempt


def test_pending_snapshot_keeps_its_capture_pod():
    digest = current_hash()
    result, _ = plan([snapshot_object("qwen-a", digest, "Capturing", "2026-01-01T11:00:00Z", attempts=2)])
    assert result.create is None and result.role == L.ROLE_COLD
    assert (result.active, result.capture_attempt) == ("qwen-a", 2)


def test_ready_snapshot_switches_to_restore():
    digest = current_hash()
    result, _ = plan([snapshot_object("qwen-a", digest, "Ready", "2026-01-01T11:00:00Z", node="gpu-3")])
    assert result.role == L.ROLE_RESTORE and result.ready == "qwen-a"
    assert result.ready_node == "gpu-3"  # where the agent captured it
    assert result.create is None and not result.capture_attempt


def test_identity_change_starts_a_new_capture_and_keeps_the_old_one():
    old = snapshot_object("qwen-old", "0" * 64, "Ready", "2026-01-01T11:00:00Z")
    result, digest = plan([old], engine={"kind": "vllm", "image": "registry.example/warmstart-worker:0.2"})
    assert result.role == L.ROLE_COLD and result.ready == ""
    assert result.create is not None and result.create["spec"]["requestKeyHash"] == digest
    assert result.delete == []  # retention 2: the old one stays for a rollback


def test_failed_capture_is_retried_with_backoff_then_gives_up():
    digest = current_hash()
    failed = snapshot_object("qwen-a", digest, "Failed", "2026-01-01T11:00:00Z", attempts=1, message="OOM")
    first, _ = plan([failed])
    retry_at = format_time(NOW + dt.timedelta(seconds=10))
    derived = {"phase": "Failed", "reason": "CaptureFailed", "message": "OOM"}  # from the agent's report
    assert first.status_patches == {"qwen-a": {**derived, "retryAfter": retry_at}}
    assert not first.capture_attempt and first.events[0][1] == "CaptureFailed"

    failed["status"].update(derived, retryAfter=retry_at)
    early, _ = plan([failed], now=NOW + dt.timedelta(seconds=5))
    assert early.status_patches == {} and not early.capture_attempt

    due, _ = plan([failed], now=NOW + dt.timedelta(seconds=11))
    assert due.status_patches["qwen-a"]["phase"] == "Pending"
    assert due.status_patches["qwen-a"]["attempts"] == 2 and due.capture_attempt == 2

    failed["status"].update(attempts=5, captureAttempt=5, retryAfter=None)
    spent, _ = plan([failed])
    assert spent.exhausted and not spent.capture_attempt and spent.role == L.ROLE_COLD


def test_backoff_doubles_and_is_capped():
    backoff = Backoff(base_seconds=10, max_seconds=100)
    assert [backoff.delay(n) for n in (1, 2, 3, 4, 5)] == [10, 20, 40, 80, 100]


def test_invalid_snapshot_is_never_used_and_gets_a_fresh_name():
    digest = current_hash()
    invalid = snapshot_object(f"qwen-{digest[:10]}", digest, "Invalid", "2026-01-01T11:00:00Z")
    result, _ = plan([invalid])
    assert result.role == L.ROLE_COLD
    assert result.create is not None and result.create["metadata"]["name"] == f"qwen-{digest[:10]}-1"


def test_retention_deletes_the_oldest_but_never_the_one_in_use():
    digest = current_hash()
    snaps = [
        snapshot_object("s1", "1" * 64, "Ready", "2026-01-01T01:00:00Z"),
        snapshot_object("s2", "2" * 64, "Ready", "2026-01-01T02:00:00Z"),
        snapshot_object("s3", "3" * 64, "Ready", "2026-01-01T03:00:00Z"),
        snapshot_object("current", digest, "Ready", "2026-01-01T00:00:00Z"),
    ]
    result, _ = plan(snaps, snapshot={"enabled": True, "retention": 2})
    assert result.ready == "current"
    assert sorted(result.delete) == ["s1", "s2"]


def changed(snapshot: str, digest: str = "d" * 64, reason: str = "ModelChanged") -> PodsChanged:
    return PodsChanged(snapshot, reason, digest, f"restore pod w refused: {reason}: model.safetensors")


def plan_changed(snapshots, changes):
    body = endpoint_body()
    spec = parse_spec(body["spec"])
    key = request_key(spec)
    owner, digest = Owner.from_body(body), request_key_hash(key)
    return plan_snapshots(owner, spec, digest, key, snapshots, NOW, changes=changes)


def applied(snapshot, patch):
    return {**snapshot, "status": {**snapshot["status"], **patch}}


def test_a_pod_refused_because_its_model_changed_retires_the_snapshot_and_captures_again_once():
    digest = current_hash()
    old = snapshot_object(f"qwen-{digest[:10]}", digest, "Ready", "2026-01-01T11:00:00Z")
    assert plan_changed([old], [changed("another-snapshot")]).ready == old["metadata"]["name"]

    first = plan_changed([old], [changed(old["metadata"]["name"])])
    patch = first.status_patches[old["metadata"]["name"]]
    assert patch["phase"] == "Stale" and patch["staleReason"] == "ModelChanged"
    assert patch["staleFactsDigest"] == "d" * 64 and "model.safetensors" in patch["staleMessage"]
    assert first.role == L.ROLE_COLD and not first.ready
    assert first.create is not None and first.active == f"qwen-{digest[:10]}-1" and first.capture_attempt == 1
    assert first.retired == (old["metadata"]["name"], "ModelChanged", patch["message"])
    assert ("Normal", "ModelChanged") in {event[:2] for event in first.events}

    # The next reconciles: the old one stays Stale, the one capture goes on; the refused pods change nothing.
    stale = applied(old, patch)
    new = snapshot_object(first.active, digest, "Capturing", "2026-01-01T12:00:00Z")
    capturing = plan_changed([stale, new], [changed(old["metadata"]["name"])])
    assert capturing.create is None and old["metadata"]["name"] not in capturing.status_patches
    assert (capturing.active, capturing.capture_attempt) == (first.active, 1)
    assert capturing.retired[:2] == (old["metadata"]["name"], "ModelChanged")

    done = snapshot_object(first.active, digest, "Ready", "2026-01-01T12:00:00Z")
    restored = plan_changed([stale, done], [changed(old["metadata"]["name"])])
    assert restored.role == L.ROLE_RESTORE and restored.ready == first.active
    assert restored.retired == ("", "", "") and restored.create is None

    # The new capture refused for the same facts of the pods: no second capture (no loop); other facts: one.
    again = plan_changed([stale, done], [changed(first.active)])
    assert again.ready == first.active and again.create is None
    assert "staleReason" not in again.status_patches.get(first.active, {})
    other = plan_changed([stale, done], [changed(first.active, digest="e" * 64, reason="EngineChanged")])
    assert other.create is not None and other.status_patches[first.active]["staleReason"] == "EngineChanged"


def test_ready_snapshots_taken_before_a_stale_one_are_not_restored():
    digest = current_hash()
    older = snapshot_object("qwen-older", digest, "Ready", "2026-01-01T10:00:00Z")
    stale = snapshot_object("qwen-stale", digest, "Ready", "2026-01-01T11:00:00Z")
    stale["status"].update(staleReason="ModelChanged", staleMessage="changed", staleFactsDigest="d" * 64)
    result = plan_changed([older, stale], [])
    assert result.role == L.ROLE_COLD and result.create is not None
    assert result.status_patches["qwen-stale"]["phase"] == "Stale"  # derived from the stale fields
