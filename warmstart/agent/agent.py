"""`warmstart agent`: the node agent's control loop (one per node, privileged, host PID namespace).

It watches the worker pods scheduled on its node and acts only on pods owned by an InferenceEndpoint
(restores: pod -> ReplicaSet -> Deployment -> InferenceEndpoint) or by the InferenceSnapshot they capture:
- capture pods: on `ready-for-snapshot`, the InferenceSnapshot goes Capturing, the worker is captured into
  the store and published signed, the InferenceSnapshot goes Ready (or Failed with the reason and an Event),
  and the worker gets `snapshot-complete`;
- restore pods: the snapshot named by the pod's InferenceSnapshot (same namespace, Ready, identity and the
  manifest's recorded namespace both checked) is restored into the pod's namespaces, `restore-complete`
  carries the port; any failure sends `restore-failed` (the worker cold-starts), records an Event and the
  failure count, and the InferenceSnapshot turns Invalid after repeated failures.
- store cleanup: snapshots whose InferenceSnapshot was deleted with the cleanup mark go at once; snapshots
  no InferenceSnapshot references go after a grace period; then the store's GC.

Its state lives in the API server (snapshot phases) and on disk (control-directory signals, the store), so a
restarted agent neither captures a Ready snapshot again nor restores a pod that already has an answer.
Captures and restores run under per-node semaphores; every external call has a timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmstart.agent.kube_status import KubeStatus, utc_now
from warmstart.agent.metrics import AgentMetrics
from warmstart.agent.pods import (
    DEFAULT_KUBELET_ROOT,
    PodProcessError,
    PodSandbox,
    control_dir_on_host,
)
from warmstart.api import labels as L
from warmstart.identity import SnapshotIdentity
from warmstart.protocol import (
    RESTORE_COMPLETE,
    RESTORE_FAILED,
    SNAPSHOT_COMPLETE,
    ControlDir,
)
from warmstart.snapshot.manifest import SnapshotError
from warmstart.snapshot.signing import Signer, Verifier
from warmstart.snapshot.store import MANIFEST_FILE, Snapshot, SnapshotStore

if TYPE_CHECKING:
    from warmstart.checkpoint.restore import FailureCounter

log = logging.getLogger(__name__)

READY, CAPTURING, FAILED, INVALID = "Ready", "Capturing", "Failed", "Invalid"
CAPTURE, RESTORE = L.ROLE_CAPTURE, L.ROLE_RESTORE
OWNER_CHAIN_DEPTH = 3  # pod -> ReplicaSet -> Deployment -> InferenceEndpoint


@dataclass
class AgentConfig:
    node: str
    store: Path
    criu_command: str
    kubelet_root: Path = DEFAULT_KUBELET_ROOT
    key: str | None = None
    work_dir: Path | None = None  # where restores materialise images (default: inside the store)
    max_captures: int = 1
    max_restores: int = 2
    resync_seconds: float = 30.0
    start_timeout: float = 300.0  # for a pod's container to appear on the host
    ready_timeout: float = 1800.0  # for a capture pod's `ready-for-snapshot`
    criu_timeout: float = 600.0
    cleanup_interval: float = 300.0
    cleanup_grace: float = 3600.0  # unreferenced store snapshots younger than this stay

    def __post_init__(self) -> None:
        if not self.node:
            raise ValueError("the node name is empty: pass --node or set WARMSTART_NODE_NAME")
        if self.max_captures < 1 or self.max_restores < 1:
            raise ValueError("--max-captures and --max-restores must be at least 1")

    @property
    def restore_work_dir(self) -> Path:
        return self.work_dir or self.store / "agent-work" / self.node


@dataclass
class Operation:
    kind: str
    pod: str
    snapshot: str
    since: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "pod": self.pod, "snapshot": self.snapshot, "since": self.since}


class Refused(RuntimeError):
    """A restore this agent will not attempt; the reason names what is wrong."""


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    return obj.get("metadata") or {}


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return _meta(obj).get("labels") or {}


def _status(obj: dict[str, Any] | None) -> dict[str, Any]:
    return (obj or {}).get("status") or {}


def _pod_key(pod: dict[str, Any]) -> str:
    return f"{_meta(pod)['namespace']}/{_meta(pod)['name']}"


def manifest_digest(snapshot: Snapshot) -> str:
    return "sha256:" + hashlib.sha256((snapshot.path / MANIFEST_FILE).read_bytes()).hexdigest()


def store_snapshot_id(snap: dict[str, Any]) -> str:
    status = _status(snap)
    return str(status.get("snapshotId") or status.get("storagePath") or "")


def _answered(control: ControlDir) -> bool:
    """True when the pod already got `restore-complete` or `restore-failed`."""
    return control.present(RESTORE_COMPLETE) or control.present(RESTORE_FAILED)


def worker_port(pod: dict[str, Any]) -> int | None:
    """The port the worker serves on: its container's first port, else its `--port` argument."""
    containers = (pod.get("spec") or {}).get("containers") or []
    for container in containers:
        for port in container.get("ports") or []:
            if port.get("containerPort"):
                return int(port["containerPort"])
        args = list(container.get("args") or [])
        if "--port" in args[:-1]:
            with contextlib.suppress(ValueError):
                return int(args[args.index("--port") + 1])
    return None


