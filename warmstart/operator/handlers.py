"""kopf handlers: InferenceEndpoint lifecycle, drift repair, and watches on children and snapshots.

Importing this module registers the handlers with kopf's default registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import kopf

from warmstart.api import labels as L
from warmstart.api.snapshot import Phase
from warmstart.kube.client import Kube, KubeError
from warmstart.operator import crds, rollout
from warmstart.operator.backoff import CAPTURE_BACKOFF, Backoff
from warmstart.operator.diagnosis import is_terminating
from warmstart.operator.metrics import METRICS
from warmstart.operator.reconcile import ChildApplyFailed, MissingAPI, reconcile
from warmstart.operator.seen_children import SeenChildren, SeenKube
from warmstart.operator.settings import OperatorSettings
from warmstart.operator.snapshots import SnapshotPlan
from warmstart.operator.spec import InvalidSpec
from warmstart.operator.wakeups import Key, Wakeups, check_loop

log = logging.getLogger(__name__)

MANAGED = {"app.kubernetes.io/managed-by": L.FIELD_MANAGER}
# A child at rest is read from the API server once in this many resyncs, from the watches' copy otherwise.
SEEN_RESYNCS = 5
CHECK = "resync"  # the check loop's name for its reconciles (kopf's handler is named by its reason)


# What earlier versions made kopf put on every endpoint. No handler needs a finalizer now, so kopf removes
# this one from each endpoint it sees that still has it (it must know the name to do so).
LEGACY_FINALIZER = f"{L.GROUP}/finalizer"


class Runtime:
    """What the handlers share: the settings `configure` gave (the defaults until then), what on_startup
    sets up."""

    settings = OperatorSettings.model_construct()  # the defaults, the environment unread
    kube: Kube | None = None
    wakeups = Wakeups(settings.resync_seconds)
    check_task: asyncio.Task[None] | None = None
    # One reconcile of an endpoint at a time, whether kopf's handler or the check loop runs it; and the
    # check loop's failures in a row of each endpoint (kopf counts its handler's own).
    locks: dict[Key, threading.Lock] = {}
    locks_lock = threading.Lock()
    check_failures: dict[Key, int] = {}
    seen = SeenChildren(settings.resync_seconds * SEEN_RESYNCS)
    backoff = Backoff(settings.capture_backoff_seconds, CAPTURE_BACKOFF.max_seconds)
    retry_backoff = Backoff(settings.retry_base_seconds, settings.retry_max_seconds)
    # uid of each of our CRDs as kopf found it when it started; another uid is a CRD kopf may not serve.
    served_crds: dict[str, str] = {}
    # Set to have `warmstart operator` start kopf again in this process (None: nobody would).
    restart: threading.Event | None = None


def configure(settings: OperatorSettings) -> None:
    """Run the handlers with these settings (before kopf starts)."""
    Runtime.settings = settings
    Runtime.wakeups = Wakeups(settings.resync_seconds)
    Runtime.seen = SeenChildren(settings.resync_seconds * SEEN_RESYNCS)
    Runtime.backoff = Backoff(settings.capture_backoff_seconds, CAPTURE_BACKOFF.max_seconds)
    Runtime.retry_backoff = Backoff(settings.retry_base_seconds, settings.retry_max_seconds)


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


def _follow_up(plan: SnapshotPlan) -> float | None:
    """Come back for a Failed snapshot awaiting its retry; the periodic resync covers everything else."""
    if plan.active_phase == Phase.FAILED and not plan.exhausted:
        return max(1.0, Runtime.backoff.base_seconds / 4)
    return None


def run_reconcile(handler: str, key: Key, retry: int = 0) -> None:
    """Reconcile one endpoint from a fresh read (so status transitions are never computed from a stale
    copy), and count it. kopf calls this from the endpoint's own handler, one call at a time per endpoint.
    An endpoint gone, or with an invalid spec (already reported in status, once per generation: retrying
    cannot help until the spec changes), is not retried. A failure raises kopf.TemporaryError, for kopf to
    retry after the backoff (`retry`: the failures in a row so far, as kopf counts them)."""
    with Runtime.locks_lock:
        lock = Runtime.locks.setdefault(key, threading.Lock())
    with lock:
        started = time.perf_counter()
        result = "error"
        try:
            body = _kube().get(L.ENDPOINT_KIND, *key)
            if body is None or body["metadata"].get("deletionTimestamp"):
                result = "gone"
                Runtime.wakeups.forget(key)  # its DELETED event may come later: no check of it meanwhile
                return
            status, plan = reconcile(
                SeenKube(_kube(), Runtime.seen),
                body,
                Runtime.backoff,
                Runtime.settings.agents,
                Runtime.settings.snapshot_store,
            )
            METRICS.endpoints.set(*key, status.phase)
            result = "success"
            Runtime.wakeups.reconciled(key, _follow_up(plan))
        except InvalidSpec:
            result = "invalid"
            METRICS.endpoints.set(*key, "Degraded")
            Runtime.wakeups.reconciled(key)
        except ChildApplyFailed as exc:
            METRICS.endpoints.set(*key, "Degraded")
            raise _retry_later(key, handler, retry, exc) from exc
        except (MissingAPI, KubeError) as exc:  # KubeError: e.g. the API server restarting, a conflict
            raise _retry_later(key, handler, retry, exc) from exc
        except Exception as exc:  # a bug in one reconcile must not stop the others; retried like any failure
            log.exception("%s/%s: %s reconcile crashed", *key, handler)
            raise _retry_later(key, handler, retry, None) from exc
        finally:
            METRICS.observe(handler, result, time.perf_counter() - started)


def _retry_later(key: Key, handler: str, retry: int, error: Exception | None) -> kopf.TemporaryError:
    failures = retry + 1
    delay = Runtime.retry_backoff.delay(failures)
    if error is not None:
        log.warning(
            "%s/%s: %s reconcile failed (%d in a row), retrying in %.0f s: %s",
            *key,
            handler,
            failures,
            delay,
            error,
        )
    Runtime.wakeups.retrying(key, delay, by_kopf=handler != CHECK)
    return kopf.TemporaryError(f"reconcile failed, retrying in {delay:.0f} s: {error}", delay=delay)


def check(key: Key) -> None:
    """The check loop's reconcile of an endpoint due for one (see wakeups); a failure is retried by the
    loop after the backoff, as kopf retries its handler's."""
    failures = Runtime.check_failures.get(key, 0)
    try:
        run_reconcile(CHECK, key, failures)
    except kopf.TemporaryError:  # logged, and the retry scheduled, by _retry_later
        Runtime.check_failures[key] = failures + 1
        return
    Runtime.check_failures.pop(key, None)


