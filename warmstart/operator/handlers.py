"""kopf handlers: InferenceEndpoint lifecycle, drift repair, and watches on children and snapshots.

Importing this module registers the handlers with kopf's default registry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from warmstart.api import labels as L
from warmstart.api.snapshot import Phase
from warmstart.config import env_float, env_int
from warmstart.operator.kube import Kube, KubeError, TransientKubeError
from warmstart.operator.metrics import METRICS
from warmstart.operator.reconcile import MissingAPI, Outcome, finalize, reconcile
from warmstart.operator.snapshots import Backoff
from warmstart.operator.spec import InvalidSpec
from warmstart.operator.workqueue import Key, KeyLocks, WorkQueue

log = logging.getLogger(__name__)

MANAGED = {"app.kubernetes.io/managed-by": L.FIELD_MANAGER}


@dataclass(frozen=True)
class OperatorSettings:
    resync_seconds: float
    capture_backoff_seconds: float
    workers: int

    def __post_init__(self) -> None:
        # Zero workers would leave every queued event unprocessed; a zero interval spins kopf's timer.
        for variable, value in (
            ("WARMSTART_OPERATOR_RESYNC_SECONDS", self.resync_seconds),
            ("WARMSTART_OPERATOR_CAPTURE_BACKOFF_SECONDS", self.capture_backoff_seconds),
            ("WARMSTART_OPERATOR_WORKERS", self.workers),
        ):
            if value <= 0:
                raise ValueError(f"{variable} must be above 0, got {value}")

    @classmethod
    def from_env(cls) -> OperatorSettings:
        return cls(
            resync_seconds=env_float("WARMSTART_OPERATOR_RESYNC_SECONDS", 60.0),
            capture_backoff_seconds=env_float("WARMSTART_OPERATOR_CAPTURE_BACKOFF_SECONDS", 30.0),
            workers=env_int("WARMSTART_OPERATOR_WORKERS", 4),
        )


SETTINGS = OperatorSettings.from_env()


class Runtime:
    """What the handlers share; set up in on_startup."""

    kube: Kube | None = None
    queue: WorkQueue | None = None
    locks = KeyLocks()
    backoff = Backoff(base_seconds=SETTINGS.capture_backoff_seconds)


def plain(value: Any) -> Any:
    """kopf's read-only body views -> plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def _kube() -> Kube:
    if Runtime.kube is None:
        Runtime.kube = Kube.from_environment()
    return Runtime.kube


def _requeue_delay(outcome: Outcome) -> float | None:
    """Come back for a Failed snapshot awaiting its retry; the resync timer covers everything else."""
    plan = outcome.plan
    if plan is not None and plan.active_phase == Phase.FAILED and not plan.exhausted:
        return max(1.0, Runtime.backoff.base_seconds / 4)
    return None


def run_reconcile(handler: str, key: Key) -> Outcome | None:
    """Reconcile one endpoint under its lock, from a fresh read (so status transitions are never computed
    from a stale copy), count it, and map failures to kopf's retry semantics. None: the endpoint is gone."""
    started = time.perf_counter()
    result = "error"
    try:
        with Runtime.locks.lock(key):
            body = _kube().get(L.ENDPOINT_KIND, *key)
            if body is None or body["metadata"].get("deletionTimestamp"):
                result = "gone"
                return None
            outcome = reconcile(_kube(), body, Runtime.backoff)
        METRICS.endpoints.set(*key, outcome.status["phase"])
        result = "success"
        delay = _requeue_delay(outcome)
        if delay is not None and Runtime.queue is not None:
            Runtime.queue.add_after(key, delay)
        return outcome
    except InvalidSpec as exc:
        result = "invalid"
        METRICS.endpoints.set(*key, "Degraded")
        raise kopf.PermanentError(str(exc)) from exc
    except MissingAPI as exc:
        raise kopf.TemporaryError(str(exc), delay=60) from exc
    except TransientKubeError as exc:
        raise kopf.TemporaryError(f"API server: {exc}", delay=5) from exc
    except KubeError as exc:  # e.g. a conflict with another writer; a fresh read usually fixes it
        raise kopf.TemporaryError(str(exc), delay=10) from exc
    finally:
        METRICS.observe(handler, result, time.perf_counter() - started)


