"""Adopting a snapshot signed elsewhere: its manifest and signature kept byte for byte, its blobs brought in
by whatever transport (an object store, a copy from another node), published by the store's own rename.

`check_signed_manifest` is the trust gate for bytes that arrived from outside: the signature is checked
before the manifest is parsed, then its id, identity hash and, when given, the expected identity.
`adopt` then links the verified blob files into `blobs/sha256/`, writes both files into the staging
directory and renames it to `snapshots/<id>` under the store's shared lock, like publish: GC either sees
the manifest or runs before any blob is linked, and a half-adopted snapshot is never listed.
"""

from __future__ import annotations

import os
from pathlib import Path

from warmstart.api.identity import SnapshotIdentity
from warmstart.host.fileio import fsync_dir, write_new_file
from warmstart.snapshot.blobs import existing_blob_of_size, ingest
from warmstart.snapshot.catalog import Snapshot, parse_manifest
from warmstart.snapshot.layout import MANIFEST_FILE, SIGNATURE_FILE, StoreLayout
from warmstart.snapshot.manifest import Manifest, SnapshotError, SnapshotInvalid
from warmstart.snapshot.signing import SignatureInvalid, Verifier, verify_document


class BlobsMissing(SnapshotError):
    """Blobs the caller counted on finding in the store were gone when it published (GC took them)."""

    def __init__(self, digests: list[str]) -> None:
        self.digests = digests
        super().__init__(f"{len(digests)} blob(s) left the store meanwhile: {', '.join(digests[:3])}")


def check_signed_manifest(
    raw: bytes,
    signature: bytes,
    snapshot_id: str,
    verifier: Verifier,
    expected_identity: SnapshotIdentity | None = None,
) -> Manifest:
    """The manifest in `raw` once `signature` checks out for it, its id is `snapshot_id` and its identity
    hashes to its identity hash (and is `expected_identity`, when given); SnapshotInvalid otherwise."""
    try:
        verify_document(verifier, raw, signature)
    except SignatureInvalid as exc:
        raise SnapshotInvalid(f"{SIGNATURE_FILE}: {exc}", snapshot_id=snapshot_id) from exc
    return parse_manifest(raw, snapshot_id, expected_identity)  # id, identity hash and identity checked there


def adopt(
    layout: StoreLayout,
    staging_root: Path,
    raw: bytes,
    signature: bytes,
    manifest: Manifest,
    fetched: dict[str, Path],
    *,
    replace: frozenset[str] = frozenset(),
) -> Snapshot:
    """Publish `manifest` (already checked: `check_signed_manifest`) with `raw` and `signature` as its files.

    `fetched` maps digests to verified files inside `staging_root` (same filesystem: they are linked, not
    copied); every other blob the manifest names must be in the store already, else BlobsMissing and nothing
    is published. Digests in `replace` were found corrupted in the store and are replaced. A snapshot of the
    same id already published is returned as it is.
    """
    output = staging_root / "snapshot"
    output.mkdir()
    write_new_file(output / MANIFEST_FILE, raw)
    write_new_file(output / SIGNATURE_FILE, signature)
    fsync_dir(output)
    entries = manifest.representatives()
    final = layout.snapshots_dir / manifest.id
    with layout.lock(exclusive=False):
        for digest, source in fetched.items():  # as the blob of the first file naming it (its mode)
            ingest(layout, source, entries[digest], keep_existing=digest not in replace)
        fsync_dir(layout.blobs_dir)
        missing = sorted(
            digest
            for digest, entry in entries.items()
            if not existing_blob_of_size(layout, digest, entry.size)
        )
        if missing:
            raise BlobsMissing(missing)
        if final.is_dir():
            return Snapshot(final, manifest)
        os.rename(output, final)
        fsync_dir(layout.snapshots_dir)
    return Snapshot(final, manifest)