@kopf.on.startup()
async def on_startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = LEGACY_FINALIZER
    # kopf keeps its own records (the last handled spec, a retry's progress) in annotations only: the
    # status is the reconcile's alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage()
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage()
    # Our own Events carry the story, once per news: kopf's would repeat each retry of a failure.
    settings.posting.enabled = False
    settings.execution.max_workers = max(8, Runtime.settings.workers * 2)
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 30
    Runtime.kube = Kube.from_environment()
    try:
        # Read before kopf's own scan of the API (startup activities run first): whatever is served now,
        # kopf serves too.
        Runtime.served_crds = await asyncio.to_thread(crds.served_uids, Runtime.kube)
    except KubeError as exc:
        raise kopf.TemporaryError(f"reading the operator's CRDs: {exc}", delay=5) from exc
    checks = check_loop(Runtime.wakeups, check, Runtime.settings.workers)
    Runtime.check_task = asyncio.create_task(checks, name="checks")


@kopf.on.cleanup()
async def on_cleanup(**_: Any) -> None:
    task, Runtime.check_task = Runtime.check_task, None
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@kopf.on.resume(L.GROUP, L.VERSION, L.ENDPOINT_PLURAL, retries=None)
@kopf.on.create(L.GROUP, L.VERSION, L.ENDPOINT_PLURAL, retries=None)
@kopf.on.update(L.GROUP, L.VERSION, L.ENDPOINT_PLURAL, retries=None)
def on_endpoint_change(namespace: str, name: str, reason: str, retry: int, **_: Any) -> None:
    """The endpoint's one reconcile on a change of its own: a new or changed spec, the operator starting. An
    invalid spec returns quietly, as kopf's PermanentError would stop retries, without kopf's own error
    line: reconcile has reported it once for this generation, and the next spec change runs this again."""
    run_reconcile(str(reason), (namespace, name), retry)


