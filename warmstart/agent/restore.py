"""Restore phase: a restore pod gets its InferenceSnapshot's snapshot restored into its namespaces.

The snapshot must be Ready, in the pod's namespace (checked against the namespace the store's manifest
recorded at capture) and its identity must hash to what the InferenceSnapshot names. The restore starts as
soon as the worker container runs (`NodeContext.find_pod`): the GPUs are checked, the snapshot verified and
the weight stager started while the kubelet's word on the image and the worker's restore facts are awaited
(`pod_checks`, before the claim). `restore-complete`
carries the port the worker serves on; any refusal or failure sends `restore-failed` (the worker
cold-starts) and records an Event. A failure that is the snapshot's, wherever it showed (its copy in the
object store refused by the pull, its files failing verification in this node's cache, CRIU or the CUDA
restore failing), is counted on this node's store and then by one path (`_failed`) in the
InferenceSnapshot's `status.restoreFailures`, which turns it Invalid after repeated failures. A refusal
that is the pod's or the node's (another image, GPU or model, an unreachable bucket) counts nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import logging
import os
import shutil
import threading
import time
from typing import Any

from warmstart.agent import objects
from warmstart.agent.cluster_store import PullFailed, PullRefused
from warmstart.agent.context import NO_IMAGE_DIGEST, NodeContext
from warmstart.agent.node_facts import FactsUnavailable, pod_gpu_facts, pod_restore_facts, visible_devices
from warmstart.agent.pods import PodProcessError, PodSandbox
from warmstart.api import labels as L
from warmstart.api.control_dir import (
    CLAIM_RESTORE,
    RESTORE_CLAIM,
    RESTORE_COMPLETE,
    RESTORE_FAILED,
    ControlDir,
)
from warmstart.api.identity import SnapshotIdentity, canonical_json
from warmstart.api.restore_facts import FactsInvalid, RestoreFacts
from warmstart.api.snapshot import (
    FACTS_DIGEST_KEY,
    MAX_RESTORE_FAILURES,
    REFUSED_KEY,
    FactsChanged,
    Phase,
    SnapshotStatus,
    derive_phase,
)
from warmstart.checkpoint.restore import (
    FailureCounter,
    NotCounted,
    PodUnfit,
    RestoreClaimed,
    RestoreFailed,
    RestoreRefused,
    count_failure,
    restore,
)
from warmstart.host import procinfo
from warmstart.snapshot.manifest import SnapshotError, SnapshotInvalid
from warmstart.snapshot.store import Snapshot

log = logging.getLogger(__name__)

FACTS_TIMEOUT = 30.0  # for a restore pod's worker to write its restore facts once its container runs


class PodBusy(RuntimeError):
    """Another process is working on this pod; look again later."""


class Refused(RuntimeError):
    """A restore this agent will not attempt; the reason names what is wrong."""


class PodChanged(Refused):
    """The pod's model or engine differs from what the snapshot was taken of: the operator captures again
    for what the pod holds now (`report` says so on the pod); nothing is counted against the snapshot."""

    def __init__(self, message: str, changed: FactsChanged, facts: RestoreFacts) -> None:
        super().__init__(message)
        digest = hashlib.sha256(canonical_json(facts.to_dict())).hexdigest()
        self.report = {REFUSED_KEY: str(changed), FACTS_DIGEST_KEY: digest}


class SnapshotRefused(Refused):
    """The snapshot's own files were refused before anything ran (its copy in the object store is missing,
    truncated or tampered with, or its manifest in this node's cache is unreadable): a failed restore of
    the snapshot, counted against it."""

    def __init__(self, message: str, snap: dict[str, Any], snapshot_id: str) -> None:
        super().__init__(message)
        self.snap = snap
        self.snapshot_id = snapshot_id


def answered(control: ControlDir) -> bool:
    return control.present(RESTORE_COMPLETE) or control.present(RESTORE_FAILED)


def _control_dir_exists(control: ControlDir) -> bool:
    try:
        with control.directory():
            return True
    except FileNotFoundError:
        return False


def worker_port(pod: dict[str, Any]) -> int | None:
    """The port the worker serves on: its container's first port, else its `--port` argument."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("containerPort"):
                return int(port["containerPort"])
        args = [str(arg) for arg in container.get("args") or []]
        values = [arg.removeprefix("--port=") for arg in args if arg.startswith("--port=")]
        values += [after for before, after in zip(args, args[1:], strict=False) if before == "--port"]
        for value in values:
            with contextlib.suppress(ValueError):
                return int(value)
    return None