def gpu_status(identity: SnapshotIdentity) -> dict[str, str]:
    facts = {
        "product": identity.gpu_product,
        "computeCapability": identity.compute_capability,
        "driverVersion": str(identity.driver_major) if identity.driver_major else "",
    }
    return {key: value for key, value in facts.items() if value}


def identity_problem(payload: dict[str, Any], wanted: str) -> str | None:
    """Why a worker's `ready-for-snapshot` does not match the InferenceSnapshot's identity hash, or None."""
    from warmstart.checkpoint.capture import CaptureError, identity_from_payload

    try:
        reported = identity_from_payload(payload).digest()
    except CaptureError as exc:
        return str(exc)
    if reported != wanted:
        return (
            f"the worker reports identity {reported[:12]}, the snapshot wants {wanted[:12]}: "
            "the pod runs another image, model or engine arguments than the snapshot describes"
        )
    return None


def _cleanup_requested(snap: dict[str, Any]) -> bool:
    """The operator marked this InferenceSnapshot's store files for removal."""
    return (_meta(snap).get("annotations") or {}).get(L.STORE_CLEANUP_ANNOTATION) == "requested"


def snapshots_to_remove(
    store_snapshots: list[Snapshot], inference_snapshots: list[dict[str, Any]], grace: float, now: float
) -> list[str]:
    """Store ids to delete: marked for cleanup, or referenced by no InferenceSnapshot for `grace` seconds."""
    referenced, marked = set(), set()
    for snap in inference_snapshots:
        snapshot_id = store_snapshot_id(snap)
        if _cleanup_requested(snap):
            marked.add(snapshot_id)
        elif snapshot_id:
            referenced.add(snapshot_id)
    doomed = []
    for snapshot in store_snapshots:
        age = now - snapshot.created.timestamp()
        if snapshot.id in marked or (snapshot.id not in referenced and age >= grace):
            doomed.append(snapshot.id)
    return doomed


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        kube: KubeStatus,
        signer: Signer,
        verifier: Verifier,
        metrics: AgentMetrics | None = None,
    ) -> None:
        from warmstart.checkpoint.criu import Criu

        self.config = config
        self.kube = kube
        self.signer = signer
        self.verifier = verifier
        self.metrics = metrics or AgentMetrics()
        self.store = SnapshotStore(config.store)
        self.criu = Criu(config.criu_command, timeout=config.criu_timeout)
        self._captures = threading.BoundedSemaphore(config.max_captures)
        self._restores = threading.BoundedSemaphore(config.max_restores)
        self._lock = threading.Lock()
        self._in_flight: dict[str, Operation] = {}  # pod uid -> what runs for it
        self._settled: set[str] = set()  # pod uids that need nothing more
        self.stopping = threading.Event()

    # --- the loop ------------------------------------------------------------------------------------

    def run(self) -> None:
        """List and watch this node's worker pods until `stopping` is set; relist every resync period."""
        for target, name in (
            (self._cleanup_loop, "store-cleanup"),
            (self._watch_snapshots, "snapshot-watch"),
        ):
            threading.Thread(target=target, name=name, daemon=True).start()
        while not self.stopping.is_set():
            try:
                self._list_and_watch()
            except Exception as exc:  # the API server restarts, networks blip: keep going
                log.warning("pod watch interrupted: %s; relisting", exc)
                self.stopping.wait(2.0)

    def _list_and_watch(self) -> None:
        from kubernetes import watch

        pods, version = self.kube.list_node_pods()
        self._forget_gone({_meta(pod)["uid"] for pod in pods})
        for pod in pods:
            self.consider(pod)
        stream = watch.Watch()
        serialize = self.kube.core.api_client.sanitize_for_serialization
        for event in stream.stream(
            self.kube.core.list_pod_for_all_namespaces,
            **self.kube.node_pod_selectors(),
            resource_version=version,
            timeout_seconds=max(1, int(self.config.resync_seconds)),
            _request_timeout=self.config.resync_seconds + self.kube.timeout,
        ):
            if self.stopping.is_set():
                stream.stop()
                return
            if event["type"] in ("ADDED", "MODIFIED"):
                self.consider(serialize(event["object"]))

    def _forget_gone(self, present: set[str]) -> None:
        with self._lock:
            self._settled &= present

    def consider(self, pod: dict[str, Any]) -> None:
        """Start work for `pod` when it is a capture or restore pod not already handled or being handled."""
        meta = _meta(pod)
        uid, role = meta.get("uid", ""), _labels(pod).get(L.ROLE_LABEL)
        if role not in (CAPTURE, RESTORE) or meta.get("deletionTimestamp"):
            return
        if _status(pod).get("phase") in ("Succeeded", "Failed"):
            return
        with self._lock:
            if uid in self._settled or uid in self._in_flight:
                return
            self._in_flight[uid] = Operation(role, _pod_key(pod), _labels(pod).get(L.SNAPSHOT_LABEL, ""))
        worker = threading.Thread(
            target=self._handle, args=(pod,), name=f"{role}-{meta['name']}", daemon=True
        )
        worker.start()

    def _handle(self, pod: dict[str, Any]) -> None:
        uid = _meta(pod)["uid"]
        settled = False  # an exception leaves the pod for the next resync
        try:
            if not self.owned(pod):
                log.info(
                    "pod %s is not owned by an InferenceEndpoint or its snapshot: ignored", _pod_key(pod)
                )
            elif _labels(pod)[L.ROLE_LABEL] == CAPTURE:
                self.handle_capture(pod)
            else:
                self.handle_restore(pod)
            settled = True
        except Exception:
            log.exception("handling pod %s failed; it is retried at the next resync", _pod_key(pod))
        finally:
            with self._lock:
                self._in_flight.pop(uid, None)
                if settled:
                    self._settled.add(uid)

    def settled_pods(self) -> set[str]:
        """Uids of the pods that need nothing more from this agent."""
        with self._lock:
            return set(self._settled)

    def wait_idle(self, timeout: float) -> bool:
        """True once nothing is in flight (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._in_flight:
                    return True
            time.sleep(0.05)
        return False

    # --- ownership -----------------------------------------------------------------------------------

    def owned(self, pod: dict[str, Any]) -> bool:
        """Capture pods: owned by the InferenceSnapshot they name; others: by an InferenceEndpoint."""
        namespace, labels = _meta(pod)["namespace"], _labels(pod)
        refs = _meta(pod).get("ownerReferences") or []
        if labels.get(L.ROLE_LABEL) == CAPTURE:
            snap = self.kube.get_snapshot(namespace, labels.get(L.SNAPSHOT_LABEL, ""))
            return snap is not None and any(
                ref.get("kind") == L.SNAPSHOT_KIND and ref.get("uid") == _meta(snap)["uid"] for ref in refs
            )
        return self._chain_reaches_endpoint(
            namespace, refs, labels.get(L.ENDPOINT_LABEL, ""), OWNER_CHAIN_DEPTH
        )

    def _chain_reaches_endpoint(
        self, namespace: str, refs: list[dict[str, Any]], endpoint: str, depth: int
    ) -> bool:
        if depth == 0:
            return False
        for ref in refs:
            if ref.get("kind") == L.ENDPOINT_KIND and str(ref.get("apiVersion", "")).startswith(L.GROUP):
                found = self.kube.get_endpoint(namespace, ref["name"])
                if found is not None and _meta(found)["uid"] == ref.get("uid") and ref["name"] == endpoint:
                    return True
            owner = self.kube.get_owner(ref.get("kind", ""), namespace, ref.get("name", ""))
            if owner is not None and _meta(owner)["uid"] == ref.get("uid"):
                parents = _meta(owner).get("ownerReferences") or []
                if self._chain_reaches_endpoint(namespace, parents, endpoint, depth - 1):
                    return True
        return False

    # --- capture -------------------------------------------------------------------------------------

    def handle_capture(self, pod: dict[str, Any]) -> None:
        """Capture the pod's worker into its InferenceSnapshot; once this returns, the pod needs nothing."""
        from warmstart.checkpoint.capture import CaptureError, wait_ready

        namespace, name, uid = _meta(pod)["namespace"], _meta(pod)["name"], _meta(pod)["uid"]
        snap = self.kube.get_snapshot(namespace, _labels(pod)[L.SNAPSHOT_LABEL])
        if snap is None:
            return
        status = _status(snap)
        control = ControlDir(control_dir_on_host(self.config.kubelet_root, uid))
        if status.get("phase") == READY:
            if control.path.is_dir() and not control.present(SNAPSHOT_COMPLETE):
                control.send(SNAPSHOT_COMPLETE, {"snapshot": store_snapshot_id(snap)})
            return
        if status.get("phase") in (INVALID, FAILED) or status.get("capturePod") not in (None, "", name):
            return  # given up on, or not this pod's attempt (any more)
        done = control.read(SNAPSHOT_COMPLETE)
        if done is not None:  # published before a restart of this agent: finish the bookkeeping
            try:
                snapshot = self.store.get(str(done.payload.get("snapshot", "")))
            except SnapshotError as exc:  # gone or unreadable since: fail this attempt, never loop on it
                self._mark_capture_failed(snap, pod, f"the published snapshot cannot be read: {exc}")
                return
            self._mark_ready(snap, name, snapshot, snapshot.timings)
            return
        sandbox = self._find_pod(uid)
        try:
            payload = wait_ready(control, sandbox, self.config.ready_timeout, cancelled=self.stopping.is_set)
        except CaptureError as exc:  # the worker died or never got ready: this attempt failed
            if self.stopping.is_set():
                raise
            self.metrics.captures.labels("failed").inc()
            self._mark_capture_failed(snap, pod, str(exc))
            return
        with self._captures:
            self._capture(pod, snap, sandbox, control, payload)

    def _find_pod(self, uid: str) -> PodSandbox:
        root, timeout = self.config.kubelet_root, self.config.start_timeout
        return PodSandbox.find(uid, root, timeout, cancelled=self.stopping.is_set)

    def _capture(
        self,
        pod: dict[str, Any],
        snap: dict[str, Any],
        sandbox: PodSandbox,
        control: ControlDir,
        payload: dict[str, Any],
    ) -> None:
        from warmstart.checkpoint.capture import CaptureError, CaptureOptions, capture

        namespace, snap_name = _meta(snap)["namespace"], _meta(snap)["name"]
        pod_name = _meta(pod)["name"]
        started = time.monotonic()
        self.kube.patch_snapshot_status(namespace, snap_name, {
            "phase": CAPTURING, "node": self.config.node, "capturePod": pod_name, "startedAt": utc_now(),
            "reason": "Capturing", "message": f"capturing pod {pod_name} on {self.config.node}",
        })  # fmt: skip
        self.metrics.in_flight.labels(CAPTURE).inc()
        try:
            problem = identity_problem(payload, (snap.get("spec") or {}).get("identityHash", ""))
            if problem:
                # Not captured: the worker carries on serving, as after any failed capture.
                control.send(RESTORE_COMPLETE, {"restored_in_place": True})
                raise CaptureError(problem)
            options = CaptureOptions(
                keep_serving=False,
                ready_timeout=self.config.ready_timeout,
                meta={"namespace": namespace, "inferenceSnapshot": snap_name, "pod": pod_name,
                      "node": self.config.node},
            )  # fmt: skip
            result = capture(
                store=self.store, signer=self.signer, sandbox=sandbox, control=control, criu=self.criu,
                options=options,
            )  # fmt: skip
        except CaptureError as exc:
            self.metrics.captures.labels("failed").inc()
            self._mark_capture_failed(snap, pod, str(exc))
            return
        finally:
            self.metrics.in_flight.labels(CAPTURE).dec()
        seconds = time.monotonic() - started
        self.metrics.captures.labels("succeeded").inc()
        self.metrics.capture_seconds.observe(seconds)
        self.metrics.captured_bytes.inc(result.snapshot.size)
        self._mark_ready(snap, pod_name, result.snapshot, {**result.timings, "total": round(seconds, 6)})
        self.kube.event(pod, "Pod", "Normal", "Captured", f"snapshot {result.snapshot.id} in {seconds:.2f}s")

    def _mark_ready(
        self, snap: dict[str, Any], pod_name: str, snapshot: Snapshot, timings: dict[str, float]
    ) -> None:
        status = {
            "phase": READY, "reason": "Captured", "node": self.config.node, "capturePod": pod_name,
            "gpu": gpu_status(snapshot.identity), "storagePath": snapshot.id, "snapshotId": snapshot.id,
            "sizeBytes": snapshot.size, "manifestDigest": manifest_digest(snapshot),
            "timings": {key: float(value) for key, value in timings.items()}, "completedAt": utc_now(),
            "message": f"captured on {self.config.node}: {snapshot.size / 2**20:.1f} MiB",
        }  # fmt: skip
        self.kube.patch_snapshot_status(_meta(snap)["namespace"], _meta(snap)["name"], status)
        self.kube.event(snap, L.SNAPSHOT_KIND, "Normal", "Ready", status["message"])

    def _mark_capture_failed(self, snap: dict[str, Any], pod: dict[str, Any], reason: str) -> None:
        log.warning("capture of %s failed: %s", _pod_key(pod), reason)
        self.kube.patch_snapshot_status(_meta(snap)["namespace"], _meta(snap)["name"], {
            "phase": FAILED, "reason": "CaptureFailed", "message": reason[:1024], "completedAt": utc_now(),
        })  # fmt: skip
        self.kube.event(snap, L.SNAPSHOT_KIND, "Warning", "CaptureFailed", reason)

    # --- restore -------------------------------------------------------------------------------------

    def handle_restore(self, pod: dict[str, Any]) -> None:
        """Restore the pod's snapshot into it, or tell it to cold-start; then the pod needs nothing more."""
        uid = _meta(pod)["uid"]
        control = ControlDir(control_dir_on_host(self.config.kubelet_root, uid))
        if _answered(control):
            return
        try:
            snap, snapshot_id, identity = self.restorable(pod)
        except Refused as exc:
            self._wait_control_dir(control)
            self._refuse(pod, control, str(exc))
            return
        sandbox = self._find_pod(uid)
        if _answered(control):  # answered while the pod's container was awaited
            return
        if sandbox.engine_running():
            log.info("pod %s already runs an engine (it gave up waiting): no restore", _pod_key(pod))
            return
        with self._restores:
            self._restore(pod, snap, snapshot_id, identity, sandbox, control)

    def restorable(self, pod: dict[str, Any]) -> tuple[dict[str, Any], str, SnapshotIdentity]:
        """The pod's InferenceSnapshot, its store id and identity; Refused with the reason otherwise."""

        namespace, name = _meta(pod)["namespace"], _labels(pod).get(L.SNAPSHOT_LABEL, "")
        snap = self.kube.get_snapshot(namespace, name) if name else None
        if snap is None:
            raise Refused(f"no InferenceSnapshot {name!r} in namespace {namespace}")
        status, spec = _status(snap), snap.get("spec") or {}
        if status.get("phase") != READY:
            raise Refused(f"InferenceSnapshot {name} is {status.get('phase') or 'Pending'}, not Ready")
        snapshot_id = store_snapshot_id(snap)
        try:
            identity = SnapshotIdentity.from_dict(spec.get("identity") or {})
        except (TypeError, ValueError) as exc:
            raise Refused(f"InferenceSnapshot {name} has no valid spec.identity: {exc}") from exc
        if identity.digest() != spec.get("identityHash"):
            raise Refused(f"InferenceSnapshot {name}: spec.identity does not hash to spec.identityHash")
        try:
            recorded = self.store.get(snapshot_id).meta.get("namespace")
        except SnapshotError as exc:
            raise Refused(f"InferenceSnapshot {name}: {exc}") from exc
        if recorded != namespace:
            raise Refused(
                f"snapshot {snapshot_id} was captured in namespace {recorded!r}; it is never restored into "
                f"another namespace ({namespace})"
            )
        return snap, snapshot_id, identity

    def _wait_control_dir(self, control: ControlDir) -> None:
        """The kubelet makes the emptyDir before the container starts; a refusal needs only the directory."""
        deadline = time.monotonic() + self.config.start_timeout
        while not control.path.is_dir():
            if time.monotonic() >= deadline or self.stopping.is_set():
                raise PodProcessError(f"no control directory at {control.path} (is the kubelet root right?)")
            time.sleep(0.1)

    def _refuse(self, pod: dict[str, Any], control: ControlDir, reason: str) -> None:
        log.warning("restore into %s refused: %s", _pod_key(pod), reason)
        control.send(RESTORE_FAILED, {"reason": reason})
        self.metrics.restores.labels("refused").inc()
        self.kube.event(pod, "Pod", "Warning", "RestoreRefused", f"{reason}; the worker starts cold")
        self.kube.annotate_pod(_meta(pod)["namespace"], _meta(pod)["name"], {"restoreFailed": reason})

    def _restore(
        self,
        pod: dict[str, Any],
        snap: dict[str, Any],
        snapshot_id: str,
        identity: SnapshotIdentity,
        sandbox: PodSandbox,
        control: ControlDir,
    ) -> None:
        from warmstart.checkpoint.restore import FailureCounter, RestoreFailed, RestoreRefused, restore

        failures = FailureCounter(self.store.root)
        work_dir = self.config.restore_work_dir / _meta(pod)["uid"]
        resume: dict[str, Any] = {"restore_started_at": time.time()}
        if (port := worker_port(pod)) is not None:
            resume["port"] = port
        started = time.monotonic()
        self.metrics.in_flight.labels(RESTORE).inc()
        try:
            sandbox.reserve_low_pids()
            result = restore(
                store=self.store, verifier=self.verifier, snapshot_id=snapshot_id, expected_identity=identity,
                sandbox=sandbox, control=control, criu=self.criu, work_dir=work_dir, resume_payload=resume,
                failures=failures,
            )  # fmt: skip
        except PodProcessError as exc:
            # The pod, not the snapshot, is at fault: a cold start, without counting against the snapshot.
            self._refuse(pod, control, f"the pod cannot take a restore: {exc}")
            return
        except (RestoreRefused, RestoreFailed) as exc:
            self._restore_failed(pod, snap, snapshot_id, str(exc), failures)
            return
        finally:
            self.metrics.in_flight.labels(RESTORE).dec()
            shutil.rmtree(work_dir, ignore_errors=True)
        seconds = time.monotonic() - started
        self.metrics.restores.labels("succeeded").inc()
        self.metrics.restore_seconds.observe(seconds)
        self.metrics.restored_bytes.inc(result.snapshot.size)
        namespace, name = _meta(pod)["namespace"], _meta(pod)["name"]
        self.kube.annotate_pod(
            namespace, name, {"restoreSeconds": round(seconds, 3), "snapshot": _meta(snap)["name"]}
        )
        self.kube.event(pod, "Pod", "Normal", "Restored", f"from snapshot {snapshot_id} in {seconds:.2f}s")

    def _restore_failed(
        self,
        pod: dict[str, Any],
        snap: dict[str, Any],
        snapshot_id: str,
        reason: str,
        failures: FailureCounter,
    ) -> None:
        """Report a failed restore (already counted in `failures`); Invalid once it failed too often."""
        count = failures.count(snapshot_id)
        self.metrics.restores.labels("failed").inc()
        message = f"{reason} (failure {count} of {failures.max_failures}); the worker starts cold"
        self.kube.event(pod, "Pod", "Warning", "RestoreFailed", message)
        self.kube.annotate_pod(_meta(pod)["namespace"], _meta(pod)["name"], {"restoreFailed": reason})
        status: dict[str, Any] = {"restoreFailures": count}
        if count >= failures.max_failures:
            status.update(
                phase=INVALID, reason="RestoreFailures", message=f"{count} restores failed: {reason}"[:1024]
            )
            self.kube.event(snap, L.SNAPSHOT_KIND, "Warning", "Invalid", status["message"])
        self.kube.patch_snapshot_status(_meta(snap)["namespace"], _meta(snap)["name"], status)

    # --- store cleanup -------------------------------------------------------------------------------

    def _cleanup_loop(self) -> None:
        while not self.stopping.wait(self.config.cleanup_interval):
            try:
                self.clean_store()
            except Exception as exc:
                log.warning("store cleanup failed: %s", exc)

    def clean_store(self) -> list[str]:
        """Remove store snapshots marked for cleanup or long unreferenced, then garbage-collect blobs."""
        doomed = snapshots_to_remove(
            self.store.list(), self.kube.list_snapshots(), self.config.cleanup_grace, time.time()
        )
        removed = [snapshot_id for snapshot_id in doomed if self._delete_from_store(snapshot_id)]
        self.store.gc()
        return removed

    def _delete_from_store(self, snapshot_id: str) -> bool:
        """Delete one store snapshot; False when it was already gone (another node's agent was faster)."""
        from warmstart.snapshot.store import SnapshotNotFound

        try:
            self.store.delete(snapshot_id)
        except SnapshotNotFound:
            return False
        self.metrics.store_deleted.inc()
        log.info("removed snapshot %s from the store", snapshot_id)
        return True

    def _watch_snapshots(self) -> None:
        """Deleted InferenceSnapshots (all namespaces): remove the store files of those marked for cleanup."""
        from kubernetes import watch

        while not self.stopping.is_set():
            try:
                stream = watch.Watch()
                for event in stream.stream(
                    self.kube.custom.list_cluster_custom_object, L.GROUP, L.VERSION, L.SNAPSHOT_PLURAL,
                    timeout_seconds=max(1, int(self.config.resync_seconds)),
                    _request_timeout=self.config.resync_seconds + self.kube.timeout,
                ):  # fmt: skip
                    if self.stopping.is_set():
                        stream.stop()
                        return
                    if event["type"] == "DELETED":
                        self.forget_deleted_snapshot(event["object"])
            except Exception as exc:
                log.warning("InferenceSnapshot watch interrupted: %s", exc)
                self.stopping.wait(2.0)

    def forget_deleted_snapshot(self, snap: dict[str, Any]) -> None:
        """A deleted InferenceSnapshot with the cleanup mark: its store files go now."""
        snapshot_id = store_snapshot_id(snap)
        if _cleanup_requested(snap) and snapshot_id:
            self._delete_from_store(snapshot_id)

    # --- what the gRPC API reports -------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        from warmstart.checkpoint import cuda
        from warmstart.checkpoint.criu import CriuError

        try:
            criu_version, criu_error = str(self.criu.version()), ""
        except CriuError as exc:
            criu_version, criu_error = "", str(exc)
        try:
            cuda.driver()
            cuda_available, cuda_reason = True, ""
        except cuda.CudaUnavailable as exc:
            cuda_available, cuda_reason = False, str(exc)
        with self._lock:
            in_flight = [operation.to_dict() for operation in self._in_flight.values()]
        return {
            "node": self.config.node, "criu_version": criu_version, "criu_error": criu_error,
            "cuda_available": cuda_available, "cuda_reason": cuda_reason, "in_flight": in_flight,
        }  # fmt: skip

    def list_snapshots(self, identity_hash: str = "") -> list[dict[str, Any]]:
        return [
            {
                "id": s.id,
                "identity_hash": s.identity_hash,
                "engine": s.identity.engine,
                "model_digest": s.identity.model_digest,
                "size": s.size,
                "created": s.manifest.created,
                "namespace": str(s.meta.get("namespace", "")),
                "inference_snapshot": str(s.meta.get("inferenceSnapshot", "")),
            }  # fmt: skip
            for s in self.store.list(identity_hash or None)
        ]
