from __future__ import annotations

import dataclasses
import datetime as dt
import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from warmstart.api import labels as L
from warmstart.api.endpoint import EndpointStatus
from warmstart.operator.diagnosis import Cause, restore_causes
from warmstart.operator.reconcile import write_status
from warmstart.operator.snapshots import SnapshotPlan
from warmstart.operator.status import (
    INVALID_SPEC,
    READY,
    Workload,
    degraded_status,
    endpoint_status,
    last_timings,
    reported_invalid,
    restored_replicas,
)

T0 = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
T1 = T0 + dt.timedelta(minutes=5)


def status(
    plan: SnapshotPlan,
    work: Workload,
    previous=None,
    now=T0,
    enabled=True,
    causes=(),
    capture_causes=(),
    kept="",
    role="",
    pods=(),
):
    """The status as written (its JSON merge patch), from `previous` as read back."""
    return written(
        endpoint_status(
            generation=3,
            snapshots_enabled=enabled,
            plan=plan,
            work=work,
            selector="a=b",
            request_hash="h",
            pods=list(pods),
            previous=EndpointStatus.model_validate(previous or {}),
            now=now,
            worker_causes=causes,
            capture_causes=capture_causes,
            kept_snapshot=kept,
            worker_role=role,
        )
    )


def written(result: EndpointStatus) -> dict:
    """The status patch the operator sends for `result`."""
    patches: list[dict] = []
    kube = SimpleNamespace(patch_status=lambda kind, namespace, name, patch: patches.append(patch))
    write_status(kube, {"namespace": "ns", "name": "llm"}, result)
    return patches[0]


def conditions(result) -> dict[str, dict]:
    return {c["type"]: c for c in result["conditions"]}


CAPTURING = SnapshotPlan(role=L.ROLE_COLD, active="s", active_phase="Pending", attempts=1, capture_attempt=1)


def test_capturing_with_cold_replicas_not_yet_ready():
    result = status(CAPTURING, Workload(desired=2, replicas=2, ready=0, updated=2))
    found = conditions(result)
    assert result["phase"] == "Capturing" and result["ready"] == "0/2"
    assert (result["reason"], result["message"]) == (
        "Capturing",
        "capturing s (attempt 1); replicas cold-start",
    )
    assert found["Ready"]["status"] == "False" and found["Ready"]["message"] == "0/2 replicas ready: starting"
    assert found["SnapshotReady"]["reason"] == "Capturing"
    assert (found["Progressing"]["status"], found["Progressing"]["reason"]) == ("True", "ScalingUp")
    assert found["Degraded"]["status"] == "False"
    assert all(c["observedGeneration"] == 3 for c in result["conditions"])
    assert result["observedGeneration"] == 3 and result["captureAttempts"] == 1


def test_one_serving_replica_is_ready_while_capturing_and_scaling_up():
    first = status(CAPTURING, Workload(desired=1, replicas=1, ready=1, updated=1))
    assert conditions(first)["Ready"]["status"] == "True" and first["phase"] == "Ready"
    # kubectl scale 1 -> 2: the new replica starts beside the serving one.
    scaled = status(CAPTURING, Workload(desired=2, replicas=2, ready=1, updated=2), previous=first, now=T1)
    ready, progressing = conditions(scaled)["Ready"], conditions(scaled)["Progressing"]
    assert (ready["status"], ready["message"]) == ("True", "1/2 replicas ready")
    assert ready["lastTransitionTime"] == conditions(first)["Ready"]["lastTransitionTime"]  # no flap
    assert (progressing["status"], progressing["reason"]) == ("True", "ScalingUp")
    assert (scaled["phase"], scaled["reason"], scaled["ready"]) == ("Ready", "ScalingUp", "1/2")


@pytest.mark.parametrize(
    ("work", "reason"),
    [
        (Workload(desired=1, replicas=2, ready=1, updated=1), "ScalingDown"),
        (Workload(desired=2, replicas=2, ready=2, updated=1), "RollingOut"),
        (Workload(desired=2, replicas=1, ready=1, updated=1), "ScalingUp"),
        (Workload(desired=2, replicas=2, ready=2, updated=2), "Stable"),
    ],
)
def test_progressing_says_what_the_deployment_is_doing(work, reason):
    found = conditions(status(SnapshotPlan(role=L.ROLE_RESTORE, ready="s"), work))["Progressing"]
    assert (found["status"], found["reason"]) == ("False" if reason == "Stable" else "True", reason)


def worker_cause(reason="Unschedulable", detail="0/3 nodes are available: 3 Insufficient nvidia.com/gpu."):
    return Cause(reason, detail, "worker", ("llm-abc",))


