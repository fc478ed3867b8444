"""Published snapshots: the `Snapshot` value, reading one, listing them, unpublishing one.

A snapshot is listed only when `snapshots/<id>` is a real directory holding a regular `manifest.sig`: an
unsigned directory there was not made by publish (which renames a directory already holding both files)
and is left for GC. Given a verifier, reading and listing check the signature before a manifest is parsed:
the small `manifest.sig` first (one made with another key, or junk, costs no read of the manifest), then
the manifest's bytes against it, then the parse. Whatever the key, a manifest must name the directory it
is in (a copied directory is no second snapshot) and its identity must hash to its identity hash.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from warmstart.api.capture_record import CaptureRecord
from warmstart.api.identity import SnapshotIdentity
from warmstart.host.fileio import UnsafeInput, read_regular_file
from warmstart.snapshot.layout import (
    DELETING_SUFFIX,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    MAX_SIGNATURE_BYTES,
    SIGNATURE_FILE,
    SnapshotNotFound,
    StoreLayout,
)
from warmstart.snapshot.manifest import (
    CREATED_FORMAT,
    SNAPSHOT_ID_PATTERN,
    FileEntry,
    IdentityMismatch,
    Manifest,
    SnapshotError,
    SnapshotInvalid,
)
from warmstart.snapshot.signing import SignatureInvalid, Verifier, check_signature, signature_of

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
        return datetime.strptime(self.manifest.created, CREATED_FORMAT).replace(tzinfo=UTC)

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
    def record(self) -> CaptureRecord:
        return self.manifest.record

    def summary(self) -> dict[str, Any]:
        """What `snapshot list --json` prints for one snapshot."""
        return {
            "id": self.id,
            "identity_hash": self.identity_hash,
            "engine": self.identity.engine,
            "engine_version": self.identity.engine_version,
            "model_digest": self.identity.model_digest,
            "model": self.record.model,
            "size": self.size,
            "files": len(self.files),
            "created": self.manifest.created,
            "node": self.node,
        }


def _snapshot_directory(layout: StoreLayout, snapshot_id: str) -> Path:
    """The snapshot's directory, checked to be a real directory (never a symbolic link)."""
    directory = layout.snapshot_dir(snapshot_id)
    layout.check_directories()
    try:
        mode = directory.lstat().st_mode
    except FileNotFoundError as exc:
        raise SnapshotNotFound(f"no snapshot {snapshot_id} in {layout.root}") from exc
    if not stat.S_ISDIR(mode):
        raise SnapshotInvalid(
            f"{directory} is not a directory (a symbolic link is refused)", snapshot_id=snapshot_id
        )
    return directory


def _read_snapshot_file(layout: StoreLayout, snapshot_id: str, name: str, limit: int) -> bytes:
    path = _snapshot_directory(layout, snapshot_id) / name
    try:
        return read_regular_file(path, limit)
    except FileNotFoundError as exc:
        what = "the snapshot is unsigned" if name == SIGNATURE_FILE else "the snapshot is incomplete"
        raise SnapshotInvalid(f"{name} is missing: {what}", snapshot_id=snapshot_id) from exc
    except UnsafeInput as exc:
        raise SnapshotInvalid(f"{name} refused: {exc}", snapshot_id=snapshot_id) from exc
    except OSError as exc:
        raise SnapshotInvalid(f"{name} cannot be read: {exc}", snapshot_id=snapshot_id) from exc


def read_manifest_bytes(layout: StoreLayout, snapshot_id: str) -> bytes:
    return _read_snapshot_file(layout, snapshot_id, MANIFEST_FILE, MAX_MANIFEST_BYTES)


def read_signature_bytes(layout: StoreLayout, snapshot_id: str) -> bytes:
    return _read_snapshot_file(layout, snapshot_id, SIGNATURE_FILE, MAX_SIGNATURE_BYTES)


