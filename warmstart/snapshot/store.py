"""The snapshot store: one facade over its parts, each in its own module.

Layout on a plain directory (a local disk, or an NFS-backed RWX volume shared by nodes)::

    <root>/blobs/sha256/<hex>            immutable file contents, read-only, written once, fsync'd
    <root>/snapshots/<id>/manifest.json  identity, files -> {digest, size, mode}, timings, node, meta
    <root>/snapshots/<id>/manifest.sig   signature over manifest.json's exact bytes
    <root>/staging/<uuid>/               work in progress: owner.json, files/ (the caller's), snapshot/

`layout` (paths, names, ids, the lock), `blobs` (ingest, place), `staging` (work in progress and its
owner), `publish` (the atomic rename), `catalog` (reading, listing, unpublishing), `verify` (signature,
identity, digests) and `gc` (garbage collection); materialising and retention are the facade's own.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from warmstart.api.identity import SnapshotIdentity
from warmstart.host.parallel import parallel_map
from warmstart.snapshot import catalog, gc, verify
from warmstart.snapshot.blobs import place
from warmstart.snapshot.catalog import Snapshot
from warmstart.snapshot.gc import GcReport
from warmstart.snapshot.layout import SnapshotNotFound, StoreLayout
from warmstart.snapshot.manifest import MIN_CHUNK_SIZE, SnapshotError
from warmstart.snapshot.signing import Verifier
from warmstart.snapshot.staging import Staging
from warmstart.snapshot.verified import VerifiedRecords

DEFAULT_CHUNK_SIZE = 64 << 20  # files above this also get per-chunk digests, verified in parallel

__all__ = ["GcReport", "Snapshot", "SnapshotNotFound", "SnapshotStore", "Staging"]


class SnapshotStore:
    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        hash_workers: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        verified_records: bool = False,
    ) -> None:
        """`verified_records`: restores (`materialize`) skip blobs this user verified (or hashed to publish)
        before, unchanged since (`verified.VerifiedRecords`); `verify` always hashes every blob."""
        if chunk_size != 0 and chunk_size < MIN_CHUNK_SIZE:
            raise ValueError(
                f"chunk_size must be 0 (no chunk digests) or at least {MIN_CHUNK_SIZE}, got {chunk_size}"
            )
        self.layout = StoreLayout(Path(root))
        self.hash_workers = hash_workers
        self.chunk_size = chunk_size
        self.records = VerifiedRecords(self.layout.root) if verified_records else None

    def __repr__(self) -> str:
        return f"SnapshotStore({str(self.root)!r})"

    @property
    def root(self) -> Path:
        return self.layout.root

    @property
    def blobs_dir(self) -> Path:
        return self.layout.blobs_dir

    @property
    def snapshots_dir(self) -> Path:
        return self.layout.snapshots_dir

    @property
    def staging_dir(self) -> Path:
        return self.layout.staging_dir

    def blob_path(self, digest: str) -> Path:
        return self.layout.blob_path(digest)

    def stage(
        self,
        identity: SnapshotIdentity,
        *,
        node: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Staging:
        """A new staging area for a snapshot of `identity`; use it as a context manager."""
        return Staging(self, identity, node, meta)

    def get(self, snapshot_id: str, *, verifier: Verifier | None = None) -> Snapshot:
        """The snapshot's manifest, its signature checked first when `verifier` is given (without one it
        is as stored: use `verify` before trusting it)."""
        return catalog.get_snapshot(self.layout, snapshot_id, verifier)

    def list(self, identity_hash: str | None = None, *, verifier: Verifier | None = None) -> list[Snapshot]:
        """Published snapshots, newest first; `identity_hash` may be a full hash or a prefix of one. With
        `verifier`, only those whose signature it verifies (checked before their manifest is parsed)."""
        return catalog.list_snapshots(self.layout, identity_hash, verifier)

    def is_published(self, snapshot_id: str) -> bool:
        """Whether `snapshot_id` is a signed snapshot directory here now (not whether it is valid)."""
        try:
            return catalog.is_signed_snapshot_dir(self.layout.snapshot_dir(snapshot_id))
        except SnapshotNotFound:
            return False

    def delete(self, snapshot_id: str) -> None:
        """Unpublish a snapshot at once; its blobs stay until GC finds them unreferenced."""
        catalog.unpublish(self.layout, snapshot_id)

    def verify(
        self,
        snapshot_id: str,
        verifier: Verifier,
        expected_identity: SnapshotIdentity | None = None,
        *,
        prefix: str | None = None,
    ) -> Snapshot:
        """Check signature, schema, identity and every blob's size and SHA-256; SnapshotInvalid otherwise."""
        return verify.verify_snapshot(
            self.layout, snapshot_id, verifier, expected_identity, prefix=prefix, workers=self.hash_workers
        )

    def check_signature(
        self, snapshot_id: str, verifier: Verifier, expected_identity: SnapshotIdentity | None = None
    ) -> Snapshot:
        """The snapshot once its signature, schema and identity hash check out, and its identity is
        `expected_identity` when given (no blob is hashed)."""
        manifest = catalog.signed_manifest(self.layout, snapshot_id, verifier, expected_identity)
        return Snapshot(self.snapshots_dir / snapshot_id, manifest)

    def materialize(
        self,
        snapshot_id: str,
        dest: str | os.PathLike[str],
        verifier: Verifier,
        *,
        expected_identity: SnapshotIdentity | None = None,
        link: bool = True,
    ) -> Snapshot:
        """Verify (as `verify`, though a blob the verified records say matched is not hashed again), then
        build `dest` from blobs, each file at its path in the snapshot: hardlinks on one filesystem, else
        copies. Copies get the recorded mode exactly; a hardlink shares the immutable blob's inode, so it
        carries the recorded mode without write bits (when the blob's mode differs, the file is copied)."""
        snapshot = verify.verify_snapshot(
            self.layout, snapshot_id, verifier, expected_identity, workers=self.hash_workers,
            records=self.records,
        )  # fmt: skip
        target_root = Path(dest)
        if target_root.is_symlink():
            raise SnapshotError(f"materialise destination {target_root} is a symbolic link")
        if target_root.exists() and any(target_root.iterdir()):
            raise SnapshotError(f"materialise destination {target_root} is not empty")
        target_root.mkdir(parents=True, exist_ok=True)
        plan = [(target_root / path, entry) for path, entry in snapshot.files.items()]
        for directory in {target.parent for target, _ in plan}:
            directory.mkdir(parents=True, exist_ok=True)
        use_link = [link]
        parallel_map(lambda item: place(self.layout, *item, use_link), plan, workers=self.hash_workers)
        return snapshot

    def gc(
        self,
        *,
        staging_older_than: float = 3600,
        blob_grace: float | None = None,
        dry_run: bool = False,
        verifier: Verifier | None = None,
        keep_blobs: Callable[[], Iterable[str]] = frozenset,
    ) -> GcReport:
        """Remove stale staging directories, junk in `snapshots/` and unreferenced blobs (see
        `gc.collect_garbage`); with `verifier`, a directory whose signature claims its key but does not
        sign its manifest is junk too; never a blob `keep_blobs()` names."""
        return gc.collect_garbage(
            self.layout, staging_older_than=staging_older_than, blob_grace=blob_grace, dry_run=dry_run,
            verifier=verifier, keep_blobs=keep_blobs,
        )  # fmt: skip

    def withdraw(self, snapshot_id: str) -> list[str] | None:
        """Unpublish a snapshot and remove at once the blobs no other manifest names (a capture whose push
        failed takes back what it wrote); the removed digests, or None when its blobs were left to GC."""
        digests = self.get(snapshot_id).manifest.digests()
        self.delete(snapshot_id)
        return gc.remove_unreferenced_blobs(self.layout, digests)

    def apply_retention(
        self,
        keep: int,
        identity_hash: str | None = None,
        *,
        verifier: Verifier | None = None,
        dry_run: bool = False,
    ) -> list[str]:
        """Delete all but the `keep` newest snapshots of each identity (with `verifier`: of those it
        verifies, so a forged newer directory never pushes a real snapshot out); return the deleted ids."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep must be a non-negative integer, got {keep!r}")
        seen: Counter[str] = Counter()
        doomed: list[str] = []
        for snapshot in self.list(identity_hash, verifier=verifier):  # newest first
            seen[snapshot.identity_hash] += 1
            if seen[snapshot.identity_hash] > keep:
                doomed.append(snapshot.id)
        if not dry_run:
            for snapshot_id in doomed:
                with contextlib.suppress(SnapshotNotFound):
                    self.delete(snapshot_id)
        return doomed