def test_a_worker_that_cannot_start_explains_not_ready_and_degraded():
    cause = worker_cause()
    result = status(
        SnapshotPlan(role=L.ROLE_COLD), Workload(desired=1, replicas=1), enabled=False, causes=[cause]
    )
    found = conditions(result)
    assert (found["Ready"]["status"], found["Ready"]["reason"]) == ("False", "Unschedulable")
    assert found["Ready"]["message"] == f"worker pod llm-abc: {cause.detail}"
    assert (found["Degraded"]["status"], found["Degraded"]["reason"]) == ("True", "Unschedulable")
    assert (result["phase"], result["reason"]) == ("Degraded", "Unschedulable")
    assert "3 Insufficient nvidia.com/gpu" in result["message"]


def test_a_capture_for_a_changed_model_says_what_changed_in_snapshot_ready():
    why = "restore pod w-1 refused: model /m: model.safetensors changed content since the snapshot"
    plan = dataclasses.replace(CAPTURING, active="s-1", retired=("s", "ModelChanged", why))
    found = conditions(status(plan, Workload(desired=1, replicas=1, ready=1, updated=1)))["SnapshotReady"]
    assert (found["status"], found["reason"]) == ("False", "ModelChanged")
    assert found["message"] == (
        f"s is Stale ({why}); capturing s-1 (attempt 1) for what the pods hold now; replicas cold-start"
    )


def test_a_capture_pod_that_cannot_progress_explains_snapshot_ready():
    cause = Cause("NoNodeAgent", "no Ready node agent on node n1", "capture", ("s-capture-1",))
    result = status(CAPTURING, Workload(desired=1, replicas=1, ready=1, updated=1), capture_causes=[cause])
    found = conditions(result)
    assert (found["SnapshotReady"]["status"], found["SnapshotReady"]["reason"]) == ("False", "NoNodeAgent")
    assert found["SnapshotReady"]["message"].startswith(
        "capture pod s-capture-1: no Ready node agent on node n1"
    )
    assert (found["Degraded"]["status"], found["Degraded"]["reason"]) == ("True", "NoNodeAgent")
    assert found["Ready"]["status"] == "True"  # the cold replica serves meanwhile
    assert result["phase"] == "Degraded"


def test_worker_causes_come_before_capture_causes_and_all_are_named():
    capture = Cause("ImagePullFailed", "container worker: ErrImagePull", "capture", ("s-capture-1",))
    result = status(
        CAPTURING, Workload(desired=1, replicas=1), causes=[worker_cause()], capture_causes=[capture]
    )
    degraded = conditions(result)["Degraded"]
    assert degraded["reason"] == "Unschedulable"
    assert (
        "worker pod llm-abc: 0/3" in degraded["message"]
        and "capture pod s-capture-1: " in degraded["message"]
    )


def test_a_kept_template_is_said_while_a_new_snapshot_is_captured():
    result = status(
        CAPTURING, Workload(desired=2, replicas=2, ready=2, updated=2), kept="old", role="restore"
    )
    message = conditions(result)["SnapshotReady"]["message"]
    assert message.startswith("capturing s (attempt 1); serving replicas keep their template (it names old")
    assert result["workerRole"] == "restore" and result["currentSnapshot"] is None


def test_restoring_and_ready():
    plan = SnapshotPlan(role=L.ROLE_RESTORE, ready="s")
    result = status(plan, Workload(desired=2, replicas=2, ready=2, updated=2))
    found = conditions(result)
    assert (
        result["phase"] == "Ready" and result["currentSnapshot"] == "s" and result["workerRole"] == "restore"
    )
    assert found["SnapshotReady"]["status"] == "True"
    assert found["Progressing"]["status"] == "False"


def test_transition_time_moves_only_on_status_change():
    plan = SnapshotPlan(role=L.ROLE_RESTORE, ready="s")
    first = status(plan, Workload(desired=1, replicas=1, ready=0, updated=1))
    same = status(plan, Workload(desired=1, replicas=1, ready=0, updated=1), previous=first, now=T1)
    assert conditions(same)["Ready"]["lastTransitionTime"] == conditions(first)["Ready"]["lastTransitionTime"]
    flipped = status(plan, Workload(desired=1, replicas=1, ready=1, updated=1), previous=same, now=T1)
    assert conditions(flipped)["Ready"]["lastTransitionTime"] == "2026-01-01T12:05:00Z"