def is_signed_snapshot_dir(entry: Path) -> bool:
    """A real directory named like a snapshot, holding a regular `manifest.sig`."""
    if not SNAPSHOT_ID_PATTERN.fullmatch(entry.name):
        return False
    try:
        return stat.S_ISDIR(entry.lstat().st_mode) and stat.S_ISREG((entry / SIGNATURE_FILE).lstat().st_mode)
    except OSError:
        return False


def parse_manifest(
    raw: bytes, snapshot_id: str, expected_identity: SnapshotIdentity | None = None
) -> Manifest:
    """The manifest in `raw`, which must name `snapshot_id`, whose identity must hash to its identity hash
    (and be `expected_identity`, when given); SnapshotInvalid (IdentityMismatch) saying why not."""
    try:
        manifest = Manifest.from_bytes(raw)
    except SnapshotInvalid as exc:
        raise SnapshotInvalid(exc.reason, snapshot_id=snapshot_id) from exc
    if manifest.id != snapshot_id:
        raise SnapshotInvalid(
            f"manifest field 'id' is {manifest.id!r} but the snapshot directory is {snapshot_id!r}",
            snapshot_id=snapshot_id,
        )
    try:
        actual_hash = manifest.identity.digest()
    except (TypeError, ValueError) as exc:
        raise SnapshotInvalid(
            f"manifest field 'identity' cannot be hashed: {exc}", snapshot_id=snapshot_id
        ) from exc
    if manifest.identity_hash != actual_hash:
        raise SnapshotInvalid(
            f"manifest field 'identity_hash' is {manifest.identity_hash} but the identity hashes to "
            f"{actual_hash}",
            snapshot_id=snapshot_id,
        )
    if expected_identity is not None and expected_identity.digest() != manifest.identity_hash:
        raise IdentityMismatch(manifest.identity.mismatches(expected_identity), snapshot_id=snapshot_id)
    return manifest


def signed_manifest(
    layout: StoreLayout,
    snapshot_id: str,
    verifier: Verifier,
    expected_identity: SnapshotIdentity | None = None,
) -> Manifest:
    """The manifest of `snapshot_id` once its signature checks out (see the module's docstring), then as
    `parse_manifest` checks it."""
    try:
        signature = signature_of(verifier, read_signature_bytes(layout, snapshot_id))
        raw = read_manifest_bytes(layout, snapshot_id)
        check_signature(verifier, raw, signature)
    except SignatureInvalid as exc:
        raise SnapshotInvalid(f"{SIGNATURE_FILE}: {exc}", snapshot_id=snapshot_id) from exc
    return parse_manifest(raw, snapshot_id, expected_identity)


def get_snapshot(layout: StoreLayout, snapshot_id: str, verifier: Verifier | None = None) -> Snapshot:
    """The snapshot, its signature checked when a verifier is given (its blobs are not hashed)."""
    if verifier is not None:
        manifest = signed_manifest(layout, snapshot_id, verifier)
    else:
        manifest = parse_manifest(read_manifest_bytes(layout, snapshot_id), snapshot_id)
    return Snapshot(layout.snapshots_dir / snapshot_id, manifest)


def list_snapshots(
    layout: StoreLayout, identity_hash: str | None = None, verifier: Verifier | None = None
) -> list[Snapshot]:
    """Published snapshots, newest first; `identity_hash` may be a full hash or a prefix of one.

    With a verifier only the snapshots it verifies are listed; what is skipped is logged once, counted.
    """
    layout.require_root()
    if not layout.snapshots_dir.is_dir():
        return []
    found: list[Snapshot] = []
    skipped: list[str] = []
    for entry in layout.snapshots_dir.iterdir():
        if identity_hash and not entry.name.startswith(identity_hash[:12]):
            continue
        if not is_signed_snapshot_dir(entry):
            continue
        try:
            snapshot = get_snapshot(layout, entry.name, verifier)
        except SnapshotError as exc:
            skipped.append(str(exc))
            continue
        if identity_hash is None or snapshot.identity_hash.startswith(identity_hash):
            found.append(snapshot)
    if skipped:
        log.warning(
            "listing %s skipped %d snapshot directories, e.g. %s", layout.root, len(skipped), skipped[0]
        )
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
