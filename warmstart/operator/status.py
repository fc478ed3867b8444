"""InferenceEndpoint status: phase and conditions per the Kubernetes API conventions."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from warmstart.api import labels as L
from warmstart.api.endpoint import EndpointStatus
from warmstart.api.schema import Condition
from warmstart.api.snapshot import Phase
from warmstart.host.clock import format_time, parse_time
from warmstart.operator.children.workers import START_TIMEOUT_SECONDS
from warmstart.operator.diagnosis import RESTORE_REFUSED, Cause, agent_report, is_ready, is_terminating
from warmstart.operator.snapshots import SnapshotPlan

READY, SNAPSHOT_READY, PROGRESSING, DEGRADED = "Ready", "SnapshotReady", "Progressing", "Degraded"
INVALID_SPEC = "InvalidSpec"
UNDATED = dt.datetime.min.replace(tzinfo=dt.UTC)  # a report without a readable time: older than any other
COLD_START = "last_cold_start_seconds"
REPORTED_TIMINGS = (("restoreSeconds", "last_restore_seconds"), ("coldStartSeconds", COLD_START))
# A worker not serving by then is restarted by its liveness probe, so a pod that turns Ready later than this
# after its container started turned Ready *again* (its readiness probe failed for a while): not a start.
COLD_START_LIMIT_SECONDS = START_TIMEOUT_SECONDS + 60


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


def condition_of(status: EndpointStatus, kind: str) -> Condition:
    """Condition `kind` of `status`; one it lacks is Unknown."""
    return next(
        (c for c in status.conditions or [] if c.type == kind), Condition(type=kind, status="Unknown")
    )


def condition(
    kind: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int,
    previous: EndpointStatus,
    now: dt.datetime,
) -> Condition:
    """A condition whose lastTransitionTime moves only when its status changes."""
    status = "True" if ok else "False"
    before = condition_of(previous, kind)
    return Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=before.last_transition_time if before.status == status else format_time(now),
        observed_generation=generation,
    )


MESSAGE_LIMIT = 1024


def _bounded(text: str) -> str:
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."


def _joined(causes: Sequence[Cause]) -> str:
    return _bounded("; ".join(cause.message for cause in causes))


def _ready(work: Workload, worker_causes: Sequence[Cause]) -> tuple[bool, str, str]:
    """True while at least one replica serves: a scale-up or a rollout beside serving replicas keeps it."""
    summary = f"{work.ready}/{work.desired} replicas ready"
    if work.desired == 0:
        return False, "ScaledToZero", "0 replicas requested: nothing serves until the endpoint scales up"
    if work.ready > 0:
        return True, "ReplicasReady", summary
    if worker_causes:
        return False, worker_causes[0].reason, _joined(worker_causes)
    return False, "ReplicasNotReady", f"{summary}: starting"


def _snapshot_ready(
    enabled: bool,
    plan: SnapshotPlan,
    capture_causes: Sequence[Cause],
    kept: str,
    refused: Sequence[Cause] = (),
) -> tuple[bool, str, str]:
    if not enabled:
        return False, "SnapshotsDisabled", "snapshot.enabled is false: every replica cold-starts"
    if plan.ready:
        but = f"; {_joined(refused)}" if refused else ""
        return True, "SnapshotReady", _bounded(f"replicas restore from {plan.ready}{but}")
    meanwhile = (
        f"; serving replicas keep their template (it names {kept}, no longer Ready), new ones cold-start"
        if kept
        else "; replicas cold-start"
    )
    if plan.exhausted:
        return (
            False,
            "CaptureFailed",
            f"{plan.active} failed {plan.attempts} times ({plan.failure_message}){meanwhile}",
        )
    if plan.active_phase == Phase.FAILED:
        return False, "CaptureRetryPending", f"{plan.active} failed ({plan.failure_message}); retry scheduled"
    if capture_causes:
        return False, capture_causes[0].reason, _bounded(_joined(capture_causes) + meanwhile)
    stale, reason, why = plan.retired
    if stale:  # what the pods hold changed since it was taken: e.g. ModelChanged
        capturing = f"capturing {plan.active} (attempt {plan.attempts}) for what the pods hold now"
        return False, reason, _bounded(f"{stale} is Stale ({why}); {capturing}{meanwhile}")
    return False, "Capturing", f"capturing {plan.active} (attempt {plan.attempts}){meanwhile}"


def _progressing(work: Workload, plan: SnapshotPlan) -> tuple[bool, str, str]:
    if work.replicas > work.desired:
        return True, "ScalingDown", f"{work.replicas} -> {work.desired} replicas"
    if work.updated < work.replicas:
        return True, "RollingOut", f"{work.updated}/{work.desired} replicas updated"
    if work.ready < work.desired:
        return True, "ScalingUp", f"{work.ready}/{work.desired} replicas ready"
    if plan.capture_attempt:
        return True, "Capturing", f"capturing {plan.active} (attempt {plan.attempts})"
    return False, "Stable", f"{work.ready}/{work.desired} replicas ready and up to date"


def _degraded(plan: SnapshotPlan, missing_api: str, causes: Sequence[Cause]) -> tuple[bool, str, str]:
    if missing_api:
        return True, "MissingAPI", missing_api
    if causes:
        return True, causes[0].reason, _joined(causes)
    if plan.exhausted:
        return True, "CaptureFailed", f"snapshot capture gave up after {plan.attempts} attempts"
    return False, "AsExpected", "no problem found in the endpoint's pods, snapshots and children"


def phase(verdicts: dict[str, tuple[bool, str, str]], desired: int, capturing: bool) -> tuple[str, str]:
    """The phase, and the condition whose reason and message explain it (status.reason and status.message);
    a Ready endpoint that is still scaling or rolling out is explained by Progressing."""
    if verdicts[DEGRADED][0]:
        return "Degraded", DEGRADED
    if desired == 0:
        return "ScaledToZero", READY
    if verdicts[READY][0]:
        return "Ready", PROGRESSING if verdicts[PROGRESSING][0] else READY
    return ("Capturing", SNAPSHOT_READY) if capturing else ("Pending", READY)


def last_timings(pods: list[dict[str, Any]]) -> dict[str, float]:
    """The newest restore and cold-start durations of the endpoint's pods, by their status fields' names.

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
    report = agent_report(pod)
    stamp = _report_time(report.get("at"), meta.get("creationTimestamp"))
    timings = {}
    for key, field in REPORTED_TIMINGS:
        value = report.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            timings[field] = (stamp, float(value))
    role = (meta.get("labels") or {}).get(L.ROLE_LABEL)
    started_cold = role == L.ROLE_COLD or (role == L.ROLE_RESTORE and "restoreFailed" in report)
    if COLD_START not in timings and started_cold:
        measured = _start_to_ready(pod.get("status") or {})
        if measured is not None:
            timings[COLD_START] = measured
    return timings


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