def test_exhausted_capture_is_degraded():
    plan = SnapshotPlan(
        role=L.ROLE_COLD,
        active="s",
        active_phase="Failed",
        attempts=5,
        exhausted=True,
        failure_message="criu dump failed",
    )
    result = status(plan, Workload(desired=1, replicas=1, ready=1, updated=1))
    assert result["phase"] == "Degraded"
    assert "criu dump failed" in conditions(result)["SnapshotReady"]["message"]
    assert conditions(result)["Degraded"]["reason"] == "CaptureFailed"


def test_scaled_to_zero_and_disabled_snapshots():
    result = status(SnapshotPlan(role=L.ROLE_COLD), Workload(desired=0), enabled=False)
    assert (result["phase"], result["reason"]) == ("ScaledToZero", "ScaledToZero")
    ready = conditions(result)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "ScaledToZero")  # nothing serves at zero
    assert conditions(result)["Degraded"]["status"] == "False"
    assert conditions(result)["SnapshotReady"]["reason"] == "SnapshotsDisabled"


def test_invalid_status_names_the_problem_and_keeps_the_other_conditions():
    before = status(
        SnapshotPlan(role=L.ROLE_RESTORE, ready="s"), Workload(desired=1, replicas=1, ready=1, updated=1)
    )
    problem = "spec.replicas: must be between 0 and 1000, got -1"
    typed = degraded_status(4, INVALID_SPEC, problem, read(before), T0, READY)
    result = written(typed)
    assert set(result) == {"phase", "reason", "message", "observedGeneration", "conditions"}  # the rest kept
    assert (result["phase"], result["reason"]) == ("Degraded", "InvalidSpec")
    assert result["message"].startswith("spec.replicas")
    assert conditions(result)["Degraded"]["message"].startswith("spec.replicas")
    assert conditions(result)["Degraded"]["observedGeneration"] == 4
    assert conditions(result)["SnapshotReady"]["status"] == "True"  # what the last reconcile saw
    assert reported_invalid(typed, 4) and not reported_invalid(typed, 5)
    assert not reported_invalid(read(before), 3)


def read(status: dict) -> EndpointStatus:
    return EndpointStatus.model_validate(status)


def test_restored_replicas_count_ready_pods_the_agent_restored():
    restored = worker_pod(
        L.ROLE_RESTORE, "2026-01-01T11:00:00Z", "2026-01-01T11:00:02Z", annotation={"restoreSeconds": 1.5}
    )
    refused = worker_pod(
        L.ROLE_RESTORE,
        "2026-01-01T11:00:00Z",
        "2026-01-01T11:00:30Z",
        annotation={"restoreFailed": "no agent"},
    )
    starting = worker_pod(
        L.ROLE_RESTORE,
        "2026-01-01T11:00:00Z",
        "2026-01-01T11:00:02Z",
        annotation={"restoreSeconds": 1.5},
        ready="False",
    )
    cold = worker_pod(L.ROLE_COLD, "2026-01-01T11:00:00Z", "2026-01-01T11:00:30Z")
    pods = [restored, refused, starting, cold]  # fmt: skip
    assert restored_replicas(pods) == 1
    result = status(SnapshotPlan(role=L.ROLE_RESTORE, ready="s"), Workload(4, 4, 3, 4), pods=pods)
    assert (result["restoredReplicas"], result["ready"]) == (1, "3/4")


def pod(annotation, created="2026-01-01T10:00:00Z"):
    meta = {"creationTimestamp": created, "annotations": {}}
    if annotation is not None:
        meta["annotations"][L.STATUS_ANNOTATION] = annotation
    return {"metadata": meta}


def test_timings_come_from_the_newest_pod_reports():
    pods = [
        pod(json.dumps({"restoreSeconds": 3.5, "at": "2026-01-01T10:00:00Z"})),
        pod(json.dumps({"restoreSeconds": 2.25, "at": "2026-01-01T11:00:00Z"})),
        pod(json.dumps({"coldStartSeconds": 61}), created="2026-01-01T09:00:00Z"),
        pod("not json"),
        pod(json.dumps({"restoreSeconds": True})),
        pod(None),
    ]
    assert last_timings(pods) == {"last_restore_seconds": 2.25, "last_cold_start_seconds": 61.0}


def test_missing_api_is_degraded_with_the_fix_named():
    result = endpoint_status(
        generation=1,
        snapshots_enabled=False,
        plan=SnapshotPlan(role=L.ROLE_COLD),
        work=Workload(desired=1, replicas=1, ready=1, updated=1),
        selector="a=b",
        request_hash="h",
        pods=[],
        previous=EndpointStatus(),
        now=T0,
        missing_api="keda.sh/v1alpha1 ScaledObject is not served: install KEDA",
    )
    assert result.phase == "Degraded"
    assert conditions(written(result))["Degraded"]["reason"] == "MissingAPI"
    assert "install KEDA" in conditions(written(result))["Degraded"]["message"]


