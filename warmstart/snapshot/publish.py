"""Publishing: hash the staged files, ingest them as blobs, write and sign the manifest, rename it live.

A snapshot becomes visible by one atomic rename of `staging/<uuid>/snapshot` (already holding both
`manifest.json` and `manifest.sig`) to `snapshots/<id>`, after its blobs are on disk, so nothing
half-written is ever listed. A blob already in the store is hashed before a new snapshot relies on it: a
planted file of the right size is replaced, never trusted. Blobs are linked and the manifest renamed under
the store's shared lock, so GC either sees the manifest or runs entirely before the blobs exist.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import stat
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from warmstart.host.clock import utc_now
from warmstart.host.fileio import fsync_dir, write_new_file
from warmstart.host.parallel import parallel_map
from warmstart.snapshot.blobs import existing_blob_of_size, ingest
from warmstart.snapshot.catalog import Snapshot
from warmstart.snapshot.gc import remove_unreferenced_blobs
from warmstart.snapshot.hashing import hash_files
from warmstart.snapshot.layout import MANIFEST_FILE, SIGNATURE_FILE, StoreLayout
from warmstart.snapshot.manifest import CREATED_FORMAT, FileEntry, Manifest, SnapshotError
from warmstart.snapshot.signing import Signer, signature_document
from warmstart.snapshot.verify import blobs_not_matching

if TYPE_CHECKING:
    from warmstart.snapshot.staging import Staging

log = logging.getLogger(__name__)


def new_snapshot_id(identity_hash: str, created: datetime) -> str:
    return f"{identity_hash[:12]}-{created.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"


def publish_staging(staging: Staging, signer: Signer) -> Snapshot:
    """Publish what `staging.dir` holds; returns the published snapshot.

    A publish that fails removes the blobs it wrote (unless a published manifest names them meanwhile):
    left for GC's grace period, they would keep a full disk full and fail the next captures too.
    """
    files = staging.collect_files()
    entries = _hashed_entries(staging, files)
    identity_hash = staging.identity.digest()
    created = utc_now()
    snapshot_id = new_snapshot_id(identity_hash, created)
    output = staging.root / "snapshot"
    output.mkdir()
    layout = staging.layout
    written: list[str] = []
    try:
        with layout.lock(exclusive=False):
            started = time.monotonic()
            _ingest_all(layout, files, entries, staging.hash_workers, written)
            staging.timings["store_ingest"] = round(time.monotonic() - started, 6)
            manifest = Manifest(
                id=snapshot_id,
                created=created.strftime(CREATED_FORMAT),
                identity=staging.identity,
                identity_hash=identity_hash,
                files=entries,
                timings=dict(staging.timings),
                node=staging.node,
                meta=staging.meta,
            )
            raw = manifest.to_bytes()
            write_new_file(output / MANIFEST_FILE, raw)
            write_new_file(output / SIGNATURE_FILE, signature_document(signer, raw))
            fsync_dir(output)
            final = layout.snapshots_dir / snapshot_id
            os.rename(output, final)
            fsync_dir(layout.snapshots_dir)
    except BaseException:
        _remove_unreferenced(layout, written)
        raise
    if staging.records is not None:
        # Every blob was hashed here (a staged file linked in, or a stored one kept once it checked out):
        # the next restore need not hash it again.
        for entry in entries.values():
            staging.records.remember(entry, layout.blob_path(entry.digest))
    log.info("published snapshot %s (%d files, %d bytes)", snapshot_id, len(entries), manifest.size)
    return Snapshot(final, manifest)


def _hashed_entries(staging: Staging, files: dict[str, Path]) -> dict[str, FileEntry]:
    modes = {path: stat.S_IMODE(path.stat().st_mode) for path in files.values()}
    started = time.monotonic()
    hashed = hash_files(
        files.values(), workers=staging.hash_workers, fsync=True, chunk_size=staging.chunk_size
    )
    staging.timings["store_hash"] = round(time.monotonic() - started, 6)
    return {
        relative: FileEntry(mode=modes[path], **dataclasses.asdict(hashed[path]))
        for relative, path in files.items()
    }


def _ingest_all(
    layout: StoreLayout,
    files: dict[str, Path],
    entries: dict[str, FileEntry],
    workers: int | None,
    written: list[str],
) -> None:
    """Ingest every staged file; a blob already there is kept only once its content checks out, and
    the digests of the blobs written here are appended to `written`."""
    present = [entry for entry in entries.values() if existing_blob_of_size(layout, entry.digest, entry.size)]
    damaged = blobs_not_matching(layout, present, workers)

    def ingest_one(item: tuple[str, FileEntry]) -> None:
        relative, entry = item
        if ingest(layout, files[relative], entry, keep_existing=entry.digest not in damaged):
            written.append(entry.digest)

    parallel_map(ingest_one, list(entries.items()), workers=workers)
    fsync_dir(layout.blobs_dir)


def _remove_unreferenced(layout: StoreLayout, written: list[str]) -> None:
    """Remove the blobs a failed publish wrote that no published manifest names (checked under the
    exclusive lock: a concurrent publisher that kept one of them has published its manifest by then)."""
    if not written:
        return
    try:
        removed = remove_unreferenced_blobs(layout, written)
    except (OSError, SnapshotError) as exc:
        log.warning("the blobs of a failed publish stay until gc: %s", exc)
        return
    if removed is None:
        log.warning("the blobs of a failed publish stay: a manifest cannot be read (gc removes them)")
