"""The cluster's snapshot store as this node's agent uses it: an S3-compatible bucket (`snapshot.remote`) with
the node's local store as its cache. A capture is pushed before its InferenceSnapshot turns Ready, so every
node can restore it; a restore pulls what this node lacks before anything is restored (signature first,
every byte against its signed digest), within a bound, and a failed pull is a refusal and a cold start;
pre-staging pulls ahead of the replicas. The cache is trimmed after each pull and each push of a capture,
and by the cleanup loop, which also collects the bucket's garbage.

Without a bucket (the chart's hostPath or shared-volume store) there is no ClusterStore: the local store is
the store, and a snapshot restores only where that store is seen.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from warmstart.agent.metrics import AgentMetrics
from warmstart.snapshot.manifest import SnapshotError, SnapshotInvalid
from warmstart.snapshot.remote import RemoteError, RemoteStore, TrimReport
from warmstart.snapshot.signing import Verifier
from warmstart.snapshot.store import Snapshot, SnapshotNotFound, SnapshotStore

log = logging.getLogger(__name__)

PUSH_ATTEMPTS = 3


class PullFailed(RuntimeError):
    """This node could not get the snapshot from the bucket; the message says why."""


class PullRefused(PullFailed):
    """The bucket's copy of the snapshot is refused: missing, truncated, or failing its signature or a signed
    digest. The snapshot is at fault, not this node: a restore counts it against the snapshot, as it counts
    a copy failing verification in the node's cache."""


@dataclass
class ClusterStore:
    local: SnapshotStore
    remote: RemoteStore
    verifier: Verifier
    metrics: AgentMetrics
    pull_timeout: float = 120.0
    cache_max_bytes: int = 0  # 0: the node cache is not bounded by size
    cache_max_age: float = 0.0  # 0: nor by age
    gc_grace: float = 3600.0
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _busy: Counter[str] = field(default_factory=Counter)  # snapshots being restored: the trim keeps them
    _guard: threading.Lock = field(default_factory=threading.Lock)
    _trimming: threading.Lock = field(default_factory=threading.Lock)  # one trim at a time

    @contextlib.contextmanager
    def in_use(self, snapshot_id: str) -> Iterator[None]:
        """While held, the cache trim never removes the snapshot."""
        with self._guard:
            self._busy[snapshot_id] += 1
        try:
            yield
        finally:
            with self._guard:  # Counter's in-place subtraction drops it once nothing holds it
                self._busy -= Counter([snapshot_id])

    def _lock(self, snapshot_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(snapshot_id, threading.Lock())

    def publish(self, snapshot_id: str) -> None:
        """Push a snapshot this node captured; RemoteError (or SnapshotError) after PUSH_ATTEMPTS."""
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            try:
                started = time.monotonic()
                result = self.remote.push(snapshot_id)
            except (RemoteError, SnapshotError) as exc:
                if attempt == PUSH_ATTEMPTS:
                    raise
                log.warning("pushing snapshot %s failed (attempt %d): %s; again", snapshot_id, attempt, exc)
                continue
            self.metrics.remote_bytes.labels("push", "capture").inc(result.stats.bytes_transferred)
            log.info("pushed snapshot %s in %.2f s: %d blobs uploaded, %d already there", snapshot_id,
                     time.monotonic() - started, len(result.uploaded), len(result.skipped))  # fmt: skip
            self._trim_after(snapshot_id)
            return

    def local_copy(self, snapshot_id: str, reason: str) -> Snapshot:
        """The snapshot from this node's cache, pulled from the bucket first when the cache lacks it.
        PullRefused when the bucket's copy is missing or refused, PullFailed saying why for the rest
        (unreachable, access denied, out of time); SnapshotError for a local problem."""
        with self._lock(snapshot_id):
            try:
                snapshot, pulled = self.local.get(snapshot_id), False
            except SnapshotNotFound:
                snapshot, pulled = self._pull(snapshot_id, reason), True
            self.remote.mark_used(snapshot_id)
        if pulled:
            self._trim_after(snapshot_id)
        return snapshot

    def _pull(self, snapshot_id: str, reason: str) -> Snapshot:
        started = time.monotonic()
        try:
            result = self.remote.pull(snapshot_id, self.verifier, timeout=self.pull_timeout)
        except (RemoteError, SnapshotError) as exc:
            self.metrics.remote_failures.labels("pull", reason).inc()
            refused = isinstance(exc, SnapshotInvalid | SnapshotNotFound) and not isinstance(exc, RemoteError)
            failure = PullRefused if refused else PullFailed
            raise failure(f"pulling snapshot {snapshot_id} from the object store failed: {exc}") from exc
        self.metrics.remote_bytes.labels("pull", reason).inc(result.stats.bytes_transferred)
        log.info("pulled snapshot %s for a %s in %.2f s: %d blobs fetched, %d cached", snapshot_id, reason,
                 time.monotonic() - started, len(result.fetched), len(result.cached))  # fmt: skip
        return result.snapshot

    def trim(self, keep: Iterable[str] = ()) -> TrimReport | None:
        """Bound this node's cache by its size and age, never a snapshot in use nor one in `keep`; None when
        it has no bound. The metrics show what it holds after, against its bound."""
        if not (self.cache_max_bytes or self.cache_max_age):
            return None
        with self._trimming:
            with self._guard:
                busy = set(self._busy) | set(keep)
            report = self.remote.trim_cache(max_bytes=self.cache_max_bytes or None,
                                            max_age=self.cache_max_age or None, busy=busy)  # fmt: skip
        self.metrics.cache_bytes.set(report.bytes_after)
        self.metrics.cache_max_bytes.set(self.cache_max_bytes)
        if report.removed:
            log.info("node cache trimmed: %s", report)
        if report.over_limit:
            log.warning("node cache holds %d bytes after its trim, over its bound of %d; kept in use: %s",
                        report.bytes_after, self.cache_max_bytes,
                        ", ".join(report.kept_busy) or "none")  # fmt: skip
        return report

    def _trim_after(self, snapshot_id: str) -> None:
        """Trim as soon as the cache grew, keeping the snapshot it grew by (its caller is about to use it); a
        trim that fails is left to the next one."""
        try:
            self.trim(keep=[snapshot_id])
        except (OSError, SnapshotError) as exc:
            log.warning("trimming the node cache after snapshot %s came in failed: %s", snapshot_id, exc)

    def maintain(self, referenced: Iterable[str]) -> None:
        """Bound this node's cache (never a snapshot in use), then collect the bucket's unreferenced
        snapshots and blobs older than the grace period (every agent may; the bucket's GC tolerates it)."""
        self.trim()
        self.remote.gc(referenced, grace=self.gc_grace)

    def forget(self, snapshot_id: str) -> None:
        """Unpublish a snapshot from the bucket (its InferenceSnapshot is gone); its blobs go with the GC."""
        try:
            self.remote.delete(snapshot_id)
        except SnapshotNotFound:
            return
        except RemoteError as exc:  # the GC's grace period takes it later
            log.warning("snapshot %s stays in the object store for now: %s", snapshot_id, exc)