def test_newest_report_is_found_by_time_not_by_text():
    # As text "…00Z" sorts after "…00.500000+00:00" and "…12:00:00+02:00" after "…11:00:00Z"; as times
    # the first of each pair is the older one.
    pods = [
        pod(json.dumps({"restoreSeconds": 1.0, "at": "2026-01-01T10:00:00Z"})),
        pod(json.dumps({"restoreSeconds": 2.0, "at": "2026-01-01T10:00:00.500000+00:00"})),
        pod(json.dumps({"coldStartSeconds": 30, "at": "2026-01-01T12:00:00+02:00"})),
        pod(json.dumps({"coldStartSeconds": 40, "at": "2026-01-01T11:00:00Z"})),
    ]
    assert last_timings(pods) == {"last_restore_seconds": 2.0, "last_cold_start_seconds": 40.0}


def test_a_report_without_a_readable_time_loses_to_a_dated_one():
    pods = [
        pod(json.dumps({"restoreSeconds": 9.0, "at": "yesterday"}), created="not a time"),
        pod(json.dumps({"restoreSeconds": 3.0, "at": "2026-01-01T10:00:00Z"})),
        pod(json.dumps({"coldStartSeconds": 50, "at": "2026-01-01T10:00:00"})),  # no zone: UTC
        pod(json.dumps({"coldStartSeconds": 60, "at": "2026-01-01T10:30:00+01:00"})),
    ]
    assert last_timings(pods) == {"last_restore_seconds": 3.0, "last_cold_start_seconds": 50.0}


def worker_pod(role, started, ready_at, annotation=None, ready="True", container="worker"):
    """A worker pod as the kubelet reports it: its container's start and its Ready condition."""
    body = pod(json.dumps(annotation) if annotation is not None else None)
    body["metadata"]["labels"] = {L.ROLE_LABEL: role}
    body["status"] = {
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            {"type": "Ready", "status": ready, "lastTransitionTime": ready_at},
        ],
        "containerStatuses": [{"name": container, "state": {"running": {"startedAt": started}}}],
    }
    return body


def test_a_cold_start_lasts_from_the_container_start_to_ready():
    pods = [worker_pod(L.ROLE_COLD, "2026-01-01T10:00:00Z", "2026-01-01T10:01:05Z")]
    assert last_timings(pods) == {"last_cold_start_seconds": 65.0}


def test_a_restore_pod_that_fell_back_to_a_cold_start_counts_as_one():
    pods = [
        worker_pod(L.ROLE_COLD, "2026-01-01T10:00:00Z", "2026-01-01T10:01:05Z"),
        worker_pod(L.ROLE_RESTORE, "2026-01-01T11:00:00Z", "2026-01-01T11:00:40.5Z",
                   annotation={"restoreFailed": "digest mismatch", "at": "2026-01-01T11:00:01Z"}),
    ]  # fmt: skip
    assert last_timings(pods) == {"last_cold_start_seconds": 40.5}


def test_only_pods_known_to_have_started_cold_and_now_ready_count():
    pods = [
        worker_pod(L.ROLE_RESTORE, "2026-01-01T11:00:00Z", "2026-01-01T11:00:09Z",
                   annotation={"restoreSeconds": 2.5, "at": "2026-01-01T11:00:07Z"}),
        worker_pod(L.ROLE_RESTORE, "2026-01-01T12:00:00Z", "2026-01-01T12:00:30Z"),  # the agent said nothing
        worker_pod(L.ROLE_COLD, "2026-01-01T12:00:00Z", "2026-01-01T12:00:20Z", ready="False"),
        worker_pod(L.ROLE_COLD, "2026-01-01T12:00:00Z", "2026-01-01T12:00:20Z", container="sidecar"),
        worker_pod(L.ROLE_COLD, "2026-01-01T12:00:00Z", "not a time"),
    ]  # fmt: skip
    assert last_timings(pods) == {"last_restore_seconds": 2.5}


def test_ready_again_long_after_the_start_is_not_a_start():
    # Ready since a probe failed for a while, days after the container started: not how long it took to start.
    pods = [
        worker_pod(L.ROLE_COLD, "2026-01-01T09:00:00Z", "2026-01-01T09:00:30Z"),
        worker_pod(L.ROLE_COLD, "2026-01-01T10:00:00Z", "2026-01-03T10:00:00Z"),
    ]
    assert last_timings(pods) == {"last_cold_start_seconds": 30.0}


