"""Store cleanup: store snapshots whose InferenceSnapshot was deleted with the cleanup mark go at once;
snapshots no InferenceSnapshot references go after a grace period; then the store's GC."""

from __future__ import annotations

import logging
import time
from typing import Any

from warmstart.agent import objects
from warmstart.agent.context import NodeContext
from warmstart.api import labels as L
from warmstart.snapshot.store import Snapshot, SnapshotNotFound

log = logging.getLogger(__name__)


def cleanup_requested(snap: dict[str, Any]) -> bool:
    """The operator marked this InferenceSnapshot's store files for removal."""
    return (objects.meta(snap).get("annotations") or {}).get(L.STORE_CLEANUP_ANNOTATION) == "requested"


def snapshots_to_remove(
    store_snapshots: list[Snapshot], inference_snapshots: list[dict[str, Any]], grace: float, now: float
) -> list[str]:
    """Store ids to delete: marked for cleanup, or referenced by no InferenceSnapshot for `grace` seconds."""
    referenced, marked = set(), set()
    for snap in inference_snapshots:
        snapshot_id = objects.store_snapshot_id(snap)
        if cleanup_requested(snap):
            marked.add(snapshot_id)
        elif snapshot_id:
            referenced.add(snapshot_id)
    doomed = []
    for snapshot in store_snapshots:
        age = now - snapshot.created.timestamp()
        if snapshot.id in marked or (snapshot.id not in referenced and age >= grace):
            doomed.append(snapshot.id)
    return doomed


class StoreCleanup:
    def __init__(self, node: NodeContext) -> None:
        self.node = node

    def loop(self) -> None:
        while not self.node.stopping.wait(self.node.config.cleanup_interval):
            try:
                self.clean()
            except Exception as exc:
                log.warning("store cleanup failed: %s", exc)

    def clean(self) -> list[str]:
        """Remove store snapshots marked for cleanup or long unreferenced, then garbage-collect blobs."""
        node = self.node
        doomed = snapshots_to_remove(
            node.store.list(), node.kube.list_snapshots(), node.config.cleanup_grace, time.time()
        )
        removed = [snapshot_id for snapshot_id in doomed if self._delete(snapshot_id)]
        node.store.gc()
        return removed

    def _delete(self, snapshot_id: str) -> bool:
        """Delete one store snapshot; False when it was already gone (another node's agent was faster)."""
        try:
            self.node.store.delete(snapshot_id)
        except SnapshotNotFound:
            return False
        self.node.metrics.store_deleted.inc()
        log.info("removed snapshot %s from the store", snapshot_id)
        return True

    def watch_deleted(self) -> None:
        """Deleted InferenceSnapshots (all namespaces): remove the store files of those marked for cleanup."""
        from kubernetes import watch

        node = self.node
        while not node.stopping.is_set():
            try:
                stream = watch.Watch()
                for event in stream.stream(
                    node.kube.custom.list_cluster_custom_object, L.GROUP, L.VERSION, L.SNAPSHOT_PLURAL,
                    timeout_seconds=max(1, int(node.config.resync_seconds)),
                    _request_timeout=node.config.resync_seconds + node.kube.timeout,
                ):  # fmt: skip
                    if node.stopping.is_set():
                        stream.stop()
                        return
                    if event["type"] == "DELETED":
                        self.forget_deleted(event["object"])
            except Exception as exc:
                log.warning("InferenceSnapshot watch interrupted: %s", exc)
                node.stopping.wait(2.0)

    def forget_deleted(self, snap: dict[str, Any]) -> None:
        """A deleted InferenceSnapshot with the cleanup mark: its store files go now."""
        snapshot_id = objects.store_snapshot_id(snap)
        if cleanup_requested(snap) and snapshot_id:
            self._delete(snapshot_id)
