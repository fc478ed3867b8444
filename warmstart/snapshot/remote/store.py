"""`RemoteStore`: an S3-compatible bucket holding the local store's layout, and a local store as its cache."""

from __future__ import annotations

from collections.abc import Iterable

from warmstart.api.identity import SnapshotIdentity
from warmstart.snapshot.manifest import Manifest
from warmstart.snapshot.remote.cache import BlobHolds, TrimReport, mark_used, trim_cache
from warmstart.snapshot.remote.collect import (
    RemoteGcReport,
    RemoteSnapshot,
    collect_remote_garbage,
    delete_remote,
    list_remote,
)
from warmstart.snapshot.remote.config import RemoteConfig
from warmstart.snapshot.remote.object_keys import Keys
from warmstart.snapshot.remote.objects import ObjectClient
from warmstart.snapshot.remote.pull import PullResult, fetch_signed_manifest, pull_snapshot
from warmstart.snapshot.remote.push import PushResult, push_snapshot
from warmstart.snapshot.remote.stats import ProgressHook, no_progress
from warmstart.snapshot.signing import Verifier
from warmstart.snapshot.store import SnapshotStore

DEFAULT_GC_GRACE = 3600.0


class RemoteStore:
    """Push, pull, list, delete and collect snapshots in a bucket; `local` is this node's cache of it.

    Thread-safe: one object serves concurrent pushes and pulls of different snapshots.
    """

    def __init__(self, local: SnapshotStore, config: RemoteConfig) -> None:
        self.local = local
        self.config = config
        self.client = ObjectClient(config)
        self.keys = Keys(config.key_prefix)
        self.holds = BlobHolds()  # the blobs of the pulls in progress: the cache trim keeps them

    def __repr__(self) -> str:
        return f"RemoteStore({self.client.where!r}, prefix={self.keys.prefix!r}, local={self.local!r})"

    def push(
        self, snapshot_id: str, *, verifier: Verifier | None = None, progress: ProgressHook = no_progress
    ) -> PushResult:
        """Upload a snapshot published in the local store: blobs the bucket lacks (multipart when large,
        several at once), then the manifest, then the signature, which makes it listed. With `verifier`,
        the local snapshot is verified in full first."""
        return push_snapshot(
            self.client, self.keys, self.local, snapshot_id, progress=progress, verifier=verifier
        )

    def pull(
        self,
        snapshot_id: str,
        verifier: Verifier,
        *,
        expected_identity: SnapshotIdentity | None = None,
        verify_cached: bool = False,
        timeout: float | None = None,
        progress: ProgressHook = no_progress,
    ) -> PullResult:
        """Make the snapshot available in the local store: signature and identity checked before any blob is
        fetched, every fetched byte checked against its signed digest, published by one rename. Blobs the
        cache has (right name and size) are used as they are, or hashed first with `verify_cached`
        (and fetched again when damaged). `timeout` bounds the whole pull (each request is bounded by the
        configuration anyway). Raises SnapshotNotFound, SnapshotInvalid (refused: nothing published) or
        RemoteUnavailable / RemoteAccessDenied."""
        result = pull_snapshot(
            self.client, self.keys, self.local, snapshot_id, verifier, expected_identity=expected_identity,
            progress=progress, verify_cached=verify_cached, timeout=timeout, holds=self.holds,
        )  # fmt: skip
        mark_used(self.local, snapshot_id)
        return result

    def list(self, identity_hash: str | None = None) -> list[RemoteSnapshot]:
        """Snapshots published in the bucket, newest first (manifests not read)."""
        return list_remote(self.client, self.keys, identity_hash)

    def manifest(
        self, snapshot_id: str, verifier: Verifier, expected_identity: SnapshotIdentity | None = None
    ) -> Manifest:
        """A snapshot's manifest from the bucket, once its signature (and identity) checks out."""
        return fetch_signed_manifest(self.client, self.keys, snapshot_id, verifier, expected_identity)[2]

    def delete(self, snapshot_id: str) -> None:
        """Unpublish a snapshot in the bucket at once; its blobs stay until `gc`."""
        delete_remote(self.client, self.keys, snapshot_id)

    def gc(
        self, referenced: Iterable[str] | None = None, *, grace: float = DEFAULT_GC_GRACE
    ) -> RemoteGcReport:
        """Remove blobs no manifest in the bucket names (and, given the snapshot ids still referenced,
        snapshots older than `grace` not among them first); see `collect`."""
        return collect_remote_garbage(self.client, self.keys, referenced, grace=grace)

    def trim_cache(
        self,
        *,
        max_bytes: int | None = None,
        max_age: float | None = None,
        busy: Iterable[str] = (),
    ) -> TrimReport:
        """Bound the local cache by age and size, least recently used first, never a snapshot in `busy` nor a
        blob a pull in progress counts on."""
        return trim_cache(
            self.local, max_bytes=max_bytes, max_age=max_age, busy=frozenset(busy), holds=self.holds
        )

    def mark_used(self, snapshot_id: str) -> None:
        """Record a restore from the local snapshot (the cache trims the least recently used first)."""
        mark_used(self.local, snapshot_id)