def test_a_cold_start_the_pod_reports_itself_wins_over_the_measured_one():
    pods = [worker_pod(L.ROLE_COLD, "2026-01-01T10:00:00Z", "2026-01-01T10:01:05Z",
                       annotation={"coldStartSeconds": 61.25, "at": "2026-01-01T10:01:04Z"})]  # fmt: skip
    assert last_timings(pods) == {"last_cold_start_seconds": 61.25}


def test_replicas_refused_their_restore_are_said_in_the_conditions_while_the_snapshot_is_ready():
    """Two replicas refused (the object store's copy tampered with) and cold: the snapshot is still Ready,
    but neither Degraded nor SnapshotReady says all is well."""
    why = "pulling snapshot s1 from the object store failed: blob sha256:ab do not match (tampered)"
    pods = [
        worker_pod(L.ROLE_RESTORE, "2026-01-01T11:00:00Z", "2026-01-01T11:00:30Z", {"restoreFailed": why}),
        worker_pod(L.ROLE_RESTORE, "2026-01-01T11:00:00Z", "2026-01-01T11:00:31Z", {"restoreFailed": why}),
        worker_pod(L.ROLE_RESTORE, "2026-01-01T11:00:00Z", "2026-01-01T11:00:02Z", {"restoreSeconds": 1.5}),
    ]
    for index, body in enumerate(pods):
        body["metadata"]["name"] = f"tiny-{index}"
    result = status(
        SnapshotPlan(role=L.ROLE_RESTORE, ready="s"), Workload(3, 3, 3, 3), pods=pods,
        causes=restore_causes(pods),
    )  # fmt: skip
    found = conditions(result)
    assert (found["Degraded"]["status"], found["Degraded"]["reason"]) == ("True", "RestoreRefused")
    assert (
        found["Degraded"]["message"] == f"2 worker pods (tiny-0, tiny-1): not restored, started cold: {why}"
    )
    assert found["SnapshotReady"]["status"] == "True"
    assert found["SnapshotReady"]["message"].startswith("replicas restore from s; 2 worker pods (tiny-0, ")
    assert (result["phase"], result["reason"]) == ("Degraded", "RestoreRefused")
    assert (result["restoredReplicas"], found["Ready"]["status"]) == (1, "True")


def test_the_patch_clears_what_no_longer_holds_and_leaves_what_it_does_not_know():
    """currentSnapshot and captureAttempts are written as null once gone; a timing no pod reports now is
    not written, so the last one stays; the model's other fields (kopf's) are never written."""
    cold = worker_pod(L.ROLE_COLD, "2026-01-01T10:00:00Z", "2026-01-01T10:01:05Z")
    result = status(SnapshotPlan(role=L.ROLE_RESTORE, ready="s"), Workload(1, 1, 1, 1), pods=[cold])
    assert result["lastColdStartSeconds"] == 65.0 and result["captureAttempts"] is None
    assert set(result) == {
        "phase", "reason", "message", "observedGeneration", "replicas", "readyReplicas", "ready",
        "restoredReplicas", "selector", "requestKeyHash", "currentSnapshot", "workerRole",
        "captureAttempts", "children", "conditions", "lastColdStartSeconds",
    }  # fmt: skip
    assert set(result["conditions"][0]) == {
        "type",
        "status",
        "reason",
        "message",
        "lastTransitionTime",
        "observedGeneration",
    }
    again = status(CAPTURING, Workload(1, 1, 1, 1), previous=result, now=T1)
    assert again["currentSnapshot"] is None and "lastColdStartSeconds" not in again


def test_a_status_written_by_an_older_operator_is_read_and_its_transition_times_kept():
    first = status(SnapshotPlan(role=L.ROLE_RESTORE, ready="s"), Workload(1, 1, 1, 1))
    older = {**first, "kopf": {"progress": {}}, "restoreMode": "lazy"}  # a field this model no longer has
    again = status(SnapshotPlan(role=L.ROLE_RESTORE, ready="s"), Workload(1, 1, 1, 1), previous=older, now=T1)
    assert again["conditions"] == first["conditions"] and "restoreMode" not in again


def test_a_status_the_schema_would_refuse_is_an_error_not_a_write():
    with pytest.raises(ValidationError, match="worker_role"):
        status(SnapshotPlan(role=L.ROLE_RESTORE, ready="s"), Workload(1, 1, 1, 1), role="warm")
