"""Publishing: hash the staged files, ingest them as blobs, write and sign the manifest, rename it live.

A snapshot becomes visible by one atomic rename of `staging/<uuid>/snapshot` (already holding both
`manifest.json` and `manifest.sig`) to `snapshots/<id>`, after its blobs are on disk, so nothing
half-written is ever listed. Blobs are linked and the manifest renamed under the store's shared lock, so
GC either sees the manifest or runs entirely before the blobs exist.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from warmstart.fileio import fsync_dir, write_new_file
from warmstart.parallel import parallel_map
from warmstart.snapshot.blobs import ingest
from warmstart.snapshot.catalog import Snapshot
from warmstart.snapshot.hashing import hash_files
from warmstart.snapshot.layout import MANIFEST_FILE, SIGNATURE_FILE, StoreLayout
from warmstart.snapshot.manifest import CREATED_FORMAT, FileEntry, Manifest
from warmstart.snapshot.signing import Signer, signature_document
from warmstart.snapshot.staging import utc_now

if TYPE_CHECKING:
    from warmstart.snapshot.staging import Staging

log = logging.getLogger(__name__)


def new_snapshot_id(identity_hash: str, created: datetime) -> str:
    return f"{identity_hash[:12]}-{created.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"


def publish_staging(staging: Staging, signer: Signer) -> Snapshot:
    """Publish what `staging.dir` holds; returns the published snapshot."""
    files = staging.collect_files()
    entries = _hashed_entries(staging, files)
    identity_hash = staging.identity.digest()
    created = utc_now()
    snapshot_id = new_snapshot_id(identity_hash, created)
    output = staging.root / "snapshot"
    output.mkdir()
    layout = staging.layout
    with layout.lock(exclusive=False):
        started = time.monotonic()
        _ingest_all(layout, files, entries, staging.hash_workers)
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
        _write_signed(output, manifest.to_bytes(), signer)
        final = layout.snapshots_dir / snapshot_id
        os.rename(output, final)
        fsync_dir(layout.snapshots_dir)
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
        relative: FileEntry(
            digest=hashed[path].digest,
            size=hashed[path].size,
            mode=modes[path],
            chunk_size=hashed[path].chunk_size,
            chunks=hashed[path].chunks,
            chunk_hash=hashed[path].chunk_hash,
        )
        for relative, path in files.items()
    }


def _ingest_all(
    layout: StoreLayout, files: dict[str, Path], entries: dict[str, FileEntry], workers: int | None
) -> None:
    parallel_map(
        lambda item: ingest(layout, files[item[0]], item[1].digest, item[1].size, item[1].mode),
        list(entries.items()),
        workers=workers,
    )
    fsync_dir(layout.blobs_dir)


def _write_signed(directory: Path, manifest_bytes: bytes, signer: Signer) -> None:
    write_new_file(directory / MANIFEST_FILE, manifest_bytes)
    write_new_file(directory / SIGNATURE_FILE, signature_document(signer, manifest_bytes))
    fsync_dir(directory)