def reconcile_key(key: Key) -> float | None:
    """Queue worker: reconcile the endpoint; returns a requeue delay."""
    try:
        run_reconcile("watch", key)
    except kopf.PermanentError:
        return None
    except kopf.TemporaryError as exc:
        return float(exc.delay or 10)
    return None  # run_reconcile already scheduled any follow-up


@kopf.on.startup()
def on_startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{L.GROUP}/finalizer"
    settings.posting.level = logging.WARNING  # handler logs stay in logs; our own Events carry the story
    settings.execution.max_workers = max(8, SETTINGS.workers * 2)
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 30
    Runtime.kube = Kube.from_environment()
    Runtime.queue = WorkQueue(reconcile_key, workers=SETTINGS.workers)
    Runtime.queue.start()


@kopf.on.cleanup()
def on_cleanup(**_: Any) -> None:
    if Runtime.queue is not None:
        Runtime.queue.stop()
        Runtime.queue = None


@kopf.on.resume(L.GROUP, L.VERSION, L.ENDPOINT_PLURAL)
@kopf.on.create(L.GROUP, L.VERSION, L.ENDPOINT_PLURAL)
@kopf.on.update(L.GROUP, L.VERSION, L.ENDPOINT_PLURAL)
def on_endpoint_change(namespace: str, name: str, reason: str, **_: Any) -> None:
    run_reconcile(str(reason), (namespace, name))


@kopf.timer(L.GROUP, L.VERSION, L.ENDPOINT_PLURAL, interval=SETTINGS.resync_seconds, initial_delay=5.0)
def resync(namespace: str, name: str, **_: Any) -> None:
    """Drift repair: a child edited or deleted by hand comes back; status catches up."""
    run_reconcile("timer", (namespace, name))


@kopf.on.delete(L.GROUP, L.VERSION, L.ENDPOINT_PLURAL)
def on_endpoint_delete(body: kopf.Body, namespace: str, name: str, **_: Any) -> None:
    started = time.perf_counter()
    try:
        # Under the endpoint's lock: a reconcile in flight must not add a snapshot after finalize lists them.
        with Runtime.locks.lock((namespace, name)):
            names = finalize(_kube(), plain(body))
    except KubeError as exc:
        METRICS.observe("delete", "error", time.perf_counter() - started)
        raise kopf.TemporaryError(f"cleaning up snapshots: {exc}", delay=5) from exc
    METRICS.observe("delete", "success", time.perf_counter() - started)
    METRICS.endpoints.forget(namespace, name)
    Runtime.locks.forget((namespace, name))
    if names:
        log.info("%s/%s deleted: snapshots %s marked for store cleanup", namespace, name, ", ".join(names))


def _enqueue_owner(namespace: str | None, labels: Mapping[str, str]) -> None:
    endpoint = labels.get(L.ENDPOINT_LABEL)
    if namespace and endpoint and Runtime.queue is not None:
        Runtime.queue.add((namespace, endpoint))


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("", "v1", "services", labels=MANAGED)
@kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers", labels=MANAGED)
def on_child_event(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    """A child changed (status, hand edit, deletion): look at its endpoint again."""
    _enqueue_owner(namespace, labels)


@kopf.on.event(L.GROUP, L.VERSION, L.SNAPSHOT_PLURAL)
def on_snapshot_event(
    event: Mapping[str, Any],
    namespace: str | None,
    name: str | None,
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    **_: Any,
) -> None:
    if namespace and name:
        if event.get("type") == "DELETED":
            METRICS.snapshots.forget(namespace, name)
        else:
            METRICS.snapshots.set(namespace, name, status.get("phase") or "Pending")
    endpoint = spec.get("endpoint")
    if namespace and endpoint and Runtime.queue is not None:
        Runtime.queue.add((namespace, str(endpoint)))
