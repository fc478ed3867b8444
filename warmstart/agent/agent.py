"""`warmstart agent`: the node agent's control loop (one per node, privileged, host PID namespace).

It watches the worker pods scheduled on its node and acts only on pods owned by an InferenceEndpoint
(restores: pod -> ReplicaSet -> Deployment -> InferenceEndpoint) or by the InferenceSnapshot they capture
(`ownership.py`). One module per phase, each saying what it does: capture pods (`capture.py`), restore pods
(`restore.py`), store cleanup of the snapshots no InferenceSnapshot needs any more (`cleanup.py`),
pre-staging of the Ready snapshots of endpoints that ask for it in this node's page cache (`prestage.py`).

Its state lives in the API server (snapshot phases) and on disk (control-directory signals, the store), so a
restarted agent neither captures a Ready snapshot again nor restores a pod that already has an answer.
Captures and restores run under per-node semaphores; every external call has a timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from warmstart.agent import objects, ownership
from warmstart.agent.capture import CapturePhase
from warmstart.agent.cleanup import StoreCleanup
from warmstart.agent.context import NodeContext
from warmstart.agent.kube_status import KubeStatus
from warmstart.agent.metrics import AgentMetrics
from warmstart.agent.prestage import PrestagePhase
from warmstart.agent.restore import RestorePhase
from warmstart.agent.settings import AgentSettings
from warmstart.api import labels as L
from warmstart.snapshot.remote import RemoteConfig
from warmstart.snapshot.signing import Signer, Verifier

log = logging.getLogger(__name__)


@dataclass
class Operation:
    kind: str
    pod: str
    snapshot: str
    since: float = field(default_factory=time.time)


class Agent:
    def __init__(
        self,
        config: AgentSettings,
        kube: KubeStatus,
        signer: Signer,
        verifier: Verifier,
        metrics: AgentMetrics | None = None,
        remote: RemoteConfig | None = None,
    ) -> None:
        self.node = NodeContext.create(config, kube, signer, verifier, metrics or AgentMetrics(), remote)
        self.capture = CapturePhase(self.node)
        self.restore = RestorePhase(self.node)
        self.cleanup = StoreCleanup(self.node, busy_pods=self.busy_pods)
        self.prestage = PrestagePhase(self.node)
        self._lock = threading.Lock()
        self._in_flight: dict[str, Operation] = {}  # pod uid -> what runs for it
        self._settled: set[str] = set()  # pod uids that need nothing more

    @property
    def config(self) -> AgentSettings:
        return self.node.config

    @property
    def metrics(self) -> AgentMetrics:
        return self.node.metrics

    @property
    def stopping(self) -> threading.Event:
        return self.node.stopping

    def run(self) -> None:
        """List and watch this node's worker pods until `stopping` is set; relist every resync period."""
        for target, name in (
            (self.cleanup.loop, "store-cleanup"),
            (self.cleanup.watch_deleted, "snapshot-watch"),
            (self.prestage.loop, "prestage"),
        ):
            threading.Thread(target=target, name=name, daemon=True).start()
        while not self.stopping.is_set():
            try:
                self._list_and_watch()
            except Exception as exc:  # the API server restarts, networks blip: keep going
                log.warning("pod watch interrupted: %s; relisting", exc)
                self.stopping.wait(2.0)

    def _list_and_watch(self) -> None:
        pods, version = self.node.kube.list_node_pods()
        with self._lock:  # pods gone from the node need remembering no more
            self._settled &= {objects.meta(pod)["uid"] for pod in pods}
        for pod in pods:
            self.consider(pod)
        for change, pod in self.node.kube.watch_node_pods(version, max(1, int(self.config.resync))):
            if self.stopping.is_set():
                return
            if change in ("ADDED", "MODIFIED"):
                self.consider(pod)

    def consider(self, pod: dict[str, Any]) -> None:
        """Start work for `pod` when it is a capture or restore pod not already handled or being handled."""
        meta, pod_labels = objects.meta(pod), objects.labels(pod)
        uid, role = meta.get("uid", ""), pod_labels.get(L.ROLE_LABEL)
        if role not in (L.ROLE_CAPTURE, L.ROLE_RESTORE) or meta.get("deletionTimestamp"):
            return
        if objects.status(pod).get("phase") in ("Succeeded", "Failed"):
            return
        with self._lock:
            if uid in self._settled or uid in self._in_flight:
                return
            self._in_flight[uid] = Operation(role, objects.key(pod), pod_labels.get(L.SNAPSHOT_LABEL, ""))
        threading.Thread(target=self._handle, args=(pod,), name=f"{role}-{meta['name']}", daemon=True).start()

    def _handle(self, pod: dict[str, Any]) -> None:
        uid = objects.meta(pod)["uid"]
        settled = False  # an exception leaves the pod for the next resync
        try:
            if not ownership.owned(self.node.kube, pod):
                log.info(
                    "pod %s is not owned by an InferenceEndpoint or its snapshot: ignored", objects.key(pod)
                )
            elif objects.labels(pod)[L.ROLE_LABEL] == L.ROLE_CAPTURE:
                self.capture.handle(pod)
            else:
                self.restore.handle(pod)
            settled = True
        except Exception:
            log.exception("handling pod %s failed; it is retried at the next resync", objects.key(pod))
        finally:
            with self._lock:
                self._in_flight.pop(uid, None)
                if settled:
                    self._settled.add(uid)

    def busy_pods(self) -> set[str]:
        """Uids of the pods a capture or restore runs for now."""
        with self._lock:
            return set(self._in_flight)

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

    def status(self) -> dict[str, Any]:
        from warmstart.checkpoint import cuda
        from warmstart.checkpoint.criu import CriuError

        try:
            criu_version, criu_error = str(self.node.criu.version()), ""
        except CriuError as exc:
            criu_version, criu_error = "", str(exc)
        try:
            cuda.driver()
            cuda_available, cuda_reason = True, ""
        except cuda.CudaUnavailable as exc:
            cuda_available, cuda_reason = False, str(exc)
        with self._lock:
            in_flight = [asdict(operation) for operation in self._in_flight.values()]
        return {
            "node": self.config.node, "criu_version": criu_version, "criu_error": criu_error,
            "cuda_available": cuda_available, "cuda_reason": cuda_reason, "in_flight": in_flight,
        }  # fmt: skip

    def list_snapshots(self, identity_hash: str = "") -> list[dict[str, Any]]:
        """The store snapshots captured on this node (the store may be shared by every node), those signed
        with this agent's key alone."""
        return [
            {
                "id": s.id,
                "identity_hash": s.identity_hash,
                "engine": s.identity.engine,
                "model_digest": s.identity.model_digest,
                "size": s.size,
                "created": s.manifest.created,
                "namespace": s.record.namespace,
                "inference_snapshot": s.record.inference_snapshot,
            }  # fmt: skip
            for s in self.node.store.list(identity_hash or None, verifier=self.node.verifier)
            if s.record.node == self.config.node
        ]
