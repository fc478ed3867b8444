"""Capture phase: a capture pod's worker, once `ready-for-snapshot`, is checkpointed into the store.

The InferenceSnapshot goes Capturing, then Ready with the runtime identity's facts and the capture's
timings (or Failed with the reason and an Event); the worker gets `snapshot-complete`. A restarted agent
finishes the bookkeeping of a capture that was published before it stopped, and never captures twice.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

from warmstart.agent import objects
from warmstart.agent.context import NO_IMAGE_DIGEST, NodeContext
from warmstart.agent.pods import PodSandbox
from warmstart.api import labels as L
from warmstart.api.capture_record import CaptureRecord
from warmstart.api.control_dir import RESTORE_COMPLETE, SNAPSHOT_COMPLETE, ControlDir
from warmstart.api.identity import SnapshotIdentity
from warmstart.api.snapshot import AGENT, CaptureState, Phase, SnapshotStatus, derive_phase, status_patch
from warmstart.checkpoint.capture import (
    CaptureError,
    CaptureOptions,
    capture,
    identity_from_payload,
    wait_ready,
)
from warmstart.host.clock import format_time
from warmstart.snapshot.layout import MANIFEST_FILE
from warmstart.snapshot.manifest import SnapshotError
from warmstart.snapshot.remote import RemoteError
from warmstart.snapshot.store import Snapshot

log = logging.getLogger(__name__)


def manifest_digest(snapshot: Snapshot) -> str:
    return "sha256:" + hashlib.sha256((snapshot.path / MANIFEST_FILE).read_bytes()).hexdigest()


def gpu_status(identity: SnapshotIdentity) -> dict[str, str]:
    facts = {
        "product": identity.gpu_product,
        "computeCapability": identity.compute_capability,
        "driverVersion": str(identity.driver_major) if identity.driver_major else "",
    }
    return {key: value for key, value in facts.items() if value}


def request_problem(payload: dict[str, Any], key: dict[str, Any]) -> str | None:
    """Why the identity a worker measured in its `ready-for-snapshot` disagrees with the InferenceSnapshot's
    request (engine kind, tensor parallelism, device), or None."""
    try:
        identity = identity_from_payload(payload)
    except CaptureError as exc:
        return str(exc)
    engine = key.get("engine") or {}
    wanted = {
        "engine": engine.get("kind"),
        "parallelism": engine.get("tensorParallelSize", 1),
        "device": "cuda" if (key.get("resources") or {}).get("gpus") else "cpu",
    }
    reported = {name: getattr(identity, name) for name in wanted}
    differences = [f"{name} {reported[name]!r} (asked for {wanted[name]!r})" for name in wanted
                   if reported[name] != wanted[name]]  # fmt: skip
    if differences:
        return "the worker runs another engine than its snapshot's request: " + ", ".join(differences)
    return None


class CapturePhase:
    def __init__(self, node: NodeContext) -> None:
        self.node = node
        self._slots = threading.BoundedSemaphore(node.config.max_captures)

    def handle(self, pod: dict[str, Any]) -> None:
        """Capture the pod's worker into its InferenceSnapshot; once this returns, the pod needs nothing."""
        node, meta = self.node, objects.meta(pod)
        snap = node.kube.get_snapshot(meta["namespace"], objects.labels(pod)[L.SNAPSHOT_LABEL])
        if snap is None:
            return
        status = SnapshotStatus.of(snap)
        control = node.control_dir(meta["uid"])
        if status.captured:
            if control.path.is_dir() and not control.present(SNAPSHOT_COMPLETE):
                control.send(SNAPSHOT_COMPLETE, {"snapshot": objects.store_snapshot_id(snap)})
            return
        failed = status.capture_attempt == status.attempt and status.capture_state == CaptureState.FAILED
        if derive_phase(status)[0] == Phase.INVALID or failed:
            return  # given up on
        if status.capture_pod not in (None, "", meta["name"]):
            log.info("capture pod %s passed over: its snapshot's current capture pod is %s",
                     objects.key(pod), status.capture_pod)  # fmt: skip
            return  # not this pod's attempt (any more)
        done = control.read(SNAPSHOT_COMPLETE)
        if done is not None:  # published before a restart of this agent: finish the bookkeeping
            try:
                snapshot = node.store.get(str(done.payload.get("snapshot", "")))
            except SnapshotError as exc:  # gone or unreadable since: fail this attempt, never loop on it
                self._mark_failed(snap, pod, f"the published snapshot cannot be read: {exc}")
                return
            self._mark_ready(snap, snapshot, snapshot.timings)
            return
        sandbox = node.find_pod(pod)
        try:
            payload = wait_ready(control, sandbox, node.config.ready_timeout, cancelled=node.stopping.is_set)
        except CaptureError as exc:  # the worker died or never got ready: this attempt failed
            if node.stopping.is_set():
                raise
            node.metrics.captures.labels("failed").inc()
            self._mark_failed(snap, pod, str(exc))
            return
        with self._slots:
            self._capture(pod, snap, sandbox, control, payload)

    def _capture(
        self,
        pod: dict[str, Any],
        snap: dict[str, Any],
        sandbox: PodSandbox,
        control: ControlDir,
        payload: dict[str, Any],
    ) -> None:
        node = self.node
        namespace, snap_name = objects.names(snap)
        pod_name, node_name = objects.meta(pod)["name"], node.config.node
        started = time.monotonic()
        node.kube.patch_snapshot_status(namespace, snap_name, status_patch(
            AGENT, capture_attempt=SnapshotStatus.of(snap).attempt, capture_state=CaptureState.CAPTURING,
            capture_message=f"capturing pod {pod_name} on {node_name}", node=node_name,
            started_at=format_time(),
        ))  # fmt: skip
        node.metrics.in_flight.labels(L.ROLE_CAPTURE).inc()
        published = ""
        try:
            problem = request_problem(payload, (snap.get("spec") or {}).get("requestKey") or {})
            image = node.worker_image(pod)
            if not problem and not image:
                problem = NO_IMAGE_DIGEST
            if problem:
                # Not captured: the worker carries on serving, as after any failed capture.
                control.send(RESTORE_COMPLETE, {"restored_in_place": True})
                raise CaptureError(problem)
            options = CaptureOptions(
                keep_serving=False,  # snapshot-complete is sent below once the snapshot is Ready (or failed)
                measured_identity={"image": image},
                ready_timeout=node.config.ready_timeout,
                record=CaptureRecord(
                    namespace=namespace, inference_snapshot=snap_name, pod=pod_name, node=node_name
                ),
            )
            result = capture(
                store=node.store, signer=node.signer, sandbox=sandbox, control=control, criu=node.criu,
                options=options,
            )  # fmt: skip
            published = result.snapshot.id
            pushed = self._push(published)
        except CaptureError as exc:
            node.metrics.captures.labels("failed").inc()
            self._mark_failed(snap, pod, str(exc))
            if published:
                control.send(SNAPSHOT_COMPLETE, {"snapshot": published})
            return
        finally:
            node.metrics.in_flight.labels(L.ROLE_CAPTURE).dec()
        seconds = time.monotonic() - started
        node.metrics.captures.labels("succeeded").inc()
        node.metrics.capture_seconds.observe(seconds)
        node.metrics.captured_bytes.inc(result.snapshot.size)
        timings = {**result.timings, **pushed, "total": round(seconds, 6)}
        self._mark_ready(snap, result.snapshot, timings)
        # Only now may the capture pod's worker exit: a capture pod that ended while its snapshot was not yet
        # Ready (pushing takes seconds) reads to the operator as a failed attempt, and it starts another.
        control.send(SNAPSHOT_COMPLETE, {"snapshot": published})
        node.kube.event(pod, "Pod", "Normal", "Captured", f"snapshot {published} in {seconds:.2f}s")

    def _push(self, snapshot_id: str) -> dict[str, float]:
        """Into the cluster's object store, when there is one, before the snapshot is Ready: a snapshot other
        nodes cannot pull would send their replicas to cold starts. Its timing; CaptureError when it fails."""
        cluster_store = self.node.cluster_store
        if cluster_store is None:
            return {}
        started = time.monotonic()
        try:
            cluster_store.publish(snapshot_id)
        except (RemoteError, SnapshotError) as exc:
            self._withdraw(snapshot_id)
            raise CaptureError(f"captured, but pushing to the object store failed: {exc}") from exc
        return {"push": round(time.monotonic() - started, 6)}

    def _withdraw(self, snapshot_id: str) -> None:
        """Take back what a capture whose push failed wrote to this node's store: its snapshot, which no
        InferenceSnapshot will name, and the blobs only it named (a whole capture's size each attempt).
        What the push left in the bucket is unsigned there, or a snapshot nothing names: the bucket's GC
        takes it."""
        try:
            removed = self.node.store.withdraw(snapshot_id)
        except (OSError, SnapshotError) as exc:
            log.warning("snapshot %s of a failed push stays in the store until cleanup: %s", snapshot_id, exc)
            return
        log.info("removed snapshot %s of a failed push and %s of its blobs", snapshot_id,
                 "none" if removed is None else len(removed))  # fmt: skip

    def _mark_ready(self, snap: dict[str, Any], snapshot: Snapshot, timings: dict[str, float]) -> None:
        node = self.node
        message = f"captured on {node.config.node}: {snapshot.size / 2**20:.1f} MiB"
        patch = status_patch(
            AGENT, capture_attempt=SnapshotStatus.of(snap).attempt, capture_state=CaptureState.CAPTURED,
            capture_message=message, node=node.config.node,
            identity=snapshot.identity.to_dict(), identity_hash=snapshot.identity_hash,
            gpu=gpu_status(snapshot.identity), snapshot_id=snapshot.id,
            storage_path=str(snapshot.path.relative_to(node.store.root)), size_bytes=snapshot.size,
            manifest_digest=manifest_digest(snapshot), completed_at=format_time(),
            timings={key: float(value) for key, value in timings.items()},
        )  # fmt: skip
        node.kube.patch_snapshot_status(*objects.names(snap), patch)
        node.kube.event(snap, L.SNAPSHOT_KIND, "Normal", "Ready", message)

    def _mark_failed(self, snap: dict[str, Any], pod: dict[str, Any], reason: str) -> None:
        log.warning("capture of %s failed: %s", objects.key(pod), reason)
        patch = status_patch(
            AGENT, capture_attempt=SnapshotStatus.of(snap).attempt, capture_state=CaptureState.FAILED,
            capture_message=reason[:1024], completed_at=format_time(),
        )  # fmt: skip
        self.node.kube.patch_snapshot_status(*objects.names(snap), patch)
        self.node.kube.event(snap, L.SNAPSHOT_KIND, "Warning", "CaptureFailed", reason)
