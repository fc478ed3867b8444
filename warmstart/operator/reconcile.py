"""One reconcile of an InferenceEndpoint: read state, apply children, drive snapshots, write status.

Idempotent: every write is a server-side apply or a create that tolerates "already exists", so running
it twice, concurrently with a restart, or after a child was edited by hand converges to the same state.
Nothing is written that would not change: a child only when the server's copy differs from it (`unchanged`),
the status only when one of its fields changed.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from warmstart.api import labels as L
from warmstart.api.endpoint import EndpointSpec, EndpointStatus
from warmstart.api.snapshot import OPERATOR, SnapshotStatus, status_patch
from warmstart.host.clock import parse_time, utc_now
from warmstart.kube.client import Kube, KubeError, TransientKubeError
from warmstart.kube.events import record_event
from warmstart.operator import children, diagnosis, rollout, unchanged
from warmstart.operator.backoff import Backoff
from warmstart.operator.diagnosis import AgentLookup
from warmstart.operator.observe import observe_pods, worker_pods
from warmstart.operator.placement import preferred_node, restore_node
from warmstart.operator.request_key import request_key, request_key_hash
from warmstart.operator.snapshots import CAPTURE_STARTED, SnapshotPlan, plan_snapshots
from warmstart.operator.spec import InvalidSpec, parse_spec
from warmstart.operator.status import (
    DEGRADED,
    INVALID_SPEC,
    PROGRESSING,
    READY,
    SNAPSHOT_READY,
    Workload,
    condition_of,
    degraded_status,
    endpoint_status,
    reported_invalid,
)

log = logging.getLogger(__name__)

AUTOSCALER_KINDS = {"hpa": "HorizontalPodAutoscaler", "keda": "ScaledObject", "http": "HTTPScaledObject"}
OPTIONAL_CHILDREN = {  # the kinds beyond Deployment and Service, and their builders
    "HorizontalPodAutoscaler": children.horizontal_pod_autoscaler,
    "ScaledObject": children.scaled_object,
    "HTTPScaledObject": children.http_scaled_object,
    "ServiceMonitor": children.service_monitor,
    "DaemonSet": children.prestage_daemonset,  # the model files' stager
}
# Kinds only an add-on serves: what to do in a cluster without it (MissingAPI).
MISSING_API_HINTS = {
    "ScaledObject": "install KEDA or use autoscaling.mode hpa",
    "HTTPScaledObject": "install the KEDA HTTP add-on or use autoscaling.mode keda",
    "ServiceMonitor": "install prometheus-operator or set monitoring.serviceMonitor false",
}
# In mode http the add-on makes a ScaledObject named after its HTTPScaledObject, i.e. after the endpoint:
# the operator deletes one only when its own record says it made it (a switch from mode keda).
ADD_ON_KINDS = {"http": ("ScaledObject",)}


APPLY_FAILED = "ApplyFailed"


class MissingAPI(RuntimeError):
    """A kind the spec asks for is not served by this cluster (e.g. KEDA or prometheus-operator absent)."""


class ChildApplyFailed(KubeError):
    """The API server refused a child of the endpoint (admission, quota, an immutable field, ...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.message = message


_UNREAD: dict[str, Any] = {}


def apply_child(kube: Kube, obj: dict[str, Any], current: dict[str, Any] | None = _UNREAD) -> dict[str, Any]:
    """Server-side apply of a child, unless the server's copy (`current`, read here when not given) already
    is what would be applied: an endpoint at rest costs no write. A refusal names the child (transient
    errors pass through)."""
    meta = obj["metadata"]
    applied = unchanged.stamped(obj)
    if current is _UNREAD:
        current = kube.get(obj["kind"], meta["namespace"], meta["name"])
    if unchanged.held(current, applied):
        return current
    try:
        return kube.apply(applied)
    except TransientKubeError:
        raise
    except KubeError as exc:
        child = f"{obj['kind']} {meta['namespace']}/{meta['name']}"
        raise ChildApplyFailed(exc.status, f"{child}: {exc}") from exc


def post_event(kube: Kube, involved: dict[str, Any], kind: str, reason: str, message: str) -> None:
    """An Event of type `kind` on `involved` (an object with its apiVersion and kind); best effort."""
    record_event(kube, involved, involved["kind"], kind, reason, message, component=L.FIELD_MANAGER)


def optional_children(spec: EndpointSpec) -> list[str]:
    """Kinds beyond Deployment and Service that this spec asks for."""
    kinds = [AUTOSCALER_KINDS[spec.autoscaling.mode]] if spec.autoscaling.mode in AUTOSCALER_KINDS else []
    if spec.monitoring.service_monitor:
        kinds.append("ServiceMonitor")
    if spec.snapshot.enabled and spec.snapshot.prestage == "PageCache":
        kinds.append("DaemonSet")
    return kinds


def unwanted_children(spec: EndpointSpec, previous: list[str] | None) -> list[str]:
    """Optional kinds to delete: not wanted, and made by the operator (`previous` None: maybe made)."""
    wanted = optional_children(spec)
    add_on_kinds = ADD_ON_KINDS.get(spec.autoscaling.mode, ())
    return [
        kind
        for kind in OPTIONAL_CHILDREN
        if kind not in wanted
        and (kind in (previous or []) or (previous is None and kind not in add_on_kinds))
    ]


def apply_optional_children(
    kube: Kube, owner: children.Owner, spec: EndpointSpec, previous: list[str] | None
) -> list[str]:
    """Apply the autoscaler, ServiceMonitor and model stager the spec wants, delete those it no longer wants.

    `previous` is what the last reconcile recorded in status.children (None: unknown, so check them all but
    the add-on's); returns the kinds that exist now, Deployment and Service included.
    """
    wanted = optional_children(spec)
    for kind in unwanted_children(spec, previous):
        kube.delete(kind, owner.namespace, owner.name)
    for kind in wanted:
        obj = OPTIONAL_CHILDREN[kind](owner, spec)
        try:
            apply_child(kube, obj)
        except ChildApplyFailed as exc:
            if kind in MISSING_API_HINTS and exc.status == 404:
                hint = MISSING_API_HINTS[kind]
                raise MissingAPI(f"{obj['apiVersion']} {kind} is not served by this cluster: {hint}") from exc
            raise
    return ["Deployment", "Service", *wanted]


def _capture_pods(kube: Kube, endpoint: children.Owner) -> list[dict[str, Any]]:
    selector = {L.ENDPOINT_LABEL: endpoint.name, L.COMPONENT_LABEL: L.CAPTURE_COMPONENT}
    return kube.list("Pod", endpoint.namespace, selector)


def capture_pod_failures(
    snapshots: list[dict[str, Any]], pods: list[dict[str, Any]], timeout: float, now: dt.datetime
) -> dict[str, str]:
    """Snapshot name -> why the capture pod of its current attempt failed: it ended without a capture
    (died, or its activeDeadlineSeconds passed), or it is older than `timeout` seconds (e.g. it never
    got scheduled, so no kubelet ever enforces its deadline).

    The agent reports only on pods it can see running; these failures only the operator can see.
    """
    by_name = {pod["metadata"]["name"]: pod for pod in pods}
    failures = {}
    for snap in snapshots:
        status = SnapshotStatus.of(snap)
        pod = by_name.get(children.capture_pod_name(snap["metadata"]["name"], status.attempt))
        if pod is None or status.captured:
            continue
        if (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
            failures[snap["metadata"]["name"]] = _why_pod_ended(pod)
        elif _age_seconds(pod, now) > timeout:
            failures[snap["metadata"]["name"]] = _why_pod_is_late(pod, timeout)
    return failures


def _age_seconds(pod: dict[str, Any], now: dt.datetime) -> float:
    created = pod["metadata"].get("creationTimestamp")
    return (now - parse_time(created)).total_seconds() if created else 0.0


def _why_pod_is_late(pod: dict[str, Any], timeout: float) -> str:
    status = pod.get("status") or {}
    waiting = [
        f"{c.get('type')}: {c.get('message')}" for c in status.get("conditions") or [] if c.get("message")
    ]
    detail = f" ({'; '.join(waiting)})" if waiting else ""
    name, phase = pod["metadata"]["name"], status.get("phase")
    return f"capture pod {name} not done within {timeout:.0f}s, still {phase}{detail}"


def _why_pod_ended(pod: dict[str, Any]) -> str:
    status = pod.get("status") or {}
    words = [f"capture pod {pod['metadata']['name']} ended ({status.get('phase')})"]
    if status.get("reason") or status.get("message"):
        words.append(f"{status.get('reason', '')}: {status.get('message', '')}".strip(": "))
    for container in status.get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated") or {}
        if terminated:
            words.append(
                f"{container['name']} exited {terminated.get('exitCode')} {terminated.get('reason', '')}"
            )
    return "; ".join(words) + " before the node agent captured it"


def sync_snapshots(
    kube: Kube, endpoint: children.Owner, spec: EndpointSpec, plan: SnapshotPlan, request_hash: str
) -> None:
    """Carry out the plan: create/retry/delete InferenceSnapshots and keep exactly the right capture pod.

    A snapshot the plan creates but that already exists was made since the plan's list was read (a
    concurrent reconcile): its status and capture pod are left alone; the next reconcile sees it.
    """
    ns = endpoint.namespace
    created = kube.create(plan.create) if plan.create is not None else None
    stale = plan.create["metadata"]["name"] if plan.create is not None and created is None else ""
    if stale:
        log.info("InferenceSnapshot %s/%s already exists: not touching its status or capture pod", ns, stale)
        plan.events = [event for event in plan.events if event[1] != CAPTURE_STARTED]  # nothing was created
    for name, patch in plan.status_patches.items():
        if name != stale:
            kube.patch_status(L.SNAPSHOT_KIND, ns, name, patch)
    for name in plan.delete:
        kube.delete(L.SNAPSHOT_KIND, ns, name)
    if stale:
        return
    wanted = children.capture_pod_name(plan.active, plan.capture_attempt) if plan.capture_attempt else ""
    existing = {p["metadata"]["name"] for p in _capture_pods(kube, endpoint)}
    for name in existing - {wanted}:
        kube.delete("Pod", ns, name)
    if wanted and wanted not in existing:
        snapshot = created or kube.get(L.SNAPSHOT_KIND, ns, plan.active)
        if snapshot is None:
            return  # created a moment ago and already gone: next reconcile decides again
        owner = children.Owner.from_body(snapshot)
        # The status names the pod before it exists: a node agent handles a capture pod once, as soon as it
        # sees it bound, and passes over one that `capturePod` does not name (an earlier attempt's), so a
        # retry's pod created first could be read against the previous attempt's name and never captured.
        kube.patch_status(L.SNAPSHOT_KIND, ns, plan.active, status_patch(OPERATOR, capture_pod=wanted))
        kube.create(children.capture_pod(owner, endpoint.name, spec, plan.capture_attempt, request_hash))


def reconcile(
    kube: Kube, body: dict[str, Any], backoff: Backoff, agents: AgentLookup | None, snapshot_store: str
) -> tuple[EndpointStatus, SnapshotPlan]:
    """Reconcile one endpoint: (its status, the snapshot plan carried out). Raises InvalidSpec (permanent,
    reported once per generation), MissingAPI, ChildApplyFailed (a child the API server refused, reported
    in status and by a Warning Event) or KubeError. `agents`: where the node agents run, to check that
    capture and restore pods have one; `snapshot_store`: the kind of store they keep snapshots in
    (placement)."""
    meta = body["metadata"]
    owner = children.Owner.from_body(body)
    generation = int(meta.get("generation") or 0)
    previous = EndpointStatus.model_validate(body.get("status") or {})
    now = utc_now()
    try:
        spec = parse_spec(body.get("spec") or {})
    except InvalidSpec as exc:
        report_invalid_spec(kube, body, exc, now)
        raise
    key = request_key(spec)
    request_hash = request_key_hash(key)
    # Capture pods before snapshots: the agent reports a snapshot captured before its pod ends, so a pod seen
    # ended is never judged against a snapshot read before that report (an attempt wrongly counted failed).
    capture_pods, snapshots = [], []
    if spec.snapshot.enabled:
        capture_pods = _capture_pods(kube, owner)
        snapshots = kube.list(L.SNAPSHOT_KIND, owner.namespace, {L.ENDPOINT_LABEL: owner.name})
    pod_failures = capture_pod_failures(snapshots, capture_pods, spec.snapshot.capture_timeout_seconds, now)
    workers = worker_pods(kube, owner)
    changes = diagnosis.facts_changes(workers)
    plan = plan_snapshots(owner, spec, request_hash, key, snapshots, now, backoff, pod_failures, changes)
    current = kube.get("Deployment", owner.namespace, owner.name)
    role, snapshot = worker_template(spec, plan, current, request_hash)
    node = worker_node((role, snapshot), plan, current, snapshot_store)
    strategy = rollout.rolling_update(current, workers)
    wanted = children.deployment(owner, spec, role, snapshot, request_hash, node, strategy)
    missing: MissingAPI | None = None  # a kind the cluster does not serve: reported in status, then retried
    try:
        if spec.snapshot.enabled:
            sync_snapshots(kube, owner, spec, plan, request_hash)
        deployment = apply_child(kube, wanted, current)
        apply_child(kube, children.service(owner, spec))
        # A fresh endpoint (no status) owns nothing to clean up; an old status without the record: check all.
        recorded = previous.children if previous.model_fields_set else []
        try:
            existing = apply_optional_children(kube, owner, spec, recorded)
        except MissingAPI as exc:
            existing, missing = ["Deployment", "Service"], exc
    except TransientKubeError:
        raise  # the API server is away: nothing to report to, the caller retries
    except KubeError as exc:
        message = exc.message if isinstance(exc, ChildApplyFailed) else str(exc)
        report_failure(kube, body, APPLY_FAILED, message, now)
        raise ChildApplyFailed(exc.status, message) from exc
    worker_causes, capture_causes = observe_pods(
        kube, owner, workers, current_capture_pods(plan, capture_pods), agents
    )
    waiting = rollout.waiting_for_room(deployment, workers)
    status = endpoint_status(
        generation=generation,
        snapshots_enabled=spec.snapshot.enabled,
        plan=plan,
        work=Workload.from_deployment(spec.replicas, deployment),
        selector=children.selector_string(owner.name),
        request_hash=request_hash,
        pods=workers,
        previous=previous,
        now=now,
        children=existing,
        missing_api=str(missing or ""),
        worker_causes=[
            *(cause for cause in worker_causes if not (cause.pods and set(cause.pods) <= waiting)),
            *diagnosis.deployment_causes(deployment),
        ],
        capture_causes=capture_causes,
        worker_role=role,
        kept_snapshot=snapshot if snapshot != plan.ready else "",
    )
    events = transition_events(plan, previous, status, missing)
    if any(getattr(previous, name) != getattr(status, name) for name in status.model_fields_set):
        write_status(kube, meta, status)
    for kind, reason, message in events:
        post_event(kube, body, kind, reason, message)
    if missing is not None:
        raise missing
    return status, plan


def worker_template(
    spec: EndpointSpec, plan: SnapshotPlan, deployment: dict[str, Any] | None, request_hash: str
) -> tuple[str, str]:
    """(role, snapshot) of the worker pods' template. A Ready snapshot: restore from it. None Ready (the
    one in use was deleted or went Invalid) while the template restores from a snapshot of this very
    request key: keep that template until another snapshot is Ready, so serving replicas are rolled once
    (onto the new snapshot) and not twice (cold, then restore); new pods meanwhile are refused by the
    agent and cold-start. Anything else: cold."""
    if plan.role == L.ROLE_RESTORE:
        return L.ROLE_RESTORE, plan.ready
    template = ((deployment or {}).get("spec") or {}).get("template") or {}
    labels = (template.get("metadata") or {}).get("labels") or {}
    kept = labels.get(L.SNAPSHOT_LABEL, "")
    same_key = labels.get(L.REQUEST_KEY_LABEL) == L.request_key_label(request_hash)
    if spec.snapshot.enabled and kept and same_key and labels.get(L.ROLE_LABEL) == L.ROLE_RESTORE:
        return L.ROLE_RESTORE, kept
    return L.ROLE_COLD, ""


def worker_node(
    template: tuple[str, str], plan: SnapshotPlan, deployment: dict[str, Any] | None, snapshot_store: str
) -> str:
    """The node the worker pods of `template` (role, snapshot) prefer: the one holding their snapshot,
    where only it does (`placement`). A kept template (see `worker_template`) keeps the node it prefers,
    so that keeping it rolls no pod."""
    role, snapshot = template
    if role != L.ROLE_RESTORE:
        return ""
    if snapshot == plan.ready:
        return restore_node(snapshot_store, plan.ready_node)
    pod = (((deployment or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
    return restore_node(snapshot_store, preferred_node(pod))


def current_capture_pods(plan: SnapshotPlan, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The capture pod of the attempt under way (older attempts' pods are being deleted)."""
    if not plan.capture_attempt:
        return []
    wanted = children.capture_pod_name(plan.active, plan.capture_attempt)
    return [pod for pod in pods if pod["metadata"]["name"] == wanted]


def write_status(kube: Kube, meta: dict[str, Any], status: EndpointStatus) -> None:
    """A merge patch of the fields `status` sets: a field set to None is cleared, one not set is kept."""
    patch = status.model_dump(by_alias=True, exclude_unset=True)
    kube.patch_status(L.ENDPOINT_KIND, meta["namespace"], meta["name"], patch)


def report_invalid_spec(kube: Kube, body: dict[str, Any], error: InvalidSpec, now: dt.datetime) -> None:
    """Degraded/InvalidSpec naming every problem, one Warning Event and one log line per generation of the
    spec: the resync finds it reported and stays quiet until the spec changes."""
    meta = body["metadata"]
    generation = int(meta.get("generation") or 0)
    previous = EndpointStatus.model_validate(body.get("status") or {})
    if reported_invalid(previous, generation):
        return
    count = len(error.problems)
    message = f"{count} problem{'s' if count > 1 else ''} in the spec: {error}"
    write_status(kube, meta, degraded_status(generation, INVALID_SPEC, message, previous, now, READY))
    post_event(kube, body, "Warning", INVALID_SPEC, message)
    log.warning(
        "%s/%s: generation %d not reconciled: %s", meta["namespace"], meta["name"], generation, message
    )


def report_failure(kube: Kube, body: dict[str, Any], reason: str, message: str, now: dt.datetime) -> None:
    """Degraded with the reason in status, and a Warning Event when that is news; best effort (the caller
    is retrying anyway), so a failure to report is logged, not raised."""
    meta = body["metadata"]
    previous = EndpointStatus.model_validate(body.get("status") or {})
    degraded = condition_of(previous, DEGRADED)
    if (degraded.status, degraded.reason, degraded.message) == ("True", reason, message):
        return  # reported already
    generation = int(meta.get("generation") or 0)
    try:
        write_status(kube, meta, degraded_status(generation, reason, message, previous, now, PROGRESSING))
    except KubeError as exc:
        log.warning("%s/%s: status not updated with %s: %s", meta["namespace"], meta["name"], reason, exc)
    post_event(kube, body, "Warning", reason, message)


def transition_events(
    plan: SnapshotPlan, previous: EndpointStatus, status: EndpointStatus, missing: MissingAPI | None
) -> list[tuple[str, str, str]]:
    """Events worth a line in `kubectl describe`: snapshot steps, the switch to restores, phase changes."""
    events = list(plan.events)
    if plan.ready and previous.current_snapshot != plan.ready:
        events.append(("Normal", "RestoreEnabled", f"new replicas restore from snapshot {plan.ready}"))
    if previous.phase != status.phase:
        events.append(("Normal", "PhaseChanged", f"phase {previous.phase} -> {status.phase}"))
        if missing is not None:
            events.append(("Warning", "MissingAPI", str(missing)))
    return events + cause_events(previous, status)


def cause_events(previous: EndpointStatus, status: EndpointStatus) -> list[tuple[str, str, str]]:
    """A Warning Event for each cause that is news: Degraded or SnapshotReady newly explained by one (a
    cause that stays, however its message changes, is not reported again)."""
    events: list[tuple[str, str, str]] = []
    for cond in status.conditions or []:
        if cond.type not in (DEGRADED, SNAPSHOT_READY) or cond.reason not in diagnosis.REASONS:
            continue
        was = condition_of(previous, cond.type)
        if (was.status, was.reason) == (cond.status, cond.reason):
            continue
        if not any(event[1] == cond.reason and cond.message in event[2] for event in events):
            events.append(("Warning", cond.reason, cond.message))
    return events
