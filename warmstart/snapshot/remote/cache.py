"""The local store as the node's cache of the object store: when each snapshot was last used, and trimming
the cache by age and size, oldest use first, never a snapshot the caller says is busy.

A snapshot's last use is its directory's mtime: set when it is published or pulled, and by `mark_used` at
each restore (the directory holds only the manifest and its signature, so nothing else moves it). The size
bound is checked against every blob file on disk, those no snapshot names included (a snapshot deleted
elsewhere leaves its blobs for GC). Over the bound, trimming frees first the blobs no snapshot names, then
unpublishes snapshots (one rename each) and lets the store's GC free the blobs no remaining snapshot names.
A snapshot in use keeps its blobs, and so does a pull in progress (`BlobHolds`): it counted on the blobs the
cache had when it started. A GC that does not know the holds (another process's) may still take one: the
pull then fetches it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from warmstart.snapshot.catalog import Snapshot
from warmstart.snapshot.layout import SnapshotNotFound
from warmstart.snapshot.store import SnapshotStore

STAGING_GRACE = 3600.0  # the store's default: abandoned pulls and captures are removed after an hour


@dataclass
class TrimReport:
    removed: list[str] = field(default_factory=list)  # snapshot ids, oldest use first
    kept_busy: list[str] = field(default_factory=list)
    bytes_before: int = 0  # bytes of every blob file on disk, before and after
    bytes_after: int = 0
    freed_bytes: int = 0  # bytes of blob files removed
    over_limit: bool = False  # still above max_bytes: what is left is busy or held by a pull


class BlobHolds:
    """The blobs pulls in progress count on finding in the local store (thread-safe): a trim keeps them."""

    def __init__(self) -> None:
        self._held: Counter[str] = Counter()
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def holding(self, digests: Iterable[str]) -> Iterator[None]:
        wanted = set(digests)
        with self._guard:
            self._held.update(wanted)
        try:
            yield
        finally:
            with self._guard:
                self._held.subtract(wanted)
                self._held = +self._held  # drops the digests no pull holds any more

    def held(self) -> frozenset[str]:
        with self._guard:
            return frozenset(self._held)


def mark_used(store: SnapshotStore, snapshot_id: str, when: float | None = None) -> None:
    """Record a use of the snapshot now (or at `when`): trimming takes the least recently used first."""
    moment = time.time() if when is None else when
    try:
        os.utime(store.layout.snapshot_dir(snapshot_id), (moment, moment), follow_symlinks=False)
    except FileNotFoundError as exc:
        raise SnapshotNotFound(f"no snapshot {snapshot_id} in {store.root}") from exc


def last_used(snapshot: Snapshot) -> float:
    return snapshot.path.lstat().st_mtime


def blob_sizes(store: SnapshotStore) -> dict[str, int]:
    """The size of every blob file on disk, by digest (what the cache holds, named by a snapshot or not)."""
    sizes: dict[str, int] = {}
    try:
        entries = list(os.scandir(store.blobs_dir))
    except FileNotFoundError:
        return sizes
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode):
            sizes[f"sha256:{entry.name}"] = info.st_size
    return sizes


def trim_cache(
    store: SnapshotStore,
    *,
    max_bytes: int | None = None,
    max_age: float | None = None,
    busy: frozenset[str] | set[str] = frozenset(),
    now: float | None = None,
    holds: BlobHolds | None = None,
) -> TrimReport:
    """Unpublish snapshots unused for more than `max_age` seconds; then, while the blob files on disk take
    more than `max_bytes`, count the blobs no snapshot names as freed and unpublish the least recently used
    snapshots, never one in `busy`; then free the blobs no snapshot names, never one `holds` holds."""
    moment = time.time() if now is None else now
    holds = holds or BlobHolds()
    snapshots = sorted(store.list(), key=lambda snapshot: (last_used(snapshot), snapshot.id))
    on_disk = blob_sizes(store)
    users = Counter(digest for snapshot in snapshots for digest in snapshot.manifest.digests())
    held = holds.held()
    report = TrimReport(bytes_before=sum(on_disk.values()))
    over = max_bytes is not None and report.bytes_before > max_bytes
    unnamed = sum(size for digest, size in on_disk.items() if users[digest] == 0 and digest not in held)
    total = report.bytes_before - unnamed if over else report.bytes_before
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
            if users[digest] == 0 and digest not in held:
                total -= on_disk.get(digest, 0)
    if report.removed or over:
        report.freed_bytes = free_unreferenced_blobs(store, holds)
    report.bytes_after = sum(blob_sizes(store).values())
    report.over_limit = max_bytes is not None and report.bytes_after > max_bytes
    return report


def free_unreferenced_blobs(store: SnapshotStore, holds: BlobHolds) -> int:
    """Remove the blobs no snapshot names, however young, except those a pull in progress holds; the bytes
    freed.

    No grace here: publish and adopt link blobs and rename their manifest under the store's shared lock and
    GC removes blobs under the exclusive one, so an unreferenced blob is no publish's in progress; the only
    writer that counts on one outside the lock is a pull (the blobs it found cached), and those are held
    (asked under the lock). The store's own GC keeps its grace for writers it cannot see.
    """
    return store.gc(staging_older_than=STAGING_GRACE, blob_grace=0, keep_blobs=holds.held).freed_bytes
