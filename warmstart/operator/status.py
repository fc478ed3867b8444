"""InferenceEndpoint status: phase and conditions per the Kubernetes API conventions."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from warmstart.api import labels as L
from warmstart.api.snapshot import Phase
from warmstart.operator.children import STARTUP_PROBE_SECONDS
from warmstart.operator.snapshots import SnapshotPlan, format_time, parse_time

READY, SNAPSHOT_READY, PROGRESSING, DEGRADED = "Ready", "SnapshotReady", "Progressing", "Degraded"
UNDATED = dt.datetime.min.replace(tzinfo=dt.UTC)  # a report without a readable time: older than any other
REPORTED_TIMINGS = (("restoreSeconds", "lastRestoreSeconds"), ("coldStartSeconds", "lastColdStartSeconds"))
COLD_START = "lastColdStartSeconds"
# A worker not serving by then is restarted by its startup probe, so a pod that turns Ready later than this
# after its container started turned Ready *again* (its readiness probe failed for a while): not a start.
COLD_START_LIMIT_SECONDS = STARTUP_PROBE_SECONDS + 60


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
    if plan.active_phase == Phase.FAILED:
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
    """The newest restore and cold-start durations of the endpoint's pods.

    Restores are reported by the node agent in the pod's `warmstart.dev/status` annotation, JSON such as
    {"restoreSeconds": 2.1, "at": "...Z"}; a report that does not parse is skipped. A cold start is what the
    kubelet recorded: from the worker container's start to the pod's Ready condition, for a pod that started
    cold (role `cold`, or a restore pod the agent reports `restoreFailed` for), to within the readiness
    probe's period. "Newest" is by the report's time, or the moment the pod turned Ready.
    """
    found: dict[str, tuple[dt.datetime, float]] = {}
    for pod in pods:
        for field, (stamp, seconds) in _pod_timings(pod).items():
            if field not in found or stamp > found[field][0]:
                found[field] = (stamp, seconds)
    return {field: value for field, (_, value) in found.items()}


def _pod_timings(pod: dict[str, Any]) -> dict[str, tuple[dt.datetime, float]]:
    meta = pod.get("metadata") or {}
    report = _status_report(meta)
    stamp = _report_time(report.get("at"), meta.get("creationTimestamp"))
    timings = {}
    for key, field in REPORTED_TIMINGS:
        value = report.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            timings[field] = (stamp, float(value))
    if COLD_START not in timings and _started_cold(meta, report):
        measured = _start_to_ready(pod.get("status") or {})
        if measured is not None:
            timings[COLD_START] = measured
    return timings


def _status_report(meta: dict[str, Any]) -> dict[str, Any]:
    """The pod's `warmstart.dev/status` annotation; empty when it is missing or not a JSON object."""
    raw = (meta.get("annotations") or {}).get(L.STATUS_ANNOTATION)
    try:
        report = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return report if isinstance(report, dict) else {}


def _started_cold(meta: dict[str, Any], report: dict[str, Any]) -> bool:
    role = (meta.get("labels") or {}).get(L.ROLE_LABEL)
    return role == L.ROLE_COLD or (role == L.ROLE_RESTORE and "restoreFailed" in report)


def _start_to_ready(status: dict[str, Any]) -> tuple[dt.datetime, float] | None:
    """(when the pod turned Ready, seconds from its worker container's start to then); None unless the pod
    is Ready and turned Ready as it started."""
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    containers = status.get("containerStatuses") or []
    worker = next((c for c in containers if c.get("name") == L.WORKER_CONTAINER), {})
    if ready.get("status") != "True":
        return None
    started = _report_time(((worker.get("state") or {}).get("running") or {}).get("startedAt"))
    became_ready = _report_time(ready.get("lastTransitionTime"))
    if UNDATED in (started, became_ready):
        return None
    seconds = (became_ready - started).total_seconds()
    return (became_ready, seconds) if 0 <= seconds <= COLD_START_LIMIT_SECONDS else None


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
    request_hash: str,
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
        "requestKeyHash": request_hash,
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


def failure_status(
    generation: int, reason: str, message: str, previous: dict[str, Any], now: dt.datetime
) -> dict[str, Any]:
    """Status for a reconcile that could not write a child: Degraded, not Progressing, with the reason; the
    other conditions and fields keep what the last good reconcile saw."""
    before = previous.get("conditions") or []
    replaced = {
        DEGRADED: condition(DEGRADED, True, reason, message, generation, before, now),
        PROGRESSING: condition(PROGRESSING, False, reason, message, generation, before, now),
    }
    conditions = [replaced.pop(c.get("type"), c) for c in before]
    conditions += replaced.values()
    return {"phase": "Degraded", "observedGeneration": generation, "conditions": conditions}


def reports(status: dict[str, Any], kind: str, reason: str, message: str) -> bool:
    """Whether `status` already carries condition `kind` True with this reason and message."""
    for cond in status.get("conditions") or []:
        if cond.get("type") == kind:
            return (cond.get("status"), cond.get("reason"), cond.get("message")) == ("True", reason, message)
    return False
