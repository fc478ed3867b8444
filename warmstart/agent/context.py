"""What every phase of the agent works with: its configuration, the API server, the store, CRIU."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmstart.agent import objects
from warmstart.agent.cluster_store import ClusterStore
from warmstart.agent.cri import ContainerRuntime
from warmstart.agent.kube_status import KubeStatus
from warmstart.agent.metrics import AgentMetrics
from warmstart.agent.node_facts import node_gpus
from warmstart.agent.pods import PodProcessError, PodSandbox, control_dir_on_host, control_volume_holders
from warmstart.agent.settings import AgentSettings
from warmstart.api import labels as L
from warmstart.api.control_dir import ControlDir
from warmstart.checkpoint.criu import Criu
from warmstart.host.cuda_driver import GpuDevice
from warmstart.snapshot.remote import RemoteConfig, RemoteStore
from warmstart.snapshot.signing import Signer, Verifier
from warmstart.snapshot.store import Snapshot, SnapshotStore

log = logging.getLogger(__name__)

NODE_LOOK_SECONDS = 0.05  # how often a starting pod is looked for on the node
API_LOOK_SECONDS = 0.2  # and in the API server, whose word comes later
NO_IMAGE_DIGEST = "neither the container runtime nor the kubelet reports the worker container's image digest"


@dataclass
class NodeContext:
    config: AgentSettings
    kube: KubeStatus
    signer: Signer
    verifier: Verifier
    metrics: AgentMetrics
    store: SnapshotStore
    criu: Criu
    cluster_store: ClusterStore | None = None  # the bucket behind the local store, when there is one
    runtime: ContainerRuntime | None = None  # the node's container runtime, when the agent may ask it
    stopping: threading.Event = field(default_factory=threading.Event)
    # The node's GPUs and driver major version (FactsUnavailable without CUDA); replaceable in tests.
    gpus: Callable[[], tuple[list[GpuDevice], int]] = node_gpus

    @classmethod
    def create(
        cls,
        config: AgentSettings,
        kube: KubeStatus,
        signer: Signer,
        verifier: Verifier,
        metrics: AgentMetrics,
        remote: RemoteConfig | None = None,
    ) -> NodeContext:
        """`remote`: the cluster's store, an S3-compatible bucket with the local store as this node's cache;
        None: the local store is the store (a hostPath on each node, or a shared volume)."""
        store = SnapshotStore(config.store, verified_records=config.verified_records)
        cluster_store = None if remote is None else ClusterStore(
            local=store, remote=RemoteStore(store, remote), verifier=verifier, metrics=metrics,
            pull_timeout=config.pull_timeout, cache_max_bytes=config.cache_max_bytes,
            cache_max_age=config.cache_max_age, gc_grace=config.cleanup_grace,
        )  # fmt: skip
        runtime = ContainerRuntime(Path(config.cri_socket)) if config.cri_socket else None
        if runtime is None:
            log.info("workers' images: from the kubelet's reports")
        elif runtime.socket.is_socket():
            log.info("workers' images: from the container runtime at %s", runtime.socket)
        else:
            log.warning("no container runtime socket at %s (agent.criSocket): restores wait for the kubelet "
                        "to report a worker's image", runtime.socket)  # fmt: skip
        return cls(
            config=config, kube=kube, signer=signer, verifier=verifier, metrics=metrics, store=store,
            criu=Criu(config.criu, timeout=config.criu_timeout), cluster_store=cluster_store,
            runtime=runtime,
        )  # fmt: skip

    def control_dir(self, pod_uid: str) -> ControlDir:
        return ControlDir(control_dir_on_host(self.config.kubelet_root, pod_uid))

    def local_snapshot(
        self, snapshot_id: str, reason: str, held: contextlib.ExitStack, verifier: Verifier | None = None
    ) -> Snapshot:
        """The store snapshot, pulled from the bucket first when there is one and this node's cache lacks it
        (then kept from the cache's trim while `held` lasts); `verifier` checks a local store's signature."""
        if self.cluster_store is None:
            return self.store.get(snapshot_id, verifier=verifier)
        held.enter_context(self.cluster_store.in_use(snapshot_id))
        return self.cluster_store.local_copy(snapshot_id, reason)

    def find_pod(self, pod: dict[str, Any]) -> PodSandbox:
        """The pod's worker container on this node, as soon as it runs: found on the node by its control
        volume (`control_volume_holders`), or by the id the kubelet's pod status reports, whichever comes
        first (waited for while the container starts)."""
        meta, root = objects.meta(pod), self.config.kubelet_root
        deadline = time.monotonic() + self.config.start_timeout
        container, asked = objects.worker_container_id(pod), time.monotonic()
        while not container:
            with contextlib.suppress(PodProcessError):
                return PodSandbox.find(meta["uid"], root, in_pod=True, lookup=control_volume_holders)
            if time.monotonic() >= deadline or self.stopping.is_set():
                raise PodProcessError(f"pod {objects.key(pod)}: the kubelet reports no worker container yet")
            time.sleep(NODE_LOOK_SECONDS)
            if time.monotonic() - asked >= API_LOOK_SECONDS:
                reported = self.kube.get_pod(*objects.names(pod)) or {}
                container, asked = objects.worker_container_id(reported), time.monotonic()
        remaining = max(0.0, deadline - time.monotonic())
        return PodSandbox.find(meta["uid"], root, remaining, self.stopping.is_set, container=container)

    def worker_image(self, pod: dict[str, Any]) -> str:
        """The image digest the pod's worker container runs from: the container runtime's answer when the
        agent may ask it, else the kubelet's report, waited for while the container starts (the kubelet
        reports it up to a second after the start); "" when neither ever does."""
        if self.runtime:
            uid = objects.meta(pod)["uid"]
            if image := self.runtime.container_image(uid, L.WORKER_CONTAINER, self.stopping.is_set):
                return image
            log.info("pod %s: no image from the container runtime; waiting for the kubelet's report",
                     objects.key(pod))  # fmt: skip
        deadline = time.monotonic() + self.config.start_timeout
        while not (image := objects.worker_image_id(self.kube.get_pod(*objects.names(pod)) or {})):
            if time.monotonic() >= deadline or self.stopping.is_set():
                return ""
            time.sleep(NODE_LOOK_SECONDS)
        return image
