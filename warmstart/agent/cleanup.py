"""Store cleanup: a store snapshot goes at once when the InferenceSnapshot its manifest names (namespace and
name) is deleted, whoever deleted it (the operator's retention, the garbage collector after its endpoint, a
person); snapshots no InferenceSnapshot references go after a grace period; then the store's GC. A copy of
an InferenceSnapshot made in another namespace names the same store snapshot, but its deletion removes
nothing: the manifest names the one it was captured for."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from warmstart.agent import objects
from warmstart.agent.context import NodeContext
from warmstart.api.capture_record import CaptureRecord
from warmstart.snapshot.manifest import SnapshotError
from warmstart.snapshot.remote import RemoteError
from warmstart.snapshot.store import Snapshot, SnapshotNotFound

log = logging.getLogger(__name__)


def snapshots_to_remove(
    store_snapshots: list[Snapshot], inference_snapshots: list[dict[str, Any]], grace: float, now: float
) -> list[str]:
    """Store ids referenced by no InferenceSnapshot for `grace` seconds."""
    referenced = {objects.store_snapshot_id(snap) for snap in inference_snapshots}
    return [
        snapshot.id
        for snapshot in store_snapshots
        if snapshot.id not in referenced and now - snapshot.created.timestamp() >= grace
    ]


def captured_for(recorded: CaptureRecord | None, snap: dict[str, Any]) -> bool:
    """Whether a snapshot's capture record names this InferenceSnapshot (namespace and name)."""
    meta = objects.meta(snap)
    if recorded is None or meta.get("namespace") is None:
        return False
    return (recorded.namespace, recorded.inference_snapshot) == (meta["namespace"], meta.get("name"))


class StoreCleanup:
    def __init__(self, node: NodeContext, busy_pods: Callable[[], set[str]] = set) -> None:
        self.node = node
        self.busy_pods = busy_pods  # uids of the pods a restore runs for now

    def loop(self) -> None:
        self.reclaim_work_dirs()  # an agent killed mid-restore left its work directory: nothing runs yet
        # The store's GC once at start: the staging of an agent killed mid-capture (its owner gone) goes now,
        # not a cleanup interval later, which on a shared volume holds a whole capture's size.
        try:
            self.node.store.gc()
        except Exception as exc:
            log.warning("store cleanup at start failed: %s", exc)
        while not self.node.stopping.wait(self.node.config.cleanup_interval):
            try:
                self.reclaim_work_dirs()
                self.clean()
            except Exception as exc:
                log.warning("store cleanup failed: %s", exc)

    def reclaim_work_dirs(self) -> list[str]:
        """Remove the restore work directories (hard links into the store's blobs) of pods that no restore
        runs for: an interrupted restore's would otherwise hold store space forever."""
        root = self.node.config.restore_work_dir
        try:
            entries = sorted(os.listdir(root))
        except FileNotFoundError:
            return []
        busy = self.busy_pods()
        removed = [name for name in entries if name not in busy]
        for name in removed:
            path = root / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if removed:
            log.info("removed %d restore work directories left by interrupted restores", len(removed))
        return removed

    def clean(self) -> list[str]:
        """Remove store snapshots long unreferenced, then garbage-collect blobs."""
        node = self.node
        inference_snapshots = node.kube.list_snapshots()
        doomed = snapshots_to_remove(node.store.list(), inference_snapshots, node.config.cleanup_grace,
                                     time.time())  # fmt: skip
        removed = [snapshot_id for snapshot_id in doomed if self._delete(snapshot_id)]
        node.store.gc()
        if node.cluster_store is not None:
            node.cluster_store.maintain({objects.store_snapshot_id(snap) for snap in inference_snapshots})
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
        """Deleted InferenceSnapshots (all namespaces): remove the store files each was captured into."""
        node = self.node
        seen: str | None = None  # each watch goes on from the last one's end, not from a new list
        while not node.stopping.is_set():
            try:
                seen = seen or node.kube.snapshots_version()
                for change, snap in node.kube.watch_snapshots(seen, max(1, int(node.config.resync))):
                    if node.stopping.is_set():
                        return
                    seen = snap["metadata"]["resourceVersion"]
                    if change == "DELETED":
                        self.forget_deleted(snap)
            except Exception as exc:  # e.g. 410, too old to go on from: start again from a list
                log.warning("InferenceSnapshot watch interrupted: %s", exc)
                seen = None
                node.stopping.wait(2.0)

    def forget_deleted(self, snap: dict[str, Any]) -> None:
        """A deleted InferenceSnapshot: the store snapshot captured for it goes now."""
        snapshot_id = objects.store_snapshot_id(snap)
        if not snapshot_id:
            return
        cluster_store = self.node.cluster_store
        try:
            snapshot = self.node.store.get(snapshot_id)
        except SnapshotError:  # not in this node's store (or unreadable: the grace period and gc take it)
            snapshot = None
        if snapshot is not None and captured_for(snapshot.record, snap):
            self._delete(snapshot_id)
        if cluster_store is None:
            return
        try:  # the bucket's manifest, once its signature checks out
            remote = cluster_store.remote.manifest(snapshot_id, self.node.verifier)
        except (SnapshotError, RemoteError):
            return
        if captured_for(remote.record, snap):
            cluster_store.forget(snapshot_id)
