"""The local store as the node's cache of the object store: when each snapshot was last used, and trimming
the cache by age and size, oldest use first, never a snapshot the caller says is busy.

A snapshot's last use is its directory's mtime: set when it is published or pulled, and by `mark_used` at
each restore (the directory holds only the manifest and its signature, so nothing else moves it). Trimming
unpublishes snapshots (one rename each) and then lets the store's GC free the blobs no remaining snapshot
names; a snapshot in use keeps its blobs, and a pull that counted on a blob trimmed meanwhile fetches it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from warmstart.snapshot.catalog import Snapshot
from warmstart.snapshot.layout import SnapshotNotFound
from warmstart.snapshot.store import SnapshotStore

STAGING_GRACE = 3600.0  # the store's default: abandoned pulls and captures are removed after an hour


@dataclass
class TrimReport:
    removed: list[str] = field(default_factory=list)  # snapshot ids, oldest use first
    kept_busy: list[str] = field(default_factory=list)
    bytes_before: int = 0  # bytes of the blobs the snapshots named, before and after
    bytes_after: int = 0
    freed_bytes: int = 0  # bytes of blob files removed
    over_limit: bool = False  # still above max_bytes: what is left is busy

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def mark_used(store: SnapshotStore, snapshot_id: str, when: float | None = None) -> None:
    """Record a use of the snapshot now (or at `when`): trimming takes the least recently used first."""
    moment = time.time() if when is None else when
    try:
        os.utime(store.layout.snapshot_dir(snapshot_id), (moment, moment), follow_symlinks=False)
    except FileNotFoundError as exc:
        raise SnapshotNotFound(f"no snapshot {snapshot_id} in {store.root}") from exc


def last_used(snapshot: Snapshot) -> float:
    return snapshot.path.lstat().st_mtime


def trim_cache(
    store: SnapshotStore,
    *,
    max_bytes: int | None = None,
    max_age: float | None = None,
    busy: frozenset[str] | set[str] = frozenset(),
    now: float | None = None,
) -> TrimReport:
    """Unpublish snapshots unused for more than `max_age` seconds, then the least recently used until the
    blobs of those left take at most `max_bytes`, never one in `busy`; then free their blobs."""
    moment = time.time() if now is None else now
    snapshots = sorted(store.list(), key=lambda snapshot: (last_used(snapshot), snapshot.id))
    sizes = {entry.digest: entry.size for snapshot in snapshots for entry in snapshot.files.values()}
    users = Counter(digest for snapshot in snapshots for digest in snapshot.manifest.digests())
    report = TrimReport(bytes_before=sum(sizes.values()))
    total = report.bytes_before
    for snapshot in snapshots:
        if snapshot.id in busy:
            report.kept_busy.append(snapshot.id)
            continue
        expired = max_age is not None and moment - last_used(snapshot) > max_age
        if not expired and (max_bytes is None or total <= max_bytes):
            continue
        with contextlib.suppress(SnapshotNotFound):  # deleted by someone else meanwhile
            store.delete(snapshot.id)
        report.removed.append(snapshot.id)
        for digest in snapshot.manifest.digests():
            users[digest] -= 1
            if users[digest] == 0:
                total -= sizes[digest]
    report.bytes_after = total
    report.over_limit = max_bytes is not None and total > max_bytes
    if report.removed:
        report.freed_bytes = store.gc(staging_older_than=STAGING_GRACE, blob_grace=0).freed_bytes
    return report
