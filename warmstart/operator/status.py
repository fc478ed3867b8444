"""InferenceEndpoint status: phase and conditions per the Kubernetes API conventions."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from warmstart.operator import labels as L
from warmstart.operator.snapshots import FAILED, SnapshotPlan, format_time, parse_time

READY, SNAPSHOT_READY, PROGRESSING, DEGRADED = "Ready", "SnapshotReady", "Progressing", "Degraded"
UNDATED = dt.datetime.min.replace(tzinfo=dt.UTC)  # a report without a readable time: older than any other


@dataclass(frozen=True)
class Workload:
    """What the Deployment reports."""

    desired: int
    replicas: int = 0
    ready: int = 0
    updated: int = 0

    @classmethod
    def from_deployment(cls, desired: int, deployment: dict[str, Any] | None) -> Workload:
        status = (deployment or {}).get("status") or {}
        return cls(
            desired=desired,
            replicas=int(status.get("replicas") or 0),
            ready=int(status.get("readyReplicas") or 0),
            updated=int(status.get("updatedReplicas") or 0),
        )


def condition(
    kind: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int,
    previous: list[dict[str, Any]],
    now: dt.datetime,
) -> dict[str, Any]:
    """A condition whose lastTransitionTime moves only when its status changes."""
    status = "True" if ok else "False"
    before = next((c for c in previous if c.get("type") == kind), None)
    changed = before is None or before.get("status") != status
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": format_time(now) if changed else before["lastTransitionTime"],
        "observedGeneration": generation,
    }


def _ready(work: Workload) -> tuple[bool, str, str]:
    if work.desired == 0:
        return True, "ScaledToZero", "0 replicas requested"
    if work.ready >= work.desired:
        return True, "ReplicasReady", f"{work.ready}/{work.desired} replicas ready"
    return False, "ReplicasNotReady", f"{work.ready}/{work.desired} replicas ready"


def _snapshot_ready(enabled: bool, plan: SnapshotPlan) -> tuple[bool, str, str]:
    if not enabled:
        return False, "SnapshotsDisabled", "snapshot.enabled is false: every replica cold-starts"
    if plan.ready:
        return True, "SnapshotReady", f"replicas restore from {plan.ready}"
    if plan.exhausted:
        return (
            False,
            "CaptureFailed",
            (f"{plan.active} failed {plan.attempts} times ({plan.failure_message}); replicas cold-start"),
        )
    if plan.active_phase == FAILED:
        return False, "CaptureRetryPending", f"{plan.active} failed ({plan.failure_message}); retry scheduled"
    return False, "Capturing", f"capturing {plan.active} (attempt {plan.attempts}); replicas cold-start"


def _progressing(work: Workload, plan: SnapshotPlan) -> tuple[bool, str, str]:
    if work.updated < work.desired or work.replicas > work.desired:
        return True, "RollingOut", f"{work.updated}/{work.desired} replicas updated"
    if plan.capture_attempt:
        return True, "Capturing", f"capturing {plan.active}"
    return False, "Stable", "nothing to do"


def _degraded(plan: SnapshotPlan, invalid_spec: str, missing_api: str) -> tuple[bool, str, str]:
    if invalid_spec:
        return True, "InvalidSpec", invalid_spec
    if missing_api:
        return True, "MissingAPI", missing_api
    if plan.exhausted:
        return True, "CaptureFailed", f"snapshot capture gave up after {plan.attempts} attempts"
    return False, "AsExpected", "no problems"


def phase(conditions: dict[str, bool], desired: int, capturing: bool) -> str:
    if conditions[DEGRADED]:
        return "Degraded"
    if desired == 0:
        return "ScaledToZero"
    if conditions[READY]:
        return "Ready"
    return "Capturing" if capturing else "Pending"


def last_timings(pods: list[dict[str, Any]]) -> dict[str, float]:
    """Newest restore and cold-start durations the pods report in their `warmstart.dev/status` annotation.

    The annotation is JSON such as {"phase": "Restored", "restoreSeconds": 2.1, "at": "...Z"}; pods without
    one, or with one that does not parse, are skipped.
    """
    found: dict[str, tuple[dt.datetime, float]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        raw = (meta.get("annotations") or {}).get(L.STATUS_ANNOTATION)
        if not raw:
            continue
        try:
            report = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(report, dict):
            continue
        stamp = _report_time(report.get("at"), meta.get("creationTimestamp"))
        for key, field in (
            ("restoreSeconds", "lastRestoreSeconds"),
            ("coldStartSeconds", "lastColdStartSeconds"),
        ):
            value = report.get(key)
            is_number = isinstance(value, int | float) and not isinstance(value, bool)
            if is_number and (field not in found or stamp > found[field][0]):
                found[field] = (stamp, float(value))
    return {field: value for field, (_, value) in found.items()}


def _report_time(*candidates: Any) -> dt.datetime:
    """The first candidate that reads as an RFC 3339 time (no zone: UTC), else UNDATED."""
    for text in candidates:
        if not isinstance(text, str) or not text:
            continue
        try:
            moment = parse_time(text)
        except ValueError:
            continue
        return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)
    return UNDATED


def endpoint_status(
    *,
    generation: int,
    snapshots_enabled: bool,
    plan: SnapshotPlan,
    work: Workload,
    selector: str,
    identity_hash: str,
    pods: list[dict[str, Any]],
    previous: dict[str, Any],
    now: dt.datetime,
    invalid_spec: str = "",
    missing_api: str = "",
) -> dict[str, Any]:
    before = previous.get("conditions") or []
    verdicts = {
        READY: _ready(work),
        SNAPSHOT_READY: _snapshot_ready(snapshots_enabled, plan),
        PROGRESSING: _progressing(work, plan),
        DEGRADED: _degraded(plan, invalid_spec, missing_api),
    }
    conditions = [condition(kind, *verdict, generation, before, now) for kind, verdict in verdicts.items()]
    status: dict[str, Any] = {
        "phase": phase({k: v[0] for k, v in verdicts.items()}, work.desired, bool(plan.capture_attempt)),
        "observedGeneration": generation,
        "replicas": work.replicas,
        "readyReplicas": work.ready,
        "selector": selector,
        "identityHash": identity_hash,
        "currentSnapshot": plan.ready or None,
        "workerRole": plan.role,
        "captureAttempts": plan.attempts if plan.active else None,
        "conditions": conditions,
    }
    status.update(last_timings(pods))
    return status


def invalid_status(
    generation: int, message: str, previous: dict[str, Any], now: dt.datetime
) -> dict[str, Any]:
    """Status for a spec the operator cannot reconcile: Degraded with the field named."""
    before = previous.get("conditions") or []
    conditions = [
        condition(DEGRADED, True, "InvalidSpec", message, generation, before, now),
        condition(READY, False, "InvalidSpec", message, generation, before, now),
    ]
    return {"phase": "Degraded", "observedGeneration": generation, "conditions": conditions}
