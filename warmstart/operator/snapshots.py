"""Snapshot lifecycle decisions: pure functions over the endpoint's InferenceSnapshots.

Per request key at most one snapshot is *active*: the newest Ready one is used for restores; otherwise
the one being captured (Pending, Capturing, or Failed awaiting a retry). Invalid snapshots are never used
again: a fresh capture gets a new name. A restore pod refused because its model or engine changed since
the capture retires the snapshot it was refused (Stale, with every snapshot of its key taken before it)
and a fresh capture follows, once per change of the pods' facts. Retention keeps the newest N, never the
active one.
"""

from __future__ import annotations

import datetime as dt
import itertools
from dataclasses import dataclass, field
from typing import Any

from warmstart.api import labels as L
from warmstart.api.endpoint import EndpointSpec
from warmstart.api.snapshot import (
    IN_PROGRESS,
    OPERATOR,
    Phase,
    SnapshotSpec,
    SnapshotStatus,
    derive_phase,
    status_patch,
)
from warmstart.host.clock import format_time, parse_time
from warmstart.operator.backoff import CAPTURE_BACKOFF, Backoff
from warmstart.operator.children import Owner, common_labels
from warmstart.operator.diagnosis import PodsChanged

NAME_HASH_CHARS = 10
CAPTURE_STARTED = "CaptureStarted"  # the event reason of a planned snapshot create


@dataclass
class SnapshotPlan:
    role: str  # cold | restore: what the Deployment's workers do
    ready: str = ""  # the Ready snapshot restores use
    ready_node: str = ""  # the node that captured it (its store holds it)
    active: str = ""  # the snapshot being captured (or retried) for the current request key
    active_phase: str = ""
    attempts: int = 0
    exhausted: bool = False  # capture failed maxCaptureAttempts times; serving stays cold
    failure_message: str = ""
    create: dict[str, Any] | None = None
    status_patches: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> status merge patch
    capture_attempt: int = 0  # > 0: a capture pod for (active, attempt) must exist
    delete: list[str] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    retired: tuple[str, str, str] = ("", "", "")  # (Stale snapshot, reason, message) the capture replaces


def phase_of(snapshot: dict[str, Any]) -> str:
    return SnapshotStatus.of(snapshot).phase


def _name(snapshot: dict[str, Any]) -> str:
    return snapshot["metadata"]["name"]


def _created(snapshot: dict[str, Any]) -> str:
    return snapshot["metadata"].get("creationTimestamp") or ""


def snapshot_name(endpoint: str, request_hash: str, taken: set[str]) -> str:
    """`<endpoint>-<hash prefix>`, then `-1`, `-2`, ... while the name is taken (e.g. by an Invalid one)."""
    base = f"{endpoint}-{request_hash[:NAME_HASH_CHARS]}"
    candidates = itertools.chain([base], (f"{base}-{index}" for index in itertools.count(1)))
    return next(name for name in candidates if name not in taken)


def snapshot_body(
    endpoint: Owner, spec: EndpointSpec, name: str, request_hash: str, key: dict[str, Any]
) -> dict[str, Any]:
    labels = common_labels(endpoint.name, "snapshot")
    labels[L.REQUEST_KEY_LABEL] = L.request_key_label(request_hash)
    return {
        "apiVersion": L.API_VERSION,
        "kind": L.SNAPSHOT_KIND,
        "metadata": {
            "name": name,
            "namespace": endpoint.namespace,
            "labels": labels,
            "ownerReferences": [endpoint.reference()],
        },
        "spec": SnapshotSpec(
            endpoint=endpoint.name,
            request_key_hash=request_hash,
            request_key=key,
            signing_key_secret=spec.snapshot.signing_key_secret or None,
        ).model_dump(by_alias=True, exclude_none=True),
    }


def _plan_failed(
    plan: SnapshotPlan, snap: dict[str, Any], spec: EndpointSpec, backoff: Backoff, now: dt.datetime
) -> None:
    name, status = _name(snap), SnapshotStatus.of(snap)
    attempts = status.attempt
    plan.failure_message = status.message or status.reason or "capture failed"
    if attempts >= spec.snapshot.max_capture_attempts:
        plan.exhausted = True
        return
    if not status.retry_after:
        when = format_time(now + dt.timedelta(seconds=backoff.delay(attempts)))
        _patch(plan, name, retry_after=when)
        why = f"snapshot {name} attempt {attempts} failed ({plan.failure_message}); retrying at {when}"
        plan.events.append(("Warning", "CaptureFailed", why))
        return
    if parse_time(status.retry_after) <= now:
        plan.attempts = attempts + 1
        plan.active_phase = Phase.PENDING
        plan.capture_attempt = plan.attempts
        _patch(
            plan,
            name,
            phase=Phase.PENDING,
            attempts=plan.attempts,
            retry_after=None,
            reason="Retrying",
            message=f"capture attempt {plan.attempts}",
        )
        plan.events.append(("Normal", "CaptureRetry", f"snapshot {name}: capture attempt {plan.attempts}"))


