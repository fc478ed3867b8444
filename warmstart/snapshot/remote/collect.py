"""The bucket's snapshots: listing them, deleting one, and garbage collection of blobs none names.

A snapshot is listed only when both its `manifest.json` and its `manifest.sig` are there (push uploads the
signature last). Deleting removes the signature first, so a snapshot being deleted is never listed with
its manifest gone.

GC keeps every blob named by a manifest in the bucket (a signed one, or one still within the grace period
that an unfinished push may yet sign), removes manifests whose push never finished once they are older than
the grace period, and, when given the ids the caller still references, deletes older snapshots it does not
reference first. Blobs younger than the grace period are kept too (a push uploads blobs before it uploads
the manifest naming them), and the manifests are read again right before blobs are deleted. A manifest
that cannot be read stops blob removal altogether. Keys that are not the store's are left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from warmstart.host.parallel import parallel_map
from warmstart.snapshot.layout import MANIFEST_FILE, MAX_MANIFEST_BYTES, SIGNATURE_FILE, SnapshotNotFound
from warmstart.snapshot.manifest import Manifest, SnapshotError
from warmstart.snapshot.remote.object_keys import Keys
from warmstart.snapshot.remote.objects import ObjectClient, ObjectInfo, ObjectMissing, ObjectTooLarge

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteSnapshot:
    """A snapshot in the bucket, as listing sees it (its manifest is not read or verified)."""

    id: str
    published: datetime  # when its signature was uploaded


@dataclass
class RemoteGcReport:
    deleted_snapshots: list[str] = field(default_factory=list)  # not referenced by the caller
    removed_unsigned: list[str] = field(default_factory=list)  # manifests of pushes that never finished
    removed_blobs: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    referenced_blobs: int = 0
    young_blobs: list[str] = field(default_factory=list)  # unreferenced, within the grace period
    ignored_keys: int = 0  # not the store's
    errors: list[str] = field(default_factory=list)


@dataclass
class _Listing:
    signed: dict[str, ObjectInfo] = field(default_factory=dict)  # id -> its manifest.sig
    manifests: dict[str, ObjectInfo] = field(default_factory=dict)  # id -> its manifest.json
    ignored: int = 0

    @property
    def complete(self) -> list[str]:
        return sorted(set(self.signed) & set(self.manifests))


def _list_snapshot_files(client: ObjectClient, keys: Keys) -> _Listing:
    listing = _Listing()
    for info in client.list(keys.snapshots):
        parsed = keys.snapshot_file_of(info.key)
        if parsed is None:
            listing.ignored += 1
            continue
        snapshot_id, name = parsed
        (listing.signed if name == SIGNATURE_FILE else listing.manifests)[snapshot_id] = info
    return listing


def list_remote(client: ObjectClient, keys: Keys, identity_hash: str | None = None) -> list[RemoteSnapshot]:
    """Published snapshots in the bucket, newest first; `identity_hash` (or a prefix of one) filters."""
    listing = _list_snapshot_files(client, keys)
    found = [
        RemoteSnapshot(snapshot_id, listing.signed[snapshot_id].last_modified)
        for snapshot_id in listing.complete
        if identity_hash is None or snapshot_id.startswith(identity_hash[:12])
    ]
    found.sort(key=lambda snapshot: (snapshot.published, snapshot.id), reverse=True)
    return found


def delete_remote(client: ObjectClient, keys: Keys, snapshot_id: str) -> None:
    """Unpublish the snapshot (signature first, then manifest); its blobs stay until GC."""
    if keys.snapshot_file_of(keys.signature(snapshot_id)) is None:
        raise SnapshotNotFound(f"{snapshot_id!r} is not a snapshot id")
    present = [client.head(keys.signature(snapshot_id)), client.head(keys.manifest(snapshot_id))]
    if not any(present):
        raise SnapshotNotFound(f"no snapshot {snapshot_id} in the object store {client.where}")
    _unpublish(client, keys, snapshot_id)


def _unpublish(client: ObjectClient, keys: Keys, snapshot_id: str) -> None:
    """Delete the snapshot's signature, then its manifest (a cut-short delete leaves an unsigned manifest)."""
    client.delete(keys.signature(snapshot_id))
    client.delete(keys.manifest(snapshot_id))