class RestorePhase:
    def __init__(self, node: NodeContext) -> None:
        self.node = node
        self._slots = threading.BoundedSemaphore(node.config.max_restores)

    def handle(self, pod: dict[str, Any]) -> None:
        """Restore the pod's snapshot into it, or tell it to cold-start; then the pod needs nothing more."""
        control = self.node.control_dir(objects.meta(pod)["uid"])
        if answered(control):
            return
        if self._interrupted_earlier(control):
            self._answer_interrupted(pod, control)
            return
        with contextlib.ExitStack() as held:  # the snapshot stays in the node cache until the restore ends
            try:
                snap, snapshot = self.restorable(pod, held)
            except SnapshotRefused as exc:  # counted and answered as `restore()` does, then over the cluster
                self._wait_control_dir(control)
                count_failure(control, FailureCounter(self.node.store.root), exc.snapshot_id, str(exc))
                self._failed(pod, exc.snap, str(exc))
                return
            except Refused as exc:
                self._wait_control_dir(control)
                self._refuse(pod, control, str(exc))
                return
            except Exception as exc:  # our defect: nothing touched the pod yet; it starts cold, not stuck
                log.exception("restore into %s: looking its snapshot up failed", objects.key(pod))
                self._wait_control_dir(control)
                self._refuse(pod, control, f"the node agent failed looking the snapshot up: {exc!r}")
                return
            sandbox = self.node.find_pod(pod)
            if answered(control):  # answered while the pod's container was awaited
                return
            try:
                expected = self.expected_identity(snapshot.identity, sandbox)
            except Refused as exc:
                self._refuse(pod, control, str(exc))
                return
            with self._slots:
                self._restore(pod, snap, snapshot, expected, sandbox, control)

    def restorable(self, pod: dict[str, Any], held: contextlib.ExitStack) -> tuple[dict[str, Any], Snapshot]:
        """The pod's InferenceSnapshot and the store snapshot it names (pulled from the object store when this
        node's cache lacks it, and kept from the cache's trim while `held` lasts); Refused with the reason
        otherwise. The store's manifest is read here only to compare; `restore()` verifies it before CRIU."""
        namespace, name = objects.meta(pod)["namespace"], objects.labels(pod).get(L.SNAPSHOT_LABEL, "")
        snap = self.node.kube.get_snapshot(namespace, name) if name else None
        if snap is None:
            raise Refused(f"no InferenceSnapshot {name!r} in namespace {namespace}")
        status, spec = SnapshotStatus.of(snap), snap.get("spec") or {}
        phase = derive_phase(status)[0]  # from the facts, not waiting for the operator to write it
        if phase != Phase.READY:
            raise Refused(f"InferenceSnapshot {name} is {phase}, not Ready")
        asked = objects.labels(pod).get(L.REQUEST_KEY_LABEL, "")
        if not asked or asked != L.request_key_label(str(spec.get("requestKeyHash", ""))):
            raise Refused(
                f"the pod asks for request key {asked!r}, InferenceSnapshot {name} was made for another"
            )
        snapshot_id = objects.store_snapshot_id(snap)
        try:
            snapshot = self.node.local_snapshot(snapshot_id, "restore", held)
        except (PullRefused, SnapshotInvalid) as exc:  # the snapshot's own files: counted against it
            raise SnapshotRefused(f"InferenceSnapshot {name}: {exc}", snap, snapshot_id) from exc
        except (PullFailed, SnapshotError) as exc:
            raise Refused(f"InferenceSnapshot {name}: {exc}") from exc
        if snapshot.identity_hash != status.identity_hash:
            raise Refused(
                f"InferenceSnapshot {name} records another identity than store snapshot {snapshot_id}"
            )
        recorded = snapshot.record.namespace
        if recorded != namespace:
            raise Refused(
                f"snapshot {snapshot_id} was captured in namespace {recorded!r}; it is never restored into "
                f"another namespace ({namespace})"
            )
        return snap, snapshot

    def expected_identity(self, recorded: SnapshotIdentity, sandbox: PodSandbox) -> SnapshotIdentity:
        """The identity this pod on this node can take, as far as the node shows it: the recorded one with,
        for a GPU snapshot, the product and compute capability of the pod's GPUs and the node's driver;
        Refused, naming each difference, when they differ. The image is the runtime's word: `pod_checks`."""
        if recorded.device != "cuda":
            return recorded
        try:
            gpu = pod_gpu_facts(*self.node.gpus(), visible_devices(sandbox.init_pid))
        except FactsUnavailable as exc:
            raise Refused(f"a GPU snapshot cannot be checked here: {exc}") from exc
        here = dataclasses.replace(
            recorded, gpu_product=gpu.product, compute_capability=gpu.compute_capability,
            driver_major=gpu.driver_major,
        )  # fmt: skip
        self._refuse_differences(recorded, here)
        return here

    def pod_checks(self, snapshot: Snapshot, pod: dict[str, Any], control: ControlDir) -> None:
        """What the container runtime and the pod's worker say, checked once the snapshot is verified (the
        restore verifies it meanwhile): the image the worker runs from, then the worker's restore facts;
        PodUnfit names what differs."""
        try:
            image = self.node.worker_image(pod)
            if not image:
                raise Refused(NO_IMAGE_DIGEST)
            self._refuse_differences(snapshot.identity, dataclasses.replace(snapshot.identity, image=image))
            self.check_restore_facts(snapshot, control)
        except Refused as exc:
            raise PodUnfit(str(exc)) from exc

    @staticmethod
    def _refuse_differences(recorded: SnapshotIdentity, here: SnapshotIdentity) -> None:
        if differences := recorded.mismatches(here):
            raise Refused("the snapshot was captured for another pod or node: " + "; ".join(differences))

    def check_restore_facts(self, snapshot: Snapshot, control: ControlDir) -> None:
        """Refused unless the pod's worker shows the capture's restore facts: engine, its version, its flags,
        the model's files (`warmstart.api.restore_facts`). Snapshots taken before they were recorded pass."""
        recorded = snapshot.record.worker.restore_facts
        if recorded is None:
            log.info("snapshot %s records no restore facts: the pod's model is not compared", snapshot.id)
            return
        try:
            captured = RestoreFacts.from_dict(recorded)
            pod = pod_restore_facts(control, FACTS_TIMEOUT, self.node.stopping.is_set)
        except (FactsInvalid, FactsUnavailable) as exc:
            raise Refused(str(exc)) from exc
        if problems := captured.mismatches(pod):
            message = "the pod differs from the snapshot's capture: " + "; ".join(problems)
            if pod.error:  # nothing measured: nothing to capture again for
                raise Refused(message)
            changed = (
                FactsChanged.MODEL_CHANGED if captured.changed_files(pod) else FactsChanged.ENGINE_CHANGED
            )
            raise PodChanged(message, changed, pod)

    def _wait_control_dir(self, control: ControlDir) -> None:
        """The kubelet makes the emptyDir before the container starts; a refusal needs only the directory."""
        deadline = time.monotonic() + self.node.config.start_timeout
        while not _control_dir_exists(control):
            if time.monotonic() >= deadline or self.node.stopping.is_set():
                raise PodProcessError(f"no control directory at {control.path} (is the kubelet root right?)")
            time.sleep(0.1)

    @staticmethod
    def _interrupted_earlier(control: ControlDir) -> bool:
        """A restore claim without an answer: an agent before this one stopped in the middle of a restore.
        PodBusy while the claiming process still runs (a replaced agent finishing): looked at again later."""
        claim = control.read(RESTORE_CLAIM) if _control_dir_exists(control) else None
        if claim is None or claim.payload.get("holder") != CLAIM_RESTORE:
            return False
        pid = claim.payload.get("pid")
        if isinstance(pid, int) and pid != os.getpid() and procinfo.is_running(pid):
            raise PodBusy(f"a restore by process {pid} is still under way in {control.path}")
        return True

    def _answer_interrupted(self, pod: dict[str, Any], control: ControlDir) -> None:
        """Kill what the interrupted restore left in the pod and let the worker start cold."""
        reason = "the node agent stopped during this pod's restore"
        self.node.find_pod(pod).kill_all_but_init()
        log.warning("restore into %s: %s; the worker starts cold", objects.key(pod), reason)
        control.send(RESTORE_FAILED, {"reason": reason})
        self.node.metrics.restores.labels("failed").inc()
        self.node.kube.event(pod, "Pod", "Warning", "RestoreInterrupted", f"{reason}; the worker starts cold")

    def _refuse(
        self, pod: dict[str, Any], control: ControlDir, reason: str, report: dict[str, str] | None = None
    ) -> None:
        log.warning("restore into %s refused: %s", objects.key(pod), reason)
        control.send(RESTORE_FAILED, {"reason": reason})
        self.node.metrics.restores.labels("refused").inc()
        self.node.kube.event(pod, "Pod", "Warning", "RestoreRefused", f"{reason}; the worker starts cold")
        self.node.kube.annotate_pod(*objects.names(pod), {"restoreFailed": reason, **(report or {})})

    def _restore(
        self,
        pod: dict[str, Any],
        snap: dict[str, Any],
        snapshot: Snapshot,
        identity: SnapshotIdentity,
        sandbox: PodSandbox,
        control: ControlDir,
    ) -> None:
        node, snapshot_id = self.node, snapshot.id
        work_dir = node.config.restore_work_dir / objects.meta(pod)["uid"]
        resume: dict[str, Any] = {"restore_started_at": time.time()}
        if (port := worker_port(pod)) is not None:
            resume["port"] = port
        started = time.monotonic()
        node.metrics.in_flight.labels(L.ROLE_RESTORE).inc()
        try:
            sandbox.reserve_low_pids()
            result = restore(
                store=node.store, verifier=node.verifier, snapshot_id=snapshot_id, expected_identity=identity,
                sandbox=sandbox, control=control, criu=node.criu, work_dir=work_dir, resume_payload=resume,
                before_claim=lambda: self.pod_checks(snapshot, pod, control),
            )  # fmt: skip
        except PodProcessError as exc:
            # The pod, not the snapshot, is at fault: a cold start, without counting against the snapshot.
            self._refuse(pod, control, f"the pod cannot take a restore: {exc}")
            return
        except PodUnfit as exc:
            changed = exc.__cause__.report if isinstance(exc.__cause__, PodChanged) else None
            self._refuse(pod, control, str(exc), changed)
            return
        except RestoreClaimed as exc:  # the worker gave up waiting and started cold: not the snapshot's fault
            log.info("no restore into %s: %s", objects.key(pod), exc)
            self.node.metrics.restores.labels("refused").inc()
            return
        except NotCounted as exc:  # answered and cleaned up; the pod's doing, or the snapshot is gone
            self._failed(pod, None, str(exc))
            return
        except (RestoreRefused, RestoreFailed) as exc:  # counted on this node's store and answered
            self._failed(pod, snap, str(exc))
            return
        finally:
            node.metrics.in_flight.labels(L.ROLE_RESTORE).dec()
            shutil.rmtree(work_dir, ignore_errors=True)
        seconds = time.monotonic() - started
        node.metrics.restores.labels("succeeded").inc()
        node.metrics.restore_seconds.observe(seconds)
        node.metrics.restored_bytes.inc(result.snapshot.size)
        began = dt.datetime.fromtimestamp(resume["restore_started_at"], dt.UTC).isoformat(
            timespec="milliseconds"
        )
        report = {
            "restoreSeconds": round(seconds, 3),
            "restoreStartedAt": began,
            "restorePhases": {phase: round(took, 3) for phase, took in result.timings.items()},
            "snapshot": objects.meta(snap)["name"],
        }
        node.kube.annotate_pod(*objects.names(pod), report)
        source = f"InferenceSnapshot {report['snapshot']} (store snapshot {snapshot_id})"
        node.kube.event(pod, "Pod", "Normal", "Restored", f"from {source} in {seconds:.2f}s")
        node.kube.clear_restore_failures(snap)

    def _failed(self, pod: dict[str, Any], snap: dict[str, Any] | None, reason: str) -> None:
        """Report a failed restore, already answered to the pod. One that is the snapshot's (`snap`, already
        counted in this store's failures) is added to its count over all nodes: Invalid once that reaches the
        limit. Every such failure comes here, wherever it was found (pull, verification, CRIU)."""
        node = self.node
        count = node.kube.add_restore_failure(*objects.names(snap), reason) if snap else None
        counted = f" (failure {count} of {MAX_RESTORE_FAILURES})" if snap else ""
        node.metrics.restores.labels("failed").inc()
        node.kube.event(pod, "Pod", "Warning", "RestoreFailed", f"{reason}{counted}; the worker starts cold")
        node.kube.annotate_pod(*objects.names(pod), {"restoreFailed": reason})
        if count is not None and count >= MAX_RESTORE_FAILURES:  # the operator turns it Invalid
            node.kube.event(snap, L.SNAPSHOT_KIND, "Warning", "Invalid", f"{count} restores failed: {reason}")
