"""Pre-staging: the Ready snapshots of endpoints with `spec.snapshot.prestage: PageCache` are kept in this
node's page cache, so the next replica restored here reads its snapshot from memory instead of from disk.

Every `prestage_interval` seconds: the Ready InferenceSnapshots whose endpoint asks for it and whose snapshot
is in the store (recorded for the InferenceSnapshot's own namespace), newest first, have the blobs that are
not resident read, within `prestage_max_bytes` (and the page cache the agent's cgroup may hold). Only blobs
of the store are read, never through a symbolic link.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from warmstart.agent import objects
from warmstart.agent.cluster_store import PullFailed
from warmstart.agent.context import NodeContext
from warmstart.api.snapshot import Phase, SnapshotStatus, derive_phase
from warmstart.snapshot import residency
from warmstart.snapshot.manifest import SnapshotError
from warmstart.snapshot.store import Snapshot

log = logging.getLogger(__name__)

PAGE_CACHE = "PageCache"  # the InferenceEndpoint's spec.snapshot.prestage that asks for it
CGROUP_SHARE = 0.75  # of the agent's memory limit, the rest left to the agent itself


@dataclass(frozen=True)
class WantedSnapshot:
    series: tuple[str, str]  # the InferenceSnapshot's namespace and name, the gauge's labels
    snapshot: Snapshot  # what the store holds for it


def prestage_requested(endpoint: dict[str, Any] | None) -> bool:
    snapshot_policy = ((endpoint or {}).get("spec") or {}).get("snapshot") or {}
    return snapshot_policy.get("prestage") == PAGE_CACHE


class PrestagePhase:
    def __init__(self, node: NodeContext) -> None:
        self.node = node
        self._reported: set[tuple[str, str]] = set()  # the gauge's series, removed once not wanted

    def loop(self) -> None:
        if self.node.config.prestage_max_bytes <= 0:
            log.info("pre-staging is off (--prestage-max-bytes 0)")
            return
        while not self.node.stopping.wait(self.node.config.prestage_interval):
            try:
                self.stage_once()
            except Exception as exc:
                log.warning("pre-staging failed: %s", exc)

    def stage_once(self) -> int:
        """One pass: stage the wanted snapshots within the budget, report their residency; the bytes read."""
        started = time.monotonic()
        store = self.node.store
        # The cache trim after each pull keeps what this pass pulled so far, so the pass never evicts its own.
        with contextlib.ExitStack() as held:
            wanted = self.wanted(held)
            read = residency.stage(
                residency.blob_paths(store, [w.snapshot for w in wanted]), self.budget(),
                root=store.blobs_dir, should_stop=self.node.stopping.is_set,
            )  # fmt: skip
        self.node.metrics.prestage_read_bytes.inc(read)
        self._report(wanted)
        self.node.metrics.prestage_seconds.observe(time.monotonic() - started)
        if read:
            log.info("pre-staged %d bytes of %d snapshots", read, len(wanted))
        return read

    def budget(self) -> int:
        """--prestage-max-bytes, within what the agent's cgroup can keep in the page cache."""
        budget, limit = self.node.config.prestage_max_bytes, residency.cgroup_memory_limit()
        return budget if limit is None else min(budget, int(limit * CGROUP_SHARE))

    def wanted(self, held: contextlib.ExitStack) -> list[WantedSnapshot]:
        """The Ready snapshots whose endpoint asks for pre-staging and that this node's store holds, newest
        first (kept from the cache's trim while `held` lasts)."""
        asks: dict[tuple[str, str], bool] = {}  # (namespace, endpoint) -> prestage requested, one read each
        found = []
        for snap in self.node.kube.list_snapshots():
            meta = objects.meta(snap)
            owner = meta.get("namespace", ""), str((snap.get("spec") or {}).get("endpoint") or "")
            if not owner[1] or derive_phase(SnapshotStatus.of(snap))[0] != Phase.READY:
                continue
            if owner not in asks:
                asks[owner] = prestage_requested(self.node.kube.get_endpoint(*owner))
            stored = self._stored(snap, held) if asks[owner] else None
            if stored is not None:
                found.append(WantedSnapshot((owner[0], meta["name"]), stored))
        return sorted(found, key=lambda wanted: wanted.snapshot.created, reverse=True)

    def _stored(self, snap: dict[str, Any], held: contextlib.ExitStack) -> Snapshot | None:
        """The store's snapshot of an InferenceSnapshot, when it holds one captured in the same namespace (the
        bucket's, pulled into this node's cache ahead of a replica)."""
        snapshot_id = objects.store_snapshot_id(snap)
        try:
            stored = self.node.local_snapshot(snapshot_id, "prestage", held, verifier=self.node.verifier)
        except (SnapshotError, ValueError, PullFailed) as exc:
            log.debug("InferenceSnapshot %s: nothing to pre-stage (%s)", objects.key(snap), exc)
            return None
        return stored if stored.record.namespace == objects.meta(snap).get("namespace") else None

    def _report(self, wanted: list[WantedSnapshot]) -> None:
        gauge = self.node.metrics.prestaged_bytes
        for item in wanted:
            gauge.labels(*item.series).set(self._resident(item.snapshot))
        current = {item.series for item in wanted}
        for gone in self._reported - current:
            gauge.remove(*gone)
        self._reported = current

    def _resident(self, snapshot: Snapshot) -> int:
        store, total = self.node.store, 0
        for path in residency.blob_paths(store, [snapshot]):
            try:
                total += residency.resident_bytes(path, root=store.blobs_dir)
            except FileNotFoundError:
                continue  # removed by GC since the pass began
        return total