@kopf.on.event(L.GROUP, L.VERSION, L.ENDPOINT_PLURAL)
def on_endpoint_event(event: Mapping[str, Any], namespace: str | None, name: str | None, **_: Any) -> None:
    """Keep the resync's list of endpoints; forget what the operator kept about a deleted one. Nothing is
    left to clean up in the cluster: its children and snapshots have it as owner, so the garbage collector
    removes them (and the node agents then remove the snapshots' files from the store)."""
    if not namespace or not name:
        return
    key = (namespace, name)
    if event.get("type") != "DELETED":
        Runtime.wakeups.track(key)
        return
    Runtime.wakeups.forget(key)
    Runtime.check_failures.pop(key, None)
    with Runtime.locks_lock:
        Runtime.locks.pop(key, None)
    METRICS.endpoints.forget(namespace, name)


@kopf.on.event(
    "apiextensions.k8s.io", "v1", "customresourcedefinitions", when=lambda name, **_: name in crds.KIND_OF_CRD
)
def on_crd_event(event: Mapping[str, Any], body: kopf.Body, name: str, uid: str, **_: Any) -> None:
    """Our CRDs: serve one that (re)appeared after kopf started."""
    crd = plain(body)
    if event.get("type") == "DELETED" or not crds.established(crd) or is_terminating(crd):
        return
    if Runtime.served_crds.get(name) == uid:
        return
    if not crds.wait_until_served(_kube(), name):
        log.warning("CRD %s established but not served by discovery: waiting for its next change", name)
        return
    if Runtime.restart is None:
        log.warning("CRD %s appeared after kopf started; restart the operator to serve it", name)
        return
    log.info("CRD %s appeared after kopf started: starting kopf again to serve it", name)
    Runtime.restart.set()


def _wake_owner(namespace: str | None, labels: Mapping[str, str]) -> None:
    endpoint = labels.get(L.ENDPOINT_LABEL)
    if namespace and endpoint:
        Runtime.wakeups.now((namespace, endpoint))


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("", "v1", "services", labels=MANAGED)
@kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers", labels=MANAGED)
@kopf.on.event("", "v1", "pods", labels={L.COMPONENT_LABEL: L.CAPTURE_COMPONENT})  # a capture pod ended
def on_child_event(
    event: Mapping[str, Any], body: kopf.Body, namespace: str | None, labels: Mapping[str, str], **_: Any
) -> None:
    """A child changed (status, hand edit, deletion): keep its copy, look at its endpoint again."""
    if event.get("type") == "DELETED":
        Runtime.seen.gone(str(body.get("kind")), namespace or "", str(body.get("metadata", {}).get("name")))
    else:
        Runtime.seen.saw(plain(body))
    _wake_owner(namespace, labels)


def _waits_for_room(body: kopf.Body, **_: Any) -> bool:
    return rollout.waits_for_room(body)


@kopf.on.event("", "v1", "pods", labels={L.COMPONENT_LABEL: L.WORKER_COMPONENT}, when=_waits_for_room)
def on_worker_without_room(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    """A worker pod the scheduler has no room for: a rollout's surge pod makes its endpoint replace one at a
    time (`rollout`), which the Deployment's own changes would tell only at the next resync."""
    _wake_owner(namespace, labels)


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
    if namespace and endpoint:
        Runtime.wakeups.now((namespace, str(endpoint)))