def plan_snapshots(
    endpoint: Owner,
    spec: EndpointSpec,
    request_hash: str,
    key: dict[str, Any],
    snapshots: list[dict[str, Any]],
    now: dt.datetime,
    backoff: Backoff = CAPTURE_BACKOFF,
    capture_pod_failures: dict[str, str] | None = None,
    changes: list[PodsChanged] | None = None,
) -> SnapshotPlan:
    """Decide what to create, retry and delete, and which role the workers run.

    Each snapshot's phase is derived from what its agent reported and from `capture_pod_failures`
    (snapshot name -> why its current capture pod ended without a capture); a changed phase is patched.
    `changes`: restore pods refused because their model or engine changed (`diagnosis.facts_changes`).
    """
    if not spec.snapshot.enabled:
        return SnapshotPlan(role=L.ROLE_COLD)
    plan = SnapshotPlan(role=L.ROLE_COLD)
    failures = capture_pod_failures or {}
    snapshots = [_with_derived_phase(s, failures.get(_name(s), ""), plan) for s in snapshots]
    ordered = sorted(snapshots, key=lambda s: (_created(s), _name(s)), reverse=True)  # newest first
    mine = [s for s in ordered if (s.get("spec") or {}).get("requestKeyHash") == request_hash]
    mine = _retire_changed(plan, mine, changes or [])
    current = _after_stale(mine)
    ready = next((s for s in current if phase_of(s) == Phase.READY), None)
    if ready is not None:
        plan.role, plan.ready = L.ROLE_RESTORE, _name(ready)
        plan.ready_node = SnapshotStatus.of(ready).node or ""
    else:
        _plan_capture(plan, endpoint, spec, request_hash, key, current, ordered, now, backoff)
        if len(current) < len(mine) and all(_name(s) == plan.active for s in current):
            stale = SnapshotStatus.of(mine[len(current)])
            plan.retired = (_name(mine[len(current)]), stale.reason or "", stale.message or "")
    plan.delete = _retention(ordered, spec.snapshot.retention, keep={plan.ready, plan.active})
    return plan


def _plan_capture(
    plan: SnapshotPlan,
    endpoint: Owner,
    spec: EndpointSpec,
    request_hash: str,
    key: dict[str, Any],
    mine: list[dict[str, Any]],
    everything: list[dict[str, Any]],
    now: dt.datetime,
    backoff: Backoff,
) -> None:
    active = next((s for s in mine if phase_of(s) != Phase.INVALID), None)
    if active is None:
        name = snapshot_name(endpoint.name, request_hash, {_name(s) for s in everything})
        plan.create = snapshot_body(endpoint, spec, name, request_hash, key)
        plan.active, plan.active_phase, plan.attempts, plan.capture_attempt = name, Phase.PENDING, 1, 1
        plan.status_patches[name] = status_patch(OPERATOR, phase=Phase.PENDING, attempts=1)
        why = f"no Ready snapshot for request key {request_hash[:12]}: created {name} and a capture pod"
        plan.events.append(("Normal", CAPTURE_STARTED, why))
        return
    status = SnapshotStatus.of(active)
    plan.active, plan.active_phase, plan.attempts = _name(active), status.phase, status.attempt
    if plan.active_phase in IN_PROGRESS:
        plan.capture_attempt = plan.attempts
    elif plan.active_phase == Phase.FAILED:
        _plan_failed(plan, active, spec, backoff, now)


def _after_stale(mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The snapshots (newest first) taken after the newest Stale one: those before it were taken of what
    it was taken of, or of something older."""
    stale = next((i for i, s in enumerate(mine) if phase_of(s) == Phase.STALE), len(mine))
    return mine[:stale]


def _retire_changed(
    plan: SnapshotPlan, mine: list[dict[str, Any]], changes: list[PodsChanged]
) -> list[dict[str, Any]]:
    """`mine` with its Ready snapshot in use made Stale when a restore pod was refused it because the pod's
    model or engine changed since the capture, so that a capture of what the pods hold now follows.

    Once per change: not when the last snapshot retired was retired for the same facts of the pods (the
    capture that followed still differs from them, e.g. nodes that hold different models); the refused
    pods' cause in the endpoint's Degraded condition says so."""
    ready = next((s for s in _after_stale(mine) if phase_of(s) == Phase.READY), None)
    change = next((c for c in changes if ready is not None and c.snapshot == _name(ready)), None)
    if ready is None or change is None:
        return mine
    last = next((s for s in mine if phase_of(s) == Phase.STALE), None)
    if last is not None and SnapshotStatus.of(last).stale_facts_digest == change.facts_digest:
        return mine
    name, message = _name(ready), change.message[:1024]
    fields = {
        "phase": Phase.STALE, "reason": change.reason, "message": message,
        "stale_reason": change.reason, "stale_message": message, "stale_facts_digest": change.facts_digest,
    }  # fmt: skip
    _patch(plan, name, **fields)
    plan.events.append(("Normal", change.reason, f"snapshot {name} is Stale, capturing again: {message}"))
    status = {**ready["status"], **status_patch(OPERATOR, **fields)}
    return [{**s, "status": status} if s is ready else s for s in mine]


def _with_derived_phase(snap: dict[str, Any], capture_pod_failure: str, plan: SnapshotPlan) -> dict[str, Any]:
    """`snap` with the phase its status derives to (see `derive_phase`); a change is patched in `plan`."""
    status = SnapshotStatus.of(snap)
    phase, reason, message = derive_phase(status, capture_pod_failure)
    message = message[:1024]
    if (status.phase, status.reason, status.message) != (phase, reason, message):
        _patch(plan, _name(snap), phase=phase, reason=reason, message=message)
    derived = {**(snap.get("status") or {}), "phase": str(phase), "reason": reason, "message": message}
    return {**snap, "status": derived}


def _patch(plan: SnapshotPlan, name: str, **fields: Any) -> None:
    plan.status_patches.setdefault(name, {}).update(status_patch(OPERATOR, **fields))


def _retention(ordered: list[dict[str, Any]], retention: int, keep: set[str]) -> list[str]:
    """Names to delete: everything beyond the newest `retention`, sparing the snapshots in use."""
    keep = {name for name in keep if name}
    spared = max(0, retention - len(keep))
    return [name for name in map(_name, ordered) if name not in keep][spared:]