def restored_replicas(pods: list[dict[str, Any]]) -> int:
    """Ready worker pods a node agent restored (it reported the restore's seconds, no refusal)."""
    count = 0
    for pod in pods:
        meta = pod.get("metadata") or {}
        report = agent_report(pod)
        role = (meta.get("labels") or {}).get(L.ROLE_LABEL)
        restored = role == L.ROLE_RESTORE and "restoreSeconds" in report and "restoreFailed" not in report
        count += int(restored and is_ready(pod) and not is_terminating(pod))
    return count


def endpoint_status(
    *,
    generation: int,
    snapshots_enabled: bool,
    plan: SnapshotPlan,
    work: Workload,
    selector: str,
    request_hash: str,
    pods: list[dict[str, Any]],
    previous: EndpointStatus,
    now: dt.datetime,
    children: Sequence[str] = (),
    missing_api: str = "",
    worker_causes: Sequence[Cause] = (),
    capture_causes: Sequence[Cause] = (),
    worker_role: str = "",
    kept_snapshot: str = "",
) -> EndpointStatus:
    """The endpoint's status from what the reconcile saw (a timing no pod reports is left as it is).
    `children`: the kinds it owns; `worker_causes`/`capture_causes`: why worker or capture pods do not
    progress; `worker_role`: the role the Deployment's template runs (default the plan's); `kept_snapshot`:
    the snapshot the template still names while no snapshot is Ready."""
    refused = [cause for cause in worker_causes if cause.reason == RESTORE_REFUSED]
    verdicts = {
        READY: _ready(work, worker_causes),
        SNAPSHOT_READY: _snapshot_ready(snapshots_enabled, plan, capture_causes, kept_snapshot, refused),
        PROGRESSING: _progressing(work, plan),
        DEGRADED: _degraded(plan, missing_api, [*worker_causes, *capture_causes]),
    }
    phase_name, explained_by = phase(verdicts, work.desired, bool(plan.capture_attempt))
    _, reason, message = verdicts[explained_by]
    return EndpointStatus(
        phase=phase_name,
        reason=reason,
        message=message,
        observed_generation=generation,
        replicas=work.replicas,
        ready_replicas=work.ready,
        ready=f"{work.ready}/{work.desired}",
        restored_replicas=restored_replicas(pods),
        selector=selector,
        request_key_hash=request_hash,
        current_snapshot=plan.ready or None,
        worker_role=worker_role or plan.role,
        capture_attempts=plan.attempts if plan.active else None,
        children=list(children),
        conditions=[
            condition(kind, *verdict, generation, previous, now) for kind, verdict in verdicts.items()
        ],
        **last_timings(pods),
    )


def degraded_status(
    generation: int, reason: str, message: str, previous: EndpointStatus, now: dt.datetime, off: str
) -> EndpointStatus:
    """Degraded and condition `off` False, both with `reason` and `message`, in place of (or beside) the
    previous ones; the other conditions and fields keep what the last good reconcile saw. For a spec the
    operator cannot reconcile (InvalidSpec, naming the field), `off` is Ready; for a reconcile that could
    not write a child, Progressing."""
    replaced = {
        DEGRADED: condition(DEGRADED, True, reason, message, generation, previous, now),
        off: condition(off, False, reason, message, generation, previous, now),
    }
    conditions = [replaced.pop(c.type, c) for c in previous.conditions or []]
    conditions += replaced.values()
    return EndpointStatus(
        phase="Degraded",
        reason=reason,
        message=message,
        observed_generation=generation,
        conditions=conditions,
    )


def reported_invalid(status: EndpointStatus, generation: int) -> bool:
    """Whether `status` already says that this generation of the spec is invalid."""
    cond = condition_of(status, DEGRADED)
    return (cond.status, cond.reason, cond.observed_generation) == ("True", INVALID_SPEC, generation)
