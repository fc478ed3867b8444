"""Published snapshots: the `Snapshot` value, reading one, listing them, unpublishing one."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from warmstart.identity import SnapshotIdentity
from warmstart.snapshot.layout import DELETING_SUFFIX, MANIFEST_FILE, SnapshotNotFound, StoreLayout
from warmstart.snapshot.manifest import (
    SNAPSHOT_ID_PATTERN,
    FileEntry,
    Manifest,
    SnapshotError,
    SnapshotInvalid,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """A published snapshot (its manifest as read from the store, not necessarily verified)."""

    path: Path
    manifest: Manifest

    @property
    def id(self) -> str:
        return self.manifest.id

    @property
    def identity(self) -> SnapshotIdentity:
        return self.manifest.identity

    @property
    def identity_hash(self) -> str:
        return self.manifest.identity_hash

    @property
    def created(self) -> datetime:
        return self.manifest.created_at

    @property
    def size(self) -> int:
        return self.manifest.size

    @property
    def files(self) -> dict[str, FileEntry]:
        return self.manifest.files

    @property
    def timings(self) -> dict[str, float]:
        return self.manifest.timings

    @property
    def node(self) -> dict[str, Any]:
        return self.manifest.node

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.meta

    def summary(self) -> dict[str, Any]:
        """What `snapshot list --json` prints for one snapshot."""
        return {
            "id": self.id,
            "identity_hash": self.identity_hash,
            "engine": self.identity.engine,
            "engine_version": self.identity.engine_version,
            "model_digest": self.identity.model_digest,
            "model": self.meta.get("model", ""),
            "size": self.size,
            "files": len(self.files),
            "created": self.manifest.created,
            "node": self.node,
        }


def read_manifest_bytes(layout: StoreLayout, snapshot_id: str) -> bytes:
    directory = layout.snapshot_dir(snapshot_id)
    try:
        return (directory / MANIFEST_FILE).read_bytes()
    except FileNotFoundError as exc:
        if not directory.is_dir():
            raise SnapshotNotFound(f"no snapshot {snapshot_id} in {layout.root}") from exc
        raise SnapshotInvalid(f"{MANIFEST_FILE} is missing", snapshot_id=snapshot_id) from exc


def parse_manifest(raw: bytes, snapshot_id: str) -> Manifest:
    try:
        return Manifest.from_bytes(raw)
    except SnapshotInvalid as exc:
        raise SnapshotInvalid(exc.reason, snapshot_id=snapshot_id) from exc


def get_snapshot(layout: StoreLayout, snapshot_id: str) -> Snapshot:
    """The snapshot's manifest as stored (not verified)."""
    manifest = parse_manifest(read_manifest_bytes(layout, snapshot_id), snapshot_id)
    return Snapshot(layout.snapshots_dir / snapshot_id, manifest)


def list_snapshots(layout: StoreLayout, identity_hash: str | None = None) -> list[Snapshot]:
    """Published snapshots, newest first; `identity_hash` may be a full hash or a prefix of one."""
    layout.require_root()
    if not layout.snapshots_dir.is_dir():
        return []
    found: list[Snapshot] = []
    for entry in layout.snapshots_dir.iterdir():
        if not SNAPSHOT_ID_PATTERN.fullmatch(entry.name):
            continue
        if identity_hash and not entry.name.startswith(identity_hash[:12]):
            continue
        try:
            snapshot = get_snapshot(layout, entry.name)
        except SnapshotError as exc:
            log.warning("skipping unreadable snapshot %s: %s", entry.name, exc)
            continue
        if identity_hash is None or snapshot.identity_hash.startswith(identity_hash):
            found.append(snapshot)
    found.sort(key=lambda s: (s.manifest.created, s.id), reverse=True)
    return found


def unpublish(layout: StoreLayout, snapshot_id: str) -> None:
    """Unpublish a snapshot at once (one rename); its blobs stay until GC finds them unreferenced.

    The rename waits for a running GC: a manifest vanishing while GC reads them all would look unreadable.
    """
    directory = layout.snapshot_dir(snapshot_id)
    doomed = layout.staging_dir / f"{uuid.uuid4().hex}{DELETING_SUFFIX}"
    try:
        with layout.lock(exclusive=False):
            os.rename(directory, doomed)
    except FileNotFoundError as exc:
        raise SnapshotNotFound(f"no snapshot {snapshot_id} in {layout.root}") from exc
    shutil.rmtree(doomed, ignore_errors=True)