def collect_remote_garbage(
    client: ObjectClient,
    keys: Keys,
    referenced: Iterable[str] | None,
    *,
    grace: float,
) -> RemoteGcReport:
    """See the module's docstring."""
    report = RemoteGcReport()
    cutoff = datetime.now(UTC) - timedelta(seconds=grace)
    listing = _list_snapshot_files(client, keys)
    report.ignored_keys += listing.ignored
    if referenced is not None:
        _delete_unreferenced_snapshots(client, keys, listing, set(referenced), cutoff, report)
    _remove_unfinished_pushes(client, keys, listing, cutoff, report)
    candidates = _unreferenced_blobs(client, keys, listing, cutoff, report)
    if candidates is None or not candidates:
        return report
    # A push may have uploaded a manifest since the first listing: read the manifests again.
    now_referenced = _referenced_digests(client, keys, _list_snapshot_files(client, keys), report)
    if now_referenced is None:
        return report
    doomed = [info for digest, info in candidates.items() if digest not in now_referenced]
    report.removed_blobs = sorted(keys.digest_of(info.key) or info.key for info in doomed)
    report.freed_bytes = sum(info.size for info in doomed)
    parallel_map(lambda info: client.delete(info.key), doomed, workers=client.config.concurrency)
    return report


def _delete_unreferenced_snapshots(
    client: ObjectClient,
    keys: Keys,
    listing: _Listing,
    referenced: set[str],
    cutoff: datetime,
    report: RemoteGcReport,
) -> None:
    for snapshot_id in listing.complete:
        if snapshot_id in referenced or listing.signed[snapshot_id].last_modified > cutoff:
            continue
        report.deleted_snapshots.append(snapshot_id)
        _unpublish(client, keys, snapshot_id)  # both listed a moment ago: no lookup first
        del listing.signed[snapshot_id], listing.manifests[snapshot_id]


def _remove_unfinished_pushes(
    client: ObjectClient, keys: Keys, listing: _Listing, cutoff: datetime, report: RemoteGcReport
) -> None:
    """Manifests never signed, and signatures whose manifest is gone (a delete cut short), once old."""
    for snapshot_id in sorted(set(listing.manifests) ^ set(listing.signed)):
        info = listing.manifests.get(snapshot_id) or listing.signed[snapshot_id]
        if info.last_modified > cutoff:
            continue
        report.removed_unsigned.append(snapshot_id)
        _unpublish(client, keys, snapshot_id)
        listing.manifests.pop(snapshot_id, None)
        listing.signed.pop(snapshot_id, None)


def _referenced_digests(
    client: ObjectClient, keys: Keys, listing: _Listing, report: RemoteGcReport
) -> set[str] | None:
    """Every digest a manifest in the listing names; None when one of them cannot be read."""

    def digests_of(snapshot_id: str) -> set[str] | str:
        try:
            raw = client.get_bytes(keys.manifest(snapshot_id), MAX_MANIFEST_BYTES)
            return Manifest.from_bytes(raw).digests()
        except ObjectMissing:
            return set()  # deleted meanwhile: names nothing
        except (ObjectTooLarge, SnapshotError) as exc:
            return f"snapshot {snapshot_id}: unreadable {MANIFEST_FILE} ({exc}); no blob removed"

    outcomes = parallel_map(digests_of, sorted(listing.manifests), workers=client.config.concurrency)
    referenced: set[str] = set()
    for outcome in outcomes:
        if isinstance(outcome, str):
            report.errors.append(outcome)
            return None
        referenced |= outcome
    return referenced


def _unreferenced_blobs(
    client: ObjectClient, keys: Keys, listing: _Listing, cutoff: datetime, report: RemoteGcReport
) -> dict[str, ObjectInfo] | None:
    """Digest -> object of every blob no manifest names and older than the cutoff; None: remove none."""
    referenced = _referenced_digests(client, keys, listing, report)
    if referenced is None:
        return None
    report.referenced_blobs = len(referenced)
    candidates: dict[str, ObjectInfo] = {}
    for info in client.list(keys.blobs):
        digest = keys.digest_of(info.key)
        if digest is None:
            report.ignored_keys += 1
        elif digest in referenced:
            continue
        elif info.last_modified > cutoff:
            report.young_blobs.append(digest)
        else:
            candidates[digest] = info
    return candidates
